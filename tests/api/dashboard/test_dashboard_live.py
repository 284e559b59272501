"""A running sweep's dashboard state is kept and refreshed with what changed (api/dashboard/live.py):
after each kind of write the engine makes to a running sweep's trials and sweep row, the kept state
equals the state read from scratch (``data._read_state``), less the version counter; and a refresh
reads only the new rows and those that could still change."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
import sqlalchemy as sa

from api import store
from api.dashboard import data, live
from api.store._queue import restart_trial_clock
from api.sweeps import service
from tests.helpers.dashboard_seed import seed_sweep
from workers import TrialError, TrialResult

# A calibration as the engine stores one (api.engine._calibrate): a new version re-predicts the
# ranked layouts, and the sweep page prints its lines.
CALIBRATION = {"version": 1, "time": {
    "n": 8, "prior": "analytical", "prior_spearman": 0.62, "loo_spearman": 0.81, "accepted": True,
    "fitted": ["compute"], "weights": {"compute": 2.5, "comm": 1.0, "dp": 1.0, "p2p": 1.0, "latency": 0.0}}}


def _bare(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if k != "version"}


@pytest.fixture(params=["sqlite", "postgresql"])
def running(request, tmp_path, monkeypatch):
    """A running seeded sweep (one trial of each failure too), its sessions, and the dashboard's live
    cache emptied, with every read refreshing (no LIVE_TTL_S sharing)."""
    url = f"sqlite:///{tmp_path / 'live.db'}" if request.param == "sqlite" else request.getfixturevalue("fresh_pg_url")
    engine, sessions = store.open_store(url)
    sid = seed_sweep(sessions, n_trials=16, name="live sweep", rich=True, status="running")
    monkeypatch.setattr(data, "LIVE_TTL_S", 0.0)
    monkeypatch.setattr(live, "_kept", OrderedDict())
    yield sessions, sid
    engine.dispose()


def _state(sessions, sid: int) -> dict[str, Any]:
    """sweep_state's (the live path while the sweep runs), checked against a read from scratch."""
    with sessions() as s:
        state = data.sweep_state(s, sweep_id=sid)
        scratch = data._read_state(s, service.describe_sweep(s, sweep_id=sid))
    assert _bare(state) == _bare(scratch)
    assert state["version"] != scratch["version"]  # the scratch read made a state of its own
    return state


def _layout(sessions, sid: int, n: int = 0) -> tuple[dict[str, Any], str, int]:
    with sessions() as s:
        t = service.list_trials(s, sweep_id=sid, status="completed").items[n]
        return dict(t.layout), t.layout_key, t.world_size


def _start(sessions, sid: int, *, number: int | None = None, attempt: int = 0, source: str = "sampler",
           status: str = "running", n: int = 0) -> int:
    layout, key, world = _layout(sessions, sid, n)
    with store.session_scope(sessions) as s:
        number = store.next_number(s, sweep_id=sid) if number is None else number
        assert store.insert_trial(s, sweep_id=sid, number=number, attempt=attempt, layout=layout, layout_key=key,
                                  world_size=world, source=source, status=status, phase="remeasure", repeat=9,
                                  backend="simulate", predicted_memory_bytes=2**30,
                                  cause="predicted to exceed the device" if status == "pruned" else None)
    return number


def _finish(sessions, sid: int, number: int, *, status: str = "completed", infra: str | None = None) -> None:
    ok = status == "completed"
    result = TrialResult(
        status=status, backend="simulate", simulated=True, step_time_s=1.0 if ok else None,
        step_times_s=[1.0] if ok else [], tokens_per_s_per_device=123456.0 if ok else None,
        tokens_per_s=123456.0 * 8 if ok else None, peak_memory_bytes=3 * 2**30 if ok else None,
        device_seconds=16.0, env={"hosts": ["node-a"]},
        error=None if ok else TrialError(kind=status, message="the node went away", infra=infra))
    with store.session_scope(sessions) as s:
        assert store.record_result(s, sweep_id=sid, number=number, attempt=0, result=result)
        store.refresh_sweep_cache(s, sweep_id=sid)


def _row(state: dict[str, Any], number: int, attempt: int = 0) -> dict[str, Any]:
    return next(t for t in state["trials"] if (t["number"], t["attempt"]) == (number, attempt))


