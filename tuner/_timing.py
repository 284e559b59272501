"""Step time of a layout: compute at an efficiency, collectives on the links the placement gives,
the pipeline bubble, and what the batch size is worth (McCandlish et al. 2018).

The efficiency, bandwidth and overlap factors are plain floats in ``CalibrationFactors`` so that
measured runs can fit them later. Everything here is per optimiser step, in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from tuner._errors import LayoutError, SpecError
from tuner._formulas import (
    allgather_time,
    allreduce_time,
    alltoall_time,
    attention_core_flops_per_token,
    backward_gemm_flops_per_token,
    head_flops_per_token,
    matmul_flops_per_token,
    model_flops_per_token,
    recompute_flops_per_token_per_layer,
    recompute_flops_split,
    useful_fraction,
)
from tuner._layout import CHECKPOINTING, Layout, microbatches
from tuner._memory import Num, rank_params
from tuner._partition import EMBEDDING_COST
from tuner._placement import AXES, Placement, _place
from tuner._specs import ClusterSpec, ModelSpec, TrainingSpec
from tuner._stack import stack_of


@dataclass(frozen=True)
class CalibrationFactors:
    """Fractions that turn peak hardware numbers into achieved ones (fit them to measurements)."""

    compute_efficiency: float = 0.6  # achieved / peak FLOP/s of the layers' matmuls
    # Achieved / peak FLOP/s of the attention core (scores, softmax, ·V; forward and backward):
    # FlashAttention-2 reaches 35% of an H100's peak (Shah et al. 2024, FlashAttention-3, Sec. 1).
    # Never above compute_efficiency (a calibrated, slower device slows both).
    attention_efficiency: float = 0.35
    intra_bw_efficiency: float = 0.8  # achieved / nominal intra-node bandwidth (NVLink)
    inter_bw_efficiency: float = 0.8  # achieved / nominal inter-node bandwidth (IB/RoCE)
    dp_overlap: float = 0.8  # fraction of DP/FSDP traffic hidden behind compute
    # The workers' CP K/V all-gather (workers/_cp.py) blocks the attention that needs it, as Llama 3's
    # does ("exposed in the critical path", Dubey et al. 2024 Sec. 3.3.2): nothing hidden by default.
    cp_overlap: float = 0.0
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
    mfu: float  # MFU_CONVENTION: model FLOPs / peak
    hfu: float  # model FLOPs + recompute / peak (what Megatron/BLOOM report, causal counted in full)
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
            "mfu_convention": MFU_CONVENTION,
            "breakdown": dict(self.breakdown),
        }


# The one FLOP count of MFU, predicted here and measured in workers/aggregate.py (model_flops_per_token).
MFU_CONVENTION = "PaLM (Chowdhery et al. 2022, App. B): 6N + 12·L·h·s per token, causal attention in full"


# Collectives a recomputed forward repeats, per layer, by ac: (TP all-reduce or SP all-gather +
# reduce-scatter pairs, CP K/V all-gathers, EP all-to-alls). Full recompute re-runs the attention's
# and the MLP's forward collectives; attention-block recompute only the attention's (its out-projection
# reduction, and under SP the all-gather of its input, which lies inside the checkpointed module).
RECOMPUTE_COLLECTIVES = {"none": (0, 0, 0), "selective": (1, 1, 0), "full": (2, 1, 2)}


# --- the model -----------------------------------------------------------------------------------


def _link(placement: Placement, axes: tuple[str, ...], cluster: ClusterSpec, f: CalibrationFactors,
          op: str = "all_reduce") -> tuple[float, float]:
    """(bandwidth, latency) of collective ``op`` for a group spanning ``axes``, at the slowest tier any
    of them reaches: the node's link, the fast domain's (NVL72's NVLink across trays), else the
    network. Strides multiply outward, so groups of axes that each stay in a node (domain) stay in
    one together. The fast domain is a scale-up fabric like the node's, so it takes the node's
    efficiency. A probed figure of that tier and collective (tuner/_figures.py) is used as measured."""
    used = [placement.axes[a] for a in axes if placement.axes[a].size > 1]
    if all(ax.intra_node for ax in used):
        tier = "intra"
    elif all(ax.in_domain for ax in used):
        tier = "domain"
    else:
        tier = "inter"
    probed = cluster.probed.link(tier, op) if cluster.probed is not None else None
    if probed is not None:
        return probed.bandwidth, probed.latency
    if tier == "intra":
        return cluster.intra_node_bandwidth * f.intra_bw_efficiency, cluster.intra_node_latency * f.latency_scale
    if tier == "domain":
        return cluster.domain_bandwidth * f.intra_bw_efficiency, cluster.domain_latency * f.latency_scale
    return cluster.inter_node_bandwidth * f.inter_bw_efficiency, cluster.inter_node_latency * f.latency_scale


def _tp_reduction(nbytes: float, tp: int, links: dict[str, tuple[float, float]], sp: bool, *, latency: bool) -> float:
    """One TP reduction of a ``nbytes`` whole over ``tp`` ranks: an all-reduce, or under sequence
    parallelism an all-gather + reduce-scatter pair of the same volume (Korthikanti et al. 2022
    Sec. 4.2.2), each on its own link; ``latency=False`` leaves the per-message latencies out."""
    if sp:
        (gb, gl), (rb, rl) = links["all_gather"], links["reduce_scatter"]
        return (allgather_time(nbytes, tp, gb, gl if latency else 0.0)
                + allgather_time(nbytes, tp, rb, rl if latency else 0.0))
    bw, lat = links["all_reduce"]
    return allreduce_time(nbytes, tp, bw, lat if latency else 0.0)


def _dgrad_reduction(nbytes: float, tp: int, links: dict[str, tuple[float, float]], sp: bool, *,
                     latency: bool) -> float:
    """The backward half of a column-parallel linear's ``_tp_reduction``: the reduction of its input
    gradient, a reduce-scatter under sequence parallelism, else the all-reduce (Korthikanti et al.
    2022 Sec. 4.2.2; Shoeybi et al. 2019 Fig. 3's f)."""
    if sp:
        bw, lat = links["reduce_scatter"]
        return allgather_time(nbytes, tp, bw, lat if latency else 0.0)
    return _tp_reduction(nbytes, tp, links, sp, latency=latency)


def _hidden_behind(comm: tuple[float, float], gemm: float) -> tuple[float, float]:
    """What a GEMM of ``gemm`` seconds per sequence hides of a collective of ``comm`` (per sequence,
    constant) seconds issued before it, as a (per sequence, constant) pair: min(mbs·c1 + c0, mbs·g) at
    every micro-batch size where that is linear in it, and below it (never more) where it is not."""
    c1, c0 = comm
    return min(c1, gemm), min(c0, max(0.0, gemm - c1))



BREAKDOWN = ("compute", "tp_comm", "cp_comm", "ep_comm", "dp_comm_exposed", "pp_bubble", "pp_p2p")


class StepTime(NamedTuple):
    """Seconds per optimiser step of one layout, by part (``BREAKDOWN`` after ``step``)."""

    step: float
    compute: float
    tp_comm: float
    cp_comm: float
    ep_comm: float
    dp_comm_exposed: float
    pp_bubble: float
    pp_p2p: float


def _lesser(a: Num, b: Num) -> Num:
    """The smaller, elementwise for arrays."""
    return np.minimum(a, b) if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) else min(a, b)


def _greater(a: Num, b: Num) -> Num:
    """The larger, elementwise for arrays."""
    return np.maximum(a, b) if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) else max(a, b)


