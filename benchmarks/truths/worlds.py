"""Generated misspecified worlds: seeded ground truths that differ from meshtune's model per part.

``generate(seed)`` draws one world (``world-<seed>``) the way real clusters differ from an analytical
model: memory per part (weights, gradients, optimizer states, activations in flight, logits,
gather buffers) scaled by factors from 0.5x to 3x with mixed signs (states over-predicted while
activations or logits are under-predicted, or the reverse), a fixed CUDA context and a communicator
allocation per parallel group, a per-layout memory jitter; for time one of three GEMM efficiency
families (saturating, tile-wave quantised, a small-GEMM cliff) with drawn constants, drawn link
efficiencies and oversubscription, exposed-communication fractions per axis, kernel-launch costs,
per-layout luck and run noise with stragglers. Each world also draws its problem (llama3-8b,
llama3-70b or mixtral-8x7b on 16-32 H100) and a second model for sweeps that learn across models.
Like the other truths it counts bytes and FLOPs its own way (benchmarks/truths/__init__.py), never
with ``tuner``'s formulas, except the two worlds of ``special`` (see there).
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass, field

from benchmarks.truths import GiB, Truth, layer_activation_bytes, layout_luck, param_counts, spans

PARTS = ("weights", "grads", "optimizer", "activations", "logits", "buffers")
N_WORLDS = 20
H100 = {"preset": "h100-sxm"}
# (model, nodes of 8 H100, global batch tokens, the other model a learning sweep runs first); each
# has 5,800-11,100 valid layouts so that a 60-trial sweep plans in seconds on one core.
PROBLEMS = (
    ("llama3-8b", 2, 1 << 20, "llama3-1b"),
    ("llama3-8b", 4, 1 << 21, "llama3-1b"),
    ("llama3-70b", 4, 1 << 21, "llama3-8b"),
    ("mixtral-8x7b", 2, 1 << 20, "llama3-8b"),
)
# Parameters per model, for the feasibility bound on the drawn state factors only.
PARAMS = {"llama3-1b": 1.2e9, "llama3-8b": 8.0e9, "llama3-70b": 70.6e9, "mixtral-8x7b": 46.7e9}
H100_BYTES = 80e9


@dataclass(frozen=True)
class WorldParams:
    """Everything one world draws (what makes it differ from the model), validated on creation."""

    factors: dict[str, float]
    context_bytes: float  # CUDA context, cuBLAS workspaces, the framework's own
    comm_bytes: float  # communicator buffers per parallel group of size > 1 (NCCL channels)
    selective_keep: float  # share of a layer's activations selective recompute keeps
    mem_sigma: float  # per-layout memory jitter (which tensors happen to be live together)
    gemm: tuple  # (family, constants...)
    attn: tuple[float, float]  # attention core efficiency a * t / (t + c)
    intra: float  # achieved share of the nominal intra-node bandwidth
    inter: float  # achieved share of the nominal inter-node bandwidth
    oversub: float  # bandwidth divides by 1 + oversub per extra node a group spans
    exposed: dict[str, float]
    launch_us: float  # per kernel launch, 30 launches per layer and pass
    luck_sigma: float
    run_sigma: float
    straggler: float  # probability that one run is 15% slow
    problem: tuple = field(default=PROBLEMS[0])

    def __post_init__(self) -> None:
        if set(self.factors) != set(PARTS):
            raise ValueError(f"factors must name exactly {PARTS}, got {sorted(self.factors)}")
        if not all(0.4 <= f <= 3.0 for f in self.factors.values()):
            raise ValueError(f"memory factors must lie in [0.4, 3], got {self.factors}")
        if not 0 < self.selective_keep <= 1:
            raise ValueError(f"selective_keep must be in (0, 1], got {self.selective_keep}")


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def draw(seed: int) -> WorldParams:
    """The parameters of ``world-<seed>`` (deterministic: a string-seeded ``random.Random``)."""
    rng = random.Random(f"meshtune-world-{seed}")
    pattern = seed % 3
    if pattern == 0:  # states over-predicted by the model, activations and logits under-predicted
        states = [rng.uniform(0.5, 0.9) for _ in range(3)]
        acts = [rng.uniform(1.3, 3.0), rng.uniform(1.3, 3.0)]
    elif pattern == 1:  # states under-predicted (fp32 master copies, unfused optimizer), activations over
        states = [rng.uniform(1.1, 3.0) for _ in range(3)]
        acts = [rng.uniform(0.5, 0.9), _log_uniform(rng, 0.5, 3.0)]
    else:  # every part on its own
        states = [_log_uniform(rng, 0.5, 3.0) for _ in range(3)]
        acts = [_log_uniform(rng, 0.5, 3.0), _log_uniform(rng, 0.5, 3.0)]
    # heavy states need the small problems; other patterns may draw any problem
    problem = PROBLEMS[rng.randrange(2)] if pattern == 1 else PROBLEMS[rng.randrange(len(PROBLEMS))]
    model, nodes = problem[0], problem[1]
    # The states must leave room on the leanest layout (ZeRO-3 over every device): at most 45% of a
    # device, else no layout of the problem fits and the world measures nothing.
    bound = 0.45 * H100_BYTES / (16 * PARAMS[model] / (nodes * 8))
    mean = sum(states) / 3
    if mean > bound:
        states = [max(0.4, s * bound / mean) for s in states]
    factors = dict(zip(PARTS, [*states, *acts, _log_uniform(rng, 0.5, 3.0)], strict=True))
    family = rng.choice(("saturating", "waves", "cliff"))
    if family == "saturating":
        gemm = (family, rng.uniform(0.7, 0.9), rng.uniform(64, 512), rng.uniform(256, 1024), rng.uniform(128, 512))
    elif family == "waves":
        gemm = (family, rng.uniform(0.65, 0.85), rng.choice((128, 256)), rng.choice((108, 132)), rng.uniform(256, 1024))
    else:
        gemm = (family, rng.uniform(0.75, 0.92), rng.uniform(5e5, 3e6), rng.uniform(512, 2048))
    return WorldParams(
        factors=factors,
        context_bytes=rng.uniform(0.5, 2.5) * GiB,
        comm_bytes=rng.uniform(0.1, 0.75) * GiB,
        selective_keep=rng.uniform(0.6, 0.95),
        mem_sigma=rng.uniform(0.0, 0.03),
        gemm=gemm,
        attn=(rng.uniform(0.3, 0.55), rng.uniform(256, 4096)),
        intra=rng.uniform(0.55, 0.85),
        inter=rng.uniform(0.4, 0.85),
        oversub=rng.uniform(0.0, 0.5),
        exposed={"tp": rng.uniform(0.6, 1.0), "cp": rng.uniform(0.3, 0.9), "ep": rng.uniform(0.8, 1.4),
                 "dp": rng.uniform(0.1, 0.6), "pp": rng.uniform(0.8, 1.0)},
        launch_us=rng.uniform(0.0, 8.0),
        luck_sigma=rng.uniform(0.01, 0.05),
        run_sigma=rng.uniform(0.015, 0.05),
        straggler=rng.uniform(0.0, 0.06),
        problem=problem,
    )


class World(Truth):
    """One generated world; its problem is ``self.problem`` (a sweep spec's model/cluster/training)."""

    def __init__(self, name: str, params: WorldParams) -> None:
        self.name, self.p = name, params
        self.run_sigma, self.luck_sigma, self.exposed = params.run_sigma, params.luck_sigma, params.exposed
        model, nodes, tokens, other = params.problem
        self.model_name, self.other_model = model, other
        self.problem = {"model": model, "cluster": {**H100, "nodes": nodes},
                        "training": {"global_batch_tokens": tokens}}

    def __repr__(self) -> str:
        return f"World({self.name!r}, {self.model_name} on {self.problem['cluster']['nodes'] * 8} H100)"

    # --- time ------------------------------------------------------------------------------------
    def gemm_eff(self, m: float, n: float, k: float) -> float:
        g = self.p.gemm
        if g[0] == "saturating":  # each dimension saturates
            return g[1] * (m / (m + g[2])) * (n / (n + g[3])) * (k / (k + g[4]))
        if g[0] == "waves":  # output tiles in waves over the SMs
            tiles = math.ceil(m / g[2]) * math.ceil(n / g[2])
            return g[1] * tiles / (math.ceil(tiles / g[3]) * g[3]) * k / (k + g[4])
        return g[1] * math.tanh(m * n / g[2]) * k / (k + g[3])

    def attn_eff(self, tokens: float) -> float:
        a, c = self.p.attn
        return a * tokens / (tokens + c)

    def link(self, layout, axis: str, cluster) -> tuple[float, float]:
        n = spans(layout, axis, cluster.devices_per_node)
        if n > 1:
            return cluster.inter_node_bandwidth * self.p.inter / (1 + self.p.oversub * (n - 1)), cluster.inter_node_latency
        return cluster.intra_node_bandwidth * self.p.intra, cluster.intra_node_latency

    def extra(self, layout, model, cluster, training, m: int) -> float:
        passes = 3 + {"none": 0, "selective": 0.5, "full": 1}[layout.ac]
        return m * model.layers / layout.pp * 30 * self.p.launch_us * 1e-6 * passes

    def run_noise(self, rng: random.Random) -> float:
        slow = 1.15 if rng.random() < self.p.straggler else 1.0
        return rng.lognormvariate(0.0, self.run_sigma) * slow

    # --- memory ----------------------------------------------------------------------------------
    def memory_parts(self, layout, model, cluster, training) -> dict[str, float]:
        """Bytes per part of the fullest device, before the world's factors (textbook counts)."""
        bpe = 2 if training.precision == "bf16" else 4
        t = layout.mbs * model.seq_len / layout.cp
        h = model.hidden
        w, g, o = self.state_parts(layout, model, training)
        if layout.ac == "full":
            per_layer = 2 * t * h  # the layer's input, kept as a checkpoint
        else:
            per_layer = layer_activation_bytes(t, h, layout.tp, layout.sp, bpe)
            if model.experts:  # the routed tokens' expert activations (3 matmuls' inputs and outputs)
                per_layer += model.top_k * t * 3 * model.expert_ffn / layout.tp * bpe
            if layout.ac == "selective":
                per_layer *= self.p.selective_keep
        inflight = self.in_flight(layout, training)
        acts = per_layer * model.layers / layout.pp * inflight
        if layout.ac == "full":  # one layer's working set is rebuilt during its backward
            acts += t * h * 34 / layout.tp
        logits = t * model.vocab / layout.tp * 4 * 2  # fp32 logits and their gradient
        dense, expert = param_counts(model)
        gather = 2 * (dense + expert / layout.ep) / layout.tp * bpe if layout.zero >= 3 else 0.0
        # stage 0 holds the most activations; the last stage (when pp > 1) one micro-batch and the logits
        last_acts = acts if layout.pp == 1 else acts / inflight
        return {"weights": w, "grads": g, "optimizer": o, "activations": acts, "logits": logits,
                "buffers": gather, "last_activations": last_acts}

    def memory(self, layout, model, cluster, training) -> float:
        p = self.memory_parts(layout, model, cluster, training)
        f = self.p.factors
        states = sum(f[k] * p[k] for k in ("weights", "grads", "optimizer")) + f["buffers"] * p["buffers"]
        stage0 = states + f["activations"] * p["activations"] + (f["logits"] * p["logits"] if layout.pp == 1 else 0)
        last = states + f["activations"] * p["last_activations"] + f["logits"] * p["logits"]
        groups = sum(getattr(layout, a) > 1 for a in ("tp", "cp", "ep", "dp", "pp"))
        fixed = self.p.context_bytes + self.p.comm_bytes * groups
        return (max(stage0, last) + fixed) * layout_luck(self.name + "-mem", layout.key, self.p.mem_sigma)


class RelativeWorld(World):
    """A world whose memory is ``scale`` x meshtune's own prediction, every part alike. Its memory is
    defined relative to the model under test (``tuner.estimate_memory``), so it only tests how the
    search adapts to a uniformly wrong memory model; its step time is a generated world's."""

    def __init__(self, name: str, params: WorldParams, scale: float) -> None:
        super().__init__(name, params)
        self.scale = scale

    def memory(self, layout, model, cluster, training) -> float:
        return self.scale * _predicted(layout, model, cluster, training)


@functools.lru_cache(maxsize=100_000)
def _predicted(layout, model, cluster, training) -> int:
    import tuner  # only the relative worlds read the model under test

    return tuner.estimate_memory(layout, model=model, cluster=cluster, training=training).total


def generate(seed: int) -> World:
    """``world-<seed>``: the same world for the same seed, in every process."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return World(f"world-{seed}", draw(seed))


# The two worlds used by the memory tests: llama3-8b on 16 H100 (PROBLEMS[0]), time of world 0.
SPECIAL = {"world-mem2x": 2.0, "world-memhalf": 0.5}


def special(name: str) -> RelativeWorld:
    """``world-mem2x`` (memory 2x the model's prediction) or ``world-memhalf`` (half of it)."""
    if name not in SPECIAL:
        raise ValueError(f"special world must be one of {sorted(SPECIAL)}, got {name!r}")
    p = draw(0)
    params = WorldParams(**{**p.__dict__, "problem": PROBLEMS[0]})
    return RelativeWorld(name, params, SPECIAL[name])


def worlds(n: int = N_WORLDS, *, start: int = 0) -> list[World]:
    """``world-<start>`` .. ``world-<start + n - 1>``."""
    return [generate(s) for s in range(start, start + n)]


def by_name(name: str) -> World:
    """A generated world (``world-<seed>``) or a special one by its name."""
    if name in SPECIAL:
        return special(name)
    head, _, tail = name.partition("-")
    if head != "world" or not tail.isdigit():
        raise ValueError(f"world must be 'world-<seed>' or one of {sorted(SPECIAL)}, got {name!r}")
    return generate(int(tail))
