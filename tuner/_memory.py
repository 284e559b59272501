"""Memory per device of a layout: model states as the workers hold them, activations per schedule,
overhead.

What a layout holds (shardings, dtypes, gathered copies, gradients kept between micro-batches,
vocab-sharded logits, CP's K/V) is read from its Realisation (tuner/_realise.py, the description
the workers assert); the formulas are in tuner/_formulas.py; this module composes them. Every pp
rank holds different things (the first the embedding and the most micro-batches in flight, the
last the output head and the logits), so each rank is costed and the costliest one reported. All
results are bytes; tests/workers/test_memory_harness.py compares each part with the workers' tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from tuner._errors import LayoutError, SpecError
from tuner._formulas import (
    cross_entropy_logits_bytes,
    layer_activation_bytes,
    microbatches_in_flight,
)
from tuner._layout import Layout, microbatches
from tuner._partition import partition_stages
from tuner._realise import Holding, Realisation, holding, realise
from tuner._specs import ClusterSpec, GiB, ModelSpec, TrainingSpec
from tuner._stack import stack_of

__all__ = ["MEMORY_HEADROOM", "OVERHEAD_BYTES", "MeshMemory", "MemoryEstimate", "estimate_memory",
           "layer_activation_bytes", "logits_bytes", "mesh_memory", "rank_params", "state_bytes", "usable_memory"]

MiB = 2**20

# Framework allowance per device, beyond what the model's tensors need. CUDA: context and kernels
# (~0.5-1 GiB), NCCL communicator buffers, cuBLAS/cuDNN workspaces and allocator slack. CPU: the
# Python interpreter plus torch libraries, which the CPU peak (VmHWM) includes (~360 MB measured per
# idle Ray rank actor with torch imported, on torch 2.13.0+cpu / Ray 2.60).
OVERHEAD_BYTES = {"cuda": 2 * GiB, "cpu": 384 * MiB}

# The one headroom rule of the plan and of sweeps. A layout *fits* when its predicted peak is at most
# the device's memory (the plan keeps it, a sweep does not prune it); it is *tight* when it fits but
# leaves less than MEMORY_HEADROOM of the device free: a measured peak moves by about 1% between runs
# of one layout (allocator rounding and fragmentation; api.engine._surrogate.MEMORY_NOISE), so such a
# layout may run out of memory even where the model is exact. The plan ranks tight layouts after every
# layout with room and says so; a sweep's warm start takes them last (api/engine/_model.py). Tight is
# not infeasible: Llama 3 405B's published 8K layout (tuner/_references.py) is predicted at 99.6%.
MEMORY_HEADROOM = 0.01


def usable_memory(device_memory: int | np.ndarray) -> int | np.ndarray:
    """Bytes of a device a layout's predicted peak may fill and still leave ``MEMORY_HEADROOM`` free
    (elementwise for arrays, as ``fits_device``)."""
    usable = np.floor(np.asarray(device_memory) * (1.0 - MEMORY_HEADROOM))
    return usable if isinstance(device_memory, np.ndarray) else int(usable)


def logits_bytes(s: int, b: int, h: int, vocab: int, t: int, sp: bool, elt: int, *, sharded: bool = True,
                 eager_norm: bool = False) -> float:
    """Last stage per micro-batch: fp32 cross-entropy logits 4sbv/t (Korthikanti et al. 2022 Sec. 4.3),
    the low-precision logits when training in bf16, and the final norm's and the head's inputs
    (plus, ``eager_norm``, torch's composite RMSNorm's normalised input and fp32 reciprocal RMS).
    ``sharded=False``: the head gathers the whole vocabulary to every tp rank (no loss parallel)."""
    sb = s * b
    norm = (elt * sb * h + 4 * sb) / (t if sp else 1) if eager_norm else 0.0
    return (cross_entropy_logits_bytes(sb, vocab // t if sharded else vocab, elt)
            + elt * 2 * sb * h / (t if sp else 1) + norm)


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted peak bytes per device on the costliest pp rank (``stage``)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    overhead: int
    total: int
    stage: int
    device_memory: int
    # FSDP's all-gather buffers (ZeRO-3: the current and the prefetched unit's unsharded weights and
    # one unit's unsharded gradients), apart from the model states params/grads/optimizer, which are
    # Rajbhandari et al.'s Fig. 1 accounting.
    buffers: int = 0

    @property
    def fits(self) -> bool:
        return fits_device(self.total, self.device_memory)

    @property
    def tight(self) -> bool:
        """Fits, but leaves less than ``MEMORY_HEADROOM`` of the device free."""
        return self.fits and self.total > usable_memory(self.device_memory)

    def to_dict(self) -> dict[str, int | bool]:
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "buffers": self.buffers,
            "overhead": self.overhead,
            "total": self.total,
            "stage": self.stage,
            "fits": self.fits,
            "tight": self.tight,
        }


def fits_device(total: int | np.ndarray, device_memory: int | np.ndarray) -> bool | np.ndarray:
    """Whether a predicted peak of ``total`` bytes (overhead included) fits a device of
    ``device_memory`` bytes; elementwise for arrays (``plan`` judges every layout at once)."""
    return total <= device_memory


class MemoryParts(NamedTuple):
    """Bytes per device of the costliest candidate rank, by part (``total`` without the overhead)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    total: float
    stage: int
    buffers: float


