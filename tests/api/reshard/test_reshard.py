"""reshard-check on 4 CPU ranks (gloo, tiny model, fp32): save under layout A with DCP, load under
layout B, verify bit-identical full state and loss continuity; a deliberately wrong reshard is caught.

All rank cases run in one spawn of 4 ranks (``run_jobs``), each with its own checkpoint directory;
each case is its own test reading the shared result. One more case goes through the Ray launcher
(the trials' gang of reused actors) to check the default backend end to end.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.dist import run_ranks
from tuner import Layout, LayoutError, SpecError, cluster_spec, model_spec, training_spec
from workers._reshard_state import canonical_fqn
from workers.reshard import (
    BF16_LOSS_RTOL,
    LOSS_RTOL,
    RankOutcome,
    ReshardJob,
    report_from_ranks,
)
from workers.reshard_rank import run_jobs

TINY = model_spec("tiny")
TINY5 = model_spec({"preset": "tiny", "layers": 5})  # 5 layers: pp2 splits 3+2, pp4 splits 1+2+1+1
CLUSTER = cluster_spec({"preset": "cpu-local", "devices_per_node": 4})
TRAINING = training_spec({"global_batch": 8, "precision": "fp32", "lr": 1e-3, "seed": 7})
BEFORE, AFTER = 2, 2

CASES = {  # name: (model, from, to, corruption)
    "dp4-to-tp2dp2": (TINY, Layout(dp=4), Layout(tp=2, dp=2), None),
    "tp2pp2-to-dp4": (TINY, Layout(tp=2, pp=2), Layout(dp=4), None),
    "zero3-to-zero0": (TINY, Layout(dp=4, zero=3), Layout(dp=4, zero=0), None),
    "pp2-uneven-to-pp4": (TINY5, Layout(pp=2, dp=2), Layout(pp=4), None),
    # Layout-specific FQNs on the save side (tp4 > kv_heads: ReplicatedKV's wk.linear; selective AC's
    # checkpoint wrapper), two pipeline chunks per rank on the load side (interleaved, one shell).
    "tp4sp-acsel-to-interleaved-pp2v2dp2-zero1": (
        TINY, Layout(tp=4, sp=True, ac="selective"),
        Layout(pp=2, dp=2, schedule="interleaved", vpp=2, zero=1), None,
    ),
    "wrong-reshard-swap-layers": (TINY, Layout(dp=4), Layout(tp=2, dp=2), "swap-layers"),
    # A wrong shard mapping (shard index rotated by one rank): under TP x DP without FSDP the
    # TP-sharded weights are permuted and the replicated norms are not; under FSDP x TP (2-D
    # meshes, FSDP's strided shards) every tensor but Adam's step is.
    "wrong-reshard-permute-shards-tp": (TINY, Layout(dp=4, zero=3), Layout(tp=2, dp=2), "permute-shards"),
    "wrong-reshard-permute-shards-fsdp-tp": (TINY, Layout(dp=4), Layout(tp=2, dp=2, zero=3), "permute-shards"),
}


def make_job(name: str, root) -> ReshardJob:
    model, a, b, corrupt = CASES[name]
    return ReshardJob(model=model, cluster=CLUSTER, training=TRAINING, from_layout=a, to_layout=b,
                      checkpoint_dir=str(root / name), steps_before=BEFORE, steps_after=AFTER, corrupt=corrupt)


def tensor_count(model) -> int:
    """Parameters and AdamW tensors (param, exp_avg, exp_avg_sq, step) of the untied model."""
    per_layer = 9  # two norms, wq wk wv wo, w1 w2 w3
    return 4 * (3 + per_layer * model.layers)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    jobs = [make_job(name, root) for name in CASES]
    for job in jobs:
        job.validate()
    per_rank = run_ranks(4, run_jobs, jobs, timeout_s=540)
    out = {}
    for i, (name, job) in enumerate(zip(CASES, jobs, strict=True)):
        outcomes = [r[i] for r in per_rank]
        failed = [o for o in outcomes if isinstance(o, str)]
        out[name] = failed[0] if failed else report_from_ranks(job, outcomes, backend="local")
    return out


@pytest.fixture(scope="module")
def reference_losses_of():
    """The single-process reference losses of a model (workers.train.reference_losses), cached."""
    from workers.train import reference_losses

    cache: dict[int, list[float]] = {}

    def losses(model) -> list[float]:
        if model.layers not in cache:
            job = make_job(next(n for n in CASES if CASES[n][0] == model), Path("/unused"))
            cache[model.layers] = reference_losses(job.request(job.from_layout), steps=BEFORE + AFTER)[0]
        return cache[model.layers]

    return losses


def test_tolerance_is_the_workers_numerics_tolerance():
    from tests.helpers.numerics import BF16_RTOL, RTOL

    assert LOSS_RTOL == RTOL and BF16_LOSS_RTOL == BF16_RTOL


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][3] is None])
def test_reshard_is_bit_exact_and_continues(name, reports, reference_losses_of):
    report = reports[name]
    assert not isinstance(report, str), f"{name} failed:\n{report}"
    model = CASES[name][0]
    assert report.verdict == "ok", report
    assert report.mismatch_count == 0 and report.mismatches == []
    assert report.tensors_checked == tensor_count(model)
    assert report.max_abs_diff == 0.0
    assert len(report.losses_before) == BEFORE and len(report.losses_a) == len(report.losses_b) == AFTER
    assert report.losses_b == pytest.approx(report.losses_a, rel=LOSS_RTOL)
    assert report.max_rel_loss_diff <= LOSS_RTOL and report.tolerance == LOSS_RTOL
    # The loss comparison can tell steps apart: losses move by far more than the tolerance per step.
    assert abs(report.losses_b[0] - report.losses_before[0]) > 100 * LOSS_RTOL * report.losses_before[0]
    # A (and so B) trains like the single-process reference of the workers' numerics tests.
    assert report.losses_before + report.losses_a == pytest.approx(reference_losses_of(model), rel=LOSS_RTOL)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_wrong_reshard_is_reported_as_corruption(reports):
    report = reports["wrong-reshard-swap-layers"]
    assert not isinstance(report, str), report
    assert report.verdict == "corrupted" and report.corrupt == "swap-layers"
    keys = {m.key for m in report.mismatches}
    # Exactly the two swapped layers' tensors (every weight and its Adam state; norms are all 1 and
    # their steps equal, so only tensors whose values differ between the layers can show).
    assert keys and all(k.split("/")[1].startswith(("layers.0.", "layers.1.")) for k in keys)
    for layer in (0, 1):
        for w in ("attention.wq", "attention.wo", "feed_forward.w1", "feed_forward.w2"):
            assert f"model/layers.{layer}.{w}.weight" in keys
            assert f"optim/layers.{layer}.{w}.weight/exp_avg" in keys
    assert report.mismatch_count == len(report.mismatches)
    assert report.max_abs_diff > 0 and all(m.max_abs_diff > 0 for m in report.mismatches)


def _linears(model) -> list[str]:
    per_layer = [f"attention.{w}" for w in ("wq", "wk", "wv", "wo")] + [f"feed_forward.w{i}" for i in (1, 2, 3)]
    return [f"layers.{i}.{w}.weight" for i in range(model.layers) for w in per_layer]


def _norms(model) -> list[str]:
    return ["norm.weight"] + [f"layers.{i}.{n}.weight" for i in range(model.layers) for n in ("attention_norm", "ffn_norm")]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("name", "sharded"), [
    # tp2 without FSDP (workers/parallelize.py's TP plan): every linear and the embedding; the
    # norms stay replicated.
    ("wrong-reshard-permute-shards-tp", lambda m: ["tok_embeddings.weight", "output.weight", *_linears(m)]),
    # FSDP x TP: the norms too (Shard(0) over dp).
    ("wrong-reshard-permute-shards-fsdp-tp",
     lambda m: ["tok_embeddings.weight", "output.weight", *_linears(m), *_norms(m)]),
])
def test_wrong_shard_mapping_is_reported_as_corruption(name, sharded, reports):
    """Every sharded tensor loaded with the shard index rotated: the same values, other places.
    Adam's step is a plain scalar, never sharded, never permuted."""
    report = reports[name]
    assert not isinstance(report, str), report
    assert report.verdict == "corrupted" and report.corrupt == "permute-shards"
    keys = sharded(TINY)
    expected = {f"model/{k}" for k in keys} | {f"optim/{k}/{s}" for k in keys for s in ("exp_avg", "exp_avg_sq")}
    assert {m.key for m in report.mismatches} == expected
    assert report.mismatch_count == len(expected) and report.tensors_checked == tensor_count(TINY)
    for m in report.mismatches:
        # A permutation, not noise: the values differ in place, and their sum is the saved one.
        assert m.max_abs_diff > 0 and m.detail.startswith("values permuted"), m
        assert m.saved_sum is not None and m.loaded_sum == pytest.approx(m.saved_sum, rel=1e-6, abs=1e-6), m