def test_the_kept_state_follows_every_write_to_a_running_sweep(running):
    sessions, sid = running
    first = _state(sessions, sid)
    kept = live._kept[sid]
    reads = kept.rows.reads
    assert reads == len(first["trials"]) > 16
    # Nothing changed: nothing read again, the same state (and version: rendered pages stay valid).
    again = _state(sessions, sid)
    assert again is first and kept.rows.reads == reads

    # A trial starts: one new row read.
    a = _start(sessions, sid)
    state = _state(sessions, sid)
    assert _row(state, a)["status"] == "running" and kept.rows.reads == reads + 1
    assert state["version"] != first["version"]
    # Its devices are granted later (restart_trial_clock): a running row changes without its status.
    before = _row(state, a)["started_at"]
    with store.session_scope(sessions) as s:
        restart_trial_clock(s, sweep_id=sid, number=a, attempt=0)
    assert _row(_state(sessions, sid), a)["started_at"] != before
    # It finishes: its row and the ranking change (a new ranked measurement of its layout).
    n_before = next(r["n"] for r in state["ranking"] if r["layout_key"] == _row(state, a)["key"])
    _finish(sessions, sid, a)
    state = _state(sessions, sid)
    assert _row(state, a)["status"] == "completed"
    assert next(r["n"] for r in state["ranking"] if r["layout_key"] == _row(state, a)["key"]) == n_before + 1
    reads = kept.rows.reads
    assert _state(sessions, sid) is state and kept.rows.reads == reads  # final now: not read again

    # A trial fails.
    b = _start(sessions, sid, n=1)
    _state(sessions, sid)
    _finish(sessions, sid, b, status="crash")
    assert _row(_state(sessions, sid), b)["status"] == "crash"

    # A node is lost under a trial; its layout is re-queued as a new trial (api/engine/_lost.py).
    c = _start(sessions, sid, n=2)
    _state(sessions, sid)
    _finish(sessions, sid, c, status="crash", infra="node_lost")
    d = _start(sessions, sid, n=2, source="requeued")
    state = _state(sessions, sid)
    assert _row(state, c)["error"]["infra"] == "node_lost" and _row(state, d)["source"] == "requeued"

    # The model prunes a layout (inserted final).
    e = _start(sessions, sid, n=3, status="pruned")
    assert _row(_state(sessions, sid), e)["status"] == "pruned"

    # The coordinator restarts: running rows are marked interrupted and re-run as attempt + 1, each
    # sorted right after its number's first attempt (before the later numbers, whatever its id).
    f, g = _start(sessions, sid, n=4), _start(sessions, sid, n=5)
    _state(sessions, sid)
    with store.session_scope(sessions) as s:
        assert {t.number for t in store.mark_interrupted(s, sweep_id=sid)} == {d, f, g}
    for number in (f, g):
        _start(sessions, sid, number=number, attempt=1, n=4 if number == f else 5)
    state = _state(sessions, sid)
    order = [(t["number"], t["attempt"]) for t in state["trials"]]
    assert order.index((f, 1)) == order.index((f, 0)) + 1 < order.index((g, 0))
    assert _row(state, f)["status"] == "interrupted" and _row(state, f, 1)["status"] == "running"

    # A calibration refit: the ranking's predictions and the page's calibration lines change.
    with store.session_scope(sessions) as s:
        store.set_calibration(s, sweep_id=sid, calibration=CALIBRATION)
    state = _state(sessions, sid)
    assert state["sweep"]["calibration_lines"] and live._kept[sid] is not kept

    # The sweep's own row: its priority, then its end (the finished path takes the kept rows over).
    with store.session_scope(sessions) as s:
        s.execute(sa.update(store.Sweep).where(store.Sweep.id == sid).values(priority="high"))
    assert _state(sessions, sid)["sweep"]["priority"] == "high"
    with store.session_scope(sessions) as s:
        store.mark_interrupted(s, sweep_id=sid, cause="sweep failed")
        store.set_sweep_status(s, sweep_id=sid, status="failed", error="test: the sweep failed")
    state = _state(sessions, sid)
    assert state["sweep"]["status"] == "failed" and not state["bundle"]["live"] and sid not in live._kept


def test_a_row_committed_after_a_higher_id_is_read(fresh_pg_url, monkeypatch):
    """PostgreSQL hands out ids at insert and rows appear at commit: a trial whose transaction commits
    after a later-inserted one's has a lower id than a row already read."""
    engine, sessions = store.open_store(fresh_pg_url)
    try:
        sid = seed_sweep(sessions, n_trials=6, name="ids", status="running")
        monkeypatch.setattr(data, "LIVE_TTL_S", 0.0)
        monkeypatch.setattr(live, "_kept", OrderedDict())
        _state(sessions, sid)
        layout, key, world = _layout(sessions, sid)
        with sessions() as slow, sessions() as fast:
            number = store.next_number(fast, sweep_id=sid)
            for s, n in ((slow, number), (fast, number + 1)):  # slow inserts first: the lower id
                store.insert_trial(s, sweep_id=sid, number=n, layout=layout, layout_key=key, world_size=world)
            fast.commit()
            state = _state(sessions, sid)
            assert [t["number"] for t in state["trials"]][-1] == number + 1
            assert number not in {t["number"] for t in state["trials"]}
            slow.commit()
        state = _state(sessions, sid)
        assert [t["number"] for t in state["trials"]][-2:] == [number, number + 1]
        slow_id = _row(state, number)["id"]
        assert slow_id < _row(state, number + 1)["id"]  # the case itself: a lower id, read later
    finally:
        engine.dispose()
