"""Infrastructure failures in the engine: a backend that is unavailable for a while is retried with
back-off; one that stays unavailable leaves the sweep resumable (never failed for good) and does not
starve the coordinator's other sweeps; a backend error is recorded truthfully on each trial in
flight; re-measurement picks contenders by their median."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

import tuner
from api import store
from api.engine import SweepRunner, _loop
from api.engine._budget import SearchBudget
from api.engine._context import LoopContext
from api.spec import SweepSpec
from api.sweeps import service as svc
from workers import BackendUnavailable
from workers.simulate import SimulateBackend

TINY = {"model": "tiny", "cluster": "cpu-local", "training": {"global_batch": 16}}
SEARCH = {"sampler": "grid", "max_trials": 4, "warm_start_top_k": 0, "remeasure_top_k": 0}
SLOW_START = "cannot start a local Ray after 3 attempts: Exception: The current node timed out during startup"



@pytest.fixture(autouse=True)
def _no_back_off(monkeypatch):
    monkeypatch.setattr(_loop, "RETRY_DELAYS_S", (0.0, 0.0, 0.0))  # back-off without waiting (read in _loop)


def _sweep(sessions, name="s", **search):
    spec = SweepSpec.model_validate({"backend": "simulate", "name": name, **TINY, "search": {**SEARCH, **search}})
    with sessions() as s:
        return svc.create_sweep(s, spec=spec, owner="t")


def _rows(sessions, sweep_id):
    with sessions() as s:
        return store.all_trials(s, sweep_id=sweep_id)


class Flaky:
    """Simulate, except that its first ``down`` calls (or all, with down=None) find it unavailable."""

    name = "flaky"

    def __init__(self, down: int | None, capacity: int = 4) -> None:
        self.sim, self.down, self.calls, self._capacity = SimulateBackend(seed=0), down, 0, capacity

    def capacity(self) -> int:
        return self._capacity

    def close(self) -> None:
        return None

    def run(self, request):
        self.calls += 1
        if self.down is None or self.calls <= self.down:
            raise BackendUnavailable(SLOW_START)
        return self.sim.run(request)


def test_an_unavailable_backend_is_retried_and_the_sweep_completes(db):
    settings, sessions = db
    sw = _sweep(sessions)
    backend = Flaky(down=2)
    final = SweepRunner(settings, sessions=sessions, backend_factory=lambda spec: backend).run_sweep(sw.id)
    rows = _rows(sessions, sw.id)
    assert final.status == "completed", final.error
    assert len(rows) == 4 and all(t.status == "completed" for t in rows)  # no trial blamed for it
    assert backend.calls == 4 + 2


def test_a_backend_that_stays_unavailable_leaves_the_sweep_resumable(db):
    settings, sessions = db
    sw = _sweep(sessions)
    runner = SweepRunner(settings, sessions=sessions, backend_factory=lambda spec: Flaky(down=None))
    with pytest.raises(BackendUnavailable, match=rf"sweep {sw.id} is left unfinished.*resum.*timed out during startup"):
        runner.run_sweep(sw.id)
    with sessions() as s:
        sweep = store.get_sweep(s, sweep_id=sw.id)
    assert sweep.status == "running" and sweep.runner_id is None  # released: a resume takes it at once
    rows = _rows(sessions, sw.id)
    assert rows and all(t.status == "interrupted" and "backend unavailable" in t.cause for t in rows)
    # The backend is back: the same sweep resumes and completes, each number with one live row.
    final = SweepRunner(settings, sessions=sessions, backend_factory=lambda spec: Flaky(down=0)).run_sweep(sw.id)
    assert final.status == "completed"
    live = [t for t in _rows(sessions, sw.id) if t.status != "interrupted"]
    assert sorted(t.number for t in live) == [0, 1, 2, 3] and all(t.status == "completed" for t in live)


def test_unavailable_at_set_up_also_leaves_the_sweep_resumable(db):
    settings, sessions = db
    sw = _sweep(sessions)

    class NoCapacity(Flaky):
        def capacity(self) -> int:
            raise BackendUnavailable(SLOW_START)

    with pytest.raises(BackendUnavailable, match="left unfinished"):
        SweepRunner(settings, sessions=sessions, backend_factory=lambda spec: NoCapacity(down=0)).run_sweep(sw.id)
    with sessions() as s:
        assert store.get_sweep(s, sweep_id=sw.id).status == "running"


def test_coordinator_backs_off_an_unavailable_sweep_and_runs_the_others(db):
    settings, sessions = db
    stuck, other = _sweep(sessions, name="stuck"), _sweep(sessions, name="other")
    runner = SweepRunner(settings, sessions=sessions, poll_s=0.01,
                         backend_factory=lambda spec: Flaky(down=None if spec.name == "stuck" else 0))
    stop = threading.Event()
    thread = threading.Thread(target=runner.run_pending, args=(stop,), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with sessions() as s:
            if store.get_sweep(s, sweep_id=other.id).status == "completed":
                break
        time.sleep(0.05)
    stop.set()
    thread.join(30)
    assert not thread.is_alive()
    with sessions() as s:
        assert store.get_sweep(s, sweep_id=other.id).status == "completed"  # not starved by the stuck one
        assert store.get_sweep(s, sweep_id=stuck.id).status == "running"  # waiting, not failed


def test_a_backend_error_is_recorded_truthfully_on_each_trial_in_flight(db):
    settings, sessions = db
    sw = _sweep(sessions)
    failed = threading.Event()

    class Broken(Flaky):
        def run(self, request):
            self.calls += 1
            if self.calls == 1:
                failed.set()
                raise tuner.BackendError("backend='x': the plug-in lost its licence")
            failed.wait(30)
            time.sleep(1.0)  # still in flight when the loop collects the error
            return self.sim.run(request)

    backend = Broken(down=0, capacity=8)  # two trials at once
    final = SweepRunner(settings, sessions=sessions, backend_factory=lambda spec: backend).run_sweep(sw.id)
    assert final.status == "failed" and "licence" in final.error
    rows = {t.number: t for t in _rows(sessions, sw.id)}
    # The trial that met the error did not crash: it never ran, and says why.
    assert rows[0].status == "interrupted" and "licence" in rows[0].cause
    # The one beside it ran to its end: it keeps its own result, not the other's error.
    assert rows[1].status == "completed" and rows[1].tokens_per_s_per_device


def _context(search, space):
    """A loop's context for ``SearchBudget`` alone: a spec's search section and a model's listed flag and space."""
    return LoopContext(sweep_id=1, spec=SimpleNamespace(search=search), sessions=None, runner_id="t",
                       problem=SimpleNamespace(listed=False, space=space), stop=threading.Event())


