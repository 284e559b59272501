"""Truth 'jittery': slower NVLink, an optimiser step bound by memory bandwidth, straggling data ranks,
heavy-tailed run noise and per-layout memory jitter.

GEMM efficiency 88% x tanh(m n / 1.5e6) x k/(k+1024) (a steeper small-GEMM cliff than the others);
intra-node links at 60% of nominal, inter-node at 80%; TP collectives 80% exposed (partly overlapped),
gradient traffic 80% hidden. The optimiser step reads and writes 16 bytes per local parameter (fp32
master, Adam m and v, gradients) at 60% of 3.35 TB/s HBM — so sharding the optimiser (ZeRO >= 1)
shortens it; the slowest of the data ranks sets the pace (1% per doubling of their count). Runs: 3%
lognormal noise plus a 15% straggler in one run out of 20. Memory: a caching-allocator reserve of 12%
over what is allocated, 0.8 GiB context, selective recompute saving only 5%, and a persistent
per-layout jitter of 3% (which tensors happen to be live together).
"""

from __future__ import annotations

import math
import random

from benchmarks.truths import GiB, Truth, layout_luck, param_counts


class Jittery(Truth):
    name = "jittery"
    run_sigma = 0.03
    luck_sigma = 0.04
    exposed = {"tp": 0.8, "cp": 0.9, "ep": 1.0, "dp": 0.2, "pp": 1.0}

    def gemm_eff(self, m: float, n: float, k: float) -> float:
        return 0.88 * math.tanh(m * n / 1.5e6) * k / (k + 1024)

    def attn_eff(self, tokens: float) -> float:
        return 0.45 * min(1.0, tokens / 4096) ** 0.5

    def link(self, layout, axis: str, cluster) -> tuple[float, float]:
        from benchmarks.truths import spans

        if spans(layout, axis, cluster.devices_per_node) > 1:
            return cluster.inter_node_bandwidth * 0.8, cluster.inter_node_latency
        return cluster.intra_node_bandwidth * 0.6, cluster.intra_node_latency * 2

    def extra(self, layout, model, cluster, training, m: int) -> float:
        dense, expert = param_counts(model)
        local = (dense * model.layers / layout.pp + model.vocab * model.hidden) / layout.tp
        local += expert * model.layers / layout.pp / layout.tp / layout.ep
        if layout.zero >= 1:
            local /= layout.dp * layout.cp
        optimizer = 16 * local / (3.35e12 * 0.6)
        return optimizer

    def step_time(self, layout, model, cluster, training) -> float:
        ranks = layout.dp * layout.ep
        return super().step_time(layout, model, cluster, training) * (1 + 0.01 * math.log2(ranks))

    def run_noise(self, rng: random.Random) -> float:
        straggler = 1.15 if rng.random() < 0.05 else 1.0
        return rng.lognormvariate(0.0, self.run_sigma) * straggler

    def memory(self, layout, model, cluster, training) -> float:
        t = layout.mbs * model.seq_len / layout.cp
        h = model.hidden
        if layout.ac == "full":
            per_layer = 2 * t * h + 0.0
        else:
            per_layer = t * h * (14 + 22 / layout.tp) if not layout.sp else t * h * 36 / layout.tp
            if layout.ac == "selective":
                per_layer *= 0.95
        acts = per_layer * model.layers / layout.pp * self.in_flight(layout, training)
        logits = t * model.vocab / layout.tp * 4 * (2 if layout.pp == 1 else 0)
        allocated = self.model_state_bytes(layout, model, training) + acts + logits
        return (allocated * 1.12 + 0.8 * GiB) * layout_luck(self.name + "-mem", layout.key, 0.03)
