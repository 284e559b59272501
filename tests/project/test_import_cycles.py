"""No import circle between the project's modules (api, tuner, workers). An import anywhere in a
module counts (a function-level import is still a dependency); one under ``if TYPE_CHECKING:`` does
not (it never runs). Circles are found as strongly connected components of the import graph."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("api", "tuner", "workers")

# Circles allowed while one is being opened where it lives (none now). Exactly these: a new circle
# fails the test, and so does an entry here that no longer is one (delete it then).
KNOWN_CYCLES: set[frozenset[str]] = set()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_modules(source: str, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``source`` imports (absolute imports; the project uses no
    relative ones), wherever the import is, except under ``if TYPE_CHECKING:``."""
    out: set[str] = set()
    stack: list[ast.AST] = [ast.parse(source)]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:  # ``from pkg import mod`` imports the module, ``from mod import name`` mod
                name = f"{node.module}.{a.name}"
                out.add(name if name in modules else node.module)
        stack.extend(ast.iter_child_nodes(node))
    return out & modules


def cycles(sources: dict[str, str]) -> set[frozenset[str]]:
    """The import circles among ``sources`` (module name -> code): every strongly connected component
    of more than one module (Tarjan's algorithm)."""
    modules = set(sources)
    graph = {m: sorted(imported_modules(src, modules) - {m}) for m, src in sources.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[frozenset[str]] = set()
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(modules)))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = {stack.pop()}
            while v not in component:
                component.add(stack.pop())
            if len(component) > 1:
                found.add(frozenset(component))

    for m in sorted(modules):
        if m not in index:
            visit(m)
    return found


def project_sources() -> dict[str, str]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path.read_text()
    return out


def test_the_project_has_no_import_circle_but_the_known_ones() -> None:
    sources = project_sources()
    assert len(sources) > 100 and "tuner._plan" in sources and "workers.reshard" in sources
    found = cycles(sources)
    new = [sorted(c) for c in found - KNOWN_CYCLES]
    gone = [sorted(c) for c in KNOWN_CYCLES - found]
    assert not new, f"new import circles (move the shared concept to a module of its own): {new}"
    assert not gone, f"these circles are gone: delete them from KNOWN_CYCLES: {gone}"
    assert all(m.startswith("api.") for c in found for m in c), found


def test_a_circle_is_found_through_a_function_level_import_and_a_package_face() -> None:
    sources = {
        "tuner": "from tuner._a import f\n",
        "tuner._a": "def f():\n    from tuner._b import g\n",
        "tuner._b": "import tuner._c\n",
        "tuner._c": "from tuner import f\n",
        "tuner._d": "from tuner._a import f\n",
    }
    assert cycles(sources) == {frozenset({"tuner", "tuner._a", "tuner._b", "tuner._c"})}
    sources["tuner._c"] = "import json\n"
    assert cycles(sources) == set()


def test_a_type_checking_import_is_not_a_circle() -> None:
    sources = {
        "workers.a": "from workers.b import X\n",
        "workers.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from workers.a import Y\nX = 1\n",
    }
    assert cycles(sources) == set()
    sources["workers.b"] = "import typing\nif typing.TYPE_CHECKING:\n    pass\nelse:\n    from workers.a import Y\n"
    assert cycles(sources) == {frozenset({"workers.a", "workers.b"})}
