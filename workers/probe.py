"""The cluster probe's rank program: short microbenchmarks on a trial's own rank processes.

``probe_rank(request, device=...)`` runs on every rank of an initialised process group (called as
``train_trial`` is, by workers/_launch.py ``run_rank``), reads what to measure from
``request.options["probe"]`` (``probe_request`` builds it) and returns raw timings, the same on
every rank; tuner/_probe.py ``derive`` turns them into the figures the models read. It imports
torch only (no Ray). Phases, each only if the budget has room: memory, links, compute, layers,
steps; repetitions sized to ``target_s``, clocks reduced with MAX. The phases: docs/workers.md,
"Cluster probe".
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tuner import (
    PROBE_VERSION,
    Layout,
    TrainingSpec,
    attention_core_flops_per_token,
    cluster_spec,
    probe_targets,
)
from workers import measure
from workers._contract import TrialRequest

# Payload bytes per collective: a latency point, and two to read the bandwidth from.
SIZES = {"cpu": (256, 256 * 1024, 2 * 1024 * 1024), "cuda": (4096, 8 * 2**20, 64 * 2**20)}
DEFAULT_BUDGET_S = 60.0
TARGET_S = 0.15  # seconds of repetitions per measurement (each at least MIN_REPS)
MIN_REPS, MAX_REPS = 3, 20
SHARING_SPAN_S = 0.05  # one run of the compute-sharing measurement
LAYER_REPS = 4  # a real layer's time is the noisiest figure on a shared host: more repetitions


def probe_request(model: Any, cluster: Any, training: TrainingSpec, *, tp_sp: list[tuple[int, bool]],
                  max_mbs: int = 4, recompute: tuple[str, ...] = (), budget_s: float = DEFAULT_BUDGET_S,
                  target_s: float = TARGET_S, workload: str = "builtin", trial_id: str | None = None,
                  layer_reps: int = LAYER_REPS) -> TrialRequest:
    """The request a backend's ``run_program`` runs ``probe_rank`` with: a data-parallel layout of the
    cluster's world size (the gang every layout of that size reuses), what to measure in its options.
    The cluster is stripped of earlier probed figures: a probe measures, it reads none."""
    cluster = dataclasses.replace(cluster_spec(cluster), probed=None)
    targets = probe_targets(cluster, tp_sp)
    world = cluster.devices
    training = dataclasses.replace(training, global_batch=max(world, 2 * world))
    # Micro-batches of 1 and of the largest size the layouts use (at most 4, at least 2): the
    # per-sequence part of a layer is read across that span, not extrapolated beyond it.
    seqs = [1, min(4, max(2, int(max_mbs)))]
    options = {"probe": {"tiers": targets.tiers, "layers": [list(x) for x in targets.layers], "seqs": seqs,
                         "recompute": [ac for ac in recompute if ac != "none"], "budget_s": budget_s,
                         "target_s": target_s, "layer_reps": layer_reps}}
    return TrialRequest(model=model, cluster=cluster, training=training, layout=Layout(dp=world),
                        warmup_steps=0, measure_steps=1, step_timeout_s=max(60.0, 2 * budget_s), options=options,
                        workload=workload, trial_id=trial_id)


class _Clock:
    """The probe's budget, agreed by every rank (each decision reduces elapsed time with MAX)."""

    def __init__(self, budget_s: float, device: torch.device) -> None:
        self.t0, self.budget_s, self.device = time.monotonic(), budget_s, device

    def left(self) -> float:
        return self.budget_s - _max(time.monotonic() - self.t0, self.device)


def _max(value: float, device: torch.device, group: Any = None) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _timed(fn: Callable[[], Any], device: torch.device, target_s: float, *, member: bool = True,
           min_reps: int = MIN_REPS) -> float:
    """The slowest rank's median seconds of ``fn`` (every rank calls this; ``member=False`` ranks
    take no part in ``fn`` and only join the agreement)."""
    return _timed_together([fn] if member else [], device, target_s, min_reps=min_reps, calls=1)[0]


