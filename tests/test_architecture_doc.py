"""docs/architecture.md is the map of src/qkv: every package and every top-level module is on it, and it names
no module that is gone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "qkv"
DOC = ROOT / "docs" / "architecture.md"


def test_every_package_and_top_level_module_is_on_the_map():
    text = DOC.read_text(encoding="utf-8")
    packages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(packages) >= 10 and "nn" in packages and "config.py" in modules  # the walk found the tree
    missing = [f"{name}/" for name in packages if not re.search(rf"(?<![\w/.]){name}/", text)]
    missing += [name for name in modules if not re.search(rf"(?<![\w/.]){re.escape(name)}", text)]
    assert missing == []


def test_the_map_names_no_module_that_is_gone():
    # `pkg/module.py` paths written on the map must exist (a renamed or removed module is a stale map)
    text = DOC.read_text(encoding="utf-8")
    named = set(re.findall(r"(?<![\w/.])([a-z_]+/[a-z_]+\.py)\b", text))
    bases = (PACKAGE, PACKAGE.parent, ROOT)
    gone = sorted(p for p in named if not any((base / p).is_file() for base in bases))
    assert gone == []
