"""Cluster probes stored and used (api/probes): found per cluster, model and environment, run when
missing or stale, never half-written; a sweep probes before its first trial and the next one reuses
it; ``meshtune probe``, ``plan``, ``show``, the API and the dashboard say which figures are probed.
The probe's ranks are a test double answering with timings made from known figures
(tests/helpers/probe_raw.py); its real run on Ray is in tests/workers/test_ray_backend.py."""

from __future__ import annotations

import types

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

import tuner
from api import store
from api.cli import main
from api.engine import SweepRunner
from api.engine._prediction import cluster_under
from api.main import create_app
from api.probes import service as probes
from api.probes.models import ClusterProbe
from api.ranking import accuracy
from api.settings import Settings
from api.spec import SweepSpec
from api.sweeps import service as svc
from tests.helpers.probe_raw import ENV, ProbingBackend, truth
from workers import BackendUnavailable, TrialResult
from workers.simulate import SimulateBackend

SPEC = {"model": "tiny", "cluster": "cpu-local", "training": {"global_batch": 16, "precision": "fp32"},
        "backend": "ray", "space": {"tp": [1, 2]},  # what the test double's probe measured layers of
        "search": {"max_trials": 3, "remeasure_top_k": 0, "warm_start_top_k": 2}}
problem = SweepSpec.model_validate(SPEC).to_problem()
MODEL, CLUSTER, TRAINING = problem.model, problem.cluster, problem.training
LAYOUTS = [tuner.Layout(dp=4), tuner.Layout(tp=2, dp=2), tuner.Layout(tp=2, dp=2, sp=True)]


class SweepingBackend(ProbingBackend):
    """Answers the probe as ProbingBackend, and runs trials as the simulate backend does (labelled simulated)."""

    def __init__(self, **kw) -> None:
        super().__init__(truth(), model=MODEL, cluster=CLUSTER, training=TRAINING, **kw)
        self.sim = SimulateBackend(seed=0)

    def run(self, request) -> TrialResult:
        return self.sim.run(request)


@pytest.fixture
def probe_db(db, tmp_path, monkeypatch):
    """``db`` with the probe on (the session turns it off) and MESHTUNE_HOME at tmp_path."""
    monkeypatch.setenv("MESHTUNE_HOME", str(tmp_path))
    return Settings(database_url=db.url, home=tmp_path, probe="auto"), db.sessions


def _count(sessions) -> int:
    with sessions() as s:
        return len(probes.newest(s))


def _ensure(sessions, backend, **kw):
    return probes.ensure(sessions, backend, model=MODEL, cluster=CLUSTER, training=TRAINING,
                         layouts=kw.pop("layouts", LAYOUTS), **kw)


def test_a_probe_runs_once_then_is_found_by_its_cluster_model_and_environment(probe_db):
    _, sessions = probe_db
    backend = SweepingBackend()
    first = _ensure(sessions, backend)
    assert not first.reused and backend.calls == ["probe_rank"]  # nothing stored: nothing to compare with
    assert probes.figures_of(first.row).matmul_flops == pytest.approx(truth().matmul_flops)
    again = _ensure(sessions, backend)
    assert again.reused and again.row.id == first.row.id and backend.calls[1:] == ["environment_rank"]
    assert _count(sessions) == 1


def test_a_newer_environment_probe_version_or_unprobed_tensor_parallel_degree_is_probed_again(probe_db):
    _, sessions = probe_db
    first = _ensure(sessions, SweepingBackend())
    upgraded = SweepingBackend(env={**ENV, "torch": "2.14.0+cpu"})
    assert not _ensure(sessions, upgraded).reused  # torch upgraded: the probe is older than the environment
    assert not _ensure(sessions, SweepingBackend(), layouts=[*LAYOUTS, tuner.Layout(tp=4)]).reused
    with sessions.begin() as s:  # rows written by an older probe code: the version they carry is behind
        s.execute(sa.update(ClusterProbe).values(version=ClusterProbe.version - 1))
    assert not _ensure(sessions, SweepingBackend()).reused
    assert _count(sessions) == 4 and first.row.id == 1


