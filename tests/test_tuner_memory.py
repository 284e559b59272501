"""Memory model: ZeRO model states, Korthikanti activations, schedules, the costliest rank."""

from __future__ import annotations

import itertools

import pytest

from tuner import (
    OVERHEAD_BYTES,
    Layout,
    cluster_spec,
    estimate_memory,
    korthikanti_layer_activation_bytes,
    layer_activation_bytes,
    microbatches_in_flight,
    model_spec,
    training_spec,
    zero_model_state_bytes,
)
from tuner._memory import MeshMemory, logits_bytes, rank_params
from tuner._partition import partition_stages


@pytest.mark.parametrize(
    ("stage", "paper_gb"),
    [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)],
)
def test_zero_matches_rajbhandari_figure_1(stage: int, paper_gb: float) -> None:
    # Rajbhandari et al. 2020, Fig. 1: 7.5B parameters, Nd = 64, mixed-precision Adam (K = 12).
    total = sum(zero_model_state_bytes(7.5e9, 64, stage, "bf16")) / 1e9
    assert total == pytest.approx(paper_gb, abs=0.05)


def test_zero_parts_and_fp32() -> None:
    psi, nd = 1000.0, 10
    assert zero_model_state_bytes(psi, nd, 0) == (2000, 2000, 12000)
    assert zero_model_state_bytes(psi, nd, 1) == (2000, 2000, 1200)
    assert zero_model_state_bytes(psi, nd, 2) == (2000, 200, 1200)
    assert zero_model_state_bytes(psi, nd, 3) == (200, 200, 1200)
    assert zero_model_state_bytes(psi, nd, 0, "fp32") == (4000, 4000, 8000)


S, B, H, A, T = 2048, 1, 12288, 96, 8  # GPT-3 175B, Korthikanti et al. 2022 Sec. 4


def test_korthikanti_table_2() -> None:
    sbh = S * B * H
    assert korthikanti_layer_activation_bytes(S, B, H, A) == sbh * (34 + 5 * A * S / H)
    assert 5 * A * S / H == 80  # "for GPT-3 ... 5as/h = 80" (Sec. 4.1)
    assert korthikanti_layer_activation_bytes(S, B, H, A, T) == sbh * (10 + 24 / T + 5 * A * S / (H * T))
    assert korthikanti_layer_activation_bytes(S, B, H, A, T, sp=True) == sbh / T * (34 + 5 * A * S / H)
    assert korthikanti_layer_activation_bytes(S, B, H, A, T, recompute="selective") == sbh * (10 + 24 / T)
    assert korthikanti_layer_activation_bytes(S, B, H, A, T, sp=True, recompute="selective") == 34 * sbh / T
    assert korthikanti_layer_activation_bytes(S, B, H, A, T, recompute="full") == 2 * sbh


@pytest.mark.parametrize(("t", "sp", "ac"), [(1, False, "none"), (8, False, "none"), (8, True, "none"),
                                             (1, False, "full"), (4, False, "full")])
def test_general_formula_reduces_to_korthikanti(t: int, sp: bool, ac: str) -> None:
    general = layer_activation_bytes(s=S, b=2, h=H, a=A, kv_dim=H, ffn=4 * H, mlp="gelu", t=t, sp=sp, ac=ac,
                                     elt=2, dropout=True, flash=False)
    assert general == pytest.approx(korthikanti_layer_activation_bytes(S, 2, H, A, t, sp=sp, recompute=ac))


@pytest.mark.parametrize(("t", "sp"), [(1, False), (8, False), (8, True)])
def test_selective_is_attention_block_recompute_not_korthikantis(t: int, sp: bool) -> None:
    # The workers checkpoint the whole attention sub-layer. In Korthikanti's Table 2 terms (GeLU MLP,
    # dropout, eager attention), the attention block's 11sbh + 5as^2b then shrinks to its 2sbh input
    # plus its sbh dropout mask: dropped are Q, K (4sbh), V (2sbh), the out-projection input (2sbh) and
    # 5as^2b. Kept: 2 norm inputs + attention input + MLP input (8sbh) + 2 dropout masks (2sbh),
    # and the MLP's inside-TP 16sbh (GeLU input and output).
    sbh = S * 2 * H
    want = (10 + 16 / t) * sbh if not sp else 26 * sbh / t
    got = layer_activation_bytes(s=S, b=2, h=H, a=A, kv_dim=H, ffn=4 * H, mlp="gelu", t=t, sp=sp,
                                 ac="selective", elt=2, dropout=True, flash=False)
    assert got == pytest.approx(want, rel=1e-12)
    # ... which is below Korthikanti's selective (they keep Q, K, V and the out-projection input).
    assert got < korthikanti_layer_activation_bytes(S, 2, H, A, t, sp=sp, recompute="selective")


