"""How the analytical model reproduces published training runs, for one training stack.

For each published row (tuner.REFERENCE_LAYOUTS, each with its source) it plans the row's problem as
``meshtune plan --reference NAME --stack STACK`` does (the default space, no option set by hand) and
prints: the reported utilisation; the model's prediction for the published layout itself; the plan's
best layout on the published mesh (tp, cp, ep, dp, pp) and its prediction; where that mesh ranks
among the plan's feasible layouts; the plan's best layout. Then whether Llama 3's 128K row is below
its 8K rows, as Table 4 of Dubey et al. 2024 reports. The ground truth is the papers' numbers, never
the model. Prints only; the pass/fail lines are for the reader:

    PYTHONPATH=$PWD python benchmarks/bench_published.py [--stack megatron] [--tolerance 0.10] [--top 0.01]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tuner import (  # noqa: E402
    REFERENCE_LAYOUTS,
    Problem,
    estimate_memory,
    estimate_time,
    layout_violation,
    place,
    plan,
)


def mesh_of(layout) -> tuple[int, ...]:
    return layout.tp, layout.cp, layout.ep, layout.dp, layout.pp


def utilisation(ref, time_estimate) -> float:
    return time_estimate.hfu if ref.mfu_kind == "hardware" else time_estimate.mfu


def row(name: str, stack: str) -> dict:
    ref = REFERENCE_LAYOUTS[name]
    training = dataclasses.replace(ref.training, stack=stack)
    kw = dict(model=ref.model, cluster=ref.cluster, training=training)
    # The published layout may not run on this stack (an embedding-only stage on meshtune's workers).
    refused = layout_violation(ref.layout, **kw)
    exact_t = None if refused else estimate_time(ref.layout, placement=place(ref.layout, ref.cluster), **kw)
    exact_m = None if refused else estimate_memory(ref.layout, **kw)
    started = time.process_time()
    p = plan(problem=Problem(**kw))
    seconds = time.process_time() - started
    mesh = mesh_of(ref.layout)
    at = next((i for i, e in enumerate(p.entries) if mesh_of(e.layout) == mesh), None)
    best_on_mesh = p.entries[at] if at is not None else None
    return {
        "name": name, "reported": ref.reported_mfu, "kind": ref.mfu_kind,
        "exact": None if refused else utilisation(ref, exact_t), "refused": refused and refused[0],
        "exact_fits": None if refused else exact_m.fits, "exact_gib": None if refused else exact_m.total / 2**30,
        "mesh": None if best_on_mesh is None else utilisation(ref, best_on_mesh.time),
        "mesh_layout": None if best_on_mesh is None else best_on_mesh.layout.key,
        "rank": None if at is None else at + 1, "entries": len(p.entries), "seconds": seconds,
        "best": p.entries[0].layout.key if p.entries else None,
        "best_u": utilisation(ref, p.entries[0].time) if p.entries else None,
    }


def _u(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stack", default="megatron")
    ap.add_argument("--tolerance", type=float, default=0.10)
    ap.add_argument("--top", type=float, default=0.01, help="share of the plan the published mesh must rank in")
    args = ap.parse_args()
    print(f"stack {args.stack}; load average before: {os.getloadavg()[0]:.1f}")
    rows = [row(n, args.stack) for n in sorted(REFERENCE_LAYOUTS)]
    print(f"{'row':28s} {'reported':>9s} {'layout':>14s} {'best on mesh':>14s} {'mesh rank':>22s}  best of the plan")
    for r in rows:
        exact = (f"refused: {r['refused']}" if r["refused"] else
                 f"{r['exact']:.3f} {r['exact'] / r['reported'] - 1:+.1%}" + ("" if r["exact_fits"] else " OOM"))
        mesh = "-" if r["mesh"] is None else f"{r['mesh']:.3f} {r['mesh'] / r['reported'] - 1:+.1%}"
        rank = "-" if r["rank"] is None else f"#{r['rank']:,}/{r['entries']:,} {r['rank'] / r['entries']:.2%}"
        print(f"{r['name']:28s} {r['reported']:6.2f} {r['kind'][0]} {exact:>14s} {mesh:>14s} {rank:>22s}  "
              f"{r['best']} {r['best_u']:.3f} ({r['seconds']:.2f} s)")
        print(f"{'':28s} best on the published mesh: {r['mesh_layout']}")
    by = {r["name"]: r for r in rows}
    long, shorts = by.get("llama3-405b-128k-h100"), [by[n] for n in ("llama3-405b-8k-h100", "llama3-405b-16k-h100")
                                                     if n in by]
    if long and shorts:
        for what in ("exact", "mesh"):
            below = all(long[what] is not None and s[what] is not None and long[what] < s[what] for s in shorts)
            print(f"Llama 3 128K below the 8K rows ({what}): {below} "
                  f"({_u(long[what])} vs {', '.join(_u(s[what]) for s in shorts)})")
    within = [r for r in rows if r["mesh"] is not None and abs(r["mesh"] / r["reported"] - 1) <= args.tolerance]
    top = [r for r in rows if r["rank"] is not None and r["rank"] <= args.top * r["entries"]]
    print(f"best on the published mesh within {args.tolerance:.0%}: {len(within)}/{len(rows)}; "
          f"published mesh in the top {args.top:.0%}: {len(top)}/{len(rows)}; "
          f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
