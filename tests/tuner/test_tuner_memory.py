"""Memory model: ZeRO model states, Korthikanti activations, schedules, the costliest rank."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from tuner import (
    OVERHEAD_BYTES,
    STACKS,
    Layout,
    cluster_spec,
    estimate_memory,
    korthikanti_layer_activation_bytes,
    layer_activation_bytes,
    microbatches_in_flight,
    model_spec,
    partition_stages,
    training_spec,
    zero_model_state_bytes,
)
from tuner._memory import MeshMemory, rank_params, state_bytes
from tuner._realise import Realisation, StateSharding, realise


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
    # What eager torch adds (the workers' truth, listed per saved tensor by the harness): each composite
    # RMSNorm keeps its normalised input (sbh) and fp32 1/rms (s*b); SDPA keeps K, V repeated to the 4
    # query heads (2 sbh instead of 2*s*b*32).
    eager = layer_activation_bytes(s=64, b=1, h=64, a=4, kv_dim=32, ffn=192, elt=4, eager_norms=True,
                                   kv_repeated=True)
    assert eager == expected + 2 * 4 * (sbh + 64) + 4 * 2 * (sbh - 64 * 32) == 361_984


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
    layer = 2 * 361_984  # mbs=2, eager torch's count (see the hand computation above)
    # fp32 logits + the final norm's and head's inputs + the final norm's normalised input and 1/rms.
    logits = 2 * (64 * 256 * 4 + 4 * 2 * 64 * 64 + 4 * (64 * 64 + 64))
    rope = 4 * 64 * 16  # cos and sin, fp32, s x head_dim/2 each, once per forward
    assert mem.activations == model.layers * layer + logits + rope
    assert mem.overhead == OVERHEAD_BYTES["cpu"]
    assert mem.total == mem.params + mem.grads + mem.optimizer + mem.activations + mem.overhead
    assert mem.fits and mem.stage == 0
    # Selective: every layer keeps 262,144 + 33,280 (norms) bytes per sequence; one layer's dropped
    # attention part, 361,984 - 295,424 = 66,560 per sequence, is re-materialised during its backward.
    sel = estimate_memory(Layout(mbs=2, ac="selective"), model=model, cluster=cluster, training=training)
    assert sel.activations == model.layers * 2 * 295_424 + 2 * 66_560 + logits + rope
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
    a = estimate_memory(Layout(tp=2, ep=4, dp=4), model=model, cluster=cluster, training=training)
    b = estimate_memory(Layout(tp=2, ep=8, dp=2), model=model, cluster=cluster, training=training)
    assert b.params < a.params  # expert weights halve when ep doubles
    # ZeRO shards experts over dp*cp, dense weights over dp*cp*ep: tp*ep*dp = 32 ranks hold each
    # expert weight once in both layouts, and each dense weight tp*dp*ep = 32 ranks too.
    a1 = estimate_memory(Layout(tp=2, ep=4, dp=4, zero=1), model=model, cluster=cluster, training=training)
    b1 = estimate_memory(Layout(tp=2, ep=8, dp=2, zero=1), model=model, cluster=cluster, training=training)
    assert a1.params == b1.params
    rp = rank_params(model, 2, 8, 1, 1)
    assert rp.expert[0] == model.layers * 8 * 3 * model.hidden * model.expert_ffn / 16


def brute_force_peak(layout: Layout, model, cluster, training, m: int) -> tuple[float, int]:
    """Max over EVERY pp rank of the same formulas (MeshMemory only looks at candidate ranks)."""
    rp = rank_params(model, layout.tp, layout.ep, layout.pp, layout.vpp)
    real = realise(layout, model, cluster, training)
    mm = MeshMemory(model, cluster, training, tp=layout.tp, cp=1, ep=1, dp=layout.dp, pp=layout.pp, vpp=layout.vpp)
    layer, working, logits = mm.act[layout.ac, layout.sp]
    logits *= m if layout.schedule == "gpipe" and layout.pp > 1 else 1
    best = (-1.0, -1)
    for r in range(layout.pp):
        states = sum(state_bytes(real, rp.dense[r], rp.expert[r], rp.layer_dense, rp.embedding if r == 0 else 0))
        mif = microbatches_in_flight(layout.schedule, layout.pp, layout.vpp, m, r)
        act = layout.mbs * (layer * rp.layers[r] * mif + working + (logits if r == layout.pp - 1 else 0))
        best = max(best, (states + act + mm.rope * mif, r), key=lambda x: x[0])
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


def test_flash_attention_off_keeps_the_scores(monkeypatch) -> None:
    # A stack whose attention materialises the scores (Megatron 2021's), else the workers'.
    monkeypatch.setitem(STACKS, "scores", replace(STACKS["meshtune"], name="scores", attention="materialised"))
    model = model_spec("llama3-8b")
    cluster = cluster_spec({"preset": "h100-sxm", "nodes": 1})
    training = training_spec({"global_batch": 8})
    layout = Layout(tp=8, dp=1)
    flash = estimate_memory(layout, model=model, cluster=cluster, training=training)
    eager = estimate_memory(layout, model=model, cluster=cluster, training=replace(training, stack="scores"))
    s, a = model.seq_len, model.heads
    extra = model.layers * (2 * a * s * s - 4 * a * s) / 8  # bf16 softmax output instead of the fp32 lse
    assert eager.activations - flash.activations == pytest.approx(extra, rel=1e-6)


def paper_realisation(real: Realisation, zero: int) -> Realisation:
    """Rajbhandari et al.'s program (DeepSpeed, Sec. 3.1 and 5): fp16 weights and gradients, fp32
    master weights + momentum + variance (K = 12) as the optimizer state; weights sharded at stage 3,
    gradients from stage 2, optimizer state from stage 1; no compute copies beside the fp16 weights."""
    n = real.dense.reduce_group
    dense = StateSharding(reduce_group=n, weights=n if zero >= 3 else 1, grads=n if zero >= 2 else 1,
                          optimizer=n if zero >= 1 else 1, weight_bytes=2, grad_bytes=2, optimizer_bytes=12)
    return replace(real, dense=dense, data_parallel="fsdp" if zero else "replicate", compute_bytes=2,
                   gathered="unit" if zero == 3 else "none", fsdp_buffer_units=2 if zero == 3 else 0,
                   grads_held_unsharded=False, autocast_weight_copies=False)


GPT_7B5 = {"preset": "gpt3-175b", "name": "gpt-7.5b", "layers": 36, "hidden": 4096, "heads": 32, "kv_heads": 32,
           "ffn": 4 * 4096}


@pytest.mark.parametrize(("zero", "paper_gb"), [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_model_states_with_fsdp_buffers_apart(zero: int, paper_gb: float) -> None:
    # Rajbhandari et al. 2020, Fig. 1: Ψ = 7.5B on Nd = 64 with mixed-precision Adam (K = 12) holds
    # 120 / 31.4 / 16.6 / 1.9 GB of model states per device under ZeRO 0 / 1 / 2 / 3. A GPT shape of
    # ~7.46B parameters (h 4096, 36 layers) is scaled to 7.5B; FSDP's gather buffers are their own part.
    # The breakdown (state_bytes) of the paper's realisation reproduces the figure.
    model = model_spec(GPT_7B5)
    cluster = cluster_spec({"preset": "a100-80g", "nodes": 8})
    training = training_spec({"global_batch": 128})
    real = paper_realisation(realise(Layout(dp=64, zero=zero), model, cluster, training), zero)
    rp = rank_params(model, 1, 1, 1, 1)
    p, g, o, buffers = state_bytes(real, rp.dense[0], 0.0, rp.layer_dense)
    assert round((p + g + o) * 7.5e9 / model.params / 1e9, 1) == pytest.approx(paper_gb, abs=0.05)
    layer = model.params_per_layer  # ZeRO-3: two layers' bf16 weights and one layer's bf16 gradients
    assert buffers == (pytest.approx(3 * 2 * layer) if zero == 3 else 0)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_workers_model_states_on_the_paper_model(zero: int) -> None:
    # The workers' program for the same model (tuner/_realise.py): fp32 master weights, fp32 gradients
    # and AdamW state, sharded as ZeRO says (16Ψ/Nd at stages 1-3), bf16 compute copies and, for
    # ZeRO-1 over its 2 micro-batches, the full fp32 gradients held between them, as buffers.
    model = model_spec(GPT_7B5)
    cluster = cluster_spec({"preset": "a100-80g", "nodes": 8})
    mem = estimate_memory(Layout(dp=64, zero=zero), model=model, cluster=cluster,
                          training=training_spec({"global_batch": 128}))
    psi, n = rank_params(model, 1, 1, 1, 1).dense[0], 64
    shard = n if zero else 1
    assert (mem.params, mem.grads, mem.optimizer) == (int(4 * psi / shard), int(4 * psi / shard),
                                                      int(8 * psi / shard))
    layer = model.params_per_layer
    want = {0: 2 * psi,  # replicate's one bf16 copy of the weights, from the first forward to the last backward
            1: 2 * psi + 4 * psi,  # the gathered bf16 weights; full fp32 gradients between micro-batches
            2: 2 * psi,  # the gathered bf16 weights
            3: 3 * 2 * layer}[zero]  # two units' bf16 weights, one unit's bf16 gradients
    assert mem.buffers == int(want)
    assert mem.total == mem.params + mem.grads + mem.optimizer + mem.activations + mem.buffers + mem.overhead


@pytest.mark.parametrize("measure", ["cuda.max_memory_allocated", "cpu.VmHWM"])
def test_memory_calibration_compares_like_with_like(measure: str) -> None:
    # torch.cuda.max_memory_allocated counts tensors only; the prediction it calibrates carries the
    # fixed 2 GiB CUDA allowance too. A run whose tensors are exactly the model's parts must leave the
    # memory model where it is (before: the allowance made it look 2 GiB short, and shrank it).
    import dataclasses
    from types import SimpleNamespace

    from api.engine import SweepModel
    from api.spec import SweepSpec

    problem = SweepModel.from_spec(SweepSpec.model_validate(
        {"model": "llama3-1b", "cluster": {"preset": "h100-sxm", "nodes": 1}, "training": {"global_batch": 64}}))
    layouts = problem.space.layouts[:4]
    for lay in layouts[:3]:
        raw = problem.raw_memory_bytes(lay)
        tensors = raw - OVERHEAD_BYTES["cuda"] if measure.startswith("cuda") else raw
        problem.observe(SimpleNamespace(layout=dataclasses.asdict(lay), status="completed", error=None,
                                        peak_memory_bytes=int(tensors), memory_measure=measure))
    assert problem.predict(layouts[3]).memory_bytes == pytest.approx(problem.raw_memory_bytes(layouts[3]), rel=0.01)