@pytest.mark.parametrize("fail, cause", [
    ({"kind": "timeout", "message": "rank 0 idle for 90 s\nstack...", "rank": 0},
     "the probe timed out on rank 0 (measuring): rank 0 idle for 90 s"),
    ({"kind": "crash", "message": "RuntimeError: gloo died", "rank": 2},
     "the probe failed (crash) on rank 2 (measuring): RuntimeError: gloo died"),
    (BackendUnavailable("no room for 4 CPU bundles within 120 s"),
     "could not start the probe's rank processes (measuring): no room for 4 CPU bundles within 120 s"),
])
def test_a_probe_that_fails_or_cannot_start_names_the_cause_in_one_line_and_stores_nothing(probe_db, fail, cause):
    _, sessions = probe_db
    with pytest.raises(probes.ProbeError) as exc:
        _ensure(sessions, SweepingBackend(fail=fail))
    assert str(exc.value) == cause and "\n" not in str(exc.value)
    assert _count(sessions) == 0


def test_an_interrupted_probe_stores_nothing(probe_db):
    _, sessions = probe_db
    with pytest.raises(KeyboardInterrupt):
        _ensure(sessions, SweepingBackend(fail=KeyboardInterrupt()))
    assert _count(sessions) == 0


def _sweep(settings, sessions, backend, **spec):
    with sessions() as s:
        sw = svc.create_sweep(s, spec=SweepSpec.model_validate({**SPEC, **spec}), owner="t")
    return SweepRunner(settings, sessions=sessions, backend_factory=lambda _: backend).run_sweep(sw.id)


def test_a_sweep_probes_before_its_first_trial_predicts_with_the_figures_and_the_next_one_reuses_them(probe_db):
    settings, sessions = probe_db
    backend = SweepingBackend()
    one = _sweep(settings, sessions, backend)
    probe = one.calibration["probe"]
    assert one.status == "completed" and not probe["reused"] and probe["figures"] and probe["id"] == 1
    assert backend.calls == ["probe_rank"]  # before any trial
    probed = cluster_under(one.calibration, CLUSTER)
    assert probed.probed == tuner.ProbedFigures.from_dict(probe["figures"])
    with sessions() as s:
        rows = store.all_trials(s, sweep_id=one.id)
    for t in rows:  # every prediction was made on the probed figures
        est = tuner.estimate_time(tuner.Layout(**t.layout), model=MODEL, cluster=probed, training=TRAINING)
        assert t.predicted_step_time_s == pytest.approx(est.step_time_s, rel=1e-9)
    two = _sweep(settings, sessions, backend)
    assert two.calibration["probe"]["reused"] and two.calibration["probe"]["id"] == 1
    assert backend.calls.count("probe_rank") == 1 and _count(sessions) == 1
    assert "probe #1" in probes.probe_line(two.calibration) and "reused" in probes.probe_line(two.calibration)


def test_sweeps_that_use_no_probe_say_why_and_keep_the_datasheet(probe_db):
    settings, sessions = probe_db
    off = _sweep(settings.model_copy(update={"probe": "off"}), sessions, SweepingBackend())
    assert "probe" not in (off.calibration or {})
    assert probes.probe_line(off.calibration, "ray") == "cluster figures: datasheet (this sweep used no probe)"

    class NoProgram(SweepingBackend):
        run_program = None

    plain = _sweep(settings, sessions, NoProgram())
    assert "runs no probe" in plain.calibration["probe"]["note"] and plain.calibration["probe"]["figures"] is None
    failed = _sweep(settings, sessions, SweepingBackend(fail={"kind": "timeout", "message": "idle", "rank": 1}))
    assert failed.status == "completed" and "the probe timed out on rank 1" in failed.calibration["probe"]["note"]
    assert "datasheet" in probes.probe_line(failed.calibration)


def test_step_time_errors_are_held_out_under_the_prior_and_in_sample_under_the_fit():
    sweep = types.SimpleNamespace(spec=SPEC, calibration={"probe": {"figures": truth().to_dict()}})
    probed = cluster_under(sweep.calibration, CLUSTER)
    rows = []
    for i, layout in enumerate(LAYOUTS):
        est = tuner.estimate_time(layout, model=MODEL, cluster=probed, training=TRAINING)
        rows.append(types.SimpleNamespace(layout_key=layout.key, layout=tuner.to_dict(layout), simulated=False,
                                          tokens_per_s_per_device=est.tokens_per_s_per_device / (1 + 0.1 * (i + 1)),
                                          predicted_tokens_per_s_per_device=est.tokens_per_s_per_device))
    got = accuracy.step_time_errors(sweep, types.SimpleNamespace(rows=rows))
    assert got["n"] == 3 and got["figures"] == "probed"
    assert got["prior"] == pytest.approx({"median_abs": 0.2 / 1.2, "max_abs": 0.3 / 1.3})  # measured steps 1.1-1.3x
    assert "median |error| 17%" in accuracy.lines(sweep, types.SimpleNamespace(rows=rows))[0]


