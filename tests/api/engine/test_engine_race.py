"""Two coordinators racing on one sweep (PostgreSQL): takeovers must never let two runners write the
same trial number, nor a measurement land on a row of another layout; a stale runner must never end a
sweep that another runner owns; a database error must not kill the coordinator's loop."""

from __future__ import annotations

import dataclasses
import threading
import time
from datetime import timedelta

import pytest
import sqlalchemy as sa

import tuner
from api import store
from api.engine import SweepRunner, _claim, _loop
from api.settings import Settings
from api.spec import SweepSpec
from api.sweeps import service as svc
from workers.simulate import SimulateBackend

TINY = {"model": "tiny", "cluster": "cpu-local", "training": {"global_batch": 16}}


class LabellingBackend:
    """Simulated results that say which layout was actually run (in ``env``), after a short sleep."""

    name = "labelling"

    def __init__(self) -> None:
        self.sim = SimulateBackend(seed=0)

    def capacity(self) -> int:
        return 8

    def close(self) -> None:
        return None

    def run(self, request):
        time.sleep(0.05)
        result = self.sim.run(request)
        return dataclasses.replace(result, env={"measured_layout": request.layout.key})


def _slow_factory(spec):
    time.sleep(0.4)  # like a local Ray start: no heartbeat from the loop's own thread meanwhile
    return LabellingBackend()


