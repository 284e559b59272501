"""Plan every layout of a 405B-class model on 16,384 devices (2,048 nodes x 8 H100) and time it.

Goal (issue 2): under 1 s on the 2-core development machine. Prints the enumeration and the full
plan (placement + memory + time for every valid layout) separately, best of ``--repeats`` runs,
each on a cold cache, so the numbers are comparable run to run.

    python benchmarks/bench_plan.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

from tuner import cluster_spec, enumerate_layouts, model_spec, plan, training_spec
from tuner._memory import rank_params
from tuner._partition import _partition
from tuner._placement import _place


def _clear_caches() -> None:
    for cached in (rank_params, _partition, _place):
        cached.cache_clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = model_spec("llama3-405b")
    cluster = cluster_spec({"preset": "h100-sxm", "nodes": 2048})
    training = training_spec({"global_batch_tokens": 16 * 2**20}, seq_len=model.seq_len)  # Llama 3: 16M tokens

    enum_s, plan_s = [], []
    for _ in range(args.repeats):
        _clear_caches()
        t0 = time.perf_counter()
        enum = enumerate_layouts(model=model, cluster=cluster, training=training)
        t1 = time.perf_counter()
        result = plan(model=model, cluster=cluster, training=training, enumeration=enum)
        t2 = time.perf_counter()
        enum_s.append(t1 - t0)
        plan_s.append(t2 - t0)
    n = len(enum.valid)
    best_enum, best_plan = min(enum_s), min(plan_s)
    print(f"model {model.name} on {cluster.devices:,} devices ({cluster.nodes:,} nodes x {cluster.devices_per_node})")
    print(f"considered {enum.considered:,} layouts: {n:,} valid, {len(result.entries):,} feasible, "
          f"{len(result.infeasible):,} over memory")
    print(f"enumerate: {best_enum:.3f} s ({n / best_enum:,.0f} layouts/s)")
    print(f"plan (enumerate + place + memory + time + sort): {best_plan:.3f} s ({n / best_plan:,.0f} layouts/s)")
    print(f"goal < 1 s: {'met' if best_plan < 1.0 else 'NOT met'} (ratio to goal {best_plan / 1.0:.2f})")
    if result.entries:
        b = result.entries[0]
        print(f"best: {b.layout.key}  {b.time.tokens_per_s_per_device:,.0f} tok/s/dev  MFU {b.time.mfu:.1%}  "
              f"{b.memory.total / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
