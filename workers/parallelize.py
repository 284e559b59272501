"""Apply a Layout to the Transformer: one DeviceMesh, then pp -> tp/sp -> ep -> ac -> dp -> cp.

``parallelize_model`` is the one place where the parallelisms are composed, in a fixed, commented
order (torchtitan's ``parallelize_llama`` is the model): ZeRO-0..3 on FSDP2 and ``replicate``, the
pipeline stages, vocab-parallel loss under TP, full or selective activation checkpointing, kv heads
kept whole when tp > kv_heads, gradients averaged over the data group. It realises what
tuner/_realise.py's ``Realisation`` says and asserts the parts it can see; another workload's
``WorkloadModel`` takes the same steps with its own TP plan. How each ZeRO level and each part is
realised: docs/workers.md, "Parallelisation".
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from tuner import AXES, ClusterSpec, Layout, ModelSpec, Realisation, check_supported, partition_stages, place
from workers._cp import apply_context_parallel
from workers._data_parallel import ExpertGradScale, apply_fsdp
from workers._ep import SumGradOverGroup, apply_expert_parallel, apply_expert_tensor_parallel
from workers.model import MoE, Transformer

# --- 1. mesh -------------------------------------------------------------------------------------


def mesh_axes(layout: Layout, cluster: ClusterSpec) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Mesh dim names (outermost first) and sizes from the tuner's placement; every axis present."""
    # Whether TP may cross nodes is the launcher's check (check_layout, the request's
    # allow_tp_across_nodes); the mesh order is the same either way.
    placed = place(layout, cluster, allow_tp_across_nodes=True)
    names, shape = tuple(placed.mesh_dim_names), tuple(placed.mesh_shape)
    missing = [a for a in AXES if a not in names]  # size-1 axes may be left out by the placement
    names += tuple(missing)
    shape += tuple(1 for _ in missing)
    assert sorted(names) == sorted(AXES), names
    return names, shape


def build_mesh(layout: Layout, cluster: ClusterSpec, device_type: str) -> DeviceMesh:
    names, shape = mesh_axes(layout, cluster)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def submesh(mesh: DeviceMesh, axes: Iterable[str]) -> DeviceMesh:
    """The (flattened, if several) sub-mesh of ``axes``, taken in the mesh's own order."""
    order = mesh.mesh_dim_names or ()
    names = tuple(a for a in order if a in set(axes))
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[names]._flatten("_".join(names))


def coordinate(mesh: DeviceMesh, axis: str) -> int:
    coords = mesh.get_coordinate()
    assert coords is not None and mesh.mesh_dim_names is not None
    return coords[mesh.mesh_dim_names.index(axis)]


# --- 2. pipeline split ---------------------------------------------------------------------------


def layers_per_stage(spec: ModelSpec, stages: int) -> list[int]:
    """Layers of each pipeline stage from the tuner's compute-balanced partitioner (uneven allowed)."""
    counts = list(partition_stages(spec, stages).layers_per_stage)
    assert sum(counts) == spec.layers and len(counts) == stages, counts
    return counts


def split_stages(model: Transformer, counts: list[int], pp: int, pp_rank: int) -> list[tuple[int, Transformer]]:
    """This rank's (stage index, model chunk) pairs: stage s lives on pp rank s % pp.

    Each chunk keeps its own layers (global keys kept), the embedding only on stage 0 and the final
    norm and head only on the last stage. Tied embeddings become two copies (first and last stage),
    whose gradients are not summed: a pipelined tied model trains as untied (costs are the same).
    """
    stages = len(counts)
    bounds = [sum(counts[:s]) for s in range(stages + 1)]
    mine = [s for s in range(stages) if s % pp == pp_rank]
    chunks = []
    for s in mine:
        chunk = model if len(mine) == 1 else copy.deepcopy(model)
        for key in list(chunk.layers.keys()):
            if not bounds[s] <= int(key) < bounds[s + 1]:
                del chunk.layers[key]
        if s != 0:
            chunk.tok_embeddings = None
        if s != stages - 1:
            chunk.norm = None
            chunk.output = None
        chunks.append((s, chunk))
    return chunks


# --- 3. tensor + sequence parallel ---------------------------------------------------------------