def _stored(sessions):
    fields = probes.measure(SweepingBackend(), model=MODEL, cluster=CLUSTER, training=TRAINING, layouts=LAYOUTS)
    with store.session_scope(sessions) as s:
        return probes.save(s, fields).id


def test_meshtune_probe_show_and_plan_say_which_figures_are_probed(probe_db, capsys, monkeypatch):
    settings, sessions = probe_db
    monkeypatch.setenv("MESHTUNE_DATABASE_URL", settings.database_url)
    args = ["--model", "tiny", "--cluster", "cpu-local"]
    assert main(["probe", "--show", *args]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "no probe of cluster 'cpu-local' for model 'tiny'" in err[0]
    pid = _stored(sessions)
    assert main(["probe", "--show", *args]) == 0
    out = capsys.readouterr().out
    assert f"probe #{pid} of cpu-local" in out and "probed vs datasheet" in out and "4x" in out  # 120/30 GFLOP/s
    assert main(["plan", *args, "--top", "3"]) == 0
    assert f"cluster figures: probe #{pid}" in capsys.readouterr().out
    assert main(["plan", *args, "--top", "3", "--datasheet"]) == 0
    assert "cluster figures: datasheet (--datasheet)" in capsys.readouterr().out
    assert main(["probe", *args, "--backend", "simulate"]) == 2
    assert "backend='simulate' runs no probe" in capsys.readouterr().err


def test_the_api_and_the_dashboard_show_probed_beside_datasheet(probe_db):
    settings, sessions = probe_db
    sweep = _sweep(settings, sessions, SweepingBackend())
    with TestClient(create_app(settings, run_engine=False)) as c:
        listed = c.get("/api/probes").json()
        assert [p["id"] for p in listed] == [1] and "within a node" in listed[0]["summary"]
        one = c.get("/api/probes/1").json()
        matmul = next(r for r in one["rows"] if r["name"] == "matmul FLOP/s per device")
        assert matmul["source"] == "probed" and matmul["ratio"] == pytest.approx(4.0)
        assert c.get("/api/probes/99").status_code == 404
        page = c.get(f"/sweeps/{sweep.id}").text
        # The plan routes model the cluster with the stored probe, as `meshtune plan` does, and say so.
        query = {"model": "tiny", "cluster": "cpu-local", "global_batch": 16, "precision": "fp32", "top": 3}
        probed = c.get("/api/plan", params=query).json()
        assert probed["figures"]["source"] == "probed" and probed["figures"]["probe_id"] == 1, probed["figures"]
        assert probed["figures"]["text"].startswith("cluster figures: probe #1 of ")
        assert probed["cluster"]["probed"]["matmul_flops"] == pytest.approx(truth().matmul_flops)
        other = c.get("/api/plan", params={**query, "stack": "torchtitan"}).json()["figures"]
        assert other["source"] == "datasheet" and "not the torchtitan stack" in other["text"]
        posted = c.post("/api/plan", json={"model": "tiny", "cluster": "cpu-local",
                                           "training": {"global_batch": 16, "precision": "fp32"}, "top": 3}).json()
        assert posted["figures"] == probed["figures"] and posted["entries"] == probed["entries"]
    assert 'id="probe-panel"' in page and "probed / datasheet" in page and "matmul FLOP/s per device" in page
    assert "4x" in page


def test_a_degree_the_probe_s_budget_skipped_does_not_make_every_later_sweep_probe_again():
    layer = {"tp": 1, "sp": False}
    row = types.SimpleNamespace(figures={"layers": [layer]}, raw={"requested_layers": [[1, False], [4, False]]})
    assert probes.covers(row, [(1, False), (4, False)])  # asked for, skipped on a busy host: the nearest stands in
    assert not probes.covers(row, [(2, True)])  # never asked for: probed again
