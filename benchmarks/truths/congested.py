"""Truth 'congested': an oversubscribed inter-node fabric, wave-quantised GEMMs, launch overheads.

GEMM efficiency follows tile waves: 128x128 output tiles on 132 SMs, efficiency = 75% x (tiles /
(waves x 132)) x k/(k+512) (wave quantisation, NVIDIA's "Matrix Multiplication Background" guide).
Inter-node bandwidth is 55% of nominal and divides by 1 + 0.4 per extra node a group spans (a 2:1
oversubscribed fat tree); all-to-all runs at 70% of a ring's rate (exposed 1.4x). Every micro-batch
pays 30 kernel launches per layer and pass at 6 us each. Memory: 1.5 GiB context, 512 MiB NCCL
buffers per group, 10% fragmentation, expert activations at capacity factor 1.25 (Fedus et al. 2022),
each activation tensor rounded up to the allocator's 2 MiB blocks.
"""

from __future__ import annotations

import math

from benchmarks.truths import GiB, Truth, spans


class Congested(Truth):
    name = "congested"
    run_sigma = 0.04
    luck_sigma = 0.03
    exposed = {"tp": 1.0, "cp": 0.8, "ep": 1.4, "dp": 0.5, "pp": 1.0}

    def gemm_eff(self, m: float, n: float, k: float) -> float:
        tiles = math.ceil(m / 128) * math.ceil(n / 128)
        waves = math.ceil(tiles / 132)
        return 0.75 * tiles / (waves * 132) * k / (k + 512)

    def attn_eff(self, tokens: float) -> float:
        return 0.38

    def link(self, layout, axis: str, cluster) -> tuple[float, float]:
        n = spans(layout, axis, cluster.devices_per_node)
        if n > 1:
            return cluster.inter_node_bandwidth * 0.55 / (1 + 0.4 * (n - 1)), cluster.inter_node_latency * 1.5
        return cluster.intra_node_bandwidth * 0.7, cluster.intra_node_latency

    def extra(self, layout, model, cluster, training, m: int) -> float:
        passes = 3 + {"none": 0, "selective": 0.5, "full": 1}[layout.ac]
        return m * model.layers / layout.pp * 30 * 6e-6 * passes

    def memory(self, layout, model, cluster, training) -> float:
        t = layout.mbs * model.seq_len / layout.cp
        h = model.hidden
        block = 2 * 1024 * 1024

        def rounded(nbytes: float) -> float:
            return math.ceil(nbytes / block) * block

        if layout.ac == "full":
            per_layer = rounded(2 * t * h)
        else:
            dense = 18 * t * h / (layout.tp if layout.sp else 1) + 16 * t * h / layout.tp
            moe = 0.0
            if model.experts:
                moe = 1.25 * model.top_k * t * (3 * model.expert_ffn / layout.tp * 2 + 2 * h)
            per_layer = sum(rounded(x / 4) for x in (dense, dense, moe, moe))
            if layout.ac == "selective":
                per_layer -= rounded(6 * t * h / layout.tp)
        acts = per_layer * model.layers / layout.pp * self.in_flight(layout, training)
        logits = rounded(t * model.vocab / layout.tp * 6)
        groups = sum(getattr(layout, a) > 1 for a in ("tp", "cp", "ep", "dp", "pp"))
        states = self.model_state_bytes(layout, model, training)
        return (states + (acts + (logits if layout.pp == 1 else 0)) * 1.10 + 1.5 * GiB + 0.5 * GiB * groups)