def _timed_together(fns: list[Callable[[], Any]], device: torch.device, target_s: float, *,
                    min_reps: int = MIN_REPS, calls: int | None = None) -> list[float]:
    """The slowest rank's median seconds of each of ``fns``, timed in turns (one call of each per
    repetition), so that the host's load drifting during the measurement moves them alike: their
    differences are what the figures are read from. ``calls``: how many the ranks agree on (a rank
    with no ``fns`` takes part in the agreement only)."""

    def once(fn: Callable[[], Any]) -> float:
        measure.synchronize(device)
        t0 = time.perf_counter()
        fn()
        measure.synchronize(device)
        return time.perf_counter() - t0

    n = len(fns) if calls is None else calls
    first = sum(once(fn) for fn in fns)  # also the warm-up
    reps = int(min(MAX_REPS, max(min_reps, target_s / max(_max(first, device), 1e-6))))
    times: list[list[float]] = [[] for _ in range(n)]
    for _ in range(reps if fns else 0):
        for i, fn in enumerate(fns):
            times[i].append(once(fn))
    return [_max(statistics.median(t) if t else 0.0, device) for t in times]


def environment_rank(request: TrialRequest, *, device: torch.device) -> dict[str, Any]:
    """Nothing: ``run_rank`` adds this rank's environment to any program's report (workers/env.py),
    which is what the caller asks for (is the stored probe of this environment?)."""
    return {}