@dataclass(frozen=True)
class RankParams:
    """Parameter counts one device of each pp rank holds, before ZeRO sharding."""

    dense: tuple[float, ...]  # sharded by tp only (replicated over dp*ep*cp)
    expert: tuple[float, ...]  # sharded by tp*ep (replicated over dp*cp)
    layers: tuple[int, ...]
    layer_dense: float  # one layer's dense weights on one device (ZeRO-3 gather buffer)
    layer_expert: float
    embedding: float = 0.0  # the (vocab-parallel) embedding's share on one device of rank 0


@lru_cache(maxsize=8192)
def rank_params(model: ModelSpec, tp: int, ep: int, pp: int, vpp: int, end_stages: bool = False) -> RankParams:
    """Per pp rank: layers held (stage s on rank s % pp; ``end_stages``: the stack's partition may
    leave the ends without a decoder layer, tuner/_partition.py) and parameter counts per device."""
    layers = (partition_stages(model, pp * vpp, end_stages=end_stages).rank_layers(pp) if pp > 1
              else (model.layers,))
    # Per layer, the mean over the layers where dense_layers mixes dense and MoE MLPs.
    expert = model.routed_expert_params_per_layer / (tp * ep)
    qk_norm = model.qk_norm_params_per_layer  # per-head norm weights: whole on every tp rank
    attention = (model.attention_params_per_layer - qk_norm) / tp + qk_norm
    if tp > model.kv_heads:  # wk/wv (+ biases) stay whole on every tp rank (workers/parallelize.py ReplicatedKV)
        kv = 2 * (model.hidden + (1 if model.qkv_bias else 0)) * model.kv_heads * model.head_dim
        attention += kv * (1 - 1 / tp)
    moe_share = model.moe_layers / model.layers
    # Router (+ shared-expert gate) replicated over tp; the shared expert and dense MLPs split by tp.
    mlp = (moe_share * (model.router_params + model.shared_expert_params / tp)
           + (1 - moe_share) * model.dense_mlp_params / tp)
    dense = attention + model.norm_params_per_layer + mlp
    emb = model.embedding_params / tp  # vocab-parallel embedding (Shoeybi et al. 2019 Sec. 3)
    dense_r = [n * dense for n in layers]
    dense_r[0] += emb
    # The last stage holds the final norm and the head; a tied head is a copy when it is on another
    # rank than the embedding (Megatron keeps both and all-reduces their gradients).
    dense_r[-1] += model.hidden + (emb if (not model.tied_embeddings or pp > 1) else 0)
    return RankParams(tuple(dense_r), tuple(n * expert for n in layers), layers, dense, expert, emb)


def candidate_ranks(rp: RankParams) -> tuple[int, ...]:
    """The pp ranks that can be the costliest: first, last, and among the middle ranks the first one
    of each layer count (in-flight micro-batches never grow with the rank, Narayanan et al. 2021)."""
    pp = len(rp.layers)
    out = {0, pp - 1}
    seen: set[int] = set()
    for r in range(1, pp - 1):
        if rp.layers[r] not in seen:
            seen.add(rp.layers[r])
            out.add(r)
    return tuple(sorted(out))


