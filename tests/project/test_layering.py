"""The README's layering rules, enforced with import-linter's contracts ([tool.importlinter] in
pyproject.toml): tuner imports neither torch.distributed nor the database; tuner imports neither
workers nor api; workers never imports api; inside api, the store imports no feature, spec or app
module, and no module but the app imports the dashboard or the CLI. Function-level imports count."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTRACTS = (
    "tuner is pure: no torch.distributed, no database",
    "tuner imports neither workers nor api",
    "workers never imports api",
    "the store imports no feature, spec or app module of api",
    "the dashboard and the CLI are on top: no other api module imports them",
)


def _lint(cwd: Path, env_path: Path | None = None) -> subprocess.CompletedProcess[str]:
    import os

    env = dict(os.environ)
    if env_path is not None:  # the copies shadow the installed packages (PYTHONPATH precedes site-packages)
        env["PYTHONPATH"] = str(env_path)
    exe = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(exe), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_code_keeps_every_layering_contract() -> None:
    out = _lint(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    for name in CONTRACTS:
        assert f"{name} KEPT" in out.stdout
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in out.stdout


def test_each_contract_fails_on_a_violating_import(tmp_path: Path) -> None:
    """On a copy of the packages with one violation per rule, every contract is broken (so the
    passing test above can fail)."""
    for pkg in ("tuner", "workers", "api"):
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__", "static", "templates"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    violations = {
        "tuner/_stats.py": "def _db():\n    import torch.distributed  # noqa\n    import sqlalchemy  # noqa\n",
        "tuner/_layout.py": "def _up():\n    from workers import aggregate  # noqa\n",
        "workers/aggregate.py": "def _up():\n    from api.store import _models  # noqa\n",
        "api/store/_sweeps.py": "def _up():\n    from api.spec import SweepSpec  # noqa\n",
        "api/sweeps/service.py": "def _up():\n    from api.dashboard import views  # noqa\n",
    }
    for path, code in violations.items():
        with open(tmp_path / path, "a") as f:
            f.write("\n\n" + code)
    out = _lint(tmp_path, env_path=tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    for name in CONTRACTS:
        assert f"{name} BROKEN" in out.stdout, out.stdout
    assert f"Contracts: 0 kept, {len(CONTRACTS)} broken." in out.stdout
    assert "tuner._stats -> torch.distributed" in out.stdout or "tuner._stats -> torch" in out.stdout, out.stdout
    assert "workers.aggregate -> api.store._models" in out.stdout, out.stdout
    assert "api.store._sweeps -> api.spec" in out.stdout and "api.sweeps.service -> api.dashboard" in out.stdout, out.stdout