def probe_rank(request: TrialRequest, *, device: torch.device) -> dict[str, Any]:
    """Run the probe on this rank (see the module docstring); the raw timings, equal on every rank."""
    from workers.env import fingerprint
    from workers.rank_model import _precision

    opts = dict(request.options["probe"])
    clock = _Clock(float(opts.get("budget_s", DEFAULT_BUDGET_S)), device)
    target = float(opts.get("target_s", TARGET_S))
    notes: list[str] = []
    dtype = _precision(request.training, device, notes, dict(request.options))
    raw: dict[str, Any] = {"version": PROBE_VERSION, "dtype": str(dtype).removeprefix("torch."),
                           "world": dist.get_world_size(), "device": device.type, "notes": notes,
                           "requested_layers": [list(x) for x in opts.get("layers") or []]}
    phases: dict[str, float] = {}

    def phase(name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.monotonic()
        try:
            return fn()
        finally:
            phases[name] = time.monotonic() - t0

    raw["memory"] = phase("memory", lambda: _memory(request, device, dtype))
    raw["links"] = phase("links", lambda: _links(opts.get("tiers") or {}, device, target, clock, notes))
    raw["gemm"], raw["attention"] = phase("compute", lambda: _compute(request.model, device, dtype, target))
    raw["layers"], raw["steps"] = phase("layers", lambda: _layers(request, device, opts, target, clock, notes))
    raw["wall_s"], raw["phases_s"] = time.monotonic() - clock.t0, phases
    with contextlib.suppress(OSError):  # a shared host's load is part of what was measured: say what it was
        raw["host_load"] = list(os.getloadavg())
    raw["env"] = fingerprint(device.type)
    return raw


# --- 1. memory --------------------------------------------------------------------------------------


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise OSError("no VmRSS in /proc/self/status")


def _memory(request: TrialRequest, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The process's baseline, and what the allocator holds over live tensors of the model's shapes."""
    measure.release_memory(device)
    spec = request.model
    s, h = spec.seq_len, spec.hidden
    shapes = [(s, h), (s, spec.ffn), (s, spec.kv_heads * spec.head_dim), (s, spec.vocab), (h, spec.ffn)]
    target = (64 if device.type == "cpu" else 1024) * 2**20
    with contextlib.suppress(OSError):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            free, total = torch.cuda.mem_get_info(device)
            baseline = total - free - torch.cuda.memory_reserved(device)
            held0, live0 = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
        else:
            baseline = _rss_bytes()
            held0, live0 = baseline, 0
        keep: list[torch.Tensor] = []
        live, i = 0, 0
        while live < target:  # allocate, free every third, allocate on: a training step's churn
            t = torch.ones(shapes[i % len(shapes)], dtype=dtype, device=device)
            keep.append(t)
            live += t.numel() * t.element_size()
            if i % 3 == 2:
                gone = keep.pop(len(keep) // 2)
                live -= gone.numel() * gone.element_size()
            i += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            held, live = torch.cuda.memory_reserved(device) - held0, torch.cuda.memory_allocated(device) - live0
        else:
            held = _rss_bytes() - held0
        del keep
        measure.release_memory(device)
        return {"baseline_bytes": int(_max(baseline, device)), "live_bytes": int(live), "held_bytes": int(held)}
    return {}


# --- 2. links -----------------------------------------------------------------------------------------


def _links(tiers: dict[str, list[int]], device: torch.device, target: float, clock: _Clock,
           notes: list[str]) -> list[dict[str, Any]]:
    rank, out = dist.get_rank(), []
    sizes = SIZES["cuda" if device.type == "cuda" else "cpu"]
    for tier, ranks in tiers.items():
        group = dist.new_group(ranks)  # every rank creates every group
        if clock.left() < 0.5 * clock.budget_s:
            notes.append(f"links of tier {tier}: skipped, over half the probe's budget")
            continue
        n, member = len(ranks), rank in ranks
        for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"):
            times = []
            for nbytes in sizes:
                fn = _collective(op, nbytes, n, group, ranks, device) if member else (lambda: None)
                times.append(_timed(fn, device, target / len(sizes), member=member))
            out.append({"tier": tier, "op": op, "group": 2 if op == "send_recv" else n, "sizes": list(sizes),
                        "times_s": times})
    return out


def _collective(op: str, nbytes: int, n: int, group: Any, ranks: list[int], device: torch.device) -> Callable[[], None]:
    """One call of ``op`` with the formula's ``nbytes`` (tuner/_probe.py FORMULAS): the whole for
    all-reduce, all-gather and reduce-scatter, what each rank holds for all-to-all, one message
    for send/recv (timed as half a ping-pong between the group's first two ranks)."""
    elt = 4
    k = max(1, nbytes // (elt * n))  # a shard
    if op == "all_reduce":
        x = torch.ones(k * n, device=device)
        return lambda: dist.all_reduce(x, group=group)
    if op == "all_gather":
        x, y = torch.ones(k, device=device), torch.empty(k * n, device=device)
        return lambda: dist.all_gather_into_tensor(y, x, group=group)
    if op == "reduce_scatter":
        x, y = torch.ones(k * n, device=device), torch.empty(k, device=device)
        return lambda: dist.reduce_scatter_tensor(y, x, group=group)
    if op == "all_to_all":
        x, y = torch.ones(k * n, device=device), torch.empty(k * n, device=device)
        return lambda: dist.all_to_all_single(y, x, group=group)
    a, b = ranks[0], ranks[1]
    me = dist.get_rank()
    x = torch.ones(max(1, nbytes // elt), device=device)
    if me not in (a, b):
        return lambda: None

    def ping_pong() -> None:  # two messages: the formula's one message is half of it
        if me == a:
            dist.send(x, b)
            dist.recv(x, b)
        else:
            dist.recv(x, a)
            dist.send(x, a)

    return lambda: ping_pong()


# --- 3. compute -----------------------------------------------------------------------------------------


def _compute(spec: Any, device: torch.device, dtype: torch.dtype, target: float) -> tuple[dict, dict]:
    """GEMM and attention FLOP/s at one sequence's tokens of the model (every rank at once)."""
    s = spec.seq_len
    ffn, tokens = spec.ffn, s
    if spec.is_moe:  # a routed expert sees top_k/experts of the tokens
        ffn, tokens = spec.expert_ffn, max(1, s * spec.top_k // spec.experts)
    kv = spec.kv_heads * spec.head_dim
    shapes = [(s, spec.hidden, spec.q_dim), (s, spec.hidden, kv), (s, spec.hidden, kv), (s, spec.q_dim, spec.hidden)]
    shapes += [(tokens, spec.hidden, ffn)] * (spec.mlp_mats - 1) + [(tokens, ffn, spec.hidden)]
    g = torch.Generator(device="cpu").manual_seed(0)
    mats = [(torch.randn(t, i, generator=g).to(device, dtype), torch.randn(i, o, generator=g).to(device, dtype),
             torch.randn(t, o, generator=g).to(device, dtype)) for t, i, o in shapes]

    def gemms() -> None:
        for a, w, grad in mats:
            a @ w  # forward
            grad @ w.T  # input gradient
            a.T @ grad  # weight gradient

    flops = float(sum(3 * 2 * t * i * o for t, i, o in shapes))
    gemm = {"flops": flops, "time_s": _timed(gemms, device, target)}
    # Long runs of them on every rank, then on rank 0 alone, every other rank waiting (blocked, not
    # spinning) in a collective: how much of each other's compute the devices of one host take when
    # all of them compute (CPU ranks sharing cores: about ranks / cores; devices of their own: 1).
    # Each run spans several scheduler time slices (SHARING_SPAN_S), or short bursts never meet.
    n = max(1, int(SHARING_SPAN_S / max(gemm["time_s"], 1e-6)))

    def run() -> None:
        for _ in range(n):
            gemms()

    gemm["busy_s"] = _timed(run, device, 0.0)
    gemm["alone_s"] = _timed(run, device, 0.0, member=dist.get_rank() == 0)
    q = torch.randn(1, spec.heads, s, spec.head_dim, generator=g).to(device, dtype).requires_grad_()
    k = torch.randn(1, spec.heads, s, spec.head_dim, generator=g).to(device, dtype).requires_grad_()
    v = torch.randn(1, spec.heads, s, spec.head_dim, generator=g).to(device, dtype).requires_grad_()
    grad = torch.randn(1, spec.heads, s, spec.head_dim, generator=g).to(device, dtype)

    def attention() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)

    attn_flops = attention_core_flops_per_token(spec.q_dim, s, causal=True) * s
    attn = {"flops": attn_flops, "time_s": _timed(attention, device, target)}
    return gemm, attn


# --- 4.-5. real layers and steps ---------------------------------------------------------------------------


def _depths(spec: Any, device: torch.device) -> tuple[int, int]:
    """Two depths to cut the model to (their difference is one or more layers): up to 4 layers where
    the fp32 weights and gradients of 4 fit in a tenth of the device's memory, else 2."""
    hi = min(spec.layers, 4)
    if device.type == "cuda":
        per_layer = 8 * spec.params / max(spec.layers, 1)
        total = torch.cuda.get_device_properties(device).total_memory
        while hi > 2 and hi * per_layer > total / 10:
            hi -= 1
    return (1, hi) if hi > 1 else (1, 1)


def _layers(request: TrialRequest, device: torch.device, opts: dict[str, Any], target: float, clock: _Clock,
            notes: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    spec = request.model
    lo, hi = _depths(spec, device)
    if hi == lo:
        notes.append("layers: the model has one layer; no per-layer figure")
        return [], None
    out, steps = [], None
    g = torch.Generator(device="cpu").manual_seed(1)
    seqs = [int(x) for x in opts.get("seqs") or (1, 2)]
    batch = tuple(torch.randint(0, spec.vocab, (max(seqs), spec.seq_len), generator=g).to(device) for _ in range(2))
    for tp, sp in [tuple(x) for x in opts.get("layers") or [(1, False)]]:
        if clock.left() < 0.1 * clock.budget_s:
            notes.append(f"layers tp={tp}{' sp' if sp else ''}: skipped, over the probe's budget (the nearest "
                         "probed tp stands in)")
            continue
        row, stepped = _layer_config(request, device, int(tp), bool(sp), (lo, hi), seqs, batch, target,
                                     int(opts.get("layer_reps", LAYER_REPS)),
                                     list(opts.get("recompute") or []) if (tp, sp) == (1, False) else [])
        out.append(row)
        steps = steps or stepped
        gc.collect()
    return out, steps


def _layer_config(request: TrialRequest, device: torch.device, tp: int, sp: bool, depths: tuple[int, int],
                  seqs: list[int], batch: tuple[torch.Tensor, torch.Tensor], target: float,
                  layer_reps: int, recompute: list[str]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """One (tp, sp): the model at both depths built at once (their layers are timed in turns), one
    micro-batch of each size forward+backward, gradient sync off; for tp=1 also each activation
    checkpointing of ``recompute`` (timed in turns with the plain layers), the optimiser and real
    steps of the deeper model with and without its gradient all-reduce, and under ZeRO-3."""
    from workers._data_parallel import zero1_micro_batch
    from workers.rank_model import build_rank_model

    spec, world = request.model, dist.get_world_size()
    dp, (lo, hi) = world // tp, depths
    tokens, targets = batch
    positions = torch.arange(spec.seq_len, device=device)
    built: dict[Any, Any] = {}
    for ac in ("none", *recompute):
        for depth in depths:
            sub = dataclasses.replace(request, model=dataclasses.replace(spec, layers=depth),
                                      layout=Layout(tp=tp, dp=dp, sp=sp, mbs=1, ac=ac),  # type: ignore[arg-type]
                                      training=dataclasses.replace(request.training, global_batch=dp))
            built[depth if ac == "none" else (ac, depth)] = build_rank_model(sub, device)

    def step(depth: Any, n: int, sync: bool = False) -> None:
        rm = built[depth]
        # As the training loop leaves them (workers/rank_model.py ``train_step``): no gradient
        # tensors, so the backward allocates them, as every real step's does.
        rm.optimizer.zero_grad(set_to_none=True)
        zero1_micro_batch(rm.par.chunks, last=sync)
        with torch.autocast(device.type, dtype=rm.dtype, enabled=rm.autocast), rm.par.loss_context():
            loss = rm.par.loss_fn(rm.par.chunks[0][1](tokens[:n], positions), targets[:n])
            loss.backward()

    def opt(depth: int) -> None:
        built[depth].optimizer.step()
        built[depth].optimizer.zero_grad(set_to_none=False)  # the next repetition steps them all again

    combos = [(k, d, n) for k in ("none", *recompute) for n in seqs for d in depths]
    times = _timed_together([functools.partial(step, d if k == "none" else (k, d), n) for k, d, n in combos], device,
                            target * len(combos), min_reps=layer_reps)

    def fb(kind: str) -> list[list[float]]:
        return [[t for (k, _, m), t in zip(combos, times, strict=True) if k == kind and m == n] for n in seqs]

    row: dict[str, Any] = {"tp": tp, "dp": dp, "sp": sp, "layers": [lo, hi], "seqs": seqs, "fb_s": fb("none")}
    if recompute:
        row["recompute_fb_s"] = {ac: fb(ac) for ac in recompute}
    if (tp, sp) != (1, False):
        return row, None
    for depth in depths:
        step(depth, 1, True)  # gradients on the optimiser's (sharded) parameters: a synced backward
    o_lo, o_hi = _timed_together([functools.partial(opt, lo), functools.partial(opt, hi)], device, 2 * target)
    steps: dict[str, Any] = {"layers": [lo, hi], "optimizer_s": [o_lo, o_hi], "dp": dp, "seqs": 1}
    if dp > 1:  # real steps of the deeper model: its gradients all-reduced and not, and under ZeRO-3
        sub = dataclasses.replace(request, model=dataclasses.replace(spec, layers=hi),
                                  layout=Layout(dp=dp, zero=3, mbs=1),
                                  training=dataclasses.replace(request.training, global_batch=dp))
        built["zero3"] = build_rank_model(sub, device)
        step("zero3", 1, True)
        steps["step_nosync_s"], steps["step_sync_s"], steps["step_zero3_s"] = _timed_together(
            [lambda: (step(hi, 1), opt(hi)), lambda: (step(hi, 1, True), opt(hi)),
             lambda: (step("zero3", 1, True), opt("zero3"))], device, 3 * target, min_reps=layer_reps)
    return row, steps