class ReplicatedKV(nn.Module):
    """A k or v projection when tp > kv_heads (tp % kv_heads == 0): the weight stays whole on every tp
    rank, each rank computes all kv heads and keeps the one its query heads use (head
    ``tp_rank // (tp / kv_heads)``, as ``repeat_interleave`` pairs them on one device). The
    projection's output gradient is summed over the tp group before the matmul's backward, so every
    rank gets the full weight gradient (identical replicas) and a complete, replicated input
    gradient."""

    def __init__(self, linear: nn.Linear, *, head_dim: int, kv_heads: int, tp_mesh: DeviceMesh) -> None:
        super().__init__()
        self.linear = linear
        self.head_dim, self.kv_heads = head_dim, kv_heads
        self.head = tp_mesh.get_local_rank() // (tp_mesh.size() // kv_heads)
        self.group = tp_mesh.get_group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, DTensor):  # sequence parallel hands attention a replicated DTensor
            x = x.to_local()
        out = SumGradOverGroup.apply(self.linear(x), self.group)
        return out.unflatten(-1, (self.kv_heads, self.head_dim))[..., self.head, :]


def block_tp_plan(sp: bool, mlp_has_w3: bool, *, shard_kv: bool = True, moe: bool = False,
                  qk_norm: bool = False, sandwich: bool = False, shared_expert: bool = False) -> dict[str, object]:
    """Megatron-style plan of one block (Shoeybi et al. 2019, Sec. 3; SP: Korthikanti et al. 2022).
    ``shard_kv=False`` (tp > kv_heads) leaves wk/wv to ``ReplicatedKV``; ``moe``: the experts are
    split by ``workers._ep.apply_expert_tensor_parallel`` and the MoE sees (and, under sp, hands
    back as a sequence shard) the whole sequence as a plain tensor. Published shapes:
    ``qk_norm``: the per-head q/k norms see this rank's heads as a Shard(2) (head-dim) DTensor, so
    their replicated weights' gradients are summed over tp (as SP's norms over the sequence);
    ``sandwich``: the post-sub-layer norms follow the residual stream's layout (a sequence shard
    under sp); ``shared_expert``: a dense MLP split as the dense one (not under sp: the tuner refuses)."""
    seq = Shard(1) if sp else Replicate()
    plan: dict[str, object] = {
        "attention.wq": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=seq),
    }
    if not moe:
        plan["feed_forward.w1"] = ColwiseParallel()
        plan["feed_forward.w2"] = RowwiseParallel(output_layouts=seq)
        if mlp_has_w3:
            plan["feed_forward.w3"] = ColwiseParallel()
    if shard_kv:
        plan["attention.wk"] = ColwiseParallel()
        plan["attention.wv"] = ColwiseParallel()
    if qk_norm:
        plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if sandwich and sp:
        plan["post_attention_norm"] = SequenceParallel(use_local_output=True)
        plan["post_ffn_norm"] = SequenceParallel(use_local_output=True)
    if shared_expert:
        plan["shared_expert.w1"] = ColwiseParallel()
        plan["shared_expert.w3"] = ColwiseParallel()
        plan["shared_expert.w2"] = RowwiseParallel(output_layouts=seq)
    if sp:
        plan.update({
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
                output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True,
            ) if moe else PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        })
    return plan


