"""Valid means runnable, for every workload: the engine enumerates and proposes only layouts that
``tuner.check_supported`` lets the sweep's workload run (the check a listed layout and the workers'
``parallelize_model`` apply), and a shape the workload cannot build at all is refused on submission
with its reason. The built-in model cut to the contract (``builtin_parts``) with GeGLU and q/k norms
trains under tp like the built-in path (2 CPU ranks)."""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import pytest
import torch

import tuner
from api import store
from api.engine import SweepModel, SweepRunner, check_runnable
from api.spec import SweepSpec
from api.sweeps import service as svc
from tests.helpers.dist import run_ranks
from tests.helpers.numerics import RTOL, STEPS
from tuner import Layout, LayoutError, SpecError, check_supported
from tuner._space import R_WORKLOAD

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "hf"
BASE = {"model": "tiny", "cluster": "cpu-local", "training": {"global_batch": 8}, "backend": "simulate"}


def _hf() -> dict:
    pytest.importorskip("transformers")
    return {"model": {"hf_config": json.loads((EXAMPLES / "llama3-tiny.json").read_text()), "seq_len": 64},
            "workload": "hf"}


WORKLOADS = {
    "nokv": lambda: {"workload": "tests.helpers.workloads:NOKV"},  # tiny: kv_heads=2 < tp=4
    "notp": lambda: {"workload": "tests.helpers.workloads:NOTP"},
    "hf": _hf,  # no cp, no ep
}


def _refused(spec: SweepSpec, layouts: list[Layout]) -> list[str]:
    problem = spec.to_problem()
    model, caps = problem.model, problem.capabilities
    out = []
    for layout in layouts:
        try:
            check_supported(layout, model, caps)
        except LayoutError as exc:
            out.append(f"{layout.key}: {exc}")
    return out


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_the_engine_enumerates_only_what_the_workload_runs(name):
    spec = SweepSpec.model_validate({**BASE, **WORKLOADS[name]()})
    problem = SweepModel.from_spec(spec)
    assert len(problem.space) > 1
    assert _refused(spec, problem.space.layouts) == []
    # The refusal is the engine's own: the bare space would have held layouts the workload refuses.
    problem = spec.to_problem()
    model, cluster, training = problem.model, problem.cluster, problem.training
    builtin = tuner.enumerate_layouts(problem=tuner.Problem(model=model, cluster=cluster,
                                                            training=training)).valid
    assert _refused(spec, builtin), name


def test_what_the_space_cannot_cut_is_counted_as_refused():
    spec = SweepSpec.model_validate({**BASE, "workload": "tests.helpers.workloads:NOKV"})
    problem = spec.to_problem()
    model, cluster, training = problem.model, problem.cluster, problem.training
    enum = tuner.enumerate_layouts(problem=tuner.Problem(model=model, cluster=cluster, training=training,
                                                         capabilities=spec.to_problem().capabilities))
    assert {lay.tp for lay in enum.valid} == {1, 2} and enum.rejected[R_WORKLOAD] > 0
    assert enum.refusal == ("workload 'nokv' needs tp=4 to divide kv_heads=2 (it cannot keep k/v projections "
                            "whole)")



def test_a_sweep_proposes_none_of_the_layouts_its_workload_refuses(db):
    """A space of two layouts, one of them (tp=4 > kv_heads) refused: the grid runs the other only."""
    settings, sessions = db
    space = {"tp": [2, 4], "pp": [1], "zero": [0], "mbs": [1], "ac": ["none"], "sp": [False]}
    spec = SweepSpec.model_validate({**BASE, "workload": "tests.helpers.workloads:NOKV", "space": space,
                                     "search": {"sampler": "grid", "max_trials": 10, "warm_start_top_k": 0,
                                                "remeasure_top_k": 0}})
    with sessions() as s:
        sweep = svc.create_sweep(s, spec=spec, owner="t")
    final = SweepRunner(settings, sessions=sessions).run_sweep(sweep.id)
    with sessions() as s:
        rows = store.all_trials(s, sweep_id=sweep.id)
    assert final.status == "completed", final
    assert [r.layout_key for r in rows] == ["tp2-cp1-ep1-dp2-pp1-z0-mbs1-ac_none-nopp"]
    assert _refused(spec, [Layout(**r.layout) for r in rows]) == []


def test_a_shape_the_builtin_model_cannot_build_is_refused_with_the_reason():
    spec = SweepSpec.model_validate({**BASE, "model": {"preset": "tiny-moe", "mlp": "geglu"}})
    with pytest.raises(SpecError) as err:
        check_runnable(spec)
    msg = str(err.value)
    assert "\n" not in msg and f"top rejection reason: {R_WORKLOAD}" in msg, msg
    assert msg.endswith("the workload: the built-in model's experts are SwiGLU, not mlp='geglu': "
                        "use the transformers workload"), msg


# --- the built-in model cut to the contract, under tensor parallelism ----------------------------

CUT_MODEL = {"preset": "tiny", "mlp": "geglu", "qk_norm": True}
CUT_LAYOUTS = {"tp2": Layout(tp=2), "tp2-sp": Layout(tp=2, sp=True)}


def _cut_request(layout: Layout, workload: str):
    from workers import TrialRequest

    spec = SweepSpec.model_validate({**BASE, "model": CUT_MODEL, "workload": workload,
                                     "cluster": {"preset": "cpu-local", "devices_per_node": layout.world_size},
                                     "training": {"global_batch": 8, "precision": "fp32", "lr": 1e-3, "seed": 7}})
    problem = spec.to_problem()
    model, cluster, training = problem.model, problem.cluster, problem.training
    return TrialRequest(model=model, cluster=cluster, training=training, layout=layout, warmup_steps=1,
                        measure_steps=STEPS - 1, options={"grad_norm": True}, workload=workload)


def _train(rank: int, world: int, requests: dict) -> dict:
    from workers.train import train_trial

    out = {}
    for name, request in requests.items():
        try:
            out[name] = train_trial(request, device=torch.device("cpu"))
        except Exception:  # one broken layout must not hide the other's result
            out[name] = traceback.format_exc()[-3000:]
    return out


@pytest.mark.timeout(600)
def test_builtin_cut_with_geglu_and_qk_norm_trains_under_tp_like_the_builtin_path():
    """GeGLU's gate (w3) column-split with w1 and the per-head q/k norms' gradients summed over tp:
    a missing plan entry breaks the shapes or moves the gradient norm far beyond RTOL."""
    from workers.train import reference_losses

    ref_losses, ref_norms = reference_losses(_cut_request(Layout(), "builtin"), steps=STEPS)
    assert max(ref_losses) - min(ref_losses) > 1000 * RTOL * max(ref_losses)
    requests = {name: _cut_request(lay, "tests.helpers.workloads:CUT") for name, lay in CUT_LAYOUTS.items()}
    for per_rank in run_ranks(2, _train, requests, timeout_s=540):
        for name in CUT_LAYOUTS:
            r = per_rank[name]
            assert not isinstance(r, str), f"{name} failed:\n{r}"
            assert r.losses == pytest.approx(ref_losses, rel=RTOL), name
            assert r.grad_norms == pytest.approx(ref_norms, rel=RTOL), name
