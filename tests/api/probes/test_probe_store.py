"""Cluster probes stored and used (api/probes): found per cluster, model and environment, run when
missing or stale, never half-written; a sweep probes before its first trial and the next one reuses
it; ``meshtune probe``, ``plan``, ``show``, the API and the dashboard say which figures are probed;
the size and device-type comparisons use the newest probe of each type's hardware at any node count.
The probe's ranks are a test double answering with timings made from known figures
(tests/helpers/probe_raw.py); its real run on Ray is in tests/workers/test_ray_backend.py."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

import tuner
from api import store
from api.cli import main
from api.cli.plan import SHOW
from api.engine import SweepRunner
from api.engine._prediction import cluster_under
from api.main import create_app
from api.probes import service as probes
from api.probes.models import ClusterProbe
from api.ranking import accuracy
from api.settings import Settings
from api.spec import SweepSpec
from api.sweeps import service as svc
from tests.helpers.probe_raw import ENV, ProbingBackend, store_probe, truth
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
    out = " ".join(capsys.readouterr().out.split())
    assert f"cluster figures: probe #{pid}" in out and "measured on" not in out  # its own node count: as probed
    assert main(["plan", *args, "--top", "3", "--datasheet"]) == 0
    assert "cluster figures: datasheet (--datasheet)" in capsys.readouterr().out
    assert main(["probe", *args, "--backend", "simulate"]) == 2
    assert "backend='simulate' runs no probe" in capsys.readouterr().err
    # The size and device comparisons: the 1-node probe models every size, the network beyond it the datasheet's.
    assert main(["plan", *args, "--nodes", "1,2"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps the line
    assert f"cluster figures: probe #{pid} of " in out and ", measured on 1 node (" in out
    assert "datasheet for the network at 2 nodes (none on the probe's 1 node)" in out and "--datasheet ignores" in out
    assert main(["plan", *args, "--nodes", "1,2", "--json"]) == 0
    sizes = json.loads(capsys.readouterr().out)
    assert sizes["figures"]["probe_id"] == pid and sizes["figures"]["datasheet_links"] == [{"tier": "inter",
                                                                                            "nodes": [2]}]
    assert sizes["cluster"]["probed"]["matmul_flops"] == pytest.approx(truth().matmul_flops)
    # One size with no probe of its own: the plan uses the comparison's probe and rule, so it is the comparison's
    # row for 2 nodes, and GET /api/plan says the same (the line says where the probe ran and what it lacked).
    assert main(["plan", *args, "--nodes", "2", "--top", "1", "--json"]) == 0
    at2 = json.loads(capsys.readouterr().out)
    f = at2["figures"]
    assert f["probe_id"] == pid and f["probe_nodes"] == 1 and f["datasheet_links"] == [{"tier": "inter", "nodes": [2]}]
    assert ", measured on 1 node (" in f["text"] and "some tensor-parallel degrees here were not probed" in f["text"]
    assert "; datasheet for the network at 2 nodes (none on the probe's 1 node)" in f["text"]
    assert at2["entries"][0]["key"] == sizes["sizes"][1]["layout_key"]
    assert at2["entries"][0]["time"]["tokens_per_s"] == pytest.approx(sizes["sizes"][1]["tokens_per_s"])
    assert at2["cluster"]["probed"] == sizes["cluster"]["probed"]
    assert main(["plan", *args, "--nodes", "2", "--top", "3"]) == 0
    assert f["text"] in " ".join(capsys.readouterr().out.split())
    query = {"model": "tiny", "cluster": "cpu-local", "nodes": 2, "global_batch": 16,
             "precision": at2["training"]["precision"], "top": 1}
    with TestClient(create_app(settings, run_engine=False)) as c:
        api = c.get("/api/plan", params=query).json()
    assert api["figures"] == {**f, "text": f["text"].removesuffix(SHOW)} and api["entries"] == at2["entries"]
    assert main(["plan", *args, "--nodes", "2", "--datasheet", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["figures"]["probe_nodes"] is None
    assert main(["plan", *args, "--nodes", "1,2", "--datasheet", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["figures"]["text"] == "cluster figures: datasheet (--datasheet)" and plain["cluster"]["probed"] is None
    assert plain["sizes"][0]["tokens_per_s"] != pytest.approx(sizes["sizes"][0]["tokens_per_s"], rel=0.01)
    assert main(["plan", "--model", "tiny", "--cluster", "cpu-local,h100-sxm", "--nodes", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"cpu-local: cluster figures: probe #{pid} of " in out
    assert ("h100-sxm: cluster figures: datasheet (no probe of this cluster's hardware and model is stored, at any "
            "node count;") in out


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


def test_the_size_and_device_comparisons_model_each_type_on_the_newest_probe_of_its_hardware(probe_db):
    settings, sessions = probe_db
    one = store_probe(sessions, truth(), model=MODEL, cluster=CLUSTER, training=TRAINING)
    query = {"model": "tiny", "cluster": "cpu-local", "nodes": "1,2,4", "global_batch": 16, "precision": "fp32"}
    plan_q = {k: v for k, v in query.items() if k != "nodes"} | {"top": 1}
    with TestClient(create_app(settings, run_engine=False)) as c:
        first = c.get("/api/plan/sizes", params=query).json()
        f = first["figures"]
        assert f["source"] == "probed" and f["probe_id"] == one and f["probe_nodes"] == 1, f
        assert f["text"].startswith(f"cluster figures: probe #{one} of ") and ", measured on 1 node (" in f["text"]
        # One node has no network to measure: 2 and 4 nodes keep the datasheet's network, and say so.
        assert f["datasheet_links"] == [{"tier": "inter", "nodes": [2, 4]}]
        assert f["text"].endswith("; datasheet for the network at 2 and 4 nodes (none on the probe's 1 node)")
        assert first["cluster"]["probed"]["matmul_flops"] == pytest.approx(truth().matmul_flops)
        # At the probe's own size the comparison is the plan, which uses the same probe.
        plan = c.get("/api/plan", params=plan_q).json()
        assert plan["figures"]["probe_id"] == one and first["sizes"][0]["layout_key"] == plan["entries"][0]["key"]
        assert first["sizes"][0]["tokens_per_s"] == pytest.approx(plan["entries"][0]["time"]["tokens_per_s"])
        assert plan["figures"]["probe_nodes"] == 1 and plan["figures"]["datasheet_links"] == []
        assert "measured on" not in plan["figures"]["text"]  # its own node count: the line as probed
        # The plan's tp=4 layouts: the probe measured layers of tp 1 and 2 only, and the plan says so.
        assert "; some tensor-parallel degrees here were not probed (nearest used)" in plan["figures"]["text"]
        # A size with no probe of its own: the plan of 2 (or 4) nodes uses the 1-node probe as the comparison
        # does, the network on the datasheet, and its best is the comparison's row.
        for i, n in ((1, 2), (2, 4)):
            alone = c.get("/api/plan", params={**plan_q, "nodes": n}).json()
            g = alone["figures"]
            assert g["probe_id"] == one and g["probe_nodes"] == 1, g
            assert g["datasheet_links"] == [{"tier": "inter", "nodes": [n]}]
            assert g["text"].startswith(f"cluster figures: probe #{one} of ") and ", measured on 1 node (" in g["text"]
            assert g["text"].endswith(f"; datasheet for the network at {n} nodes (none on the probe's 1 node)")
            assert alone["entries"][0]["key"] == first["sizes"][i]["layout_key"]
            assert alone["entries"][0]["time"]["tokens_per_s"] == pytest.approx(first["sizes"][i]["tokens_per_s"])
            assert alone["cluster"]["probed"] == first["cluster"]["probed"]
        sheet = c.get("/api/plan/sizes", params={**query, "stack": "torchtitan"}).json()
        assert sheet["figures"]["source"] == "datasheet" and "not the torchtitan stack" in sheet["figures"]["text"]
        assert sheet["cluster"]["probed"] is None and sheet["figures"]["probe_nodes"] is None
        other = c.get("/api/plan/sizes", params={**query, "devices_per_node": 2}).json()["figures"]
        assert other["source"] == "datasheet" and "no probe of this cluster's hardware and model is stored" in other["text"]

        # A newer probe of 2 nodes measured a network 500x slower than the datasheet's: it models every size, the
        # 4-node one included (the tier it measured); one node never reaches the network, so it predicts as before.
        slow = tuple(tuner.LinkFigure("inter", x.op, 1e7, 2e-4, 2) for x in truth().links)
        two = store_probe(sessions, dataclasses.replace(truth(), links=truth().links + slow), model=MODEL,
                          cluster=dataclasses.replace(CLUSTER, nodes=2), training=TRAINING)
        again = c.get("/api/plan/sizes", params=query).json()
        f = again["figures"]
        assert f["probe_id"] == two and f["probe_nodes"] == 2 and f["datasheet_links"] == [], f
        assert ", measured on 2 nodes (" in f["text"] and "datasheet for" not in f["text"]
        (a1, a2, a4), (b1, b2, b4) = first["sizes"], again["sizes"]
        assert b1["tokens_per_s"] == pytest.approx(a1["tokens_per_s"]) and b1["layout_key"] == a1["layout_key"]
        assert b2["tokens_per_s"] < a2["tokens_per_s"] and b4["tokens_per_s"] < a4["tokens_per_s"]
        at2 = c.get("/api/plan", params={**plan_q, "nodes": 2}).json()  # the plan of 2 nodes: its own probe
        assert at2["figures"]["probe_id"] == two and at2["entries"][0]["key"] == b2["layout_key"]
        assert "measured on" not in at2["figures"]["text"]
        at4 = c.get("/api/plan", params={**plan_q, "nodes": 4}).json()  # none of 4 nodes: the newest, of 2
        assert at4["figures"]["probe_id"] == two and at4["figures"]["probe_nodes"] == 2
        assert at4["figures"]["datasheet_links"] == [] and ", measured on 2 nodes (" in at4["figures"]["text"]
        assert at4["entries"][0]["key"] == b4["layout_key"]
        assert at4["entries"][0]["time"]["tokens_per_s"] == pytest.approx(b4["tokens_per_s"])
        at1 = c.get("/api/plan", params=plan_q).json()  # a probe of its own node count comes first, newer or not
        assert at1["figures"]["probe_id"] == one and at1["entries"][0]["key"] == b1["layout_key"]

        # Device types: each on its own hardware's probe; h100-sxm has none.
        body = {"model": "tiny", "cluster": {"preset": ["cpu-local", "h100-sxm"]}, "nodes": [1, 2, 4],
                "training": {"global_batch": 16, "precision": "fp32"}}
        devices = c.post("/api/plan/devices", json=body).json()
        cpu, gpu = devices["figures"]
        assert cpu["device"] == "cpu-local" and cpu["probe_id"] == two and cpu["text"] == f["text"]
        assert gpu["device"] == "h100-sxm" and gpu["source"] == "datasheet" and "at any node count" in gpu["text"]
        assert devices["clusters"][0]["probed"] is not None and devices["clusters"][1]["probed"] is None
        assert [d["tokens_per_s"] for d in devices["devices"] if d["device"] == "cpu-local"] == pytest.approx(
            [s["tokens_per_s"] for s in again["sizes"]])
        h100 = c.get("/api/plan/sizes", params={**query, "cluster": "h100-sxm"}).json()
        assert [d["tokens_per_s"] for d in devices["devices"] if d["device"] == "h100-sxm"] == pytest.approx(
            [s["tokens_per_s"] for s in h100["sizes"]])
        theirs = c.get("/api/plan/devices", params={**query, "cluster": "cpu-local,h100-sxm", "stack": "megatron"})
        assert [x["text"] for x in theirs.json()["figures"]] == [
            "cluster figures: datasheet (a probe measures meshtune's workers, not the megatron stack)"] * 2


def test_a_comparison_names_each_tier_a_probe_s_nodes_did_not_reach_at_each_size(url):
    """One NVL72 tray probed: its fast domain (18 trays) and the network beyond it keep the datasheet's
    figures. The probe is found by its hardware at another node count on both stores."""
    from api.plan import service as plan_service

    engine, sessions = store.open_store(url)
    nvl = tuner.cluster_spec("gb200-nvl72")
    tray = tuner.ProbedFigures(matmul_flops=1.5e15, links=tuple(
        tuner.LinkFigure("intra", op, 6e11, 6e-6, 4) for op in ("all_reduce", "all_gather", "reduce_scatter",
                                                                 "all_to_all", "send_recv")))
    pid = store_probe(sessions, tray, model=MODEL, cluster=dataclasses.replace(nvl, nodes=1), training=TRAINING)
    with sessions() as s:
        row, note = plan_service.comparison_probe(s, model=MODEL, cluster=nvl, training=TRAINING, backend="ray")
        assert row.id == pid and note == ""
        f = plan_service.comparison_figures(row=row, note=note, cluster=nvl, training=TRAINING, counts=(1, 9, 18, 36))
    assert f["datasheet_links"] == [{"tier": "domain", "nodes": [9, 18, 36]}, {"tier": "inter", "nodes": [36]}]
    assert f["text"].endswith("; datasheet for the fast domain at 9, 18 and 36 nodes and the network at 36 nodes "
                              "(none on the probe's 1 node)")
    with sessions() as s:  # another model's shapes: not this probe
        other = tuner.model_spec("llama3-8b")
        assert plan_service.comparison_probe(s, model=other, cluster=nvl, training=TRAINING, backend="ray")[0] is None
    engine.dispose()


def test_a_degree_the_probe_s_budget_skipped_does_not_make_every_later_sweep_probe_again():
    layer = {"tp": 1, "sp": False}
    row = types.SimpleNamespace(figures={"layers": [layer]}, raw={"requested_layers": [[1, False], [4, False]]})
    assert probes.covers(row, [(1, False), (4, False)])  # asked for, skipped on a busy host: the nearest stands in
    assert not probes.covers(row, [(2, True)])  # never asked for: probed again
