"""The sweep engine on the simulate backend (fast; results labelled simulated) and a scripted one."""

from __future__ import annotations

import threading
import time

import pytest

import tuner
from api import store
from api.engine import SweepRunner
from api.engine._loop import SweepLoop
from api.ranking import service as rankings
from api.settings import Settings
from api.spec import SweepSpec
from api.sweeps import service as svc
from tests.helpers.engine_backends import ScriptedBackend
from workers.simulate import SimulateBackend

TINY = {"model": "tiny", "cluster": "cpu-local", "training": {"global_batch": 16}}



def _sweep(sessions, **spec):
    # ScriptedBackend's own options (oom_tp, crash_pp, sleep_s) are a plug-in's: only a module:attr
    # backend may take options that are not worker options.
    backend = "tests.helpers.engine_backends:ScriptedBackend" if "trial" in spec else "simulate"
    with sessions() as s:
        return svc.create_sweep(s, spec=SweepSpec.model_validate({"backend": backend, **TINY, **spec}), owner="t")


def _rows(sessions, sweep_id):
    with sessions() as s:
        return store.all_trials(s, sweep_id=sweep_id)


def test_memory_model_prunes_before_running(db):
    settings, sessions = db
    problem = SweepSpec.model_validate(TINY).to_problem()
    model, cluster, training = problem.model, problem.cluster, problem.training
    layouts = tuner.enumerate_layouts(problem=tuner.Problem(model=model, cluster=cluster,
                                                            training=training)).valid
    peaks = sorted(tuner.estimate_memory(x, model=model, cluster=cluster, training=training).total for x in layouts)
    cap = peaks[len(peaks) // 2]  # half the layouts cannot fit
    sw = _sweep(sessions, cluster={"preset": "cpu-local", "device_memory": cap},
                search={"sampler": "grid", "max_trials": 40, "warm_start_top_k": 0, "remeasure_top_k": 0})
    backend = ScriptedBackend()
    final = SweepRunner(settings, sessions=sessions, backend_factory=lambda spec: backend).run_sweep(sw.id)
    rows = _rows(sessions, sw.id)
    pruned = [t for t in rows if t.status == "pruned"]
    ran = [t for t in rows if t.status == "completed"]
    assert final.status == "completed" and len(rows) == 40 and pruned and ran
    assert all(t.predicted_memory_bytes > cap and t.device_seconds == 0 and "memory model" in t.cause for t in pruned)
    assert not {t.layout_key for t in pruned} & set(backend.calls)  # no device time for pruned layouts
    assert all(t.predicted_memory_bytes <= cap and t.simulated for t in ran)
    assert final.n_pruned == len(pruned)


def test_measured_oom_is_infeasible_and_never_proposed_again(db):
    settings, sessions = db
    sw = _sweep(sessions, search={"sampler": "tpe", "max_trials": 30, "warm_start_top_k": 0, "remeasure_top_k": 0},
                trial={"options": {"oom_tp": 1}})
    # One trial at a time: seeded TPE + seeded simulate is then deterministic.
    runner = SweepRunner(settings, sessions=sessions, backend_factory=lambda spec: ScriptedBackend(capacity=4))
    assert runner.run_sweep(sw.id).status == "completed"
    rows = _rows(sessions, sw.id)
    ooms = [t for t in rows if t.status == "oom"]
    assert ooms and all(t.layout["tp"] == 1 and t.cause.startswith("oom:") for t in ooms)
    keys = [t.layout_key for t in rows if t.phase == "search"]
    assert len(keys) == len(set(keys)) == 30  # dedupe by layout key: nothing proposed twice
    # What the sampler was told: every OOM is a COMPLETE trial with a violated constraint (not FAIL,
    # which TPE ignores), rebuilt the same way on resume.
    loop = SweepLoop(runner, sw.id, threading.Event(), None)
    loop.claim.recover()
    loop._rebuild()
    told = loop.proposer.study.trials
    infeasible = [t for t in told if t.constraints.get("memory", 0) > 0]
    failed = [t for t in rows if t.phase == "search" and t.status != "completed"]  # oom, crash, pruned after an oom
    assert len(infeasible) == len(failed) and all(t.state.name == "COMPLETE" and t.values[0] == 0.0 for t in infeasible)
    assert not any(t.state.name == "FAIL" for t in told)  # failures teach: never FAIL-and-forget
    # The failures teach: in the second half fewer doomed (tp=1) runs are *launched* than tp=1's share
    # of the space would launch by chance — the sampler steers away and the memory model, raised
    # around each OOM (its neighbours, every layout needing as much of each part), prunes before any
    # device time is spent (pruned proposals are not launches).
    space = loop.ctx.problem.space.layouts
    late = [t for t in rows if t.number >= 15]
    launched_ooms = sum(t.status == "oom" for t in late)
    assert launched_ooms / len(late) < sum(x.tp == 1 for x in space) / len(space)
    assert any(t.status == "pruned" and t.layout["tp"] == 1 for t in late)


def test_crash_is_a_failure_with_cause_and_budgets_stop_the_search(db):
    settings, sessions = db
    sw = _sweep(sessions, search={"sampler": "random", "max_trials": 200, "patience": 5, "warm_start_top_k": 0,
                                  "remeasure_top_k": 0}, trial={"options": {"crash_pp": 2}})
    one_at_a_time = lambda spec: ScriptedBackend(capacity=4)  # noqa: E731 - patience counts in order
    final = SweepRunner(settings, sessions=sessions, backend_factory=one_at_a_time).run_sweep(sw.id)
    rows = _rows(sessions, sw.id)
    assert final.status == "completed" and len(rows) < 200  # patience ended it
    ran = [t for t in rows if t.status != "pruned"]
    best_at = max(range(len(ran)), key=lambda i: ran[i].tokens_per_s_per_device or 0)
    assert len(ran) - 1 - best_at == 5
    crashes = [t for t in rows if t.status == "crash"]
    assert all(t.cause == "crash: scripted crash" and t.error["rank"] == 0 for t in crashes)

    sw = _sweep(sessions, search={"sampler": "random", "max_trials": 200, "max_device_seconds": 5,
                                  "warm_start_top_k": 0, "remeasure_top_k": 0})
    final = SweepRunner(settings, sessions=sessions, backend_factory=one_at_a_time).run_sweep(sw.id)
    spent = [t.device_seconds for t in _rows(sessions, sw.id)]
    assert sum(spent[:-1]) < 5 <= sum(spent) and final.device_seconds == pytest.approx(sum(spent))


def test_warm_start_remeasure_calibration_and_ranking(db):
    settings, sessions = db
    sw = _sweep(sessions, search={"sampler": "tpe", "max_trials": 10, "warm_start_top_k": 3, "remeasure_top_k": 2,
                                  "repeats": 3})
    final = SweepRunner(settings, sessions=sessions, backend_factory=lambda spec: SimulateBackend(seed=1)).run_sweep(sw.id)
    rows = _rows(sessions, sw.id)
    assert [t.source for t in rows[:3]] == ["warm_start"] * 3
    remeasured = [t for t in rows if t.phase == "remeasure"]
    # Adaptive: contenders among the top 2 of each round, each to at most 3 measurements.
    assert remeasured and {t.repeat for t in remeasured} <= {1, 2}
    per_layout = {k: sum(t.layout_key == k for t in rows) for k in {t.layout_key for t in remeasured}}
    assert max(per_layout.values()) <= 3
    assert sorted(t.number for t in rows) == list(range(len(rows)))
    with sessions() as s:
        rk = rankings.ranking(s, sweep_id=sw.id)
    assert rk.simulated and rk.rows[0].n >= 2 and rk.rows[0].low <= rk.rows[0].median <= rk.rows[0].high
    cal = final.calibration
    assert cal["time"]["n"] >= 2 and set(cal["time"]["fitted"]) <= set(cal["time"]["weights"])
    # every row says which calibration its predictions were made under, and versions only grow
    versions = [t.calibration_version for t in sorted(rows, key=lambda t: t.number)]
    assert versions[0] == 0 and versions == sorted(versions) and cal["version"] >= versions[-1]


@pytest.mark.parametrize("sampler", ["nsga2", "gp", "grid"])
def test_every_sampler_runs_without_duplicates(db, sampler):
    settings, sessions = db
    sw = _sweep(sessions, search={"sampler": sampler, "max_trials": 12, "warm_start_top_k": 1, "remeasure_top_k": 0})
    final = SweepRunner(settings, sessions=sessions).run_sweep(sw.id)
    keys = [t.layout_key for t in _rows(sessions, sw.id)]
    assert final.status == "completed" and len(keys) == len(set(keys)) == 12


def test_concurrent_trials_when_capacity_allows(db):
    settings, sessions = db
    sw = _sweep(sessions, search={"sampler": "random", "max_trials": 6, "remeasure_top_k": 0},
                trial={"options": {"sleep_s": 0.4}})
    runner = SweepRunner(settings, sessions=sessions, backend_factory=lambda spec: ScriptedBackend(capacity=8))
    assert runner.run_sweep(sw.id).status == "completed"
    rows = sorted(_rows(sessions, sw.id), key=lambda t: t.started_at)
    # 8 devices / 4 per trial = 2 at once: trials overlap in time, never more than 2.
    assert any(b.started_at < a.finished_at for a, b in zip(rows, rows[1:], strict=False))
    for t in rows:
        assert sum(o.started_at <= t.started_at < o.finished_at for o in rows) <= 2


def test_cancel_stops_a_running_sweep_and_bad_backend_fails_it(db):
    settings, sessions = db
    sw = _sweep(sessions, search={"sampler": "random", "max_trials": 50, "remeasure_top_k": 0},
                trial={"options": {"sleep_s": 0.3}})
    runner = SweepRunner(settings, sessions=sessions, backend_factory=lambda spec: ScriptedBackend(capacity=4))
    th = threading.Thread(target=runner.run_sweep, args=(sw.id,))
    th.start()
    while len(_rows(sessions, sw.id)) < 2:
        time.sleep(0.05)
    with sessions() as s:
        svc.cancel_sweep(s, sweep_id=sw.id)
    th.join(20)
    rows = _rows(sessions, sw.id)
    assert not th.is_alive() and len(rows) < 50
    assert all(t.status != "running" for t in rows)  # the trial in flight was still recorded
    with sessions() as s:
        assert svc.get_sweep(s, sweep_id=sw.id).status == "cancelled"

    with pytest.raises(tuner.SpecError, match="backend='no_such_module:Backend'"):  # refused on submission
        _sweep(sessions, backend="no_such_module:Backend")
    sw = _sweep(sessions)  # a backend that breaks after submission still fails the sweep with its cause

    def broken(spec):
        raise tuner.BackendError("backend='gone:Backend': cannot import module 'gone'")

    final = SweepRunner(settings, sessions=sessions, backend_factory=broken).run_sweep(sw.id)
    assert final.status == "failed" and "gone" in final.error


def test_reference_layouts_are_enqueued_first_and_checked_on_submission(db):
    settings, sessions = db
    name, ref = next(iter(tuner.REFERENCE_LAYOUTS.items()))
    spec = {"model": tuner.to_dict(ref.model), "cluster": tuner.to_dict(ref.cluster),
            "training": {"global_batch": ref.training.global_batch},
            "search": {"reference_layouts": [name], "max_trials": 2, "warm_start_top_k": 1, "remeasure_top_k": 0}}
    with sessions() as s:
        sw = svc.create_sweep(s, spec=SweepSpec.model_validate({"backend": "simulate", **spec}), owner="t")
    assert SweepRunner(settings, sessions=sessions).run_sweep(sw.id).status == "completed"
    rows = _rows(sessions, sw.id)
    assert (rows[0].source, rows[0].layout_key) == ("reference", ref.layout.key) and rows[1].source == "warm_start"
    with sessions() as s, pytest.raises(tuner.SpecError, match=r"search.reference_layouts\[0\].*device count"):
        svc.create_sweep(s, spec=SweepSpec.model_validate({**TINY, "search": {"reference_layouts": [name]}}), owner="t")


def test_listed_layouts_are_measured_exactly_repeats_times(db):
    settings, sessions = db
    listed = [{"tp": 2}, {"tp": 1, "zero": 1}, {"tp": 4, "sp": True}]
    sw = _sweep(sessions, search={"layouts": listed, "repeats": 2, "max_trials": 1, "patience": 1,
                                  "remeasure_top_k": 0, "sampler": "nsga2"})
    assert sw.sampler == "layouts"
    backend = ScriptedBackend(capacity=4)
    final = SweepRunner(settings, sessions=sessions, backend_factory=lambda spec: backend).run_sweep(sw.id)
    rows = _rows(sessions, sw.id)
    keys = [lay.key for lay in SweepSpec.model_validate({**TINY, "search": {"layouts": listed}}).listed_layouts()]
    assert final.status == "completed" and len(rows) == 6 and sorted(backend.calls) == sorted(keys * 2)
    assert [t.layout_key for t in rows if t.phase == "search"] == keys  # in the listed order, no sampler
    assert {t.source for t in rows if t.phase == "search"} == {"listed"}
    assert all(t.status == "completed" for t in rows)
    with sessions() as s:
        ranking = rankings.ranking(s, sweep_id=sw.id)
    assert sorted(r.layout_key for r in ranking.rows) == sorted(keys) and {r.n for r in ranking.rows} == {2}


@pytest.mark.parametrize(
    "layouts, needle",
    [
        ([{"tp": 3}], "search.layouts[0].tp"),
        ([{"tp": 2}, {"tpp": 1}], "search.layouts[1].tpp"),
        ([{"tp": 2, "zero": 7}], "search.layouts[0].zero"),
        ([{"mbs": 3}], "search.layouts[0].mbs"),
        ([{"tp": 2}, {"tp": 2, "dp": 2}], "search.layouts[1]"),
        ([], "search.layouts is empty"),
    ],
)
def test_listed_layouts_bad_input_is_422_naming_the_field(db, layouts, needle):
    from fastapi.testclient import TestClient

    from api.main import create_app

    settings, sessions = db
    body = {**TINY, "backend": "simulate", "search": {"layouts": layouts}}
    with TestClient(create_app(Settings(database_url=settings.database_url, api_tokens={}), run_engine=False)) as c:
        r = c.post("/api/sweeps", json=body)
        assert r.status_code == 422 and needle in r.text, r.text
        assert c.get("/api/sweeps").json()["total"] == 0


def test_failed_sweep_marks_its_running_trials_interrupted_with_the_cause(db):
    """A coordinator died with two trials running; the resuming one cannot import the backend: the
    sweep fails and no row is left "running" (nor counted as running by /metrics)."""
    settings, sessions = db
    sw = _sweep(sessions)  # its backend went away after submission (submission checks it)
    with store.session_scope(sessions) as s:
        for number, layout in enumerate(({"tp": 2, "dp": 2}, {"tp": 1, "dp": 4})):
            lay = tuner.Layout(**layout)
            store.insert_trial(s, sweep_id=sw.id, number=number, layout=layout, layout_key=lay.key,
                               world_size=lay.world_size)

    def broken(spec):
        from workers.backends import get_backend

        return get_backend("no_such_module:Backend")

    final = SweepRunner(settings, sessions=sessions, backend_factory=broken).run_sweep(sw.id)
    assert final.status == "failed" and "no_such_module" in final.error
    rows = _rows(sessions, sw.id)
    assert len(rows) == 4 and all(t.status == "interrupted" for t in rows)  # attempts 0 (restart) and 1 (failed)
    retried = [t for t in rows if t.attempt == 1]
    assert len(retried) == 2 and all(t.cause.startswith("sweep failed: ") and "no_such_module" in t.cause
                                     for t in retried)
    with sessions() as s:
        assert not any(status == "running" for status, _ in svc.counts(s).trials_by_status)


def test_memory_fit_does_not_compound_across_refits():
    """Each refit fits measured peaks against the model's unscaled parts, so refits on the same data
    agree (rows store the prediction under the calibration in force when they were inserted)."""
    import dataclasses
    from types import SimpleNamespace

    from api.engine import SweepModel

    problem = SweepModel.from_spec(SweepSpec.model_validate(TINY))
    layouts = problem.space.layouts[:4]

    def row(layout):
        raw = problem.raw_memory_bytes(layout)
        return SimpleNamespace(layout=dataclasses.asdict(layout), status="completed", peak_memory_bytes=int(raw * 1.5),
                               error=None)

    for lay in layouts[:3]:
        problem.observe(row(lay))
    first = problem.predict(layouts[3]).memory_bytes
    problem.observe(row(layouts[0]))  # the same measurement again: nothing compounds
    assert problem.predict(layouts[3]).memory_bytes == pytest.approx(first, rel=1e-6)
    assert first == pytest.approx(1.5 * problem.raw_memory_bytes(layouts[3]), rel=0.02)