def test_layer_activations_hand_computed_tiny_fp32() -> None:
    # tiny: h=64, a=4, kv_dim=2*16=32, ffn=192 SwiGLU, fp32 (4 bytes), flash attention, s=64, b=1.
    # outside TP: 4 tensors of sbh; Q+attention output 2 sbh, K+V 2*s*b*32; lse 4*a*s*b; eager SwiGLU
    # keeps 4*s*b*ffn (gate, silu(gate), up, their product).
    sbh = 64 * 64
    expected = 4 * 4 * sbh + 4 * (2 * sbh + 2 * 64 * 32) + 4 * 4 * 64 + 4 * 4 * 192 * 64
    assert expected == 312_320
    got = layer_activation_bytes(s=64, b=1, h=64, a=4, kv_dim=32, ffn=192, elt=4)
    assert got == expected
    # selective (attention-block recompute): the 4 outside tensors and the MLP's 4 ffn-wide tensors
    # stay, Q, K, V, the attention output and the lse go: 16*4096 + 16*192*64 = 65,536 + 196,608.
    assert layer_activation_bytes(s=64, b=1, h=64, a=4, kv_dim=32, ffn=192, elt=4, ac="selective") == 262_144
    # full keeps the input only.
    assert layer_activation_bytes(s=64, b=1, h=64, a=4, kv_dim=32, ffn=192, elt=4, ac="full") == 4 * sbh


def test_microbatches_in_flight_per_schedule() -> None:
    p, m = 8, 32
    assert [microbatches_in_flight("1f1b", p, 1, m, r) for r in range(p)] == [8, 7, 6, 5, 4, 3, 2, 1]
    assert microbatches_in_flight("1f1b", p, 1, 3, 0) == 3  # fewer micro-batches than stages
    assert microbatches_in_flight("gpipe", p, 1, m, 5) == m
    # Korthikanti et al. 2022 Sec. 4.2.3: the first stage holds p + (p-1)/v stage-sized micro-batches.
    for v in (2, 3, 4):
        assert microbatches_in_flight("interleaved", p, v, m, 0) == pytest.approx(p + (p - 1) / v)
    assert microbatches_in_flight("1f1b", 1, 1, m, 0) == 1


def test_single_device_estimate_hand_computed() -> None:
    model = model_spec("tiny")
    cluster = cluster_spec({"preset": "cpu-local", "devices_per_node": 1})
    training = training_spec({"global_batch": 8, "precision": "fp32"})
    mem = estimate_memory(Layout(mbs=2), model=model, cluster=cluster, training=training)
    n = model.params  # untied: every weight on the one device
    assert (mem.params, mem.grads, mem.optimizer) == (4 * n, 4 * n, 8 * n)
    layer = 2 * 312_320  # mbs=2, see the hand computation above
    logits = 2 * (64 * 256 * 4 + 4 * 2 * 64 * 64)  # fp32 logits + the final norm's and head's inputs
    assert mem.activations == model.layers * layer + logits
    assert mem.overhead == OVERHEAD_BYTES["cpu"]
    assert mem.total == mem.params + mem.grads + mem.optimizer + mem.activations + mem.overhead
    assert mem.fits and mem.stage == 0
    # Selective: every layer keeps 262,144 bytes per sequence; one layer's dropped attention part,
    # 312,320 - 262,144 = 50,176 per sequence, is re-materialised during its backward.
    sel = estimate_memory(Layout(mbs=2, ac="selective"), model=model, cluster=cluster, training=training)
    assert sel.activations == model.layers * 2 * 262_144 + 2 * 50_176 + logits
    assert sel.activations < mem.activations


def test_tp_pp_zero_shard_the_right_parameters() -> None:
    model = model_spec("llama3-8b")
    rp = rank_params(model, 4, 1, 4, 1)
    layers = partition_stages(model, 4).layers_per_stage
    per_layer = model.attention_params_per_layer / 4 + model.mlp_params_per_layer / 4 + 2 * model.hidden
    assert rp.dense[1] == pytest.approx(layers[1] * per_layer)
    assert rp.dense[0] == pytest.approx(layers[0] * per_layer + model.embedding_params / 4)
    assert rp.dense[3] == pytest.approx(layers[3] * per_layer + model.hidden + model.embedding_params / 4)
    # Every weight is held once across tp*pp (embedding and untied head are vocab-parallel), except
    # the norm weights, which every tp rank keeps whole.
    norms = 2 * model.hidden * model.layers + model.hidden
    assert sum(rp.dense) * 4 == pytest.approx(model.params + 3 * norms, rel=1e-12)


def test_moe_expert_weights_shard_over_ep_and_zero_over_dp() -> None:
    model = model_spec("mixtral-8x7b")
    cluster = cluster_spec({"preset": "h100-sxm", "nodes": 4})
    training = training_spec({"global_batch": 64})
    a = estimate_memory(Layout(tp=2, ep=4, dp=4, zero=1), model=model, cluster=cluster, training=training)
    b = estimate_memory(Layout(tp=2, ep=8, dp=2, zero=1), model=model, cluster=cluster, training=training)
    assert b.params < a.params  # expert weights halve when ep doubles
    rp = rank_params(model, 2, 8, 1, 1)
    assert rp.expert[0] == model.layers * 8 * 3 * model.hidden * model.expert_ffn / 16