def _outcome(losses_a, losses_b, mismatches=()):
    return RankOutcome(rank=0, losses_a=losses_a, losses_b=losses_b, tensors_checked=4,
                       mismatches=[dict(key=k, max_abs_diff=1.0, detail="values differ") for k in mismatches],
                       mismatch_count=len(mismatches), max_abs_diff=1.0 if mismatches else 0.0,
                       dtype="float32", save_s=0.0, load_s=0.0)


def test_verdict_rules(tmp_path):
    job = ReshardJob(model=TINY, cluster=CLUSTER, training=TRAINING, from_layout=Layout(dp=4),
                     to_layout=Layout(tp=2, dp=2), checkpoint_dir=str(tmp_path), steps_before=1, steps_after=2)
    a = [5.0, 4.0, 3.0]
    assert report_from_ranks(job, [_outcome(a, [4.0, 3.0 * (1 + 0.5 * LOSS_RTOL)])], backend="x").verdict == "ok"
    diverged = report_from_ranks(job, [_outcome(a, [4.0, 3.0 * (1 + 3 * LOSS_RTOL)])], backend="x")
    assert diverged.verdict == "diverged" and diverged.max_rel_loss_diff == pytest.approx(3 * LOSS_RTOL)
    assert report_from_ranks(job, [_outcome(a, [4.0, float("nan")])], backend="x").verdict == "diverged"
    corrupted = report_from_ranks(job, [_outcome(a, [4.0, 3.0], ["model/norm.weight"])], backend="x")
    assert corrupted.verdict == "corrupted" and corrupted.mismatches[0].key == "model/norm.weight"
    assert type(corrupted).from_dict(corrupted.to_dict()) == corrupted


