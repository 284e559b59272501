"""A test that patches a module's constant (``monkeypatch.setattr(module, "NAME", value)``) patches it
where it is read: in the module that assigns it and reads it itself, not in one that merely imports
or re-exports it (the patch then changes nothing the code reads: patching the watchdog's grace in
workers.ray_backend after it moved to workers._watchdog did nothing), and never with
``raising=False``, which turns a constant that moved or was renamed into a silent no-op."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
CONSTANT = re.compile(r"^_?[A-Z][A-Z0-9_]*$")


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Names bound to modules by the imports of a test file (top-level and inside functions)."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _constant_patches() -> list[tuple[str, int, str, str, bool]]:
    """(file, line, module, NAME, raising=False given) of every constant patch in the tests."""
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        tree = ast.parse(path.read_text())
        aliases = _aliases(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "setattr"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "monkeypatch"
                    and len(node.args) >= 2 and isinstance(node.args[0], ast.Name)
                    and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                    and CONSTANT.match(node.args[1].value) and node.args[0].id in aliases):
                continue
            silent = any(k.arg == "raising" and isinstance(k.value, ast.Constant) and k.value.value is False
                         for k in node.keywords)
            found.append((path.name, node.lineno, aliases[node.args[0].id], node.args[1].value, silent))
    return found


def _assigned_and_read(module_name: str, name: str) -> tuple[bool, bool]:
    """Whether ``module_name`` assigns ``name`` at its top level, and reads it in its own code."""
    module = importlib.import_module(module_name)
    tree = ast.parse(inspect.getsource(module))
    assigned = any(
        isinstance(node, (ast.Assign, ast.AnnAssign))
        and any(isinstance(t, ast.Name) and t.id == name for t in (node.targets if isinstance(node, ast.Assign)
                                                                    else [node.target]))
        for node in tree.body)
    read = any(isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Load) for node in ast.walk(tree))
    return assigned, read


def test_constants_are_patched_where_they_are_read():
    patches = _constant_patches()
    assert len(patches) >= 4, patches  # the scan finds the suite's patches (engine, claims, dashboard, health)
    wrong = []
    for file, line, module, name, silent in patches:
        assigned, read = _assigned_and_read(module, name)
        if silent or not assigned or not read:
            wrong.append(f"{file}:{line} patches {module}.{name}: "
                         + ("raising=False" if silent else "not assigned there" if not assigned else "not read there"))
    assert not wrong, wrong


def test_a_moved_constant_is_not_re_exported_where_a_patch_would_miss_it():
    """The watchdog's grace lives in workers._watchdog and only there: a patch of it elsewhere fails."""
    import workers._watchdog as watchdog
    import workers.ray_backend as ray_backend

    assert _assigned_and_read("workers._watchdog", "ERROR_GRACE_S") == (True, True)
    assert not hasattr(ray_backend, "ERROR_GRACE_S") and watchdog.ERROR_GRACE_S > 0