def state_bytes(real: Realisation | Holding, dense: float, expert: float, layer_w: float,
                embedding: float = 0.0) -> tuple[float, float, float, float]:
    """(params, grads, optimizer, buffers) bytes of one device holding ``dense`` and ``expert``
    parameters, as ``real`` (tuner/_realise.py) says the workers hold them.

    params, grads, optimizer: the tensors at rest, sharded over their StateSharding groups (ZeRO,
    Rajbhandari et al. 2020 Sec. 5): the master weights, the gradients the optimizer steps on, AdamW's
    state. buffers: what exists beside them while a step runs: FSDP's compute copies of the weights
    (ZeRO-1/2: the whole stage from forward to the last backward; ZeRO-3: ``fsdp_buffer_units``
    units plus one unit's unsharded gradients), full-size gradients held between micro-batches,
    and autocast's cached low-precision weight copies.
    ``embedding``: this device's embedding share; without a data-parallel wrapper its gradient is the
    whole table on every tp rank (DTensor's embedding backward leaves it Replicate; measured by the
    harness, tp=4 on tiny: 12,288 more fp32 gradient elements than parameters).
    """
    ds, es = real.dense, real.experts
    params = dense * ds.weight_bytes / ds.weights
    grads = dense * ds.grad_bytes / ds.grads
    opt = dense * ds.optimizer_bytes / ds.optimizer
    sharded_w = dense if ds.weights > 1 else 0.0
    sharded_g = dense if ds.grads > 1 else 0.0
    if es is not None and expert:
        params += expert * es.weight_bytes / es.weights
        grads += expert * es.grad_bytes / es.grads
        opt += expert * es.optimizer_bytes / es.optimizer
        sharded_w += expert if es.weights > 1 else 0.0
        sharded_g += expert if es.grads > 1 else 0.0
    if real.data_parallel == "none" and real.tp > 1:
        grads += embedding * (real.tp - 1) * ds.grad_bytes
    cb = real.compute_bytes
    buffers = 0.0
    if real.gathered == "stage":  # FSDP's gathered weights; replicate's one bf16 copy of every weight
        buffers += (sharded_w if real.data_parallel == "fsdp" else dense + expert) * cb
    elif real.gathered == "unit":
        buffers += (real.fsdp_buffer_units + 1) * layer_w * cb
    if real.grads_held_unsharded:
        buffers += sharded_g * real.unsharded_grad_bytes
    if real.autocast_weight_copies:
        buffers += (dense + expert) * cb
    return params, grads, opt, buffers


class ActRow(list):
    """Activation bytes on each candidate rank, with the micro-batches per step they were costed for
    (the model states depend on it: ZeRO-1 holds full gradients between micro-batches)."""

    m: int


Num = float | np.ndarray  # the composing formulas below take numbers or numpy arrays alike


def rank_activation_bytes(per_layer: Num, working: Num, logits: Num, mbs: Num, inflight: Num, layers: Num,
                          layer_const: Num, rope: Num) -> Num:
    """Activation bytes of one pp rank at its peak: per-layer activations (Korthikanti et al. 2022
    Sec. 4) of ``mbs`` sequences times its ``inflight`` layer-micro-batches (Narayanan et al. 2021
    Sec. 2.2), one layer's recompute ``working`` set, the ``logits`` it keeps (the last rank's only),
    ``layer_const`` bytes per layer-micro-batch and RoPE tables of ``rope`` bytes per chunk forward,
    ``inflight / layers`` of them (``layers`` >= 1: a rank holding no decoder layer, only an end stage,
    passes 1 and has no layer-micro-batch in flight, so no RoPE table). ``MeshMemory`` says what
    each one is; ``plan`` passes arrays to cost every layout of a problem at once."""
    return mbs * (per_layer * inflight + working + logits) + layer_const * inflight + rope * (inflight / layers)


def rank_peak_bytes(params: Num, grads: Num, optimizer: Num, buffers: Num, activations: Num) -> Num:
    """What one rank holds at its peak, without the framework overhead: its model states (Rajbhandari
    et al. 2020 Fig. 1), the buffers beside them and its activations."""
    return params + grads + optimizer + buffers + activations