def _where(cond: bool | np.ndarray, a: Num, b: Num) -> Num:
    """``a`` where ``cond`` holds, else ``b``, elementwise for arrays."""
    return np.where(cond, a, b) if isinstance(cond, np.ndarray) else (a if cond else b)


def step_time(per_mb: tuple[tuple[Num, Num], ...], p2p: tuple[Num, Num], dp: tuple[Num, Num, Num], mbs: Num, m: Num,
              pp: Num, vpp: Num, dp_overlap: Num, sharing: Num = 1.0, step_fixed: Num = 0.0) -> StepTime:
    """Seconds per optimiser step, by part, of ``m`` micro-batches of ``mbs`` sequences on a mesh whose
    terms ``MeshTime`` prepared: ``per_mb`` the slowest stage's (compute, tp, cp, ep) seconds of one
    micro-batch as (per sequence, constant) pairs, ``p2p`` the pipeline sends' pair, ``dp`` the
    data-parallel (hidable once, exposed once, hidable per micro-batch) seconds. The bubble is
    (p-1)/(v m) of the ideal time (Narayanan et al. 2021 Sec. 2.2); overlap hides data-parallel
    traffic once per step behind at most the last micro-batch, per micro-batch behind the compute.
    ``sharing`` (probed, > 1 where devices share their host's cores) lets a stage idle in the bubble
    lend its share; ``step_fixed`` is the optimiser's measured seconds per step, counted as compute. Numbers or numpy arrays alike (``plan`` costs every layout
    of a problem at once)."""
    (c1, c0), (t1, t0), (k1, k0), (e1, e0) = per_mb
    compute, tp_t, cp_t, ep_t = mbs * c1 + c0, mbs * t1 + t0, mbs * k1 + k0, mbs * e1 + e0
    t_mb = compute + tp_t + cp_t + ep_t
    busy = m * t_mb
    bubble = t_mb * (pp - 1) / vpp
    # Devices sharing their host's cores (CPU ranks, probed): the critical path runs up to that much
    # faster, never faster than the node can do the work of every stage.
    bubble = _where(sharing > 1.0, _greater(0.0, (busy + bubble) / sharing - busy), bubble)
    p1, p0 = p2p
    p2p_t = m * (mbs * p1 + p0)
    hidable, fixed, per_mb_dp = dp
    t_dp = hidable + m * per_mb_dp
    # Traffic once per step runs in the last micro-batch's backward (the others run without gradient
    # sync: Megatron's no_sync_func in megatron/core/pipeline_parallel/schedules.py, torch's replicate
    # and FSDP alike) and, an all-gather of the updated weights, in the first one's forward: at most
    # one micro-batch's time hides it. Per micro-batch traffic hides behind the rest of the compute.
    once = _lesser(hidable * dp_overlap, t_mb)
    exposed = fixed + t_dp - once - _lesser(m * per_mb_dp * dp_overlap, busy - once)
    return StepTime(busy + bubble + p2p_t + exposed + step_fixed, m * compute + step_fixed, m * tp_t, m * cp_t,
                    m * ep_t, exposed, bubble, p2p_t)


