"""Time model: formulas by hand, a single-device step by hand, links from the placement."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tuner import (
    STACKS,
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
from tuner._formulas import allgather_time, allreduce_time, recompute_flops_per_token_per_layer
from tuner._memory import rank_params


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


# "small" (tuner/_specs.py): L=8, h=256, 8 heads, 4 kv heads of 32, SwiGLU ffn=768, V=1024, T=256, untied.
#   P_attn = 2·256·256 + 2·256·4·32 = 196,608    P_mlp = 3·256·768 = 589,824    norms 2·256 per layer
#   N = 1024·256 (embedding) + 8·(196,608 + 589,824 + 512) + 256 + 1024·256 (head) = 6,820,096
# Model FLOPs per token (PaLM App. B, the MFU convention), the embedding lookup excluded:
#   6·(6,820,096 - 262,144) + 12·8·256·256 = 39,347,712 + 6,291,456 = 45,639,168
# Step time (5e10 FLOP/s peak; matmuls at 0.5, the flash attention core at min(0.35, 0.5)):
#   matmuls per layer 6·(P_attn + P_mlp) = 4,718,592; causal attention core 6·h·T = 393,216 (half
#   PaLM's 12·h·T); the head 6·h·V = 1,572,864 and the embedding at 1/4 of it.
#   Recompute per layer: selective 2·196,608 = 393,216 matmul + 2·h·T = 131,072 core; full
#   2·786,432 = 1,572,864 matmul + 131,072 core.
SMALL_MODEL_FLOPS = 45_639_168
TOKENS = 8 * 256


def small_step_s(matmul_layer: int, core_layer: int) -> float:
    return TOKENS * ((8 * matmul_layer + 1.25 * 1_572_864) / 2.5e10 + 8 * core_layer / 1.75e10)


@pytest.mark.parametrize(
    ("ac", "step_s", "recompute"),
    [
        ("none", small_step_s(4_718_592, 393_216), 0),
        ("selective", small_step_s(4_718_592 + 393_216, 393_216 + 131_072), 8 * (2 * 196_608 + 4 * 256 * 256)),
        ("full", small_step_s(4_718_592 + 1_572_864, 393_216 + 131_072), 8 * (2 * 786_432 + 4 * 256 * 256)),
    ],
)
def test_single_device_step_hand_computed(ac: str, step_s: float, recompute: int) -> None:
    model = model_spec("small")
    cluster = cluster_spec({"preset": "cpu-local", "devices_per_node": 1})  # 5e10 FLOP/s peak
    training = training_spec({"global_batch": 8, "critical_batch": 8})
    f = CalibrationFactors(compute_efficiency=0.5)
    assert model.params == 6_820_096 and model_flops_per_token(model) == SMALL_MODEL_FLOPS
    t = estimate_time(Layout(mbs=2, ac=ac), model=model, cluster=cluster, training=training, factors=f)
    assert t.step_time_s == pytest.approx(step_s, rel=1e-12)
    assert t.breakdown["compute"] == pytest.approx(step_s, rel=1e-12)
    assert sum(v for k, v in t.breakdown.items() if k != "compute") == 0
    assert t.tokens_per_s == pytest.approx(TOKENS / step_s, rel=1e-12)
    # MFU by PaLM's convention (labelled), HFU by Megatron's (+ the recomputed forward, full attention).
    assert t.mfu == pytest.approx(SMALL_MODEL_FLOPS * TOKENS / step_s / 5e10, rel=1e-12)
    assert t.hfu == pytest.approx((SMALL_MODEL_FLOPS + recompute) * TOKENS / step_s / 5e10, rel=1e-12)
    assert "PaLM" in t.to_dict()["mfu_convention"]
    assert t.useful_tokens_per_s == pytest.approx(t.tokens_per_s / 2)  # B = B_crit: half is useful


def test_causal_attention_halves_the_core_in_step_time_not_in_mfu(monkeypatch) -> None:
    # Long sequences: the attention core dominates. A flash (causal) kernel does half of PaLM's
    # 12·L·h·s; a materialised-scores kernel (a stack with attention="materialised") does all of it
    # at the matmul rate.
    monkeypatch.setitem(STACKS, "scores", replace(STACKS["meshtune"], name="scores", attention="materialised"))
    model = model_spec({"preset": "small", "seq_len": 8192})
    cluster = cluster_spec({"preset": "cpu-local", "devices_per_node": 1})
    training = training_spec({"global_batch": 1})
    f = CalibrationFactors(compute_efficiency=0.5, attention_efficiency=0.5)
    flash = estimate_time(Layout(), model=model, cluster=cluster, training=training, factors=f)
    full = estimate_time(Layout(), model=model, cluster=cluster, training=replace(training, stack="scores"), factors=f)
    core = 8 * 12 * 256 * 8192 * 8192 / 2.5e10  # L·12·h·s per token x s tokens at 0.5 of 5e10
    assert full.step_time_s - flash.step_time_s == pytest.approx(core / 2, rel=1e-9)
    assert full.mfu * full.step_time_s == pytest.approx(flash.mfu * flash.step_time_s, rel=1e-12)  # one count


def test_recompute_flops_hand_computed() -> None:
    model = model_spec("small")
    assert recompute_flops_per_token_per_layer(model, "none") == 0
    assert recompute_flops_per_token_per_layer(model, "selective") == 2 * 196_608 + 4 * 256 * 256 == 655_360
    assert recompute_flops_per_token_per_layer(model, "full") == 2 * 786_432 + 4 * 256 * 256 == 1_835_008


def test_selective_repeats_the_attention_tp_collective() -> None:
    # TP/SP: 4 all-reduce-sized collectives per layer (2 forward, 2 backward); attention-block recompute
    # repeats the attention's forward one (5 per layer), full recompute both forward ones (6 per layer).
    # At the ends: the embedding's output and the head's input-gradient reductions (one all-reduce
    # each) and, with the logits vocab-sharded (loss parallel), 3 all-reduces of one fp32 per token.
    model = model_spec("llama3-8b")
    cluster = cluster_spec({"preset": "h100-sxm", "nodes": 1})
    training = training_spec({"global_batch": 8})
    f = CalibrationFactors(latency_scale=0.0)
    tp = {ac: estimate_time(Layout(tp=8, ac=ac, sp=True), model=model, cluster=cluster, training=training, factors=f)
          .breakdown["tp_comm"] for ac in ("none", "selective", "full")}
    one = allreduce_time(2 * 8192 * 4096, 8, 450e9 * 0.8, 0.0)
    ends = 2 * one + 3 * allreduce_time(4 * 8192, 8, 450e9 * 0.8, 0.0)
    assert tp["none"] == pytest.approx(8 * (32 * 4 * one + ends), rel=1e-12)  # 8 micro-batches
    assert tp["selective"] == pytest.approx(8 * (32 * 5 * one + ends), rel=1e-12)
    assert tp["full"] == pytest.approx(8 * (32 * 6 * one + ends), rel=1e-12)


# Data parallel on "small" over 4 CPU ranks (5e9 B/s links at 0.8: 4e9 B/s), no latency, no overlap.
# Each rank holds all N = 6,820,096 weights; ring over 4 ranks moves 3/4 of the whole:
#   all-gather of bf16 weights  0.75 · 2·N / 4e9 = 0.002557536 s
#   reduce-scatter of fp32 grads 0.75 · 4·N / 4e9 = 0.005115072 s
#   all-reduce of fp32 grads   1.5 · 4·N / 4e9  = 0.010230144 s
AG, RS, AR = 0.002557536, 0.005115072, 0.010230144


@pytest.mark.parametrize(("zero", "overlap", "dp_s"), [
    (0, 0.0, AR), (0, 1.0, 0.0),             # ZeRO-0: replicate's per-unit all-reduces, overlapped
    (1, 0.0, AG + RS), (1, 1.0, 0.0),        # ZeRO-1: one reduce-scatter + all-gather per step
    (2, 0.0, 4 * (AG + RS)),                 # ZeRO-2 (pp=1): reduce-scatter, and so a gather, per micro-batch
    (3, 0.0, 4 * (2 * AG + RS)),             # ZeRO-3 (pp=1): gather forward and backward, reduce-scatter
])
def test_data_parallel_traffic_pp1_hand_computed(zero: int, overlap: float, dp_s: float) -> None:
    f = CalibrationFactors(latency_scale=0.0, dp_overlap=overlap)
    t = estimate_time(Layout(dp=4, zero=zero, mbs=1), model=model_spec("small"), cluster=cluster_spec("cpu-local"),
                      training=training_spec({"global_batch": 16}), factors=f)  # m = 16 / (4 · 1) = 4
    assert t.breakdown["dp_comm_exposed"] == pytest.approx(dp_s, rel=1e-9)


def test_data_parallel_traffic_under_pipelining_workers() -> None:
    # pp=2 x dp=2, the workers' stage (tuner/_realise.py, decision 6): the same rule as without
    # pipelining, ZeRO-2/3 reduce-scatter every one of the m = 8 micro-batches' backwards.
    model, cluster = model_spec("small"), cluster_spec("cpu-local")
    training = training_spec({"global_batch": 16})  # m = 16 / (2 · 1) = 8
    psi = max(rank_params(model, 1, 1, 2, 1).dense)
    ag, rs = 0.5 * 2 * psi / 4e9, 0.5 * 4 * psi / 4e9
    f = CalibrationFactors(latency_scale=0.0, dp_overlap=0.0)
    dp = {z: estimate_time(Layout(pp=2, dp=2, zero=z), model=model, cluster=cluster, training=training, factors=f)
          .breakdown["dp_comm_exposed"] for z in (0, 1, 2, 3)}
    assert dp[0] == pytest.approx(2 * rs, rel=1e-9)  # fp32 all-reduce = 2 x the reduce-scatter
    assert dp[1] == pytest.approx(ag + rs, rel=1e-9)
    assert dp[2] == pytest.approx(8 * (ag + rs), rel=1e-9)
    assert dp[3] == pytest.approx(8 * (2 * ag + rs), rel=1e-9)


def test_data_parallel_traffic_under_pipelining_torchtitan() -> None:
    # pp=2 x dp=2 as torchtitan runs it: torch.distributed.pipelining runs every backward without
    # gradient sync or reshard and reduce-scatters once after the last one (exposed); ZeRO-1/2
    # gather once per step, ZeRO-3 m + 1 times. The largest stage holds psi weights; over 2 ranks a
    # ring moves 1/2.
    model, cluster = model_spec("small"), cluster_spec("cpu-local")
    training = training_spec({"global_batch": 16, "stack": "torchtitan"})  # m = 16 / (2 · 1) = 8
    psi = max(rank_params(model, 1, 1, 2, 1).dense)
    ag, rs = 0.5 * 2 * psi / 4e9, 0.5 * 4 * psi / 4e9
    f = CalibrationFactors(latency_scale=0.0, dp_overlap=0.0)
    dp = {z: estimate_time(Layout(pp=2, dp=2, zero=z), model=model, cluster=cluster, training=training,
                           factors=f).breakdown["dp_comm_exposed"] for z in (0, 1, 2, 3)}
    assert dp[0] == pytest.approx(2 * rs, rel=1e-9)  # fp32 all-reduce = 2 x the reduce-scatter
    assert dp[1] == dp[2] == pytest.approx(ag + rs, rel=1e-9)
    assert dp[3] == pytest.approx(9 * ag + rs, rel=1e-9)
    # Full overlap hides the gathers only: the final reduce-scatter waits for the last backward.
    hidden = CalibrationFactors(latency_scale=0.0, dp_overlap=1.0)
    z3 = estimate_time(Layout(pp=2, dp=2, zero=3), model=model, cluster=cluster, training=training, factors=hidden)
    assert z3.breakdown["dp_comm_exposed"] == pytest.approx(rs, rel=1e-9)


def test_data_parallel_traffic_of_megatron() -> None:
    # The same mesh as Megatron-LM runs it (tuner/_stack.py MEGATRON), pipelined or not: DDP's one
    # all-reduce and the distributed optimizer's reduce-scatter hidden in the last backward, its
    # all-gather of the updated weights exposed; Megatron-FSDP's ZeRO-2 reduce-scatters every
    # micro-batch and gathers the weights once, exposed; ZeRO-3 gathers twice per micro-batch.
    model, cluster = model_spec("small"), cluster_spec("cpu-local")
    training = training_spec({"global_batch": 16, "stack": "megatron"})  # m = 8
    psi = max(rank_params(model, 1, 1, 2, 1).dense)
    ag, rs = 0.5 * 2 * psi / 4e9, 0.5 * 4 * psi / 4e9
    for overlap, want in ((0.0, {0: 2 * rs, 1: ag + rs, 2: ag + 8 * rs, 3: 8 * (2 * ag + rs)}),
                          (1.0, {0: 0.0, 1: ag, 2: ag, 3: 0.0})):
        f = CalibrationFactors(latency_scale=0.0, dp_overlap=overlap)
        got = {z: estimate_time(Layout(pp=2, dp=2, zero=z), model=model, cluster=cluster, training=training,
                                factors=f).breakdown["dp_comm_exposed"] for z in (0, 1, 2, 3)}
        assert got == pytest.approx(want, rel=1e-9, abs=1e-15), overlap


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
                         training=training_spec({"global_batch": 4}), factors=CalibrationFactors(compute_efficiency=0.25, attention_efficiency=0.25))
    fast = estimate_time(Layout(tp=4), model=model_spec("small"), cluster=cluster_spec("cpu-local"),
                         training=training_spec({"global_batch": 4}), factors=CalibrationFactors(compute_efficiency=0.5, attention_efficiency=0.5))
    assert slow.breakdown["compute"] == pytest.approx(2 * fast.breakdown["compute"])
