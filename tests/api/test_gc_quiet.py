"""api/_gc.py: ``meshtune serve`` keeps long-lived objects out of the collector's full passes — what
is alive once started, and a sweep's dashboard state once built — and nothing else (tests, the CLI)
freezes anything. Run in a child process: freezing is process-wide."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import gc, sys
sys.path[:0] = [{root!r}]
from api import _gc, store
from api.dashboard import data
from tests.helpers.dashboard_seed import seed_sweep

engine, sessions = store.open_store({url!r})
sid = seed_sweep(sessions, n_trials=40, name="gc")
with sessions() as s:
    data.sweep_state(s, sweep_id=sid)
assert gc.get_freeze_count() == 0, "settle() froze objects outside meshtune serve"
data._finished.clear()
_gc.serve_quietly()
started = gc.get_freeze_count()
assert started > 0 and gc.get_threshold() == _gc.YOUNG_THRESHOLD
with sessions() as s:
    state = data.sweep_state(s, sweep_id=sid)
rows = state["trials"]
assert gc.get_freeze_count() > started, "a built sweep state was left to the full collections"
scanned = {{id(o) for o in gc.get_objects()}}  # the generations a full pass walks (not the frozen)
assert len(rows) >= 40 and id(rows) not in scanned and not any(id(r) in scanned for r in rows)
print("ok", started, gc.get_freeze_count())
"""


def test_serve_freezes_startup_and_built_states_only(tmp_path: Path) -> None:
    code = CHILD.format(root=str(ROOT), url=f"sqlite:///{tmp_path / 'g.db'}")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-2000:]


def test_meshtune_serve_sets_the_collector_before_serving(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """``meshtune serve`` calls serve_quietly() before uvicorn starts (both replaced here: the real ones
    would freeze this test process and serve forever)."""
    import uvicorn

    from api.cli import main
    from api.cli import serve as serve_cli

    calls: list[str] = []
    monkeypatch.setenv("MESHTUNE_DATABASE_URL", f"sqlite:///{tmp_path / 's.db'}")
    monkeypatch.setattr(serve_cli, "serve_quietly", lambda: calls.append("collector"))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: calls.append("uvicorn"))
    assert main(["serve", "--no-engine", "--port", "0"]) == 0
    assert calls == ["collector", "uvicorn"]
