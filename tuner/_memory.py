"""Memory per device of a layout: model states under ZeRO, activations per schedule, overhead.

Every pp rank holds different things (the first the embedding and the most micro-batches in flight,
the last the output head and the logits), so each rank is costed and the costliest one reported.
Formulas are short pure functions, each with its source; all results are bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from tuner._errors import LayoutError, SpecError
from tuner._formulas import (
    STATE_BYTES,
    cross_entropy_logits_bytes,
    microbatches_in_flight,
    zero_model_state_bytes,
)
from tuner._layout import Layout, microbatches
from tuner._partition import partition_stages
from tuner._specs import ClusterSpec, GiB, ModelSpec, TrainingSpec

MiB = 2**20

# Framework allowance per device, beyond what the model's tensors need. CUDA: context and kernels
# (~0.5-1 GiB), NCCL communicator buffers, cuBLAS/cuDNN workspaces and allocator slack. CPU: the
# Python interpreter plus torch libraries, which the CPU peak (VmHWM) includes (~360 MB measured per
# idle Ray rank actor with torch imported, on torch 2.13.0+cpu / Ray 2.60).
OVERHEAD_BYTES = {"cuda": 2 * GiB, "cpu": 384 * MiB}

def layer_activation_bytes(
    *,
    s: int,
    b: int,
    h: int,
    a: int,
    kv_dim: int,
    ffn: int,
    mlp: str = "swiglu",
    t: int = 1,
    sp: bool = False,
    ac: str = "none",
    elt: int = 2,
    dropout: bool = False,
    flash: bool = True,
    moe_top_k: int = 0,
    experts: int = 0,
    cp: int = 1,
    swiglu_saved: int = 4,
) -> float:
    """One layer's saved activations for one micro-batch of b sequences of s tokens (this rank's CP
    share), generalising Korthikanti et al. 2022 Sec. 4 to GQA, SwiGLU, MoE, no dropout, flash attention.

    With ``mlp='gelu', ffn=4h, kv_dim=h, dropout, not flash, elt=2`` and ac none or full it is exactly
    their Table 2. meshtune's "selective" is attention-block recompute, not Korthikanti's (which drops
    only the 5as²b scores, nothing under flash attention): the workers (workers/parallelize.py
    ``apply_ac``) checkpoint the whole attention sub-layer, so it keeps only that sub-layer's input
    (and the norm's input before it) and drops Q, K, V, the scores or log-sum-exp and the
    out-projection's input.
    """
    sbh = s * b * h
    if ac == "full":  # only the layer input is kept (Korthikanti Table 2, "full recompute")
        return elt * sbh / (t if sp else 1)
    # Outside the TP region: two norm inputs, attention input, MLP input (+ 1-byte dropout masks).
    outside = elt * 4 * sbh + (2 * sbh if dropout else 0)
    # Inside the TP region (sharded by t): Q, K, V, the attention output fed to the out projection.
    # Under CP the attention keeps the all-gathered K and V of the whole sequence (cp·s tokens),
    # kv_heads-sized: GQA-aware attention never repeats them to the query heads (workers/_cp.py).
    attn = elt * (2 * sbh + 2 * cp * s * b * kv_dim)
    if flash:  # flash attention keeps the fp32 log-sum-exp per query instead of the scores (Dao 2022)
        attn += 4 * a * s * b
    else:  # softmax output (+ dropout mask and output): Korthikanti's 5as²b
        attn += (elt + (3 if dropout else 0)) * a * s * s * b
    if ac == "selective":  # attention-block recompute: all of it is recomputed in the backward
        attn = 0.0
    # MLP: GeLU keeps the up-projection and GeLU outputs (Korthikanti); eager SwiGLU (workers/model.py)
    # keeps four ffn-wide tensors: the gate (silu's input), silu(gate) and the up projection (the
    # product's inputs) and the product (w2's input); a fused one (Megatron's bias_swiglu) three.
    per_token = (swiglu_saved if mlp == "swiglu" else 2) * ffn
    if moe_top_k:  # routed tokens: each of top_k copies keeps its input, expert activations, output
        mlp_bytes = elt * moe_top_k * s * b * (per_token + 2 * h) + 4 * s * b * experts
    else:
        mlp_bytes = elt * s * b * per_token
    inside = attn + mlp_bytes
    return (outside + inside) / t if sp else outside + inside / t


def logits_bytes(s: int, b: int, h: int, vocab: int, t: int, sp: bool, elt: int) -> float:
    """Last stage per micro-batch: fp32 cross-entropy logits 4sbv/t (Korthikanti et al. 2022 Sec. 4.3),
    the low-precision logits when training in bf16, and the final norm's and the head's inputs."""
    return cross_entropy_logits_bytes(s * b, vocab // t, elt) + elt * 2 * s * b * h / (t if sp else 1)


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
        return self.total <= self.device_memory

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
        }


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


@lru_cache(maxsize=8192)
def rank_params(model: ModelSpec, tp: int, ep: int, pp: int, vpp: int) -> RankParams:
    """Per pp rank: layers held (stage s on rank s % pp) and parameter counts per device."""
    layers = partition_stages(model, pp * vpp).rank_layers(pp) if pp > 1 else (model.layers,)
    mats = 3 if model.mlp == "swiglu" else 2
    expert = model.experts * mats * model.hidden * model.expert_ffn / (tp * ep) if model.is_moe else 0.0
    dense = (
        model.attention_params_per_layer / tp
        + 2 * model.hidden
        + (model.hidden * model.experts if model.is_moe else model.mlp_params_per_layer / tp)
    )
    emb = model.embedding_params / tp  # vocab-parallel embedding (Shoeybi et al. 2019 Sec. 3)
    dense_r = [n * dense for n in layers]
    dense_r[0] += emb
    # The last stage holds the final norm and the head; a tied head is a copy when it is on another
    # rank than the embedding (Megatron keeps both and all-reduces their gradients).
    dense_r[-1] += model.hidden + (emb if (not model.tied_embeddings or pp > 1) else 0)
    return RankParams(tuple(dense_r), tuple(n * expert for n in layers), layers, dense, expert)


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


class MeshMemory:
    """The memory model of one mesh (degrees and vpp) of one problem, prepared so that each layout
    of it (zero, mbs, ac, sp, schedule) costs a few float operations. ``plan`` and
    ``estimate_memory`` share them through ``mesh_memory`` (cached per mesh and problem)."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, *, tp: int, cp: int,
                 ep: int, dp: int, pp: int, vpp: int, flash: bool = True, overhead: int | None = None,
                 swiglu_saved: int = 4) -> None:
        self.pp, self.vpp, self.device_memory = pp, vpp, cluster.device_memory
        self.overhead = OVERHEAD_BYTES[cluster.device_kind] if overhead is None else overhead
        rp = rank_params(model, tp, ep, pp, vpp)
        self.ranks = candidate_ranks(rp)
        precision = training.precision
        pbytes, gbytes, _ = STATE_BYTES[precision]
        nd_dense, nd_expert = dp * ep * cp, dp * cp  # ZeRO shards over every rank holding a replica
        # Model states per zero stage and candidate rank: (params, grads, optimizer).
        self.states: list[list[tuple[float, float, float]]] = []
        layer_w = rp.layer_dense + rp.layer_expert
        # FSDP keeps the current and the prefetched layer unsharded, and one layer's gradients (ZeRO-3).
        self.buffers = [2 * pbytes * layer_w + gbytes * layer_w if zero == 3 and nd_dense > 1 else 0.0
                        for zero in range(4)]
        for zero in range(4):
            row = []
            for r in self.ranks:
                d = zero_model_state_bytes(rp.dense[r], nd_dense, zero, precision)
                e = zero_model_state_bytes(rp.expert[r], nd_expert, zero, precision)
                row.append((d[0] + e[0], d[1] + e[1], d[2] + e[2]))
            self.states.append(row)
        self.state_totals = [[sum(x) + self.buffers[z] for x in row] for z, row in enumerate(self.states)]
        self.layers = [rp.layers[r] for r in self.ranks]
        elt = 2 if precision == "bf16" else 4
        s = model.seq_len // cp
        common = dict(s=s, b=1, h=model.hidden, a=model.heads, kv_dim=model.kv_heads * model.head_dim,
                      ffn=model.expert_ffn if model.is_moe else model.ffn, mlp=model.mlp, t=tp, elt=elt,
                      flash=flash, moe_top_k=model.top_k, experts=model.experts, cp=cp,
                      swiglu_saved=swiglu_saved)
        # Per sequence of a micro-batch (everything is linear in mbs): (per layer, working set, logits).
        self.act: dict[tuple[str, bool], tuple[float, float, float]] = {}
        for sp in (False, True):
            logits = logits_bytes(s, 1, model.hidden, model.vocab, tp, sp, elt)
            for ac in ("none", "selective", "full"):
                layer = layer_activation_bytes(sp=sp, ac=ac, **common)  # type: ignore[arg-type]
                # Recompute re-materialises, during one layer's backward, what it dropped: the whole
                # layer's activations (full) or its attention sub-layer's (selective).
                dropped = layer_activation_bytes(sp=sp, ac="none", **common) - layer  # type: ignore[arg-type]
                working = {"none": 0.0, "selective": dropped, "full": dropped + layer}[ac]
                self.act[ac, sp] = (layer, working, logits)

    def inflight(self, schedule: str, m: int) -> list[float]:
        """Layer-micro-batches in flight on each candidate rank."""
        return [n * microbatches_in_flight(schedule, self.pp, self.vpp, m, r)
                for n, r in zip(self.layers, self.ranks, strict=True)]

    def activations(self, ac: str, sp: bool, mbs: int, schedule: str, m: int,
                    inflight: list[float] | None = None) -> list[float]:
        """Activation bytes on each candidate rank."""
        if inflight is None:
            inflight = self.inflight(schedule, m)
        layer, working, logits = self.act[ac, sp]
        # The last rank keeps logits for every micro-batch in flight there: m under GPipe, else one.
        logits *= m if (schedule == "gpipe" and self.pp > 1) else 1
        last = self.pp - 1
        return [mbs * (layer * n + working + (logits if r == last else 0.0))
                for n, r in zip(inflight, self.ranks, strict=True)]

    def peak(self, zero: int, acts: list[float]) -> MemoryParts:
        """The parts of the costliest candidate rank, given its activations."""
        totals = self.state_totals[zero]
        best, top = 0, totals[0] + acts[0]
        for c in range(1, len(acts)):
            t = totals[c] + acts[c]
            if t > top:
                best, top = c, t
        p, g, o = self.states[zero][best]
        return MemoryParts(p, g, o, acts[best], top, self.ranks[best], self.buffers[zero])

    def estimate(self, zero: int, mbs: int, ac: str, sp: bool, schedule: str, m: int) -> MemoryParts:
        """The parts of the costliest rank."""
        return self.peak(zero, self.activations(ac, sp, mbs, schedule, m))

    @staticmethod
    def whole_bytes(est: MemoryParts) -> int:
        """What MemoryEstimate.total adds up, without the overhead: whole bytes per part."""
        return int(est.params) + int(est.grads) + int(est.optimizer) + int(est.activations) + int(est.buffers)

    def wrap(self, est: MemoryParts) -> MemoryEstimate:
        p, g, o, a, b = int(est.params), int(est.grads), int(est.optimizer), int(est.activations), int(est.buffers)
        obj = object.__new__(MemoryEstimate)  # the values are checked by construction; skip __init__
        obj.__dict__.update(params=p, grads=g, optimizer=o, activations=a, buffers=b, overhead=self.overhead,
                            total=p + g + o + a + b + self.overhead, stage=est.stage,
                            device_memory=self.device_memory)
        return obj