def test_cli_summary_names_verdict_and_mismatches(tmp_path, capsys):
    from api.cli.reshard import print_summary

    job = ReshardJob(model=TINY, cluster=CLUSTER, training=TRAINING, from_layout=Layout(dp=4),
                     to_layout=Layout(tp=2, dp=2), checkpoint_dir=str(tmp_path), steps_before=1, steps_after=2)
    print_summary(report_from_ranks(job, [_outcome([5.0, 4.0, 3.0], [4.0, 3.0], ["model/norm.weight"])], backend="x"))
    out = capsys.readouterr().out
    assert "corrupted" in out and "model/norm.weight" in out and "tp2-cp1-ep1-dp2" in out


def test_canonical_fqn_drops_layout_wrappers():
    assert canonical_fqn("layers.3._checkpoint_wrapped_module.attention.wq.weight") == "layers.3.attention.wq.weight"
    assert canonical_fqn("layers.0.attention.wk.linear.weight") == "layers.0.attention.wk.weight"
    assert canonical_fqn("layers.0.attention.wv.linear.weight") == "layers.0.attention.wv.weight"
    assert canonical_fqn("layers.0.feed_forward.w1.weight") == "layers.0.feed_forward.w1.weight"


@pytest.mark.parametrize(("change", "field"), [
    ({"from_layout": Layout(dp=2)}, "from_layout"),  # world size 2 on a 4-device cluster
    ({"to_layout": Layout(tp=8)}, "to_layout"),
    ({"to_layout": Layout(pp=8)}, "to_layout"),
])
def test_bad_layouts_name_the_field(change, field, tmp_path):
    args = dict(model=TINY, cluster=CLUSTER, training=TRAINING, from_layout=Layout(dp=4),
                to_layout=Layout(tp=2, dp=2), checkpoint_dir=str(tmp_path))
    with pytest.raises(LayoutError, match=field):
        ReshardJob(**{**args, **change}).validate()


