"""Ground truths for the search benchmark, written apart from meshtune's cost model.

Each truth answers "how long does one optimiser step of this layout take, and how much memory does
the fullest device hold" for a simulated cluster whose behaviour meshtune does not know. None of them
imports or copies anything from ``tuner``'s formulas (``tuner/_timing.py``, ``_memory.py``,
``_formulas.py``): they read ``ModelSpec``/``ClusterSpec``/``TrainingSpec``/``Layout`` fields as
inputs and count FLOPs, bytes and collectives their own way. What differs between them (and from the
tuner) is deliberately what differs between real clusters: the GEMM efficiency curve, which
collectives are exposed, memory overheads (allocator, communicator buffers, context), and per-layout
"luck" (kernel selection, placement) that no analytical model sees.

The shared counting in this module is textbook:
- FLOPs per token of a decoder layer: 2 x (multiply-accumulate count) of its matmuls, attention core
  2 x 2 x s x h for scores and values, halved for the causal mask (Vaswani et al. 2017; Narayanan et
  al. 2021, Sec. 3.4); backward = 2 x forward.
- ring collectives: all-reduce moves 2(n-1)/n of the buffer, all-gather / reduce-scatter (n-1)/n,
  all-to-all (n-1)/n (Thakur et al. 2005, "Optimization of collective communication operations in
  MPICH").
- rank order: tp fastest-varying, then cp, ep, dp, pp (Megatron-LM's default order), so a group of
  an axis with stride ``st`` and degree ``d`` stays within a node when ``st*d <= devices_per_node``.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass

GiB = 1 << 30
ORDER = ("tp", "cp", "ep", "dp", "pp")


@dataclass(frozen=True)
class Outcome:
    """One noise-free answer of a truth: step seconds (None: OOM) and the fullest device's bytes."""

    step_s: float | None
    peak_bytes: int


def layout_luck(name: str, key: str, sigma: float) -> float:
    """A persistent per-layout factor (kernel selection, rank placement): the same every run."""
    h = int.from_bytes(hashlib.blake2b(f"{name}|{key}".encode(), digest_size=8).digest(), "big")
    return math.exp(random.Random(h).gauss(0.0, sigma))