def test_remeasure_plan_ranks_layouts_by_their_median_search_measurement():
    space = SimpleNamespace(layouts=[tuner.Layout(dp=4), tuner.Layout(tp=4)], index={})
    space.index = {lay.key: i for i, lay in enumerate(space.layouts)}
    lucky, steady = (lay.key for lay in space.layouts)

    def row(number, key, tok):
        return SimpleNamespace(number=number, layout_key=key, tokens_per_s_per_device=tok, phase="search",
                               status="completed", repeat=0)

    ctx = _context(SimpleNamespace(remeasure_top_k=1, repeats=2), space)
    # One lucky fast measurement among slow ones must not make a contender of its layout.
    ctx.rows = {i: r for i, r in enumerate([row(0, lucky, 900.0), row(1, lucky, 100.0), row(2, lucky, 110.0),
                                            row(3, steady, 500.0), row(4, steady, 480.0)])}
    assert [(lay.key, rep) for lay, rep in SearchBudget(ctx).remeasure_plan()] == [(steady, 1)]


def test_remeasure_plan_spends_no_more_than_the_announced_re_measurements():
    """remeasure_top_k=2, repeats=2 announces 2 re-measurements ("8 searched + 2 re-measurements of
    the top 2"): once two are recorded, a third layout that has since become a contender is not
    re-measured (the sweep would otherwise run more trials than it said it would)."""
    space = SimpleNamespace(layouts=[tuner.Layout(dp=4), tuner.Layout(tp=4), tuner.Layout(pp=4)], index={})
    space.index = {lay.key: i for i, lay in enumerate(space.layouts)}
    a, b, c = (lay.key for lay in space.layouts)

    def row(number, key, tok, phase="search", repeat=0):
        return SimpleNamespace(number=number, layout_key=key, tokens_per_s_per_device=tok, phase=phase,
                               status="completed", repeat=repeat)

    ctx = _context(SimpleNamespace(remeasure_top_k=2, repeats=2), space)
    budget = SearchBudget(ctx)
    ctx.rows = {i: r for i, r in enumerate([row(0, a, 1000.0), row(1, b, 990.0), row(2, c, 980.0)])}
    first = [(lay.key, rep) for lay, rep in budget.remeasure_plan()]
    assert first == [(a, 1), (b, 1)]
    # b's re-measurement came out slow: c is now among the top 2 and overlaps the best, but the
    # announced re-measurements are spent.
    ctx.rows |= {3: row(3, a, 1010.0, "remeasure", 1), 4: row(4, b, 700.0, "remeasure", 1)}
    assert budget.remeasure_plan() == []
