"""The layering rule of docs/architecture.md, checked on the source: nn/ knows no model family,
models/ never imports train/, generate/, tasks/, cli/ or experiments/ at import time."""

from __future__ import annotations

import ast
from pathlib import Path

import qkv

SRC = Path(qkv.__file__).parent


def module_level_imports(path: Path) -> set[str]:
    """qkv modules imported at module level. Function-local imports (late bindings such as
    QKVModel.generate -> qkv.generate) and `if TYPE_CHECKING:` blocks are not looked at."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {n for n in names if n == "qkv" or n.startswith("qkv.")}


def test_nn_imports_only_nn():
    for path in sorted((SRC / "nn").glob("*.py")):
        for name in module_level_imports(path):
            assert name.startswith("qkv.nn"), f"{path.name} imports {name}: nn/ must not know the layers above"


def test_models_do_not_import_the_layers_above():
    above = ("qkv.train", "qkv.generate", "qkv.tasks", "qkv.cli", "qkv.experiments", "qkv.run", "qkv.demo")
    for path in sorted((SRC / "models").glob("*.py")):
        for name in module_level_imports(path):
            assert not name.startswith(above), f"models/{path.name} imports {name}"