def spans(layout, axis: str, per_node: int) -> int:
    """How many nodes one group of ``axis`` touches (1 = all on one node)."""
    stride = 1
    for a in ORDER:
        if a == axis:
            break
        stride *= getattr(layout, a)
    d = getattr(layout, axis)
    return max(1, (stride * d) // per_node) if stride * d > per_node else 1


def head_dim(model) -> int:
    return model.hidden // model.heads


def layer_matmuls(model, tp: int, ep: int) -> list[tuple[int, int, float]]:
    """(output width per rank, inner dim, tokens multiplier) of each forward matmul of one layer."""
    h, hd = model.hidden, head_dim(model)
    qkv = (model.heads + 2 * model.kv_heads) * hd
    mm = [(qkv // tp, h, 1.0), (h, model.heads * hd // tp, 1.0)]
    if model.experts:
        f = model.expert_ffn
        # each token visits top_k experts; a rank holds experts/ep of them and sees the tokens routed there
        mm += [(2 * f // tp, h, float(model.top_k)), (h, f // tp, float(model.top_k)), (model.experts, h, 1.0 / tp)]
    elif model.mlp == "swiglu":
        mm += [(2 * model.ffn // tp, h, 1.0), (h, model.ffn // tp, 1.0)]
    else:
        mm += [(model.ffn // tp, h, 1.0), (h, model.ffn // tp, 1.0)]
    return mm


def param_counts(model) -> tuple[int, int]:
    """(dense parameters per layer, expert parameters per layer)."""
    h, hd = model.hidden, head_dim(model)
    attn = h * (model.heads + 2 * model.kv_heads) * hd + model.heads * hd * h + 2 * h
    if model.experts:
        return attn + model.experts * h, model.experts * 3 * h * model.expert_ffn
    k = 3 if model.mlp == "swiglu" else 2
    return attn + k * h * model.ffn, 0


def ring(kind: str, nbytes: float, n: int, bw: float, lat: float) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    frac = {"allreduce": 2 * (n - 1) / n, "allgather": (n - 1) / n, "alltoall": (n - 1) / n}[kind]
    steps = {"allreduce": 2 * (n - 1), "allgather": n - 1, "alltoall": n - 1}[kind]
    return frac * nbytes / bw + steps * lat


def layer_activation_bytes(t: float, h: int, tp: int, sp: bool, bpe: int) -> float:
    """Activations one transformer layer keeps for its backward, per rank: t*h*(10 + 24/tp) bytes in
    bf16 without sequence parallelism, t*h*34/tp with it (Korthikanti et al. 2022, Table 2, without
    the attention-score term that flash attention does not store)."""
    return t * h * (34 / tp if sp else 10 + 24 / tp) * bpe / 2


def microbatches(layout, training) -> int:
    return max(1, training.global_batch // (layout.dp * layout.ep * layout.mbs))


class Truth:
    """The common frame: subclasses give the curves. ``answer`` is noise-free; ``noise`` per run."""

    name = "truth"
    run_sigma = 0.03
    luck_sigma = 0.02

    def env(self) -> dict[str, str]:
        # What a real trial's environment says (workers/env.py): the sweep's cluster fingerprint.
        return {"backend": "truth", "device_name": f"{self.name} device", "torch": "truth", "nccl": f"{self.name}-nccl",
                "device_kind": "cuda"}

    def answer(self, layout, model, cluster, training) -> Outcome:
        peak = int(self.memory(layout, model, cluster, training))
        if peak > cluster.device_memory:
            return Outcome(None, peak)
        step = self.step_time(layout, model, cluster, training) * layout_luck(self.name, layout.key, self.luck_sigma)
        return Outcome(step, peak)

    def run_noise(self, rng: random.Random) -> float:
        return rng.lognormvariate(0.0, self.run_sigma)

    def memory(self, layout, model, cluster, training) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    # --- hooks of the step-time frame (each truth gives its own) ---------------------------------
    def gemm_eff(self, m: float, n: float, k: float) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def attn_eff(self, tokens: float) -> float:
        return 0.4

    def link(self, layout, axis: str, cluster) -> tuple[float, float]:
        """(bytes/s, seconds per message) of one group of ``axis``."""
        if spans(layout, axis, cluster.devices_per_node) > 1:
            return cluster.inter_node_bandwidth * 0.7, cluster.inter_node_latency
        return cluster.intra_node_bandwidth * 0.75, cluster.intra_node_latency

    # fractions of each collective's time that stays on the critical path
    exposed = {"tp": 1.0, "cp": 0.7, "ep": 1.0, "dp": 0.4, "pp": 1.0}

    def step_time(self, layout, model, cluster, training) -> float:
        s, h, bpe = model.seq_len, model.hidden, 2 if training.precision == "bf16" else 4
        peak = cluster.peak_flops if training.precision == "bf16" else cluster.peak_flops / 2
        t = layout.mbs * s / layout.cp  # tokens per micro-batch on one rank
        layers = model.layers / layout.pp
        fwd = 0.0
        for n, k, mult in layer_matmuls(model, layout.tp, layout.ep):
            tokens = t * mult  # experts: with balanced routing a rank's experts see top_k x its tokens
            fwd += 2 * tokens * n * k / (peak * self.gemm_eff(tokens, n, k))
        core = 2 * 2 * t * s * h / layout.tp * 0.5 / layout.cp * 1.0  # causal: half the scores
        fwd_core = core / (peak * self.attn_eff(t))
        recompute = {"none": 0.0, "selective": fwd_core, "full": fwd + fwd_core}[layout.ac]
        compute_mb = layers * (3 * (fwd + fwd_core) + recompute)
        head = 2 * t * h * model.vocab / layout.tp * 3 / (peak * self.gemm_eff(t, model.vocab / layout.tp, h))
        compute_mb += head  # the last stage carries the output layer: the pipeline runs at its pace
        comm_mb = 0.0
        act = t * h * bpe
        if layout.tp > 1:
            bw, lat = self.link(layout, "tp", cluster)
            per = ring("allreduce", act, layout.tp, bw, lat)
            n_coll = {"none": 4, "selective": 5, "full": 6}[layout.ac]
            comm_mb += self.exposed["tp"] * layers * n_coll * per * (0.95 if layout.sp else 1.0)
        if layout.cp > 1:
            bw, lat = self.link(layout, "cp", cluster)
            kv = t * 2 * model.kv_heads * head_dim(model) * bpe / layout.tp
            comm_mb += self.exposed["cp"] * layers * 3 * ring("allgather", kv * layout.cp, layout.cp, bw, lat)
        if layout.ep > 1:
            bw, lat = self.link(layout, "ep", cluster)
            disp = t * model.top_k * h * bpe / layout.tp
            comm_mb += self.exposed["ep"] * layers * 4 * ring("alltoall", disp, layout.ep, bw, lat)
        m = microbatches(layout, training)
        busy = m * (compute_mb + comm_mb)
        bubble = (layout.pp - 1) / layout.vpp * (compute_mb + comm_mb) if layout.pp > 1 else 0.0
        p2p = 0.0
        if layout.pp > 1:
            bw, lat = self.link(layout, "pp", cluster)
            p2p = self.exposed["pp"] * m * 2 * layout.vpp * (act / layout.tp / bw + lat)
        dense, expert = param_counts(model)
        dense_rank = (dense * model.layers / layout.pp + model.vocab * h / layout.pp) / layout.tp
        expert_rank = expert * model.layers / layout.pp / layout.tp / layout.ep
        dp_group = layout.dp * layout.cp
        grad = 0.0
        if dp_group * layout.ep > 1:
            bw, lat = self.link(layout, "dp", cluster)
            grad = ring("allreduce", dense_rank * 4, dp_group * layout.ep, bw, lat)
            grad += ring("allreduce", expert_rank * 4, dp_group, bw, lat)
            if layout.zero >= 3:  # parameters gathered again for every micro-batch's forward and backward
                grad += 2 * m * ring("allgather", (dense_rank + expert_rank) * bpe, dp_group, bw, lat)
        hidden = min(grad * (1 - self.exposed["dp"]), busy)
        return busy + bubble + p2p + grad - hidden + self.extra(layout, model, cluster, training, m)

    def extra(self, layout, model, cluster, training, m: int) -> float:
        """Per-step costs a truth adds on top (launch overheads, stragglers); 0 by default."""
        return 0.0

    # --- memory helpers -----------------------------------------------------------------------------
    def state_parts(self, layout, model, training) -> tuple[float, float, float]:
        """(weights, gradients, Adam state) bytes of the fullest pp stage (stage 0 holds the embedding):
        bf16 weights, fp32 gradients, fp32 master + m + v, each sharded per its ZeRO stage
        (Rajbhandari et al. 2020, Fig. 1)."""
        dense, expert = param_counts(model)
        h = model.hidden
        dense_rank = (dense * model.layers / layout.pp + model.vocab * h) / layout.tp
        expert_rank = expert * model.layers / layout.pp / layout.tp / layout.ep
        shard_d = layout.dp * layout.cp * layout.ep
        shard_e = layout.dp * layout.cp
        w = gr = opt = 0.0
        for n, g in ((dense_rank, shard_d), (expert_rank, shard_e)):
            w += 2 * n / (g if layout.zero >= 3 else 1)
            gr += 4 * n / (g if layout.zero >= 2 else 1)
            opt += 12 * n / (g if layout.zero >= 1 else 1)
        return w, gr, opt

    def model_state_bytes(self, layout, model, training) -> float:
        """Weights, gradients and Adam state of the fullest pp stage, together."""
        return sum(self.state_parts(layout, model, training))

    def in_flight(self, layout, training) -> int:
        """Micro-batches whose activations stage 0 holds at its peak."""
        m = microbatches(layout, training)
        if layout.pp == 1:
            return 1
        if layout.schedule == "gpipe":
            return m
        extra = (layout.pp - 1) // layout.vpp if layout.schedule == "interleaved" else 0
        return min(m, layout.pp + extra)


def registry() -> dict[str, Truth]:
    from benchmarks.truths.congested import Congested
    from benchmarks.truths.jittery import Jittery
    from benchmarks.truths.roofline import Roofline

    return {t.name: t for t in (Roofline(), Congested(), Jittery())}