def test_bad_job_fields(tmp_path):
    args = dict(model=TINY, cluster=CLUSTER, training=TRAINING, from_layout=Layout(dp=4),
                to_layout=Layout(dp=4), checkpoint_dir=str(tmp_path))
    with pytest.raises(SpecError, match="steps_after"):
        ReshardJob(**args, steps_after=0)
    with pytest.raises(SpecError, match="corrupt"):
        ReshardJob(**args, corrupt="flip")
    with pytest.raises(LayoutError, match="to_layout=.*shards no tensor"):
        ReshardJob(**args, corrupt="permute-shards").validate()  # dp4, zero=0: nothing to permute
    ReshardJob(**{**args, "to_layout": Layout(dp=4, zero=1)}, corrupt="permute-shards").validate()
    moe = model_spec({"preset": "tiny", "experts": 4, "top_k": 2, "expert_ffn": 64})
    with pytest.raises(LayoutError, match="to_layout.ep=2"):
        ReshardJob(**{**args, "model": moe, "to_layout": Layout(ep=2, dp=2)}).validate()


# --- API and CLI (through the default backend, Ray: the trials' gang of reused actors) ------------

TOKEN = {"Authorization": "Bearer tok-reshard-8c1f"}
# backend "ray": a migration check runs real ranks and is refused on simulate-backend sweeps
SWEEP = {"name": "reshard", "model": "tiny", "cluster": "cpu-local", "backend": "ray",
         "training": {"global_batch": 8, "precision": "fp32", "lr": 1e-3, "seed": 7}}


@pytest.fixture(scope="module")
def reshard_api(tmp_path_factory):
    from fastapi.testclient import TestClient

    from api import store
    from api.main import create_app
    from api.settings import Settings

    home = tmp_path_factory.mktemp("reshard-api")
    url = f"sqlite:///{home / 'api.db'}"
    store.upgrade(url)
    settings = Settings(home=home, database_url=url, api_tokens={"ci": TOKEN["Authorization"][7:]},
                        read_requires_auth=False, ray_address=None)
    with TestClient(create_app(settings, run_engine=False), raise_server_exceptions=False) as client:
        r = client.post("/api/sweeps", json=SWEEP, headers=TOKEN)
        assert r.status_code == 201, r.text
        yield client, r.json()["id"], url


