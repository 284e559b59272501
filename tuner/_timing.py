"""Step time of a layout: compute at an efficiency, collectives on the links the placement gives,
the pipeline bubble, and what the batch size is worth (McCandlish et al. 2018).

The efficiency, bandwidth and overlap factors are plain floats in ``CalibrationFactors`` so that
measured runs can fit them later. Everything here is per optimiser step, in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from tuner._errors import LayoutError, SpecError
from tuner._layout import AXES, Layout, microbatches
from tuner._memory import rank_params
from tuner._partition import EMBEDDING_COST, head_flops_per_token, layer_flops_per_token
from tuner._placement import Placement, _place
from tuner._specs import ClusterSpec, ModelSpec, TrainingSpec


@dataclass(frozen=True)
class CalibrationFactors:
    """Fractions that turn peak hardware numbers into achieved ones (fit them to measurements)."""

    compute_efficiency: float = 0.6  # achieved / peak FLOP/s of the layers' kernels
    intra_bw_efficiency: float = 0.8  # achieved / nominal intra-node bandwidth (NVLink)
    inter_bw_efficiency: float = 0.8  # achieved / nominal inter-node bandwidth (IB/RoCE)
    dp_overlap: float = 0.8  # fraction of DP/FSDP traffic hidden behind compute
    cp_overlap: float = 0.5  # fraction of CP K/V exchange hidden behind attention
    ep_overlap: float = 0.0  # fraction of EP all-to-all hidden
    tp_overlap: float = 0.0  # fraction of TP/SP collectives hidden
    latency_scale: float = 1.0  # multiplies the cluster's per-message latencies

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise SpecError(f"factors.{name} must be a number, got {v!r}")
            if name.endswith("overlap"):
                if not 0 <= v <= 1:
                    raise SpecError(f"factors.{name} must be within [0, 1], got {v!r}")
            elif name == "latency_scale":
                if v < 0:
                    raise SpecError(f"factors.{name} must be >= 0, got {v!r}")
            elif not 0 < v <= 1:
                raise SpecError(f"factors.{name} must be within (0, 1], got {v!r}")


@dataclass(frozen=True)
class TimeEstimate:
    step_time_s: float
    tokens_per_s: float
    tokens_per_s_per_device: float
    mfu: float  # model FLOPs (PaLM App. B, no recompute) / peak
    hfu: float  # hardware FLOPs incl. recompute / peak (what Megatron/BLOOM report)
    useful_tokens_per_s: float
    breakdown: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return {
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_device": self.tokens_per_s_per_device,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "useful_tokens_per_s": self.useful_tokens_per_s,
            "breakdown": dict(self.breakdown),
        }


# --- formulas ------------------------------------------------------------------------------------


def model_flops_per_token(model: ModelSpec) -> float:
    """Training FLOPs per token, 6N + 12·L·h·T (PaLM, Chowdhery et al. 2022, App. B); N counts the
    weights a token multiplies (active experts, head; not the embedding lookup)."""
    n = model.active_params - model.embedding_params + (model.embedding_params if model.tied_embeddings else 0)
    return 6.0 * n + 12.0 * model.layers * model.hidden * model.seq_len


def attention_forward_flops_per_token(model: ModelSpec) -> float:
    """Forward FLOPs per token of one attention sub-layer: its projections 2·P_attn plus the scores
    and their softmax·V, 4·h·T (PaLM, Chowdhery et al. 2022, App. B counts 12·h·T for fwd + bwd)."""
    return 2.0 * model.attention_params_per_layer + 4.0 * model.hidden * model.seq_len


def recompute_flops_per_token_per_layer(model: ModelSpec, ac: str) -> float:
    """Extra forward FLOPs per token per layer that activation checkpointing re-runs in the backward.

    full: the whole layer's forward again, 2·(P_attn + P_mlp) + 4·h·T (Korthikanti et al. 2022 Sec. 5).
    selective: meshtune's "selective" is attention-block recompute, not Korthikanti's: the workers
    (workers/parallelize.py ``apply_ac``) checkpoint the whole attention sub-layer (Q, K, V, RoPE,
    SDPA, out-projection), so its forward, 2·P_attn + 4·h·T, runs again.
    """
    if ac == "full":
        active = model.attention_params_per_layer + model.active_mlp_params_per_layer
        return 2.0 * active + 4.0 * model.hidden * model.seq_len
    if ac == "selective":
        return attention_forward_flops_per_token(model)
    return 0.0


# Collectives a recomputed forward repeats, per layer, by ac: (TP all-reduce or SP all-gather +
# reduce-scatter pairs, CP K/V all-gathers, EP all-to-alls). Full recompute re-runs the attention's
# and the MLP's forward collectives; attention-block recompute only the attention's (its out-projection
# reduction, and under SP the all-gather of its input, which lies inside the checkpointed module).
RECOMPUTE_COLLECTIVES = {"none": (0, 0, 0), "selective": (1, 1, 0), "full": (2, 1, 2)}


def allreduce_time(nbytes: float, n: int, bw: float, lat: float) -> float:
    """Ring all-reduce: 2(n-1)/n · bytes / bw + 2(n-1) · latency (Thakur et al. 2005)."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat


