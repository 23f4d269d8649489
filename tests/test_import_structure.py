"""The import graph of qkv's own modules: no cycles, and no private name imported from another module.

Read from the source with `ast` (not by importing), so an import inside a function counts as much as one at
the top: a cycle that only closes at call time is still two modules that cannot be understood apart.
`if TYPE_CHECKING:` imports count too (a type-only cycle means the shared type sits on the wrong floor).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "qkv"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(current: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (relative imports resolved against `current`)."""
    if node.level == 0:
        return node.module or ""
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import of a qkv module in `path`.

    `from qkv.pkg import sub` where `sub` is a module is an import of `qkv.pkg.sub` (and of `qkv.pkg`,
    whose `__init__` runs first)."""
    found = []
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "qkv"]
        elif isinstance(node, ast.ImportFrom):
            target = resolve(name, is_package, node)
            if target.split(".")[0] != "qkv":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in known:
                    found.append((sub, None, node.lineno))
                else:
                    found.append((target, alias.name, node.lineno))
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    edges: dict[str, set[str]] = {m: set() for m in known}
    for name, path in known.items():
        for target, _, _ in imports(name, path, known):
            # a package importing its own submodule (a face re-exporting) is the package's business; the
            # submodule importing its parent package's face is the edge that can close a cycle
            if target in known and target != name and not target.startswith(name + "."):
                edges[name].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_known_edges():
    # a check that an empty graph would pass is no check: the parser must see both kinds of import
    edges = graph()
    assert "qkv.config" in edges["qkv.train.config"]  # at the top
    assert "qkv.run" in edges["qkv.cli.main"]  # inside a function (a light command stays light)


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles_among_qkv_modules():
    assert cycles(graph()) == []


def test_no_private_name_imported_across_modules():
    known = modules()
    offenders = [
        f"{path.relative_to(SRC)}:{line} imports {target}.{imported}"
        for name, path in known.items()
        for target, imported, line in imports(name, path, known)
        if imported is not None and imported.startswith("_") and not imported.startswith("__")
    ]
    assert offenders == []