@pytest.mark.parametrize(("body", "field"), [
    ({"from_layout": {"tp": 0}, "to_layout": {"dp": 4}}, "from_layout.tp"),
    ({"from_layout": {"dp": 4}, "to_layout": {"dq": 4}}, "to_layout.dq"),
    ({"from_layout": {"dp": 4}, "to_layout": {"dp": 2}}, "to_layout"),  # world size 2 on 4 devices
    ({"from_layout": {"dp": 4}, "to_layout": {"tp": 4, "zero": 7}}, "to_layout.zero"),
    ({"from_layout": {"dp": 4}, "to_layout": {"dp": 4}, "steps_after": 0}, "steps_after"),
])
def test_api_rejects_bad_input_naming_the_field(reshard_api, body, field):
    client, sweep_id, _ = reshard_api
    r = client.post(f"/api/sweeps/{sweep_id}/reshard-check", json=body, headers=TOKEN)
    assert r.status_code == 422, r.text
    assert r.json()["errors"][0]["field"] == field, r.json()
    assert client.get(f"/api/sweeps/{sweep_id}/reshard-checks").json() == []  # nothing ran, nothing stored


def test_api_unknown_sweep_is_404(reshard_api):
    client, _, _ = reshard_api
    r = client.post("/api/sweeps/999999/reshard-check", json={"from_layout": {"dp": 4}, "to_layout": {"dp": 4}},
                    headers=TOKEN)
    assert r.status_code == 404 and "999999" in r.json()["detail"]
    assert client.get("/api/sweeps/999999/reshard-checks").status_code == 404
    assert client.post("/api/sweeps/1/reshard-check", json={"from_layout": {"dp": 4}, "to_layout": {"dp": 4}}
                       ).status_code == 401


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_api_runs_on_ray_and_stores_the_verdict(reshard_api, ray_local):
    """POST -> service -> Ray launcher (TP x DP -> ZeRO-3) -> verdict stored with the sweep."""
    client, sweep_id, _ = reshard_api
    body = {"from_layout": {"tp": 2, "dp": 2}, "to_layout": {"dp": 4, "zero": 3}, "steps_before": 1, "steps_after": 1}
    r = client.post(f"/api/sweeps/{sweep_id}/reshard-check", json=body, headers=TOKEN)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["verdict"] == "ok" and out["backend"] == "ray" and out["error"] is None, out
    assert out["tensors_checked"] == tensor_count(TINY) and out["max_abs_diff"] == 0.0 and out["mismatches"] == []
    assert out["from_key"].startswith("tp2-") and out["to_layout"]["zero"] == 3 and out["owner"] == "ci"
    assert out["tolerance"] == LOSS_RTOL and out["max_rel_loss_diff"] <= LOSS_RTOL
    stored = client.get(f"/api/sweeps/{sweep_id}/reshard-checks").json()
    assert [c["id"] for c in stored] == [out["id"]] and stored[0]["losses_b"] == out["losses_b"]


def test_cli_bad_input_exits_2(capsys):
    from api.cli import main

    base = ["reshard-check", "--model", "tiny", "--cluster", "cpu-local", "--global-batch", "8"]
    assert main([*base, "--from", "tp=2,dp=2", "--to", "dp=3"]) == 2
    assert "--to" in capsys.readouterr().err
    assert main([*base, "--from", "tq=2", "--to", "dp=4"]) == 2
    err = capsys.readouterr().err
    assert "--from" in err and "tq" in err
    assert main([*base, "--from", "dp=4", "--to", "dp=4", "--steps-before", "0"]) == 2
    assert "--steps-before" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cli_reports_injected_corruption_and_exits_1(reshard_api, ray_local, capsys, monkeypatch):
    """``--sweep``: the sweep's problem, the verdict stored with it; the wrong reshard exits 1."""
    import json

    from api.cli import main

    client, sweep_id, url = reshard_api
    monkeypatch.setenv("MESHTUNE_DATABASE_URL", url)
    code = main(["reshard-check", "--sweep", str(sweep_id), "--from", "dp=4", "--to", "pp=2,dp=2",
                 "--steps-before", "1", "--steps-after", "1", "--inject-corruption", "swap-layers", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["verdict"] == "corrupted" and report["mismatch_count"] > 0, report
    stored = client.get(f"/api/sweeps/{sweep_id}/reshard-checks").json()
    assert stored[-1]["verdict"] == "corrupted" and stored[-1]["owner"] == "cli"