def allgather_time(nbytes: float, n: int, bw: float, lat: float) -> float:
    """Ring all-gather or reduce-scatter of a ``nbytes`` whole: (n-1)/n · bytes / bw + (n-1)·latency."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / bw + (n - 1) * lat


def alltoall_time(nbytes: float, n: int, bw: float, lat: float) -> float:
    """All-to-all where each rank holds ``nbytes``: (n-1)/n of it leaves the rank, (n-1) messages."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / bw + (n - 1) * lat


def pipeline_bubble_fraction(pp: int, vpp: int, m: int) -> float:
    """Idle fraction of the ideal time, (p-1)/(v·m) (Narayanan et al. 2021, Sec. 2.2)."""
    return (pp - 1) / (vpp * m)


def useful_fraction(global_batch: int, critical_batch: int | None) -> float:
    """Share of the tokens that buy progress: E_min/E = 1/(1 + B/B_crit) (McCandlish et al. 2018,
    Eq. 2.11: E = E_min(1 + B/B_crit)); ~1 well below B_crit, ~B_crit/B far above it."""
    if critical_batch is None:
        return 1.0
    return 1.0 / (1.0 + global_batch / critical_batch)


# --- the model -----------------------------------------------------------------------------------


def _link(placement: Placement, axes: tuple[str, ...], cluster: ClusterSpec, f: CalibrationFactors) -> tuple[float, float]:
    """(bandwidth, latency) for a group spanning ``axes``: inter-node if any of them leaves a node.
    Strides multiply outward, so groups of axes that each stay in a node stay in one node together."""
    intra = all(placement.axes[a].intra_node for a in axes if placement.axes[a].size > 1)
    if intra:
        return cluster.intra_node_bandwidth * f.intra_bw_efficiency, cluster.intra_node_latency * f.latency_scale
    return cluster.inter_node_bandwidth * f.inter_bw_efficiency, cluster.inter_node_latency * f.latency_scale


# Bytes per gradient element in the data-parallel reduction: the workers reduce in fp32.
REDUCE_BYTES = 4

BREAKDOWN = ("compute", "tp_comm", "cp_comm", "ep_comm", "dp_comm_exposed", "pp_bubble", "pp_p2p")