def _whole(x: Num) -> int | np.ndarray:
    """Whole bytes (truncated), elementwise for arrays."""
    return np.trunc(x) if isinstance(x, np.ndarray) else int(x)


@lru_cache(maxsize=1024)
def activation_table(model: ModelSpec, *, s: int, tp: int, cp: int, ep: int, elt: int, flash: bool, swiglu_saved: int,
                     kv_repeated: bool, logits_sharded: bool, eager_norms: bool,
                     gathered_inputs: bool) -> dict[tuple[str, bool], tuple[float, float, float]]:
    """Per (ac, sp), bytes per sequence of a micro-batch (everything is linear in mbs): one layer's
    activations, the working set its recompute re-materialises, and the last stage's logits, for
    ``s`` local tokens of a sequence (``seq_len / cp``) and the Realisation's choices (``MeshMemory``)."""
    common = dict(s=s, b=1, h=model.hidden, a=model.heads, kv_dim=model.kv_heads * model.head_dim,
                  ffn=model.expert_ffn if model.is_moe else model.ffn, mlp=model.mlp, t=tp, elt=elt,
                  flash=flash, moe_top_k=model.top_k, experts=model.experts, cp=cp, ep=ep,
                  swiglu_saved=swiglu_saved, kv_repeated=kv_repeated, eager_norms=eager_norms,
                  gathered_inputs=gathered_inputs,
                  head_dim=model.head_dim if tp > model.kv_heads else 0, q_dim=model.q_dim,
                  norms=model.norms_per_layer, qk_norm_head_dim=model.head_dim if model.qk_norm else 0,
                  shared_ffn=model.shared_expert_ffn)
    act: dict[tuple[str, bool], tuple[float, float, float]] = {}
    for sp in (False, True):
        logits = logits_bytes(s, 1, model.hidden, model.vocab, tp, sp, elt, sharded=logits_sharded,
                              eager_norm=eager_norms)
        for ac in ("none", "selective", "full"):
            layer = layer_activation_bytes(sp=sp, ac=ac, **common)  # type: ignore[arg-type]
            # Recompute re-materialises, during one layer's backward, what it dropped: the whole
            # layer's activations (full) or its attention sub-layer's (selective).
            dropped = layer_activation_bytes(sp=sp, ac="none", **common) - layer  # type: ignore[arg-type]
            working = {"none": 0.0, "selective": dropped, "full": dropped + layer}[ac]
            act[ac, sp] = (layer, working, logits)
    return act


