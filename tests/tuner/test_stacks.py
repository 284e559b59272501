"""Training stacks (tuner/_stack.py): what each one changes in the one memory and time model, and the
refusals (an unknown stack is one line naming the field and the value)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tuner import (
    STACKS,
    Layout,
    Problem,
    SpecError,
    Stack,
    TrainingSpec,
    cluster_spec,
    estimate_memory,
    estimate_time,
    model_spec,
    plan,
    training_spec,
)
from tuner._formulas import allgather_time, allreduce_time
from tuner._plan import _costed_groups

MODEL = model_spec("llama3-8b")
NODE = cluster_spec({"preset": "h100-sxm", "nodes": 1})


def test_an_unknown_stack_is_one_line_naming_the_field():
    with pytest.raises(SpecError, match=r"^training.stack='jax' is not a known stack \(known: megatron, meshtune, "
                                        r"torchtitan\)$"):
        training_spec({"global_batch": 8, "stack": "jax"})
    with pytest.raises(SpecError, match=r"^training.stack=3 is not a known stack"):
        TrainingSpec(global_batch=8, stack=3)  # type: ignore[arg-type]
    with pytest.raises(SpecError, match=r"^stack.swiglu_saved must be one of \(3, 4\), got 5$"):
        replace(STACKS["megatron"], swiglu_saved=5)
    with pytest.raises(SpecError, match=r"^stack.data_parallel must be one of"):
        replace(STACKS["megatron"], data_parallel="deepspeed")
    with pytest.raises(SpecError, match=r"^stack.fused_norms must be true or false, got 1$"):
        replace(STACKS["megatron"], fused_norms=1)


def _activations(stack: Stack, layout: Layout, monkeypatch) -> float:
    monkeypatch.setitem(STACKS, stack.name, stack)
    training = training_spec({"global_batch": 8, "stack": stack.name})
    return estimate_memory(layout, model=MODEL, cluster=NODE, training=training).activations


def test_each_kernel_property_changes_its_own_saved_tensors(monkeypatch):
    # tp=8 with sp, no pipeline, one sequence of 8192 tokens: one layer's saved bytes times 32 layers, plus
    # the last stage's logits. Each property of the megatron stack, switched back to the workers' value
    # alone, adds exactly what the workers' eager torch keeps beyond it (per layer, /t where it is sharded).
    layout = Layout(tp=8, dp=1, sp=True, mbs=1)
    s, h, t, layers, ffn, kv = 8192, 4096, 8, 32, 14336, 8 * 128
    megatron = STACKS["megatron"]
    base = _activations(replace(megatron, name="m0"), layout, monkeypatch)
    swiglu = _activations(replace(megatron, name="m1", swiglu_saved=4), layout, monkeypatch) - base
    assert swiglu == pytest.approx(layers * 2 * s * ffn / t)  # the fourth ffn-wide bf16 tensor, tp-sharded
    gathered = _activations(replace(megatron, name="m2", sequence_parallel="dtensor"), layout, monkeypatch) - base
    assert gathered == pytest.approx(layers * 2 * (2 * s * h) * (1 - 1 / t))  # attention and MLP inputs, whole
    repeated = _activations(replace(megatron, name="m3", repeats_kv=True), layout, monkeypatch) - base
    assert repeated == pytest.approx(layers * 2 * 2 * s * (h - kv) / t)  # K and V at the query heads' width
    norms = _activations(replace(megatron, name="m4", fused_norms=False), layout, monkeypatch) - base
    per_token = 2 * h + 4  # the normalised bf16 input and the fp32 reciprocal RMS
    assert norms == pytest.approx((layers * 2 + 1) * s * per_token / t)  # two a layer and the final norm
    # The workers' stack is exactly the megatron one with all four switched back (no other difference).
    both = replace(megatron, name="m5", swiglu_saved=4, sequence_parallel="dtensor", repeats_kv=True,
                   fused_norms=False, data_parallel="workers")
    assert _activations(both, layout, monkeypatch) == estimate_memory(
        layout, model=MODEL, cluster=NODE, training=training_spec({"global_batch": 8})).activations


def test_megatron_hides_the_column_parallel_input_gradients_behind_their_weight_gradients(monkeypatch):
    # llama3-8b at tp8 on one H100 node, 8 micro-batches of one 8K sequence, no recompute. Each layer's qkv
    # and fc1 reduce their input gradient while their weight-gradient GEMM runs and re-gather their
    # sequence-parallel input while their input-gradient GEMM runs (megatron/core/tensor_parallel/layers.py),
    # each hiding min(collective, GEMM): qkv's GEMMs (6144 wide) are shorter than a collective, fc1's
    # (2 x 14336) and the head's (128256) longer. Nothing else is hidden: with sp the row-parallel linears'
    # backward all-gathers stay, so the hidden share differs with and without sp on one datasheet link.
    monkeypatch.setitem(STACKS, "m0", replace(STACKS["megatron"], name="m0", dgrad_overlap=False))
    s, h, t, layers, m = 8192, 4096, 8, 32, 8
    rate, bw, lat = NODE.peak_flops * 0.6, NODE.intra_node_bandwidth * 0.8, NODE.intra_node_latency
    qkv, fc1, head = (2 * w * s / t / rate for w in (h * (4096 + 2 * 1024), h * 2 * 14336, h * 128256))

    def tp_comm(stack: str, sp: bool) -> float:
        training = training_spec({"global_batch": m, "stack": stack})
        return estimate_time(Layout(tp=t, sp=sp), model=MODEL, cluster=NODE, training=training).breakdown["tp_comm"]

    rs = allgather_time(2 * s * h, t, bw, lat)  # the input gradient's reduce-scatter (sp), or the re-gather
    ar = allreduce_time(2 * s * h, t, bw, lat)  # its all-reduce (no sp)
    assert qkv < rs < ar < fc1 < head
    hidden = {True: layers * (qkv + rs) + rs, False: layers * (qkv + ar) + ar}
    for sp in (True, False):
        assert tp_comm("m0", sp) - tp_comm("megatron", sp) == pytest.approx(m * hidden[sp], rel=1e-9)
    # the re-gathers: qkv's GEMM hides a share, fc1's and the head's all; the workers save the gathered input
    assert tp_comm("m0", True) - tp_comm("m0", False) == pytest.approx(m * layers * (rs - qkv), rel=1e-9)
    workers = training_spec({"global_batch": m})
    assert estimate_time(Layout(tp=t, sp=True), model=MODEL, cluster=NODE, training=workers).breakdown[
        "tp_comm"] == tp_comm("m0", False)
    # with sp: 2 of each layer's 8 halves hidden at most (here fc1's whole and qkv's GEMM-long share)
    assert tp_comm("megatron", True) > 0.75 * tp_comm("m0", False) > tp_comm("megatron", False)


def test_megatrons_distributed_optimizer_holds_6_plus_12_over_d_bytes():
    # Megatron-LM docs/.../dist_optimizer.md: bf16 parameters, fp32 gradients: 6 + 12/d bytes per parameter
    # (the workers' ZeRO-1 with m > 1 holds 6 + 16/d: an fp32 gradient shard beside the unsharded buffer).
    training = training_spec({"global_batch": 64, "stack": "megatron"})
    layout = Layout(tp=1, dp=8, zero=1, mbs=1)  # m = 8
    mem = estimate_memory(layout, model=MODEL, cluster=NODE, training=training)
    n = MODEL.params
    assert mem.params + mem.grads + mem.optimizer + mem.buffers == pytest.approx(n * (6 + 12 / 8), rel=1e-6)
    workers = estimate_memory(layout, model=MODEL, cluster=NODE, training=training_spec({"global_batch": 64}))
    assert workers.params + workers.grads + workers.optimizer + workers.buffers == pytest.approx(
        n * (6 + 16 / 8), rel=1e-6)


def test_torchtitan_holds_unsharded_gradients_under_pipelining_only():
    # torch.distributed.pipelining defers every FSDP sync to the step's end: ZeRO-2 holds the stage's
    # unsharded fp32 gradients (the workers' stage reduce-scatters each micro-batch's); without a
    # pipeline torchtitan syncs each micro-batch and holds only the shard.
    titan = training_spec({"global_batch": 64, "stack": "torchtitan"})
    workers = training_spec({"global_batch": 64})
    kw = dict(model=MODEL, cluster=NODE)
    piped = Layout(pp=2, dp=4, zero=2, mbs=1)
    gap = (estimate_memory(piped, training=titan, **kw).buffers - estimate_memory(piped, training=workers, **kw).buffers)
    stage = estimate_memory(piped, training=workers, **kw).params * 4  # fp32 master shard x 4 ranks: the stage
    assert gap == pytest.approx(stage, rel=1e-3)
    flat = Layout(dp=8, zero=2, mbs=1)
    states = [(m.params, m.grads, m.optimizer, m.buffers)
              for m in (estimate_memory(flat, training=t, **kw) for t in (titan, workers))]
    assert states[0] == states[1]


def test_plan_under_a_stack_equals_its_per_layout_estimators():
    # The plan's array path reads the stack through the same prepared meshes as estimate_memory/time.
    model, cluster = model_spec("small"), cluster_spec({"preset": "h100-sxm", "nodes": 2})
    for stack in ("megatron", "torchtitan"):
        training = training_spec({"global_batch": 32, "stack": stack})
        p = plan(problem=Problem(model=model, cluster=cluster, training=training))
        assert len(p.entries) > 100
        for e in list(p.entries[::97]) + list(p.infeasible[::13]):
            kw = dict(model=model, cluster=cluster, training=training)
            assert e.memory == estimate_memory(e.layout, **kw)
            assert e.time == estimate_time(e.layout, placement=e.placement, **kw)
    assert _costed_groups  # the plan's grouped path is the one under test


def test_megatron_ranks_layouts_otherwise_than_the_workers():
    # llama3-8b on 8 H100s: the workers' eager kernels keep ~2x the activations, so Megatron fits layouts
    # without recompute that the workers must checkpoint; the two stacks' plans differ in their winners.
    training = {"global_batch_tokens": 2**20}
    ours = plan(problem=Problem(model=MODEL, cluster=NODE,
                                training=training_spec(training, seq_len=MODEL.seq_len)))
    theirs = plan(problem=Problem(model=MODEL, cluster=NODE,
                                  training=training_spec({**training, "stack": "megatron"}, seq_len=MODEL.seq_len)))
    assert len(theirs.entries) > len(ours.entries)
    assert theirs.best.layout != ours.best.layout and theirs.best.time.mfu > ours.best.time.mfu


@pytest.mark.parametrize("name", ["megatron-145b-1536-a100", "megatron-530b-2520-a100", "megatron-1t-3072-a100"])
def test_plan_of_megatrons_published_runs_reproduces_them(name, capsys):
    """`meshtune plan --reference NAME --stack megatron`, nothing else set: the plan's best layout on
    the published mesh within 10% of Narayanan et al. 2021's Table 1, that mesh in the top 1%."""
    from api.cli import main

    assert main(["plan", "--reference", name, "--stack", "megatron", "--top", "1", "--json"]) == 0
    published = __import__("json").loads(capsys.readouterr().out)["published"]
    assert abs(published["predicted"] / published["reported"] - 1) <= 0.10
    assert abs(published["mesh_best_predicted"] / published["reported"] - 1) <= 0.10
    assert published["mesh_rank"] <= 0.01 * published["feasible"], published


def test_a_published_layout_another_stack_cannot_run_is_said_and_its_mesh_still_compared(capsys):
    # Llama 3's embedding-only first and loss-only last pipeline chunks: Megatron runs them, meshtune's
    # workers give every stage a decoder layer.
    from api.cli import main

    assert main(["plan", "--reference", "llama3-405b-8k-h100", "--stack", "meshtune", "--top", "1", "--json"]) == 0
    published = __import__("json").loads(capsys.readouterr().out)["published"]
    assert published["refused"] == "pp*vpp=128 stages exceed layers=126 (stack meshtune)"
    assert published["predicted"] is None and published["mesh_rank"] >= 1
    assert main(["plan", "--reference", "llama3-405b-8k-h100", "--stack", "meshtune", "--top", "1"]) == 0
    assert "the published layout does not run here: pp*vpp=128 stages exceed layers=126" in capsys.readouterr().out


def test_plan_reference_refusals_are_one_line(capsys):
    from api.cli import main

    assert main(["plan", "--reference", "gpt-4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--reference='gpt-4' is not a published run meshtune knows (known: bloom-176b-384-a100," in err
    assert len(err.splitlines()) == 1
