"""Plan every layout of llama3-405b on 16,384 and 131,072 H100s (2,048 and 16,384 nodes of 8, 16M-token
batches, the Llama 3 setting) and time it on one core.

Goal: at most 0.25 s for 16,384 GPUs and 1 s for 131,072 GPUs of CPU time on one core,
the best of ``--repeats`` runs, every valid layout enumerated and costed on cold caches (enumerate +
place + memory + time + sort, ``tuner.plan``). The process pins itself to one core and reads its
own CPU time (other processes on a shared machine add wall time, not this process's CPU time, but
they still slow it through shared caches: the load average is printed before and after).
``--sizes`` takes node counts. Read as node counts, the goal's sizes would be 131,072 GPUs in 0.25 s
and 1,048,576 GPUs (131,072 nodes) in 1 s: that reading is printed too (not judged).

Measured side by side in one run, per size:
- ``plan``: ``tuner.plan`` from scratch (every cache of the tuner cleared first);
- ``bare loop``: a loop that only enumerates the same candidates, one tuple per (tp, cp, ep, dp,
  pp, schedule, vpp, mbs, zero, ac, sp) combination the enumeration walks (every degree a divisor),
  checked to count exactly the plan's considered layouts plus their folded twins; ``plan / bare
  loop`` is what placing, costing and ranking every layout costs over merely walking them;
- ``per-layout``: the straightforward path (check_layout, place, and the memory and time models
  built for each layout alone, nothing shared), timed on a sample and scaled to every layout;
- the plan's entries and rejections compared with the ones recorded before the planner was
  restructured for speed (tests/data/plan_golden.json, where the size is there; ``--no-check`` skips).

    python benchmarks/bench_plan.py [--repeats 5] [--sizes 2048,16384,131072] [--sample 300] [--core 0] [--no-check]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tuner import (  # noqa: E402
    Problem,
    SearchSpace,
    check_layout,
    cluster_spec,
    divisors,
    enumerate_layouts,
    model_spec,
    place,
    plan,
    training_spec,
)
from tuner._memory import MeshMemory, activation_table, mesh_memory, rank_params  # noqa: E402
from tuner._partition import _partition  # noqa: E402
from tuner._placement import _place  # noqa: E402
from tuner._realise import _builtin_capabilities, _collectives, _holding  # noqa: E402
from tuner._space import _schedules  # noqa: E402
from tuner._timing import CalibrationFactors, MeshTime, _flop_counts, mesh_time  # noqa: E402

GOALS = {2048: 0.25, 16384: 1.0}  # nodes of 8 -> CPU seconds on one core
OTHER_READING = {16384: 0.25, 131072: 1.0}  # the goal's GPU counts read as node counts
CACHES = (rank_params, _partition, _place, mesh_memory, mesh_time, activation_table, _holding, _collectives,
          _flop_counts, _builtin_capabilities)


def _clear_caches() -> None:
    for cached in CACHES:
        cached.cache_clear()


def _cpu(fn):  # -> (result, cpu seconds, wall seconds)
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - c0, time.perf_counter() - w0


def bare_loop(model, cluster, space: SearchSpace) -> int:
    """Every candidate the enumeration walks, as a tuple, and nothing else: the count."""
    world, n = cluster.devices, 0
    for tp in divisors(world):
        sps = [s for s in space.sp if not s or tp > 1]
        for cp in divisors(world // tp):
            rest = world // (tp * cp)
            for ep in divisors(rest) if model.is_moe else (1,):
                for pp in divisors(rest // ep):
                    dp = rest // (ep * pp)
                    for schedule, vpp in _schedules(pp, space):
                        for mbs in space.mbs:
                            for zero in space.zero:
                                for ac in space.ac:
                                    for sp in sps:
                                        candidate = (tp, cp, ep, dp, pp, schedule, vpp, mbs, zero, ac, sp)
                                        n += candidate is not None
    return n


def per_layout_seconds(sample, kw, f: CalibrationFactors) -> float:
    """CPU seconds of the straightforward path over ``sample``: every model built for one layout."""
    model, cluster, training = kw["model"], kw["cluster"], kw["training"]

    def run() -> None:
        for layout in sample:
            m = check_layout(layout, **kw)
            placement = place(layout, cluster)
            d = {"tp": layout.tp, "cp": layout.cp, "ep": layout.ep, "dp": layout.dp, "pp": layout.pp, "vpp": layout.vpp}
            MeshMemory(model, cluster, training, **d).estimate(layout.zero, layout.mbs, layout.ac, layout.sp,
                                                               layout.schedule, m)
            MeshTime(model, cluster, training, f, placement, **d).estimate(layout.zero, layout.mbs, layout.ac,
                                                                           layout.sp, m)
            _clear_caches()

    return _cpu(run)[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", default="2048,16384,131072", help="node counts (8 GPUs each), comma-separated")
    parser.add_argument("--sample", type=int, default=300, help="layouts timed on the per-layout path")
    parser.add_argument("--core", type=int, default=0, help="the one core to run on")
    parser.add_argument("--no-check", action="store_true", help="skip the comparison with the recorded plans")
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.core})
    model = model_spec("llama3-405b")
    training = training_spec({"global_batch_tokens": 16 * 2**20}, seq_len=model.seq_len)  # Llama 3: 16M tokens
    space, f = SearchSpace().for_stack(training), CalibrationFactors()
    golden = None
    if not args.no_check:
        from tests.helpers import plan_golden as golden  # the recorded plans and how they are compared

    load0 = os.getloadavg()
    print(f"one core (cpu {args.core}), best of {args.repeats}; load average {load0[0]:.2f} {load0[1]:.2f} "
          f"{load0[2]:.2f} on {os.cpu_count()} cpus")
    verdicts = []
    for nodes in (int(x) for x in args.sizes.split(",")):
        cluster = cluster_spec({"preset": "h100-sxm", "nodes": nodes})
        kw = {"model": model, "cluster": cluster, "training": training}
        plan_t, bare_t = [], []
        for _ in range(args.repeats):  # interleaved, so a busy moment disturbs both alike
            _clear_caches()
            result, cpu, wall = _cpu(lambda: plan(problem=Problem(**kw)))  # noqa: B023 - called at once
            plan_t.append((cpu, wall))
            walked, cpu, _ = _cpu(lambda: bare_loop(model, cluster, space))  # noqa: B023
            bare_t.append(cpu)
        enum = enumerate_layouts(problem=Problem(**kw))
        considered = len(result.entries) + sum(result.rejected.values())
        assert walked == considered + result.twins == enum.considered + enum.twins, (walked, considered)
        sample = enum.valid[:: max(1, enum.count // args.sample)]
        naive = per_layout_seconds(sample, kw, f) * enum.count / len(sample)
        (cpu, wall), bare = min(plan_t), min(bare_t)
        print(f"\n{cluster.devices:,} GPUs ({nodes:,} nodes x 8): {considered:,} layouts considered "
              f"({result.twins:,} twins folded), {enum.count:,} valid: {len(result.entries):,} fit, "
              f"{len(result.infeasible):,} over memory; rejected by reason "
              + ", ".join(f"{k} {v:,}" for k, v in sorted(result.rejected.items(), key=lambda kv: -kv[1])))
        print(f"  plan        cpu {cpu:.3f} s  (median {statistics.median(c for c, _ in plan_t):.3f}; wall {wall:.3f} s)"
              f"  {enum.count / cpu:,.0f} valid layouts/s")
        print(f"  bare loop   cpu {bare:.3f} s  ({walked:,} candidates walked)   plan / bare loop = {cpu / bare:.1f}x")
        print(f"  per-layout  cpu {naive:.3f} s  (sampled {len(sample):,}, scaled)   per-layout / plan = {naive / cpu:.0f}x")
        b = result.best
        if b is not None:
            print(f"  best: {b.layout.key}  {b.time.tokens_per_s_per_device:,.0f} tok/s/dev  MFU {b.time.mfu:.1%}  "
                  f"{b.memory.total / 2**30:.1f} GiB")
        name = f"llama3-405b-h100x{nodes}"
        if golden is not None and name in golden.PROBLEMS:
            same = golden.summary(result) == golden.load()[name]
            print(f"  entries and rejections identical to the recorded plan: {'yes' if same else 'NO'}")
            verdicts.append(same)
        goal = GOALS.get(nodes)
        if goal is not None:
            print(f"  goal <= {goal} s of one core: {'met' if cpu <= goal else 'NOT met'} ({cpu / goal:.2f} of it)")
            verdicts.append(cpu <= goal)
        other = OTHER_READING.get(nodes)
        if other is not None:
            print(f"  the goal's other reading ({nodes:,} GPUs in <= {other} s, i.e. {cluster.devices:,} here): "
                  f"{'met' if cpu <= other else 'not met'} ({cpu / other:.2f} of it)")
    load1 = os.getloadavg()
    print(f"\nload average after: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    sys.exit(0 if all(verdicts) else 1)


if __name__ == "__main__":
    main()
