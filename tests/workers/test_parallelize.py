"""Parallelisation pieces without processes (mesh axes, stage split, TP rules) and the rank program's
injected failures and measurements on real CPU ranks."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from tests.helpers.dist import RankFailed, run_ranks
from tuner import AXES, Layout, LayoutError, cluster_spec, model_spec, training_spec
from workers import TrialRequest
from workers.model import Transformer
from workers.parallelize import block_tp_plan, check_supported, layers_per_stage, mesh_axes, split_stages
from workers.train import NonFiniteLoss, as_out_of_memory

TINY = model_spec("tiny")


def request(layout: Layout, **options) -> TrialRequest:
    return TrialRequest(
        model=TINY,
        cluster=cluster_spec({"preset": "cpu-local", "devices_per_node": layout.world_size}),
        training=training_spec({"global_batch": 4, "precision": "bf16", "lr": 1e-3}),
        layout=layout,
        warmup_steps=1,
        measure_steps=2,
        options=options,
    )


def test_mesh_axes_cover_every_axis_with_the_layout_degrees():
    layout = Layout(tp=2, pp=2, dp=2)
    names, shape = mesh_axes(layout, cluster_spec({"preset": "cpu-local", "devices_per_node": 8}))
    assert sorted(names) == sorted(AXES)
    assert dict(zip(names, shape, strict=True)) == layout.degrees()


def test_layers_per_stage_cover_the_model():
    for stages in (1, 2, 3, 4):
        counts = layers_per_stage(TINY, stages)
        assert len(counts) == stages and sum(counts) == TINY.layers and min(counts) >= 1


def test_split_stages_keeps_own_layers_embedding_first_head_last():
    model = Transformer(TINY)
    chunks = split_stages(model, [1, 1, 1, 1], pp=2, pp_rank=0)  # interleaved: stages 0 and 2
    assert [s for s, _ in chunks] == [0, 2]
    (_, first), (_, third) = chunks
    assert list(first.layers.keys()) == ["0"] and list(third.layers.keys()) == ["2"]
    assert first.tok_embeddings is not None and first.output is None and first.norm is None
    assert third.tok_embeddings is None and third.output is None
    (_, last), = split_stages(Transformer(TINY), [2, 2], pp=2, pp_rank=1)
    assert list(last.layers.keys()) == ["2", "3"] and last.output is not None and last.tok_embeddings is None


def test_tp_rules_reject_clearly():
    with pytest.raises(LayoutError, match="kv_heads=2"):
        check_supported(Layout(tp=3), TINY)
    check_supported(Layout(tp=4), TINY)  # tp > kv_heads: replicated kv heads (ReplicatedKV)
    check_supported(Layout(tp=2), model_spec("tiny-moe"))  # experts split over tp
    check_supported(Layout(ep=4, zero=3), model_spec("tiny-moe"))  # experts without replicas, unsharded
    with pytest.raises(LayoutError, match="expert_ffn=95"):
        check_supported(Layout(tp=2), dataclasses.replace(model_spec("tiny-moe"), expert_ffn=95))
    check_supported(Layout(tp=2), TINY)
    assert {"attention_norm", "ffn_norm", "feed_forward.w3"} <= set(block_tp_plan(True, True))
    assert "attention_norm" not in block_tp_plan(False, False) and "feed_forward.w3" not in block_tp_plan(False, False)


def test_failure_types_survive_pickling_and_cpu_oom_is_typed():
    err = pickle.loads(pickle.dumps(NonFiniteLoss(3, float("nan"))))
    assert isinstance(err, RuntimeError) and err.step == 3
    try:
        torch.empty(2**50, dtype=torch.uint8)
    except RuntimeError as exc:
        oom = as_out_of_memory(exc)
    assert isinstance(oom, torch.OutOfMemoryError) and oom.bytes_requested == 2**50
    assert as_out_of_memory(RuntimeError("something else")) is None


def _run_expecting_failure(rank: int, world: int, requests: list[TrialRequest]) -> list[tuple]:
    from workers.train import train_trial

    out = []
    for req in requests:
        try:
            report = train_trial(req, device=torch.device("cpu"))
            out.append(("ok", report))
        except Exception as exc:
            out.append((type(exc).__name__, str(exc), getattr(exc, "bytes_requested", None),
                        getattr(exc, "step", None)))
    return out


@pytest.mark.slow
def test_single_rank_failures_crash_oom_and_world_mismatch():
    reqs = [
        request(Layout(), fail="crash"),
        request(Layout(), fail="oom", fail_step=0),
        request(Layout(dp=2)),  # world size 2 on a 1-rank group
    ]
    crash, oom, mismatch = run_ranks(1, _run_expecting_failure, reqs, timeout_s=120)[0]
    assert crash[0] == "RuntimeError" and "injected crash on rank 0 at step 1" in crash[1]
    assert oom[0] == "OutOfMemoryError" and oom[2] == 2**50
    assert mismatch[0] == "LayoutError" and "world size 2" in mismatch[1]


@pytest.mark.slow
def test_two_ranks_nan_on_every_rank_and_measured_sleep():
    reqs = [
        request(Layout(pp=2), fail="nan", fail_step=1),
        request(Layout(dp=2, zero=3), sleep_per_step_s=0.25),
    ]
    results = run_ranks(2, _run_expecting_failure, reqs, timeout_s=120)
    for nan, _ in results:  # the last stage sees the NaN; the all-reduced loss tells rank 0 too
        assert nan[0] == "NonFiniteLoss" and nan[3] == 1
    reports = [slow[1] for _, slow in results]
    assert reports[0].step_times_s == reports[1].step_times_s  # agreed across ranks
    assert all(t >= 0.25 for t in reports[0].step_times_s)
    assert reports[0].memory_measure == "cpu.VmHWM" and reports[0].peak_memory_bytes > 50 * 2**20
    assert reports[0].dtype == "float32" and any("bf16" in n for n in reports[0].notes)
    assert len(reports[0].losses) == 3 and len(reports[0].warmup_times_s) == 1


def test_run_ranks_reports_the_failing_rank():
    with pytest.raises(RankFailed, match="rank 1: ValueError: boom"):
        run_ranks(2, _boom_on_rank_1, timeout_s=60)


def _boom_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("boom")
    return rank