@pytest.mark.postgres
def test_two_runners_racing_write_each_trial_number_once_with_its_own_layout(fresh_pg_url, monkeypatch, caplog):
    monkeypatch.setattr(_claim, "HEARTBEAT_S", 0.05)
    engine, sessions = store.open_store(fresh_pg_url)
    problem = SweepSpec.model_validate(TINY).to_problem()
    model, cluster, training = problem.model, problem.cluster, problem.training
    layouts = tuner.enumerate_layouts(problem=tuner.Problem(model=model, cluster=cluster,
                                                            training=training)).valid
    peaks = sorted(tuner.estimate_memory(x, model=model, cluster=cluster, training=training).total for x in layouts)
    spec = SweepSpec.model_validate({
        **TINY, "backend": "simulate", "cluster": {"preset": "cpu-local", "device_memory": peaks[len(peaks) // 2]},
        "search": {"sampler": "grid", "max_trials": 40, "warm_start_top_k": 0, "remeasure_top_k": 2, "repeats": 2},
    })
    with sessions() as s:
        sweep_id = svc.create_sweep(s, spec=spec, owner="t").id
    settings = Settings(database_url=fresh_pg_url)
    runners = [SweepRunner(settings, sessions=store.make_sessionmaker(engine), backend_factory=_slow_factory,
                           stale_after_s=0.25, poll_s=0.02) for _ in range(2)]
    stop = threading.Event()
    threads = [threading.Thread(target=r.run_pending, args=(stop,), daemon=True) for r in runners]
    for t in threads:
        t.start()
    # A stall of the owner (GC pause, network hiccup): its heartbeat looks old, the other one takes over.
    owners: list[str] = []
    deadline = time.monotonic() + 60
    status = None
    stalls = 0
    try:
        while time.monotonic() < deadline:
            time.sleep(0.25)
            with store.session_scope(sessions) as s:
                sweep = store.get_sweep(s, sweep_id=sweep_id)
                status = sweep.status
                if status != "running":
                    break
                if sweep.runner_id and (not owners or owners[-1] != sweep.runner_id):
                    owners.append(sweep.runner_id)
                if stalls < 12 and sweep.runner_id:  # at most 12 stalls, then it runs to its end
                    stalls += 1
                    s.execute(sa.update(store.Sweep).where(store.Sweep.id == sweep_id)
                              .values(heartbeat_at=store._models.utcnow() - timedelta(seconds=10)))
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    with sessions() as s:
        rows = store.all_trials(s, sweep_id=sweep_id)
    live: dict[int, list] = {}
    for t in rows:
        if t.status != "interrupted":
            live.setdefault(t.number, []).append(t)
    measured = [t for t in rows if t.status not in ("pruned", "interrupted", "running")]
    wrong = [(t.number, t.attempt, t.layout_key, t.env["measured_layout"]) for t in measured
             if t.env and t.env["measured_layout"] != t.layout_key]
    assert not wrong, f"measurements recorded on rows of another layout: {wrong}"
    assert all(len(ts) == 1 for ts in live.values()), {n: len(ts) for n, ts in live.items() if len(ts) > 1}
    assert status == "completed", status
    taken_over = caplog.text.count("this coordinator stops running it")
    assert taken_over >= 2 and len(owners) >= 2  # the sweep really changed hands several times
    assert sorted(live) == list(range(len(live)))  # no number lost or skipped
    search = [ts[0].layout_key for ts in live.values() if ts[0].phase == "search"]
    assert len(search) == 40 and len(set(search)) == 40  # nothing proposed twice
    assert measured and all(t.env and t.env["measured_layout"] == t.layout_key for t in measured)
    assert not [t for t in rows if t.status == "running"]
    engine.dispose()


def test_stale_runner_cannot_fail_a_sweep_another_runner_owns(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 's.db'}"
    engine, sessions = store.open_store(url)
    with sessions() as s:
        sweep_id = svc.create_sweep(s, spec=SweepSpec.model_validate({**TINY, "backend": "simulate"}), owner="t").id
    old = SweepRunner(Settings(database_url=url), sessions=sessions)
    new = SweepRunner(Settings(database_url=url), sessions=sessions)
    with store.session_scope(sessions) as s:
        assert store.claim_sweep(s, runner_id=new.runner_id, sweep_id=sweep_id) is not None
        store.insert_trial(s, sweep_id=sweep_id, number=0, layout={"dp": 2}, layout_key="k", world_size=2)
    def boom(self):
        raise RuntimeError("boom")

    monkeypatch.setattr(_loop.SweepLoop, "run", boom)
    old._run_claimed(sweep_id, threading.Event(), None)  # the stale runner's loop fails
    with sessions() as s:
        sweep = store.get_sweep(s, sweep_id=sweep_id)
        assert sweep.status == "running" and sweep.runner_id == new.runner_id and sweep.error is None
        assert store.get_trial_by_number(s, sweep_id=sweep_id, number=0).status == "running"
    new._run_claimed(sweep_id, threading.Event(), None)
    with sessions() as s:
        assert store.get_sweep(s, sweep_id=sweep_id).status == "failed"
        assert store.get_trial_by_number(s, sweep_id=sweep_id, number=0).status == "interrupted"
    engine.dispose()


@pytest.mark.parametrize("outage_s", [600.0, 0.0], ids=["waited-out", "past-the-wait"])
def test_coordinator_loop_survives_database_errors_and_releases_past_the_outage_wait(tmp_path, monkeypatch, caplog,
                                                                                      outage_s):
    """A blip mid-sweep is waited out by the sweep's loop (api/engine/_outage.py: the sweep goes on, its
    claim kept); one that outlasts the wait releases the sweep (not failed), and the coordinator's loop
    re-claims and finishes it. Errors while claiming never end the coordinator's loop."""
    from api.engine import _outage

    monkeypatch.setattr(_outage, "OUTAGE_S", outage_s)
    url = f"sqlite:///{tmp_path / 'd.db'}"
    engine, sessions = store.open_store(url)
    with sessions() as s:
        sweep_id = svc.create_sweep(s, spec=SweepSpec.model_validate({**TINY, "backend": "simulate"}), owner="t").id
    runner = SweepRunner(Settings(database_url=url), sessions=sessions, poll_s=0.01)
    calls = {"claim": 0, "beat": 0}
    real_claim, real_heartbeat = store.claim_sweep, store.heartbeat

    def flaky_claim(session, **kw):
        calls["claim"] += 1
        if calls["claim"] <= 2:  # the database is away for a moment
            raise sa.exc.OperationalError("SELECT 1", {}, Exception("server closed the connection unexpectedly"))
        return real_claim(session, **kw)

    def flaky_heartbeat(session, **kw):
        if threading.current_thread().name.startswith("meshtune-sweep"):  # the loop's own beats (not the keep-alive's)
            calls["beat"] += 1
        if calls["beat"] == 3 and threading.current_thread().name.startswith("meshtune-sweep"):  # a blip mid-sweep
            raise sa.exc.OperationalError("UPDATE", {}, Exception("could not connect to server"))
        return real_heartbeat(session, **kw)

    monkeypatch.setattr(store, "claim_sweep", flaky_claim)
    monkeypatch.setattr(store, "heartbeat", flaky_heartbeat)
    monkeypatch.setattr(_claim, "HEARTBEAT_S", 0.01)
    stop = threading.Event()
    thread = threading.Thread(target=runner.run_pending, args=(stop,), daemon=True, name="run_pending")
    thread.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with sessions() as s:
            if store.get_sweep(s, sweep_id=sweep_id).status == "completed":
                break
        time.sleep(0.1)
    stop.set()
    thread.join(timeout=30)
    assert not thread.is_alive()
    with sessions() as s:
        sweep = store.get_sweep(s, sweep_id=sweep_id)
    assert sweep.status == "completed", (sweep.status, sweep.error)
    if outage_s:  # waited out: claimed once (after the two failed claims), never released
        assert calls["claim"] == 3 and "the store answers again" in caplog.text
        assert "releasing it for a later resume" not in caplog.text
    else:  # released (not failed); the loop lived on, re-claimed it and finished it
        assert calls["claim"] > 3 and "releasing it for a later resume" in caplog.text
    engine.dispose()
