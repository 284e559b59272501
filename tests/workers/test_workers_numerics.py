"""Every supported layout trains like the single-process reference (tiny model, fp32, 4 CPU ranks).

Tolerance: rtol 1e-5 on the per-step loss and on the global gradient norm, over 4 steps.
Why: in fp32 a layout changes only the order of reductions (matmul splits under TP, the dp/cp
all-reduce or reduce-scatter, micro-batch accumulation), each worth a few ulps (eps = 1.2e-7)
of relative error; measured differences (torch 2.13, 2026-11) are <= 1.7e-7 on the loss (2 ulps
of a loss of 5.5) and <= 5.6e-8 on the gradient norm over 4 AdamW steps, for every layout below.
1e-5 keeps ~60x headroom for other CPUs' kernels and stays far below any real bug:
the losses move by ~1e-2 per step, and a wrong 1/m, 1/dp or 1/tp factor moves the gradient norm by
a factor >= 2 (the gradient norm is compared because Adam's update is almost invariant to the
scale of the gradient, so losses alone would not show such a bug).

All layouts run in one spawn of 4 ranks (one process-group start, ~50 s on 2 busy cores); each
layout is its own test that reads the shared result. Context-parallel and MoE/EP layouts are tested
by their own modules with the same helper (tests/helpers/dist.py).
"""

from __future__ import annotations

import traceback

import pytest
import torch

from tests.helpers.dist import run_ranks
from tests.helpers.numerics import BF16_NORM_RTOL, BF16_RTOL, RTOL, STEPS
from tuner import Layout, cluster_spec, model_spec, training_spec
from workers import TrialRequest

LAYOUTS = {
    "dp4": Layout(dp=4),
    "dp4-zero1": Layout(dp=4, zero=1),
    "dp4-zero2": Layout(dp=4, zero=2),
    "dp4-zero3": Layout(dp=4, zero=3),
    "tp2-dp2": Layout(tp=2, dp=2),
    "tp2-dp2-sp-zero3": Layout(tp=2, dp=2, sp=True, zero=3),
    "pp2-dp2-1f1b": Layout(pp=2, dp=2, schedule="1f1b"),
    "pp2-dp2-gpipe-zero3": Layout(pp=2, dp=2, schedule="gpipe", zero=3),
    "pp2v2-dp2-interleaved-zero1": Layout(pp=2, dp=2, schedule="interleaved", vpp=2, zero=1),
    "tp2-pp2": Layout(tp=2, pp=2),
    "dp4-ac-full": Layout(dp=4, ac="full"),
    "dp4-ac-selective-zero3": Layout(dp=4, ac="selective", zero=3),
    "tp2-dp2-sp-ac-full-zero2": Layout(tp=2, dp=2, sp=True, ac="full", zero=2),
    "tp4-sp-ac-selective": Layout(tp=4, sp=True, ac="selective"),  # tp > kv_heads=2: ReplicatedKV
    # Under pp > 1 ZeRO-2 reduce-scatters every micro-batch (workers.rank_model._SyncingStage);
    # every tp layout above runs the vocab-parallel loss, every zero=0 one torch's replicate.
    "pp2-dp2-1f1b-zero2": Layout(pp=2, dp=2, schedule="1f1b", zero=2),
}
BF16_LAYOUTS = {  # FSDP's MixedPrecisionPolicy; autocast (no FSDP) through a pipeline with TP
    "bf16-dp4-zero3": Layout(dp=4, zero=3),
    "bf16-tp2-pp2": Layout(tp=2, pp=2),
    "bf16-dp4": Layout(dp=4),  # replicate's MixedPrecisionPolicy (ZeRO-0 keeps no autocast copies)
}


def make_request(layout: Layout, *, bf16: bool = False) -> TrialRequest:
    return TrialRequest(
        model=model_spec("tiny"),
        cluster=cluster_spec({"preset": "cpu-local", "devices_per_node": layout.world_size}),
        training=training_spec(
            {"global_batch": 8, "precision": "bf16" if bf16 else "fp32", "lr": 1e-3, "seed": 7}
        ),
        layout=layout,
        warmup_steps=1,
        measure_steps=STEPS - 1,
        options={"grad_norm": True, "cpu_bf16": bf16},
    )


def _run_layouts(rank: int, world: int, requests: dict[str, TrialRequest]) -> dict[str, object]:
    from workers.train import train_trial

    out: dict[str, object] = {}
    for name, request in requests.items():
        try:
            out[name] = train_trial(request, device=torch.device("cpu"))
        except Exception:  # keep going: one broken layout must not hide the others' results
            out[name] = traceback.format_exc()[-3000:]
    return out


@pytest.fixture(scope="module")
def builtin_reference() -> tuple[list[float], list[float]]:
    from workers.train import reference_losses

    return reference_losses(make_request(Layout()), steps=STEPS)


@pytest.fixture(scope="module")
def builtin_four_rank_results() -> list[dict[str, object]]:
    # Generous: the machine is shared; ~70 s when it is quiet.
    requests = {k: make_request(v) for k, v in LAYOUTS.items()}
    requests.update({k: make_request(v, bf16=True) for k, v in BF16_LAYOUTS.items()})
    return run_ranks(4, _run_layouts, requests, timeout_s=540)


def test_reference_learns(builtin_reference):
    losses, norms = builtin_reference
    assert len(losses) == STEPS and all(n > 0 for n in norms)
    # The comparison below is meaningful only if steps differ far more than the tolerance.
    assert max(losses) - min(losses) > 1000 * RTOL * max(losses)


@pytest.mark.slow
@pytest.mark.timeout(600)  # the first case also runs the shared 4-rank fixture
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_reference(name, builtin_reference, builtin_four_rank_results):
    ref_losses, ref_norms = builtin_reference
    reports = [per_rank[name] for per_rank in builtin_four_rank_results]
    for r in reports:
        assert not isinstance(r, str), f"{name} failed:\n{r}"
    for r in reports:  # every rank reports the global loss of each step and the same step times
        assert r.losses == pytest.approx(ref_losses, rel=RTOL), name
        assert r.grad_norms == pytest.approx(ref_norms, rel=RTOL), name
        assert r.step_times_s == reports[0].step_times_s
        assert len(r.step_times_s) == len(r.stage_compute_s) == STEPS - 1
        assert r.memory_measure == "cpu.VmHWM" and r.peak_memory_bytes > 0
        assert r.tokens_per_step == 8 * 64
    if LAYOUTS[name].pp > 1:
        stages = sorted({r.pp_stage for r in reports})
        assert stages == list(range(LAYOUTS[name].pp))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BF16_LAYOUTS))
def test_bf16_mixed_precision_layout_tracks_reference(name, builtin_reference, builtin_four_rank_results):
    ref_losses, ref_norms = builtin_reference
    for per_rank in builtin_four_rank_results:
        r = per_rank[name]
        assert not isinstance(r, str), f"{name} failed:\n{r}"
        assert r.dtype == "bfloat16"
        assert r.losses == pytest.approx(ref_losses, rel=BF16_RTOL), name
        assert r.grad_norms == pytest.approx(ref_norms, rel=BF16_NORM_RTOL), name
        assert r.losses != pytest.approx(ref_losses, rel=1e-7)  # it really ran in bf16