@lru_cache(maxsize=4096)
def mesh_memory(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, tp: int, cp: int, ep: int,
                dp: int, pp: int, vpp: int, flash: bool = True, overhead: int | None = None,
                swiglu_saved: int = 4) -> MeshMemory:
    """The prepared (and shared: never mutate it) memory model of one mesh of one problem."""
    return MeshMemory(model, cluster, training, tp=tp, cp=cp, ep=ep, dp=dp, pp=pp, vpp=vpp, flash=flash, swiglu_saved=swiglu_saved,
                      overhead=overhead)


def estimate_memory(
    layout: Layout,
    *,
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    overhead_bytes: int | None = None,
    flash_attention: bool = True,
    fused_swiglu: bool = False,
) -> MemoryEstimate:
    """Peak bytes per device of ``layout`` on its costliest pp rank (``overhead_bytes`` replaces the
    framework allowance OVERHEAD_BYTES; ``flash_attention=False`` keeps the attention scores;
    ``fused_swiglu`` keeps 3 ffn-wide tensors per token instead of eager torch's 4)."""
    m = microbatches(layout, training)
    if overhead_bytes is not None and (isinstance(overhead_bytes, bool) or not isinstance(overhead_bytes, int)
                                       or overhead_bytes < 0):
        raise SpecError(f"overhead_bytes must be a non-negative integer, got {overhead_bytes!r}")
    if layout.world_size != cluster.devices:
        raise LayoutError(f"layout world size {layout.world_size} does not equal the device count {cluster.devices}")
    mm = mesh_memory(model, cluster, training, layout.tp, layout.cp, layout.ep, layout.dp, layout.pp, layout.vpp,
                     flash_attention, overhead_bytes, 3 if fused_swiglu else 4)
    return mm.wrap(mm.estimate(layout.zero, layout.mbs, layout.ac, layout.sp, layout.schedule, m))