class MeshMemory:
    """The memory model of one mesh (degrees and vpp) of one problem, prepared so that each layout
    of it (zero, mbs, ac, sp, schedule) costs a few float operations. ``plan`` and
    ``estimate_memory`` share them through ``mesh_memory`` (cached per mesh and problem). What each
    layout holds comes from its Realisation (tuner/_realise.py), not from rules of its own: the
    model states from its ``holding`` (per ZeRO level and micro-batch count), the activations' kernels
    from the mesh's realisation and the training stack (``training.stack``, tuner/_stack.py)."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, *, tp: int, cp: int,
                 ep: int, dp: int, pp: int, vpp: int, overhead: int | None = None) -> None:
        self.model, self.cluster, self.training = model, cluster, training
        self.stack = stack = stack_of(training)
        self.degrees = dict(tp=tp, cp=cp, ep=ep, dp=dp, pp=pp, vpp=vpp)
        self.pp, self.vpp, self.device_memory = pp, vpp, cluster.device_memory
        probed = cluster.probed  # measured on the cluster (tuner/_figures.py): the process's baseline, the allocator's share
        if overhead is None and probed is not None and probed.memory_overhead_bytes is not None:
            overhead = probed.memory_overhead_bytes
        self.overhead = OVERHEAD_BYTES[cluster.device_kind] if overhead is None else overhead
        self.allocator = probed.allocator_overhead or 0.0 if probed is not None else 0.0
        self.rp = rp = rank_params(model, tp, ep, pp, vpp, stack.end_stages)
        self.ranks = candidate_ranks(rp)
        self.layers = [rp.layers[r] for r in self.ranks]
        self.layer_w = rp.layer_dense + rp.layer_expert
        self._states: dict[tuple[int, int], list[tuple[float, float, float, float]]] = {}
        self._rows: dict[int, tuple[Holding, list[tuple[float, float, float, float]]]] = {}
        base = self._realise(0, self._some_mbs(), "none", False, "1f1b")
        elt = base.compute_bytes
        s = model.seq_len // cp
        # The stack's kernels: the attention, SwiGLU, norms and sequence parallelism. Under CP every
        # stack's attention takes the kv_heads-sized K/V it gathered (the Realisation's ``cp_kv``).
        kv_repeated = stack.repeats_kv and cp == 1
        # RoPE's cos/sin tables (fp32, s x head_dim/2 each), computed once per forward of a stage chunk.
        self.rope = 4 * s * model.head_dim
        # Per layer and micro-batch, whatever mbs: on CPU the CP chunk attention's boolean causal mask
        # (workers/_cp.py chunk_mask) becomes an fp32 additive mask that SDPA saves: each of the two
        # chunks' c = s/2 queries against (g+1)c keys, (2cp+1)c keys in all (CUDA: a lower-right bias).
        c = s // 2
        self.layer_const = 4.0 * c * c * (2 * cp + 1) if cp > 1 and cluster.device_kind == "cpu" else 0.0
        # Per sequence of a micro-batch: (per layer, working set, logits), shared by the meshes alike in them.
        self.act = activation_table(model, s=s, tp=tp, cp=cp, ep=ep, elt=elt, flash=stack.flash,
                                    swiglu_saved=stack.swiglu_saved, kv_repeated=kv_repeated,
                                    logits_sharded=base.logits_sharded, eager_norms=not stack.fused_norms,
                                    gathered_inputs=stack.saves_gathered)

    def _some_mbs(self) -> int:
        """A micro-batch size valid for this mesh (the activations' realisation does not depend on it)."""
        return 1 if self.training.global_batch % (self.degrees["dp"] * self.degrees["ep"]) == 0 else 0

    def _realise(self, zero: int, mbs: int, ac: str, sp: bool, schedule: str) -> Realisation:
        d = self.degrees
        layout = Layout(tp=d["tp"], pp=d["pp"], dp=d["dp"], cp=d["cp"], ep=d["ep"], zero=zero, mbs=max(mbs, 1),
                        ac=ac, sp=sp and d["tp"] > 1, vpp=d["vpp"],  # type: ignore[arg-type]
                        schedule="interleaved" if d["vpp"] > 1 else (schedule if d["pp"] > 1 else "1f1b"))
        training = self.training
        if not mbs:  # global_batch does not divide this mesh: realise it as if it did (one micro-batch)
            training = replace(training, global_batch=layout.data_ranks)
        return realise(layout, self.model, self.cluster, training)

    def states(self, zero: int, m: int) -> list[tuple[float, float, float, float]]:
        """Per candidate rank (params, grads, optimizer, buffers) with ``m`` micro-batches per step."""
        key = (zero, m)
        got = self._states.get(key)
        if got is None:
            d = self.degrees
            held = holding(d["tp"], d["cp"], d["ep"], d["dp"], zero, m, self.training.precision,
                           self.cluster.device_kind, self.model.is_moe, self.stack.data_parallel, self.pp > 1)
            # ``holding`` gives one object per distinct holding (cached): rows are kept by its identity,
            # beside the object itself so that the identity stays its own.
            kept = self._rows.get(id(held))
            if kept is None:
                rp = self.rp
                kept = self._rows[id(held)] = (held, [
                    state_bytes(held, rp.dense[r], rp.expert[r], self.layer_w, rp.embedding if r == 0 else 0.0)
                    for r in self.ranks])
            got = self._states[key] = kept[1]
        return got

    def inflight(self, schedule: str, m: int) -> list[float]:
        """Layer-micro-batches in flight on each candidate rank."""
        return [n * microbatches_in_flight(schedule, self.pp, self.vpp, m, r)
                for n, r in zip(self.layers, self.ranks, strict=True)]

    def logits_held(self, schedule: str, m: int) -> list[int]:
        """Micro-batches whose logits each candidate rank keeps: the last rank m under GPipe, else one."""
        n = m if (schedule == "gpipe" and self.pp > 1) else 1
        return [n if r == self.pp - 1 else 0 for r in self.ranks]

    def activations(self, ac: str, sp: bool, mbs: int, schedule: str, m: int) -> ActRow:
        """Activation bytes on each candidate rank."""
        layer, working, logits = self.act[ac, sp]
        lc, rope = self.layer_const, self.rope
        row = ActRow(rank_activation_bytes(layer, working, logits * held, mbs, n, max(nl, 1), lc, rope)
                     for n, nl, held in zip(self.inflight(schedule, m), self.layers, self.logits_held(schedule, m),
                                            strict=True))
        row.m = m
        return row

    def peak(self, zero: int, acts: ActRow) -> MemoryParts:
        """The parts of the costliest candidate rank (the first of the costliest), given its activations."""
        rows = self.states(zero, acts.m)
        best, top = 0, rank_peak_bytes(*rows[0], acts[0])
        for c in range(1, len(acts)):
            t = rank_peak_bytes(*rows[c], acts[c])
            if t > top:
                best, top = c, t
        p, g, o, b = rows[best]
        return MemoryParts(p, g, o, acts[best], top, self.ranks[best], b)

    def estimate(self, zero: int, mbs: int, ac: str, sp: bool, schedule: str, m: int) -> MemoryParts:
        """The parts of the costliest rank."""
        return self.peak(zero, self.activations(ac, sp, mbs, schedule, m))

    @staticmethod
    def whole_bytes(est: MemoryParts, allocator: Num = 0.0) -> int | np.ndarray:
        """What MemoryEstimate.total adds up, without the fixed overhead: whole bytes per part, and
        what the allocator holds beyond them (``allocator``: a probed share of them), elementwise."""
        tensors = (_whole(est.params) + _whole(est.grads) + _whole(est.optimizer) + _whole(est.activations)
                   + _whole(est.buffers))
        return tensors + _whole(allocator * tensors)

    def wrap(self, est: MemoryParts) -> MemoryEstimate:
        p, g, o, a, b = int(est.params), int(est.grads), int(est.optimizer), int(est.activations), int(est.buffers)
        whole = self.whole_bytes(est, self.allocator)
        overhead = self.overhead + whole - (p + g + o + a + b)  # the fixed overhead and the allocator's share
        obj = object.__new__(MemoryEstimate)  # the values are checked by construction; skip __init__
        obj.__dict__.update(params=p, grads=g, optimizer=o, activations=a, buffers=b, overhead=overhead,
                            total=whole + self.overhead, stage=est.stage,
                            device_memory=self.device_memory)
        return obj


@lru_cache(maxsize=4096)
def mesh_memory(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, tp: int, cp: int, ep: int,
                dp: int, pp: int, vpp: int, overhead: int | None = None) -> MeshMemory:
    """The prepared (and shared: never mutate it) memory model of one mesh of one problem."""
    return MeshMemory(model, cluster, training, tp=tp, cp=cp, ep=ep, dp=dp, pp=pp, vpp=vpp, overhead=overhead)


def estimate_memory(
    layout: Layout,
    *,
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    overhead_bytes: int | None = None,
) -> MemoryEstimate:
    """Peak bytes per device of ``layout`` on its costliest pp rank, trained with ``training.stack``
    (tuner/_stack.py: its attention kernel, SwiGLU, norms, sequence parallelism and how its
    data-parallel program holds the model states); ``overhead_bytes`` replaces the framework
    allowance OVERHEAD_BYTES."""
    m = microbatches(layout, training)
    if overhead_bytes is not None and (isinstance(overhead_bytes, bool) or not isinstance(overhead_bytes, int)
                                       or overhead_bytes < 0):
        raise SpecError(f"overhead_bytes must be a non-negative integer, got {overhead_bytes!r}")
    if layout.world_size != cluster.devices:
        raise LayoutError(f"layout world size {layout.world_size} does not equal the device count {cluster.devices}")
    mm = mesh_memory(model, cluster, training, layout.tp, layout.cp, layout.ep, layout.dp, layout.pp, layout.vpp,
                     overhead_bytes)
    return mm.wrap(mm.estimate(layout.zero, layout.mbs, layout.ac, layout.sp, layout.schedule, m))
