"""The tests share code through tests/helpers and fixtures through conftest.py files, never through
each other: no test module imports another test module, and no fixture is defined in two modules that
are not conftest.py (nor in a module beside a conftest.py fixture of the same name, which it would
silently replace). What is shared goes to tests.helpers or to the conftest.py at the level of its
users."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _rel(path: Path) -> str:
    return path.relative_to(TESTS).as_posix()


def imported_test_modules(path: Path, source: str) -> set[str]:
    """Test modules (``test_*``) that ``source`` imports, by their dotted name."""
    package = ".".join(("tests", *path.relative_to(TESTS).parent.parts))
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], *filter(None, [base])])
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        out.update(n for n in names if n and n.split(".")[-1].startswith("test_"))
    return out


def fixture_names(source: str) -> set[str]:
    """Names of the fixtures a module defines at its top level (``name=`` where given)."""
    names = set()
    for node in ast.parse(source).body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for deco in node.decorator_list:
            call = deco if isinstance(deco, ast.Call) else None
            target = call.func if call else deco
            if (target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)) == "fixture":
                given = [k.value.value for k in (call.keywords if call else []) if k.arg == "name"]
                names.add(given[0] if given else node.name)
    return names


def _modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if p.name != "__init__.py")


def test_no_test_module_imports_another() -> None:
    found = {(_rel(p), m) for p in _modules() for m in imported_test_modules(p, p.read_text(encoding="utf-8"))}
    assert not found, f"share it through tests/helpers instead: {sorted(found)}"


def test_each_fixture_is_defined_once() -> None:
    where: dict[str, list[str]] = defaultdict(list)
    in_conftest: dict[str, list[str]] = defaultdict(list)
    for path in _modules():
        for name in fixture_names(path.read_text(encoding="utf-8")):
            (in_conftest if path.name == "conftest.py" else where)[name].append(_rel(path))
    twice = {name: files for name, files in where.items() if len(files) > 1}
    assert not twice, f"one fixture, one definition (in the conftest.py of its users), or names apart: {twice}"
    shadowing = {name: (where[name], in_conftest[name]) for name in where if name in in_conftest}
    assert not shadowing, f"a module's fixture replaces a conftest.py one of the same name: {shadowing}"