def apply_root_tp(model: nn.Module, tp_mesh: DeviceMesh, *, sp: bool) -> None:
    """Embedding, final norm and head of a chunk (the built-in model's and any workload's)."""
    seq = Shard(1) if sp else Replicate()
    root: dict[str, object] = {}
    if model.tok_embeddings is not None:
        root["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None and sp:
        root["norm"] = SequenceParallel()
    if model.output is not None:  # logits stay vocab-sharded (V/tp per rank): VocabParallelCrossEntropy
        root["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=True)
    tied = model.tok_embeddings is not None and model.output is not None and (
        model.output.weight is model.tok_embeddings.weight
    )
    parallelize_module(model, tp_mesh, root)
    if tied:  # both shard the vocab dim: re-tie the embedding's DTensor into the head
        model.output.weight = model.tok_embeddings.weight


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, *, sp: bool) -> None:
    apply_root_tp(model, tp_mesh, sp=sp)
    kv_heads, tp = model.spec.kv_heads, tp_mesh.size()
    for block in model.layers.values():
        moe = isinstance(block.feed_forward, MoE)  # a MoE model's dense_layers are dense blocks
        parallelize_module(block, tp_mesh, block_tp_plan(sp, not moe and block.feed_forward.w3 is not None,
                                                          shard_kv=kv_heads % tp == 0, moe=moe,
                                                          qk_norm=block.attention.q_norm is not None,
                                                          sandwich=block.post_ffn_norm is not None,
                                                          shared_expert=block.shared_expert is not None))
        if kv_heads % tp:
            attn = block.attention
            for name in ("wk", "wv"):
                setattr(attn, name, ReplicatedKV(getattr(attn, name), head_dim=model.spec.head_dim,
                                                 kv_heads=kv_heads, tp_mesh=tp_mesh))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in fp32 (logits may be bf16)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class VocabParallelCrossEntropy:
    """The loss over vocab-sharded logits (this tp rank's V/tp columns, a plain tensor, so that the
    pipeline schedule only ever sees plain tensors): torch's ``loss_parallel`` computes the softmax's
    max and sum over the tp group and never gathers the V-wide logits (Megatron's vocab-parallel
    cross-entropy, Shoeybi et al. 2019, Sec. 3). Forward AND backward must run inside
    ``loss_parallel()`` (``Parallelized.loss_context``)."""

    def __init__(self, tp_mesh: DeviceMesh) -> None:
        self.mesh = tp_mesh

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        assert not isinstance(logits, DTensor), "the output projection hands back its local vocab shard"
        sharded = DTensor.from_local(logits.flatten(0, 1).float(), self.mesh, [Shard(1)], run_check=False)
        return F.cross_entropy(sharded, targets.flatten()).to_local()


# --- 4. activation checkpointing -----------------------------------------------------------------


def apply_ac(model: Transformer, mode: str) -> None:
    if mode == "none":
        return
    for key, block in list(model.layers.items()):
        if mode == "full":
            model.layers[key] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        else:  # "selective": the attention sub-layer only (see the module docstring)
            name = getattr(model, "selective_ac", None) or "attention"  # a workload names its own
            setattr(block, name, checkpoint_wrapper(getattr(block, name), checkpoint_impl=CheckpointImpl.NO_REENTRANT))


# --- 5. data parallel: workers/_data_parallel.py ---------------------------------------------

# --- the composition -----------------------------------------------------------------------------


@dataclass
class Parallelized:
    """This rank's share of the model after ``parallelize_model``."""

    chunks: list[tuple[int, Transformer]]  # (pipeline stage index, module); one (0, model) when pp == 1
    # Called after the last backward of a step: the expert-gradient scale (ep > 1 with a data axis).
    grad_sync: Callable[[], None] | None
    fsdp: bool  # FSDP2 or its replicate wraps the chunks (there is a data axis)
    notes: list[str]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy
    tp_loss: bool = False  # VocabParallelCrossEntropy: run forward+backward in loss_context()

    def loss_context(self):
        return loss_parallel() if self.tp_loss else contextlib.nullcontext()


def parallelize_model(
    model: Transformer, mesh: DeviceMesh, layout: Layout, *, param_dtype: torch.dtype,
    realisation: Realisation | None = None,
) -> Parallelized:
    """Apply ``layout`` to ``model`` (built identically on every rank) in a fixed order; with the
    tuner's ``realisation`` of it, assert that what was built is what it says."""
    spec = model.spec
    notes: list[str] = []
    # The tuner's rule (tuner/_realise.py), not a copy of it; a workload's declared capabilities too.
    check_supported(layout, spec, getattr(model, "capabilities", None))

    # 2. Pipeline split: keep only this rank's stages (stage s on pp rank s % pp).
    if layout.pp > 1:
        counts = layers_per_stage(spec, layout.stages)
        chunks = split_stages(model, counts, layout.pp, coordinate(mesh, "pp"))
        if spec.tied_embeddings:
            notes.append("tied embeddings are untied across pipeline stages (two copies)")
    else:
        chunks = [(0, model)]

    for _, chunk in chunks:
        # 3. Tensor parallel (+ sequence parallel): shard projections, keep norms sequence-sharded.
        if layout.tp > 1 and not isinstance(chunk, Transformer):  # a workload's plan (workers/workload.py)
            chunk.apply_tensor_parallel(mesh["tp"], sp=layout.sp)
        elif layout.tp > 1:
            apply_tp(chunk, mesh["tp"], sp=layout.sp)
        # 7 (applied here). Expert parallel: it re-shapes the expert weights, so it must come before
        # FSDP wraps them (torchtitan applies EP together with TP for the same reason).
        if layout.ep > 1:
            apply_expert_parallel(chunk, mesh["ep"])
        if layout.tp > 1 and spec.is_moe:  # after EP: it wraps the all-to-all (workers/_ep.py)
            apply_expert_tensor_parallel(chunk, mesh["tp"])
        # 4. Activation checkpointing, per block.
        apply_ac(chunk, layout.ac)

    # 5. Data parallel over dp*cp*ep (dense) and dp*cp (experts), one rule for every chunk: FSDP2
    # for ZeRO-1/2/3, FSDP's replicate for ZeRO-0 (tuner/_realise.py says what each holds).
    data_axes = [a for a in ("dp", "cp", "ep") if getattr(layout, a) > 1]
    expert_axes = [a for a in ("dp", "cp") if getattr(layout, a) > 1]
    grad_sync = None
    fsdp = bool(data_axes)
    if data_axes:
        dense_mesh = submesh(mesh, data_axes)
        # Experts without data replicas (ep > 1, dp*cp = 1): FSDP over the size-1 dp mesh holds them
        # unsharded and reduces nothing, so every ZeRO level runs (tuner/_realise.py, decision 2).
        expert_mesh = dense_mesh if layout.ep == 1 else submesh(mesh, expert_axes or ["dp"])
        for _, chunk in chunks:
            apply_fsdp(chunk, dense_mesh, expert_mesh, zero=layout.zero, param_dtype=param_dtype)
        if layout.ep > 1:
            grad_sync = ExpertGradScale.for_modules([c for _, c in chunks], 1.0 / layout.ep)

    # 6. Context parallel: swap the attention kernel for one that sees the whole sequence's K/V.
    if layout.cp > 1:
        for _, chunk in chunks:
            apply_context_parallel(chunk, mesh["cp"])
    par = Parallelized(chunks=chunks, grad_sync=grad_sync, fsdp=fsdp, notes=notes)
    if getattr(model, "loss", None) is not None:  # a workload's own loss (never under tp: its contract)
        par.loss_fn = model.loss
    if layout.tp > 1:
        par.loss_fn, par.tp_loss = VocabParallelCrossEntropy(mesh["tp"]), True
    if realisation is not None:
        _assert_realised(par, realisation, data_meshes=(dense_mesh, expert_mesh) if data_axes else None)
    return par


def _assert_realised(par: Parallelized, r: Realisation, *, data_meshes) -> None:
    """Invariants: the built model is the tuner's Realisation where that is cheap to see."""
    assert par.fsdp == (r.data_parallel != "none"), (par.fsdp, r.data_parallel)
    if data_meshes is not None:
        dense_mesh, expert_mesh = data_meshes
        assert dense_mesh.size() == r.dense.reduce_group, (dense_mesh.size(), r.dense)
        assert r.experts is None or expert_mesh.size() == r.experts.reduce_group, (expert_mesh.size(), r.experts)
    for _, chunk in par.chunks:
        for p in chunk.parameters():  # fp32 master weights, so fp32 gradients (FSDP reduces in fp32)
            assert p.dtype == torch.float32 and r.dense.grad_bytes == 4, p.dtype
        if chunk.output is not None:
            w = chunk.output.weight
            names = (w.device_mesh.mesh_dim_names or ()) if isinstance(w, DTensor) else ()
            sharded = "tp" in names and w.placements[names.index("tp")] == Shard(0)  # vocab rows over tp
            assert sharded == r.logits_sharded and par.tp_loss == r.logits_sharded, (w.placements, r.logits_sharded)
        for m in chunk.modules():
            if hasattr(m, "attn_fn"):
                assert (type(m.attn_fn).__name__ == "ContextParallelAttention") == (r.cp_kv == "kv_heads")
