"""Text corpora that are always on the machine, so no task needs a download.

    pydoc   Python's bundled documentation text (`pydoc_data.topics`): ~0.5 MB, one text, split by position
    stdlib  the Python standard library's own `.py` sources (~12 MB), split by FILE: no file is in both splits

The pydoc text is memorised by 25-50M-parameter models within a few thousand steps (train loss
0.07 against val 2.14), so at that scale its val loss measures overfitting. The stdlib sources are ~25x
larger, and the file-level split means the val loss is measured on modules the model never saw a line of.

The stdlib split: every `.py` file under `sysconfig.get_paths()["stdlib"]` outside test folders
(`test`, `tests`, `idle_test`), `site-packages` and `__pycache__`, named by its path relative to that root
with `/` separators. A file is val when the first 8 bytes of sha256(path), read as a fraction of 2**64,
fall below `val_fraction`: deterministic, independent of the order files are found in, and a file keeps its
side across Python versions (only files added or removed between versions differ). Files are joined in
sorted path order, each preceded by a `# file: PATH` line, so a model sees where one module ends.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path
from pydoc_data.topics import topics

from qkv.config import ConfigError

CORPORA = ("pydoc", "stdlib")
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})


def pydoc_text() -> str:
    """Python's bundled documentation text: pydoc_data.topics values in sorted-key order."""
    return "".join(topics[k] for k in sorted(topics))


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[str]:
    """Relative paths (with '/') of the stdlib's .py files outside test folders, sorted."""
    root = root or stdlib_root()
    if not root.is_dir():
        raise ConfigError(f"the Python standard library sources are not at {root} (a stripped install?)")
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in EXCLUDED_DIRS)
        rel = Path(folder).relative_to(root)
        out += [(rel / f).as_posix() for f in files if f.endswith(".py")]
    return sorted(out)


def is_val_file(path: str, val_fraction: float) -> bool:
    """The file-level split: a stable hash of the relative path, not its position in any listing."""
    h = int.from_bytes(hashlib.sha256(path.encode("utf-8")).digest()[:8], "big")
    return h / 2**64 < val_fraction


def stdlib_split(val_fraction: float, root: Path | None = None) -> dict[str, list[str]]:
    """{"train": [paths], "val": [paths]}: disjoint, deterministic (see the module docstring)."""
    files = stdlib_files(root)
    split = {"train": [p for p in files if not is_val_file(p, val_fraction)],
             "val": [p for p in files if is_val_file(p, val_fraction)]}
    if not split["train"] or not split["val"]:
        raise ConfigError(f"val_fraction={val_fraction} leaves the stdlib "
                          f"{'train' if not split['train'] else 'val'} split empty ({len(files)} files)")
    return split


def stdlib_texts(val_fraction: float, root: Path | None = None) -> dict[str, str]:
    """{"train": text, "val": text} of the stdlib corpus (files that are not UTF-8 are skipped)."""
    root = root or stdlib_root()
    out = {}
    for name, paths in stdlib_split(val_fraction, root).items():
        parts = []
        for p in paths:
            try:
                parts.append(f"# file: {p}\n" + (root / p).read_text(encoding="utf-8"))
            except (UnicodeDecodeError, OSError):
                continue
        out[name] = "\n".join(parts)
    return out