def brute_force_peak(layout: Layout, model, cluster, training, m: int) -> tuple[float, int]:
    """Max over EVERY pp rank of the same formulas (MeshMemory only looks at candidate ranks)."""
    rp = rank_params(model, layout.tp, layout.ep, layout.pp, layout.vpp)
    elt = 2 if training.precision == "bf16" else 4
    s = model.seq_len // layout.cp
    kw = dict(s=s, b=layout.mbs, h=model.hidden, a=model.heads, kv_dim=model.kv_heads * model.head_dim,
              ffn=model.ffn, mlp=model.mlp, t=layout.tp, sp=layout.sp, elt=elt)
    layer = layer_activation_bytes(ac=layout.ac, **kw)
    working = layer_activation_bytes(ac="none", **kw) if layout.ac == "full" else 0
    logits = logits_bytes(s, layout.mbs, model.hidden, model.vocab, layout.tp, layout.sp, elt)
    logits *= m if layout.schedule == "gpipe" and layout.pp > 1 else 1
    best = (-1.0, -1)
    for r in range(layout.pp):
        states = sum(zero_model_state_bytes(rp.dense[r], layout.dp, layout.zero, training.precision))
        act = layer * rp.layers[r] * microbatches_in_flight(layout.schedule, layout.pp, layout.vpp, m, r)
        act += working + (logits if r == layout.pp - 1 else 0)
        if layout.zero == 3 and layout.dp > 1:  # FSDP's gather buffers (none without a data axis)
            states += 3 * 2 * rp.layer_dense
        best = max(best, (states + act, r), key=lambda x: x[0])
    return best


def test_candidate_ranks_give_the_same_peak_as_every_rank() -> None:
    model = model_spec({"preset": "llama3-8b", "layers": 30})
    cluster = cluster_spec({"preset": "h100-sxm", "nodes": 2})
    training = training_spec({"global_batch": 96})
    checked = 0
    for pp, sched, vpp, zero, ac, mbs in itertools.product(
        (2, 4, 8), ("gpipe", "1f1b", "interleaved"), (1, 2), (0, 3), ("none", "full"), (1, 2)
    ):
        if (sched == "interleaved") != (vpp > 1):
            continue
        layout = Layout(tp=2, pp=pp, dp=16 // (2 * pp) if pp < 8 else 1, zero=zero, ac=ac, mbs=mbs,
                        schedule=sched, vpp=vpp, sp=True)
        m = training.global_batch // (layout.dp * mbs)
        mm = MeshMemory(model, cluster, training, tp=2, cp=1, ep=1, dp=layout.dp, pp=pp, vpp=vpp)
        got = mm.estimate(zero, mbs, ac, True, sched, m)
        want_total, want_rank = brute_force_peak(layout, model, cluster, training, m)
        assert got[4] == pytest.approx(want_total, rel=1e-12)
        checked += 1
    assert checked == 72


def test_flash_attention_off_keeps_the_scores() -> None:
    model = model_spec("llama3-8b")
    cluster = cluster_spec({"preset": "h100-sxm", "nodes": 1})
    training = training_spec({"global_batch": 8})
    layout = Layout(tp=8, dp=1)
    flash = estimate_memory(layout, model=model, cluster=cluster, training=training)
    eager = estimate_memory(layout, model=model, cluster=cluster, training=training, flash_attention=False)
    s, a = model.seq_len, model.heads
    extra = model.layers * (2 * a * s * s - 4 * a * s) / 8  # bf16 softmax output instead of the fp32 lse
    assert eager.activations - flash.activations == pytest.approx(extra, rel=1e-6)


@pytest.mark.parametrize(("zero", "paper_gb"), [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_model_states_with_fsdp_buffers_apart(zero: int, paper_gb: float) -> None:
    # Rajbhandari et al. 2020, Fig. 1: Ψ = 7.5B on Nd = 64 with mixed-precision Adam (K = 12) holds
    # 120 / 31.4 / 16.6 / 1.9 GB of model states per device under ZeRO 0 / 1 / 2 / 3. A GPT shape of
    # ~7.46B parameters (h 4096, 36 layers) is scaled to 7.5B; FSDP's gather buffers are their own part.
    model = model_spec({"preset": "gpt3-175b", "name": "gpt-7.5b", "layers": 36, "hidden": 4096, "heads": 32,
                        "kv_heads": 32, "ffn": 4 * 4096})
    cluster = cluster_spec({"preset": "a100-80g", "nodes": 8})
    mem = estimate_memory(Layout(dp=64, zero=zero), model=model, cluster=cluster,
                          training=training_spec({"global_batch": 64}))
    states = (mem.params + mem.grads + mem.optimizer) * 7.5e9 / model.params
    assert round(states / 1e9, 1) == pytest.approx(paper_gb, abs=0.05 if zero < 3 else 0.1)
    layer = model.params_per_layer  # ZeRO-3: two layers' bf16 weights and one layer's bf16 gradients
    assert mem.buffers == (int(3 * 2 * layer) if zero == 3 else 0)
    assert mem.total == mem.params + mem.grads + mem.optimizer + mem.activations + mem.buffers + mem.overhead
