"""Truth 'roofline': an H100-like cluster where small GEMMs lose efficiency smoothly.

GEMM efficiency saturates in each dimension (m/(m+256) x n/(n+512) x k/(k+256), peak 82%): wide
tensor parallelism and small micro-batches are punished more than a constant efficiency says. TP
collectives fully exposed, CP K/V gathers half hidden, 70% of the gradient traffic hidden behind the
backward. Memory: 1 GiB of context, 256 MiB of communicator buffers per parallel group of size > 1,
7% allocator fragmentation on activations; activations counted per layer as t*h*(10 + 24/tp) bytes
without sequence parallelism, t*h*34/tp with it (the per-layer counts of Korthikanti et al. 2022,
Table 2, without the attention-score term that flash attention does not store).
"""

from __future__ import annotations

from benchmarks.truths import GiB, Truth, layer_activation_bytes


class Roofline(Truth):
    name = "roofline"
    run_sigma = 0.03
    luck_sigma = 0.02
    exposed = {"tp": 1.0, "cp": 0.5, "ep": 1.0, "dp": 0.3, "pp": 1.0}

    def gemm_eff(self, m: float, n: float, k: float) -> float:
        return 0.82 * (m / (m + 256)) * (n / (n + 512)) * (k / (k + 256))

    def attn_eff(self, tokens: float) -> float:
        return 0.5 * tokens / (tokens + 2048)

    def memory(self, layout, model, cluster, training) -> float:
        bpe = 2 if training.precision == "bf16" else 4
        t = layout.mbs * model.seq_len / layout.cp
        h = model.hidden
        if layout.ac == "full":
            per_layer = 2 * t * h
        else:
            per_layer = layer_activation_bytes(t, h, layout.tp, layout.sp, bpe)
            if layout.ac == "selective":
                per_layer *= 0.85
        layers = model.layers / layout.pp
        acts = per_layer * layers * self.in_flight(layout, training) * 1.07
        if layout.ac == "full":  # one layer's working set is rebuilt during its backward
            acts += t * h * 34 / layout.tp
        logits = t * model.vocab / layout.tp * 4 * 2  # fp32 logits and their gradient
        groups = sum(getattr(layout, a) > 1 for a in ("tp", "cp", "ep", "dp", "pp"))
        stage0 = self.model_state_bytes(layout, model, training) + acts
        # the last stage holds one micro-batch's activations (1F1B) and the logits
        last = stage0 + logits if layout.pp == 1 else (
            self.model_state_bytes(layout, model, training) + acts / self.in_flight(layout, training) + logits)
        return max(stage0, last) + 1.0 * GiB + 0.25 * GiB * groups
