"""Time model: formulas by hand, a single-device step by hand, links from the placement."""

from __future__ import annotations

import pytest

from tuner import (
    CalibrationFactors,
    Layout,
    SpecError,
    cluster_spec,
    estimate_time,
    model_flops_per_token,
    model_spec,
    pipeline_bubble_fraction,
    place,
    training_spec,
    useful_fraction,
)
from tuner._partition import EMBEDDING_COST, head_flops_per_token, layer_flops_per_token
from tuner._timing import allgather_time, allreduce_time, recompute_flops_per_token_per_layer


def test_collective_formulas() -> None:
    assert allreduce_time(1e9, 8, 100e9, 1e-5) == pytest.approx(2 * 7 / 8 * 1e9 / 100e9 + 14e-5)
    assert allgather_time(1e9, 4, 50e9, 0.0) == pytest.approx(3 / 4 * 1e9 / 50e9)
    assert allreduce_time(1e9, 1, 100e9, 1e-5) == 0.0


def test_pipeline_bubble_narayanan() -> None:
    assert pipeline_bubble_fraction(8, 1, 32) == pytest.approx(7 / 32)
    assert pipeline_bubble_fraction(8, 4, 32) == pytest.approx(7 / 128)
    assert pipeline_bubble_fraction(1, 1, 5) == 0


def test_useful_fraction_mccandlish() -> None:
    assert useful_fraction(64, None) == 1.0
    assert useful_fraction(1, 1000) == pytest.approx(1 / 1.001)  # far below B_crit: nearly all useful
    assert useful_fraction(1000, 1000) == pytest.approx(0.5)
    assert useful_fraction(10_000, 1000) == pytest.approx(1 / 11)  # far above: ~B_crit/B


def test_palm_flops_per_token() -> None:
    m = model_spec("gpt3-175b")
    n_matmul = m.layers * (m.attention_params_per_layer + m.mlp_params_per_layer + 2 * m.hidden) + m.hidden \
        + m.vocab * m.hidden  # tied: the head multiplies by the embedding matrix once more
    assert model_flops_per_token(m) == pytest.approx(6 * n_matmul + 12 * 96 * 12288 * 2048)
    assert model_flops_per_token(m) / (6 * m.params) == pytest.approx(1.0 + 12 * 96 * 12288 * 2048 / (6 * m.params), rel=1e-3)
    # MoE counts the active experts only.
    moe = model_spec("mixtral-8x7b")
    assert model_flops_per_token(moe) < 6 * moe.params / 2


def test_single_device_step_hand_computed() -> None:
    model = model_spec("small")
    cluster = cluster_spec({"preset": "cpu-local", "devices_per_node": 1})
    training = training_spec({"global_batch": 8, "critical_batch": 8})
    f = CalibrationFactors(compute_efficiency=0.5)
    t = estimate_time(Layout(mbs=2, ac="full"), model=model, cluster=cluster, training=training, factors=f)
    per_token = model.layers * (layer_flops_per_token(model) + recompute_flops_per_token_per_layer(model, "full"))
    per_token += head_flops_per_token(model) * (1 + EMBEDDING_COST)
    step = per_token * 8 * model.seq_len / (cluster.peak_flops * 0.5)
    assert t.step_time_s == pytest.approx(step, rel=1e-12)
    assert t.breakdown["compute"] == pytest.approx(step, rel=1e-12)
    assert sum(v for k, v in t.breakdown.items() if k != "compute") == 0
    assert t.tokens_per_s == pytest.approx(8 * model.seq_len / step)
    assert t.mfu == pytest.approx(model_flops_per_token(model) * t.tokens_per_s / cluster.peak_flops)
    assert t.hfu > t.mfu  # full recompute runs the forward twice
    assert t.useful_tokens_per_s == pytest.approx(t.tokens_per_s / 2)


def test_tp_dp_pp_costs_follow_the_links() -> None:
    model = model_spec("llama3-8b")
    cluster = cluster_spec({"preset": "h100-sxm", "nodes": 2})
    training = training_spec({"global_batch": 64})
    no_latency = CalibrationFactors(latency_scale=0.0)
    intra = estimate_time(Layout(tp=8, dp=2), model=model, cluster=cluster, training=training, factors=no_latency)
    # Same degrees, TP deliberately placed across nodes (dp innermost): TP traffic on the slow link.
    order = ("dp", "tp", "cp", "ep", "pp")
    across = place(Layout(tp=8, dp=2), cluster, order=order, allow_tp_across_nodes=True)
    slow = estimate_time(Layout(tp=8, dp=2), model=model, cluster=cluster, training=training, placement=across,
                         factors=no_latency)
    ratio = slow.breakdown["tp_comm"] / intra.breakdown["tp_comm"]
    assert ratio == pytest.approx(cluster.intra_node_bandwidth / cluster.inter_node_bandwidth, rel=1e-9)
    assert slow.breakdown["dp_comm_exposed"] < intra.breakdown["dp_comm_exposed"]  # dp moved onto NVLink
    # Bubble: (p-1)/(v m) of the per-micro-batch time; interleaving shrinks it.
    one = estimate_time(Layout(tp=8, pp=2, schedule="1f1b"), model=model, cluster=cluster, training=training)
    inter = estimate_time(Layout(tp=8, pp=2, schedule="interleaved", vpp=4), model=model, cluster=cluster,
                          training=training)
    for est, vpp in ((one, 1), (inter, 4)):  # m = 64 micro-batches, p = 2
        per_mb = (est.breakdown["compute"] + est.breakdown["tp_comm"]) / 64
        assert est.breakdown["pp_bubble"] == pytest.approx(per_mb * (2 - 1) / vpp, rel=1e-9)
    assert inter.breakdown["pp_bubble"] < one.breakdown["pp_bubble"] / 3
    assert inter.breakdown["pp_p2p"] == pytest.approx(4 * one.breakdown["pp_p2p"])  # v times the boundaries
    # ZeRO-3 gathers weights every micro-batch; ZeRO-1 reduces gradients once per step.
    z1 = estimate_time(Layout(tp=8, dp=2, zero=1), model=model, cluster=cluster, training=training)
    z3 = estimate_time(Layout(tp=8, dp=2, zero=3), model=model, cluster=cluster, training=training)
    assert z3.step_time_s > z1.step_time_s


def test_calibration_factors_validate() -> None:
    with pytest.raises(SpecError, match="factors.compute_efficiency must be within"):
        CalibrationFactors(compute_efficiency=0)
    with pytest.raises(SpecError, match="factors.dp_overlap must be within"):
        CalibrationFactors(dp_overlap=1.5)
    with pytest.raises(SpecError, match="factors.latency_scale must be a number"):
        CalibrationFactors(latency_scale="x")
    slow = estimate_time(Layout(tp=4), model=model_spec("small"), cluster=cluster_spec("cpu-local"),
                         training=training_spec({"global_batch": 4}), factors=CalibrationFactors(compute_efficiency=0.25))
    fast = estimate_time(Layout(tp=4), model=model_spec("small"), cluster=cluster_spec("cpu-local"),
                         training=training_spec({"global_batch": 4}), factors=CalibrationFactors(compute_efficiency=0.5))
    assert slow.breakdown["compute"] == pytest.approx(2 * fast.breakdown["compute"])