@lru_cache(maxsize=256)
def _flop_counts(model: ModelSpec, flash: bool) -> tuple[float, float, float, dict[str, tuple[float, float]], float,
                                                         dict[str, float]]:
    """What every mesh's time model reads of the model, per token: one layer's matmul and attention
    core FLOPs (the core per local token, on the query width heads x head_dim; halved by a causal
    ``flash`` kernel), the head's, the (matmul, core) FLOPs recompute adds per layer by ac, MFU's
    model FLOPs, and by ac Megatron's hardware count (full attention, plus the recomputed forward)."""
    matmul = matmul_flops_per_token(model.attention_params_per_layer + model.active_mlp_params_per_layer)
    core = attention_core_flops_per_token(model.q_dim, model.seq_len, causal=flash)
    recompute = {ac: recompute_flops_split(model, ac, causal=flash) for ac in CHECKPOINTING}
    model_flops = model_flops_per_token(model)
    hw_flops = {ac: model_flops + model.layers * recompute_flops_per_token_per_layer(model, ac) for ac in CHECKPOINTING}
    return matmul, core, head_flops_per_token(model), recompute, model_flops, hw_flops


class MeshTime:
    """The time model of one placed mesh (degrees and vpp) of one problem, prepared so that each of
    its layouts (zero, mbs, ac, sp, m) costs a few float operations. Per micro-batch terms are
    ``mbs * per_sequence + per_message_latency``.

    What the training stack runs (``training.stack``, tuner/_stack.py) decides the attention kernel
    (a flash kernel skips the causal mask's upper half, as the workers' chunked CP attention does; a
    materialised-scores kernel, Megatron 2021's, computes all of s²), the data-parallel program per
    ZeRO level and the bytes it reduces. ``loss_parallel``: under TP the logits stay vocab-sharded
    and the cross-entropy all-reduces three floats per token (torch's loss_parallel: max, sum of
    exponentials, the target logit; Megatron's vocab-parallel cross-entropy the same); False
    all-gathers the whole logits to every tp rank.
    """

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, f: CalibrationFactors,
                 placement: Placement, *, tp: int, cp: int, ep: int, dp: int, pp: int, vpp: int,
                 loss_parallel: bool = True) -> None:
        self.pp, self.vpp = pp, vpp
        stack = stack_of(training)
        flash = stack.flash
        world = tp * cp * ep * dp * pp
        elt = 2 if training.precision == "bf16" else 4
        seq, h = model.seq_len, model.hidden
        seq_local = seq // cp  # tokens of one sequence on this device (before TP)
        probed = cluster.probed
        # Measured GEMM and attention rates (tuner/_figures.py) replace peak x efficiency.
        rate = (probed.matmul_flops if probed is not None and probed.matmul_flops
                else cluster.peak_flops * f.compute_efficiency)
        # A flash kernel runs at its own efficiency; a materialised-scores path (flash=False) is two
        # batched GEMMs at the matmuls' (its softmax's memory traffic is not modelled).
        attn_rate = cluster.peak_flops * min(f.attention_efficiency, f.compute_efficiency) if flash else rate
        if flash and probed is not None and probed.attention_flops:
            attn_rate = probed.attention_flops
        rp = rank_params(model, tp, ep, pp, vpp, stack.end_stages)
        matmul, core, head, recompute, self.model_flops, self.hw_flops = _flop_counts(model, flash)
        emb = EMBEDDING_COST * head

        def link(axis: str, op: str) -> tuple[float, float]:
            return _link(placement, (axis,), cluster, f, op)

        # Per ac and sp: (compute, tp, cp, ep) of one micro-batch on the slowest stage, as (per
        # sequence, constant) pairs: the pipeline runs at its slowest stage.
        self.per_mb: dict[tuple[str, bool], tuple[tuple[float, float], ...]] = {}
        # Ranks alike in layers and ends cost alike (the ends' measured extra too: it goes by whether
        # the rank holds the embedding or the head): the first of each kind stands for them (max keeps
        # the first of equals, so the slowest stage found is the one every rank gives).
        kinds: dict[tuple[int, bool, bool], int] = {}
        for r, n_layers in enumerate(rp.layers):
            kinds.setdefault((n_layers, r == 0, r == pp - 1), r)
        distinct = sorted(kinds.values())
        tp_links = {}
        if tp > 1:
            tp_links = (dict.fromkeys(("all_reduce", "all_gather", "reduce_scatter"), link("tp", "all_reduce"))
                        if probed is None else {op: link("tp", op) for op in ("all_reduce", "all_gather", "reduce_scatter")})
        cp_links = (link("cp", "all_gather"), link("cp", "reduce_scatter")) if cp > 1 else None
        ep_link = link("ep", "all_to_all") if ep > 1 else None
        # Per ac, what does not depend on sp: one layer's compute, the collectives a recomputed forward
        # repeats, CP's and EP's per layer (per sequence, latency).
        per_ac = {}
        for ac in ("none", "selective", "full"):
            re_matmul, re_core = recompute[ac]
            layer_s = ((matmul + re_matmul) / rate + (core + re_core) / attn_rate) * seq_local / tp
            tp_extra, cp_extra, ep_extra = RECOMPUTE_COLLECTIVES[ac]  # a recomputed forward repeats them
            cp_l = ep_l = (0.0, 0.0)
            if cp > 1:
                # CP: all-gather K and V of the local kv heads forward, reduce-scatter their gradients
                # backward (Llama 3, Dubey et al. 2024 Sec. 3.3.2); kv_heads-sized, never head-repeated.
                # Of the n, k are the reduce-scatter, on its own link: written as n all-gathers and k
                # times the difference, so one link for both is the all-gathers' n exactly.
                (agb, agl), (rsb, rsl) = cp_links
                kv = 2 * elt * seq * model.kv_heads * model.head_dim / min(tp, model.kv_heads)
                n = (2 + cp_extra) * (1 - f.cp_overlap)
                k = 1 - f.cp_overlap
                ag1, ag0 = allgather_time(kv, cp, agb, 0.0), allgather_time(0.0, cp, agb, agl)
                cp_l = (n * ag1 + k * (allgather_time(kv, cp, rsb, 0.0) - ag1),
                        n * ag0 + k * (allgather_time(0.0, cp, rsb, rsl) - ag0))
            if ep > 1:
                # EP: dispatch and combine all-to-alls forward and backward (Lepikhin et al. 2020).
                bw, lat = ep_link
                n = (4 + ep_extra) * (1 - f.ep_overlap)
                a2a = elt * seq_local * model.top_k * h
                ep_l = (n * alltoall_time(a2a, ep, bw, 0.0), n * alltoall_time(0.0, ep, bw, lat))
            per_ac[ac] = (re_matmul, re_core, layer_s, tp_extra, cp_l, ep_l)
        gemms = _column_parallel_gemms(model, seq_local / (tp * rate)) if tp > 1 else None
        for sp in (False, True):
            sp = sp and tp > 1
            # TP collectives at the model's ends, per micro-batch: the vocab-parallel embedding's output
            # reduction (first stage) and the head's input-gradient reduction (last stage), each one
            # all-reduce (or, under SP, a reduce-scatter/all-gather pair of the same volume); the logits.
            ends_tp = [0.0] * pp
            ends_tp_lat = [0.0] * pp
            # The column-parallel linears' backward, per micro-batch as (per sequence, constant) for one
            # layer's (qkv, fc1) and for the head: what their weight-gradient GEMMs hide of their input
            # gradients' reductions (stack.dgrad_overlap), and what their input-gradient GEMMs leave
            # exposed of the re-gather of their sequence-parallel input (sequence_parallel "megatron");
            # zero where the stack does neither.
            hidden_layer = hidden_head = regather_layer = regather_head = (0.0, 0.0)
            if tp > 1:
                # one reduction of a micro-batch's activations (bandwidth part, latency part)
                red1 = _tp_reduction(elt * seq_local * h, tp, tp_links, sp, latency=False)
                red0 = _tp_reduction(0.0, tp, tp_links, sp, latency=True)
                if stack.dgrad_overlap:
                    dgrad = (_dgrad_reduction(elt * seq_local * h, tp, tp_links, sp, latency=False),
                             _dgrad_reduction(0.0, tp, tp_links, sp, latency=True))
                    hidden_layer, hidden_head = _behind(dgrad, gemms, exposed=False)
                if sp and not stack.saves_gathered:
                    gb, gl = tp_links["all_gather"]
                    ag = allgather_time(elt * seq_local * h, tp, gb, 0.0), allgather_time(0.0, tp, gb, gl)
                    regather_layer, regather_head = _behind(ag, gemms, exposed=True)
                for r in (0, -1):  # pp == 1: one stage, both reductions
                    ends_tp[r] += red1
                    ends_tp_lat[r] += red0
                ends_tp[-1] += regather_head[0] - hidden_head[0]
                ends_tp_lat[-1] += regather_head[1] - hidden_head[1]
                (ar_bw, ar_lat), (ag_bw, ag_lat) = tp_links["all_reduce"], tp_links["all_gather"]
                if loss_parallel:
                    ends_tp[-1] += 3 * allreduce_time(4 * seq_local, tp, ar_bw, 0.0)
                    ends_tp_lat[-1] += 3 * allreduce_time(0.0, tp, ar_bw, ar_lat)
                else:  # ColwiseParallel(output_layouts=Replicate()): the forward all-gathers V/tp shards
                    ends_tp[-1] += allgather_time(elt * seq_local * model.vocab, tp, ag_bw, 0.0)
                    ends_tp_lat[-1] += allgather_time(0.0, tp, ag_bw, ag_lat)
            over = probed.layer(tp, sp) if probed is not None else None
            for ac in ("none", "selective", "full"):
                re_matmul, re_core, layer_s, tp_extra, cp_l, ep_l = per_ac[ac]
                tp_l = (0.0, 0.0)  # per layer: (per sequence, latency)
                if tp > 1:
                    # TP/SP: 2 all-reduces (or all-gather + reduce-scatter pairs) forward, 2 backward
                    # (Shoeybi et al. 2019 Fig. 4; Korthikanti et al. 2022 Sec. 4.2.2), less what the
                    # weight-gradient GEMMs hide of the backward ones (never of a recomputed forward's),
                    # plus what the input-gradient GEMMs leave exposed of the sequence-parallel re-gathers.
                    n = (4 + tp_extra) * (1 - f.tp_overlap)
                    tp_l = (n * red1 + (regather_layer[0] - hidden_layer[0]) * (1 - f.tp_overlap),
                            n * red0 + (regather_layer[1] - hidden_layer[1]) * (1 - f.tp_overlap))
                # What a probed layer takes beyond the above (dispatch, elementwise work): recompute
                # repeats the forward's share of it, as it repeats the forward's FLOPs, or what a
                # probe of the checkpointed layer measured.
                lay1 = lay0 = 0.0
                if over:
                    redo = dict(probed.recompute).get(ac) or 1.0 + (re_matmul + re_core) / (matmul + core)
                    lay1, lay0 = over.layer_per_seq_s * redo, over.layer_s * redo
                stages = []
                for r in distinct:
                    n_layers = rp.layers[r]
                    ends = (emb if r == 0 else 0.0) + (head if r == pp - 1 else 0.0)
                    end1 = end0 = 0.0
                    if over:
                        share = ends / (emb + head)  # the ends' measured extra, split as their FLOPs are
                        end1, end0 = over.ends_per_seq_s * share, over.ends_s * share
                    parts = ((n_layers * (layer_s + lay1) + ends * seq_local / (tp * rate) + end1,
                              n_layers * lay0 + end0),
                             (n_layers * tp_l[0] + ends_tp[r], n_layers * tp_l[1] + ends_tp_lat[r]),
                             (n_layers * cp_l[0], n_layers * cp_l[1]), (n_layers * ep_l[0], n_layers * ep_l[1]))
                    (a0, b0), (a1, b1), (a2, b2), (a3, b3) = parts
                    stages.append(((a0 + b0) + (a1 + b1) + (a2 + b2) + (a3 + b3), parts))
                self.per_mb[ac, sp] = max(stages, key=lambda x: x[0])[1]
            # No TP, or one link for every collective, nothing hidden and nothing re-gathered: sp costs
            # the same. (Hidden behind the weight gradient is the input gradient's reduction: a whole
            # all-reduce without sp, the reduce-scatter half of a pair with it.)
            if tp == 1 or (probed is None and not stack.dgrad_overlap and stack.saves_gathered):
                break
        for ac in ("none", "selective", "full"):  # sp without TP is no sequence parallelism
            self.per_mb.setdefault((ac, True), self.per_mb[ac, False])

        # Pipeline p2p: activations cross 2v stage boundaries per micro-batch (forward + backward);
        # Megatron's scatter-gather sends 1/t of them under sequence parallelism.
        self.p2p: dict[bool, tuple[float, float]] = {False: (0.0, 0.0), True: (0.0, 0.0)}
        if pp > 1:
            bw, lat = link("pp", "send_recv")
            for sp in (False, True):
                act = elt * seq_local * h / (tp if sp else 1)
                self.p2p[sp] = (2 * vpp * act / bw, 2 * vpp * lat)

        # DP: weights are all-gathered in the param dtype, gradients reduced in the stack's bytes (fp32
        # for all three: FSDP2 MixedPrecisionPolicy reduce_dtype=float32, Megatron's fp32 main grads),
        # the largest rank's dense weights over dp*ep*cp, its expert weights over dp*cp. Per zero
        # stage: (hidable, exposed) seconds once per step, and hidable seconds per micro-batch, from the
        # stack's program (tuner/_stack.py: which all-gathers, reduce-scatters and all-reduces run when).
        pbytes = 2 if training.precision == "bf16" else 4
        reduce_bytes = stack.reduce_bytes
        workers = stack.data_parallel == "workers"  # what the probe measured: meshtune's own workers
        # The workers issue each of these once per FSDP unit (a block, and each chunk's root:
        # workers/_data_parallel.py); a probed cluster pays their measured latency per unit, while
        # datasheet figures cost one latency per collective.
        units = max(rp.layers) + vpp if workers and probed is not None else 1
        # What a real step's sync took per unit beyond the modelled collective (tuner/_figures.py).
        unit_ar = (probed.grad_sync_unit_s or 0.0) if probed is not None and workers else 0.0
        unit_fsdp = (probed.fsdp_unit_s or 0.0) if probed is not None and workers else 0.0
        ag = rs = ar = 0.0
        for psi, nd, axes in ((max(rp.dense), dp * ep * cp, ("dp", "ep", "cp")), (max(rp.expert), dp * cp, ("dp", "cp"))):
            if nd > 1 and psi > 0:
                if probed is None:  # the datasheet has one link per tier for every collective
                    one = _link(placement, axes, cluster, f)
                    links = dict.fromkeys(("all_gather", "reduce_scatter", "all_reduce"), one)
                else:
                    links = {op: _link(placement, axes, cluster, f, op) for op in ("all_gather", "reduce_scatter", "all_reduce")}
                ag += allgather_time(pbytes * psi, nd, links["all_gather"][0], 0.0) + units * (allgather_time(
                    0.0, nd, *links["all_gather"]) + unit_fsdp)
                rs += allgather_time(reduce_bytes * psi, nd, links["reduce_scatter"][0], 0.0) + units * (allgather_time(
                    0.0, nd, *links["reduce_scatter"]) + unit_fsdp)
                ar += allreduce_time(reduce_bytes * psi, nd, links["all_reduce"][0], 0.0) + units * (allreduce_time(
                    0.0, nd, *links["all_reduce"]) + unit_ar)
        self.dp = {z: tuple(_dp_seconds(slot, ag, rs, ar) for slot in stack.program(z, pp > 1)) for z in range(4)}
        # The optimiser step and zeroing, measured (per step, and per layer of this rank's stages).
        self.step_fixed = 0.0
        if probed is not None and probed.step_s is not None:
            self.step_fixed = probed.step_s + (probed.step_layer_s or 0.0) * max(rp.layers)
        self.dp_overlap = probed.dp_overlap if probed is not None and probed.dp_overlap is not None else f.dp_overlap
        self.sharing = probed.compute_sharing or 1.0 if probed is not None else 1.0
        self.tokens = training.global_batch * seq
        self.world = world
        self.peak = world * cluster.peak_flops
        self.useful = useful_fraction(training.global_batch, training.critical_batch)

    def estimate(self, zero: int, mbs: int, ac: str, sp: bool, m: int) -> StepTime:
        """Seconds per optimiser step, by part."""
        return step_time(self.per_mb[ac, sp], self.p2p[sp], self.dp[zero], mbs, m, self.pp, self.vpp, self.dp_overlap,
                         self.sharing, self.step_fixed)

    def wrap(self, est: StepTime, ac: str) -> TimeEstimate:
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


