"""No package reaches into another's private modules: api/, tuner/ and workers/ import each other
through the package face (``from tuner import rank``) or a public module, never ``tuner._stats``.
Every import counts, at module level or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("api", "tuner", "workers")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def private_imports(module: str, source: str) -> list[str]:
    """``line: name`` of each import in ``source`` (the code of ``module``) that names a
    ``_``-prefixed module or attribute of another project package."""
    own = module.split(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:  # a relative import stays inside its own package
            continue
        for name in names:
            top, *rest = name.split(".")
            if top in PACKAGES and top != own and any(p.startswith("_") and not p.startswith("__") for p in rest):
                found.append(f"{node.lineno}: {name}")
    return found


def test_no_package_imports_another_packages_private_module() -> None:
    wrong = []
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 100, len(files)  # the walk sees the packages
    for path in files:
        for hit in private_imports(module_name(path), path.read_text()):
            wrong.append(f"{path.relative_to(ROOT)}:{hit}")
    assert not wrong, "import these from the package face instead:\n" + "\n".join(wrong)


def test_the_check_finds_each_form_of_a_private_import() -> None:
    source = (
        "import workers._gangs\n"
        "from tuner._stats import rank\n"
        "from workers import _contract\n"
        "from workers.backends import _resolve\n"
        "def f():\n"
        "    from tuner._probe import summary\n"
    )
    assert private_imports("api.ranking.service", source) == [
        "1: workers._gangs", "2: tuner._stats.rank", "3: workers._contract", "4: workers.backends._resolve",
        "6: tuner._probe.summary",
    ]


def test_the_check_allows_faces_public_modules_and_a_package_own_private_modules() -> None:
    source = (
        "from tuner import rank\n"
        "from workers.ray_backend import RayBackend\n"
        "import workers.backends\n"
        "from api.store._models import Trial\n"
        "from . import _sibling\n"
        "from __future__ import annotations\n"
    )
    assert private_imports("api.cli.run_trial", source) == []
    assert private_imports("tuner._plan", "from tuner._stats import rank\n") == []
    assert private_imports("tuner._plan", "from api._answers import x\n") == ["1: api._answers.x"]
