"""The import graph of `hf_zero/`, counting every import: at load time, under `TYPE_CHECKING`, and deferred inside
functions (tests/test_code_notes.py keeps it free of cycles)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "hf_zero"


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def edges() -> dict[str, set[str]]:
    """Module -> the package's modules it imports. `from pkg import mod` counts the module, not the package."""
    mods = modules()
    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
                target = ".".join([*base, node.module] if node.module else base)
                subs = {f"{target}.{a.name}" for a in node.names} & mods.keys()
                graph[name] |= subs or ({target} & mods.keys())
        graph[name].discard(name)
    return graph


def cycles() -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    graph = edges()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found