def _column_parallel_gemms(model: ModelSpec, per_flop: float) -> tuple[tuple[tuple[float, float], ...], float]:
    """Seconds per sequence of each backward GEMM (the input gradient's, the weight gradient's: the
    same FLOPs) of one layer's column-parallel linears, with the share of the layers that have each
    (the fused qkv projection; fc1, the gate and up projections or GELU's up projection, in a dense
    layer, or a MoE layer's shared expert's: its routed experts' tokens move by the all-to-all), and
    of the head's. ``per_flop``: seconds per sequence per FLOP per token of one device's share."""
    up = model.mlp_mats - 1
    moe = model.moe_layers / model.layers
    linears = ((1.0, model.hidden * (model.q_dim + 2 * model.kv_heads * model.head_dim)),
               (1 - moe, up * model.hidden * model.ffn), (moe, up * model.hidden * model.shared_expert_ffn))
    layer = tuple((share, backward_gemm_flops_per_token(w) * per_flop) for share, w in linears if share and w)
    return layer, backward_gemm_flops_per_token(model.hidden * model.vocab) * per_flop


def _behind(comm: tuple[float, float], gemms: tuple[tuple[tuple[float, float], ...], float], *,
            exposed: bool) -> tuple[tuple[float, float], tuple[float, float]]:
    """What each of ``gemms`` (``_column_parallel_gemms``) hides of one collective of ``comm`` issued
    before it (``exposed``: what it leaves exposed), summed over one layer's linears (the mean over
    the layers), and the head's: two (per sequence, constant) pairs."""
    def one(gemm: float) -> tuple[float, float]:
        h1, h0 = _hidden_behind(comm, gemm)
        return (comm[0] - h1, comm[1] - h0) if exposed else (h1, h0)

    layer, head = gemms
    parts = [(share, one(g)) for share, g in layer]
    return (sum(w * x[0] for w, x in parts), sum(w * x[1] for w, x in parts)), one(head)


def _dp_seconds(counts: tuple[int, int, int], ag: float, rs: float, ar: float) -> float:
    """Seconds of ``counts`` (all-gathers, reduce-scatters, all-reduces) of the data-parallel
    collectives priced ``ag``, ``rs``, ``ar``: one slot of a stack's program (a count of 0 or 1
    adds exactly nothing or the price, so the sums are those the programs were written with)."""
    n_ag, n_rs, n_ar = counts
    return n_ag * ag + n_rs * rs + n_ar * ar


@lru_cache(maxsize=4096)
def mesh_time(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, f: CalibrationFactors, tp: int,
              cp: int, ep: int, dp: int, pp: int, vpp: int, order: tuple[str, ...] = AXES) -> MeshTime:
    """The prepared (and shared: never mutate it) time model of one mesh placed in ``order``."""
    placement = _place((tp, cp, ep, dp, pp), order, cluster.devices_per_node, cluster.domain_devices)
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
    """Predicted step time of ``layout`` and what follows from it (tokens/s, MFU, useful tokens/s),
    trained with ``training.stack`` (tuner/_stack.py; see ``MeshTime``).

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