class MeshTime:
    """The time model of one placed mesh (degrees and vpp) of one problem, prepared so that each of
    its layouts (zero, mbs, ac, sp, m) costs a few float operations. Per micro-batch terms are
    ``mbs * per_sequence + per_message_latency``."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, f: CalibrationFactors,
                 placement: Placement, *, tp: int, cp: int, ep: int, dp: int, pp: int, vpp: int) -> None:
        self.pp, self.vpp = pp, vpp
        world = tp * cp * ep * dp * pp
        elt = 2 if training.precision == "bf16" else 4
        seq, h = model.seq_len, model.hidden
        seq_local = seq // cp  # tokens of one sequence on this device (before TP)
        rate = cluster.peak_flops * f.compute_efficiency
        rp = rank_params(model, tp, ep, pp, vpp)
        layer_flops = layer_flops_per_token(model)  # PaLM App. B, per layer
        head = head_flops_per_token(model)
        emb = EMBEDDING_COST * head

        tp_link = _link(placement, ("tp",), cluster, f) if tp > 1 else None
        cp_link = _link(placement, ("cp",), cluster, f) if cp > 1 else None
        ep_link = _link(placement, ("ep",), cluster, f) if ep > 1 else None
        # Per ac: (compute, tp, cp, ep) of one micro-batch as (per sequence, constant) pairs.
        self.per_mb: dict[str, tuple[tuple[float, float], ...]] = {}
        for ac in ("none", "selective", "full"):
            layer_hw = layer_flops + recompute_flops_per_token_per_layer(model, ac)
            flops = [n * layer_hw for n in rp.layers]
            flops[0] += emb
            flops[-1] += head
            slow = max(range(pp), key=flops.__getitem__)  # the pipeline runs at its slowest stage
            n_layers = rp.layers[slow]
            compute = (flops[slow] * seq_local / (tp * rate), 0.0)
            tp_extra, cp_extra, ep_extra = RECOMPUTE_COLLECTIVES[ac]  # a recomputed forward repeats them
            tp_t = cp_t = ep_t = (0.0, 0.0)
            if tp_link:
                # TP/SP: 2 all-reduces (or all-gather + reduce-scatter pairs) forward, 2 backward
                # (Shoeybi et al. 2019 Fig. 4; Korthikanti et al. 2022 Sec. 4.2.2).
                bw, lat = tp_link
                n = n_layers * (4 + tp_extra) * (1 - f.tp_overlap)
                tp_t = (n * allreduce_time(elt * seq_local * h, tp, bw, 0.0), n * allreduce_time(0.0, tp, bw, lat))
            if cp_link:
                # CP: all-gather K and V of the local heads forward, reduce-scatter their gradients
                # backward (Llama 3, Dubey et al. 2024 Sec. 3.3.2).
                bw, lat = cp_link
                kv = 2 * elt * seq * model.kv_heads * model.head_dim / min(tp, model.kv_heads)
                n = n_layers * (2 + cp_extra) * (1 - f.cp_overlap)
                cp_t = (n * allgather_time(kv, cp, bw, 0.0), n * allgather_time(0.0, cp, bw, lat))
            if ep_link:
                # EP: dispatch and combine all-to-alls forward and backward (Lepikhin et al. 2020).
                bw, lat = ep_link
                n = n_layers * (4 + ep_extra) * (1 - f.ep_overlap)
                a2a = elt * seq_local * model.top_k * h
                ep_t = (n * alltoall_time(a2a, ep, bw, 0.0), n * alltoall_time(0.0, ep, bw, lat))
            self.per_mb[ac] = (compute, tp_t, cp_t, ep_t)

        # Pipeline p2p: activations cross 2v stage boundaries per micro-batch (forward + backward);
        # Megatron's scatter-gather sends 1/t of them under sequence parallelism.
        self.p2p: dict[bool, tuple[float, float]] = {False: (0.0, 0.0), True: (0.0, 0.0)}
        if pp > 1:
            bw, lat = _link(placement, ("pp",), cluster, f)
            for sp in (False, True):
                act = elt * seq_local * h / (tp if sp else 1)
                self.p2p[sp] = (2 * vpp * act / bw, 2 * vpp * lat)

        # DP, as the workers run it (workers/parallelize.py, workers/_data_parallel.py): weights are
        # all-gathered in the param dtype, gradients reduced in fp32 (FSDP2 MixedPrecisionPolicy
        # reduce_dtype=float32; ZeRO-0 all-reduces the fp32 master gradients autocast leaves), the
        # largest rank's dense weights over dp*ep*cp, its expert weights over dp*cp. Per zero stage:
        # (hidable, exposed) seconds once per step, and hidable seconds per micro-batch.
        #   ZeRO-0: one all-reduce after the last backward (GradSync): exposed.
        #   ZeRO-1: gradients accumulate unsharded, one reduce-scatter in the last backward, one
        #     all-gather of the updated shards in the next forward.
        #   ZeRO-2, pp == 1: reduce-scatter every backward, so every forward all-gathers again.
        #   ZeRO-3, pp == 1: all-gather forward and backward, reduce-scatter, per micro-batch.
        #   pp > 1: torch.distributed.pipelining drives FSDP itself (stage.py): every backward runs
        #     without gradient sync and without reshard, and one reduce-scatter runs after the
        #     schedule's last backward (``perform_reduce_grad``), nothing left to hide it behind.
        #     ZeRO-1/2 (reshard_after_forward=False) then gather once per step; ZeRO-3 reshards after
        #     each forward, and a module's gather is needed by each forward that follows a forward
        #     and each backward that follows a forward: m + 1 gathers per step whatever the schedule
        #     (a run of k forwards costs k, or k - 1 after a backward, plus the backward after it).
        pbytes = 2 if training.precision == "bf16" else 4
        ag = rs = ar = 0.0
        for psi, nd, axes in ((max(rp.dense), dp * ep * cp, ("dp", "ep", "cp")), (max(rp.expert), dp * cp, ("dp", "cp"))):
            if nd > 1 and psi > 0:
                bw, lat = _link(placement, axes, cluster, f)
                ag += allgather_time(pbytes * psi, nd, bw, lat)
                rs += allgather_time(REDUCE_BYTES * psi, nd, bw, lat)
                ar += allreduce_time(REDUCE_BYTES * psi, nd, bw, lat)
        if pp == 1:
            self.dp = {0: (0.0, ar, 0.0), 1: (ag + rs, 0.0, 0.0), 2: (0.0, 0.0, ag + rs), 3: (0.0, 0.0, 2 * ag + rs)}
        else:
            self.dp = {0: (0.0, ar, 0.0), 1: (ag, rs, 0.0), 2: (ag, rs, 0.0), 3: (ag, rs, ag)}
        self.dp_overlap = f.dp_overlap
        self.tokens = training.global_batch * seq
        self.world = world
        self.peak = world * cluster.peak_flops
        self.model_flops = model_flops_per_token(model)
        self.hw_flops = {
            ac: self.model_flops + model.layers * recompute_flops_per_token_per_layer(model, ac)
            for ac in ("none", "selective", "full")
        }
        self.useful = useful_fraction(training.global_batch, training.critical_batch)

    def estimate(self, zero: int, mbs: int, ac: str, sp: bool, m: int) -> tuple[float, ...]:
        """(step, compute, tp, cp, ep, dp exposed, bubble, p2p) seconds per optimiser step."""
        (c1, c0), (t1, t0), (k1, k0), (e1, e0) = self.per_mb[ac]
        compute, tp_t, cp_t, ep_t = mbs * c1 + c0, mbs * t1 + t0, mbs * k1 + k0, mbs * e1 + e0
        t_mb = compute + tp_t + cp_t + ep_t
        busy = m * t_mb
        bubble = t_mb * (self.pp - 1) / self.vpp  # (p-1)/(v m) of the ideal time (Narayanan 2021)
        p1, p0 = self.p2p[sp]
        p2p = m * (mbs * p1 + p0)
        hidable, fixed, per_mb = self.dp[zero]
        t_dp = hidable + m * per_mb
        exposed = fixed + t_dp - min(t_dp * self.dp_overlap, busy)  # overlap cannot hide more than the compute
        step = busy + bubble + p2p + exposed
        return (step, m * compute, m * tp_t, m * cp_t, m * ep_t, exposed, bubble, p2p)

    def wrap(self, est: tuple[float, ...], ac: str) -> TimeEstimate:
        step = est[0]
        tps = self.tokens / step
        obj = object.__new__(TimeEstimate)  # the values are checked by construction; skip __init__
        obj.__dict__.update(
            step_time_s=step,
            tokens_per_s=tps,
            tokens_per_s_per_device=tps / self.world,
            mfu=self.model_flops * tps / self.peak,
            hfu=self.hw_flops[ac] * tps / self.peak,
            useful_tokens_per_s=tps * self.useful,
            breakdown=dict(zip(BREAKDOWN, est[1:], strict=True)),
        )
        return obj


@lru_cache(maxsize=4096)
def mesh_time(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, f: CalibrationFactors, tp: int,
              cp: int, ep: int, dp: int, pp: int, vpp: int, order: tuple[str, ...] = AXES) -> MeshTime:
    """The prepared (and shared: never mutate it) time model of one mesh placed in ``order``."""
    placement = _place((tp, cp, ep, dp, pp), order, cluster.devices_per_node)
    return MeshTime(model, cluster, training, f, placement, tp=tp, cp=cp, ep=ep, dp=dp, pp=pp, vpp=vpp)


def estimate_time(
    layout: Layout,
    *,
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    factors: CalibrationFactors | None = None,
    placement: Placement | None = None,
) -> TimeEstimate:
    """Predicted step time of ``layout`` and what follows from it (tokens/s, MFU, useful tokens/s).

    ``placement`` (from ``place``) chooses the axis order; without it the default order is used
    (TP across nodes allowed here: ``place``/``plan`` are where that is refused)."""
    f = factors or CalibrationFactors()
    m = microbatches(layout, training)
    if layout.world_size != cluster.devices:
        raise LayoutError(f"layout world size {layout.world_size} does not equal the device count {cluster.devices}")
    order = placement.order if placement is not None else AXES
    mt = mesh_time(model, cluster, training, f, layout.tp, layout.cp, layout.ep, layout.dp, layout.pp, layout.vpp,
                   order)
    return mt.wrap(mt.estimate(layout.zero, layout.mbs, layout.ac, layout.sp, m), layout.ac)
