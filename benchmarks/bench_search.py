"""Search efficiency of the sweep engine on the simulate backend, methods side by side in one run.

Problem: llama3-70b on 64 H100 (8 nodes x 8), 4M-token batches — 19,536 valid layouts of which ~5,300
fit in memory. For each seed every method runs a full sweep through the real engine and store
(SQLite), one trial at a time, and we count the trials (pruned ones included: each is a trial number)
until a layout whose *noise-free* model throughput is within 2% of the best layout's is measured.
The simulate backend adds 3% lognormal noise to each measurement, as on a shared machine.

Methods: TPE with warm start (the model's top-5 layouts first), random search, grid order (the tuner's
enumeration order), TPE without warm start. Reported: the median over seeds of trials-to-2%
(">N" when a run did not get there within N trials) and how many runs got there at all, next to the
exact expectation for random search without replacement ((N+1)/(K+1) for K targets among N layouts)
and the exact grid position (grid order does not depend on the seed).

Two "truths": ``exact`` — the simulate backend answers from the same model the engine uses to warm
start (so warm start is right up to noise: an upper bound on its value); ``off`` — the simulate backend
answers from different efficiency/bandwidth/overlap factors, so the engine's model is misspecified the
way an uncalibrated model is on a new cluster, and warm start is only roughly right.

    python benchmarks/bench_search.py --seeds 10 --max-trials 300
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tuner  # noqa: E402
from api import store  # noqa: E402
from api.engine import SweepRunner  # noqa: E402
from api.services import sweeps as svc  # noqa: E402
from api.settings import Settings  # noqa: E402
from api.spec import SweepSpec  # noqa: E402
from workers.simulate import SimulateBackend  # noqa: E402

PROBLEM = {
    "model": "llama3-70b",
    "cluster": {"preset": "h100-sxm", "nodes": 8},
    "training": {"global_batch_tokens": 4194304},
}
TRUTHS = {
    "exact": None,
    # Slower links and less DP overlap than the model assumes: its top-5 layouts land at 86-91% of
    # the true best, so warm start alone does not reach the 2% target.
    "off": {"intra_bw_efficiency": 0.3, "inter_bw_efficiency": 0.1, "dp_overlap": 0.2},
}
METHODS = {
    "tpe+warm": {"sampler": "tpe", "warm_start_top_k": 5},
    "random": {"sampler": "random", "warm_start_top_k": 0},
    "grid": {"sampler": "grid", "warm_start_top_k": 0},
    "tpe": {"sampler": "tpe", "warm_start_top_k": 0},
}


def true_throughput(factors: tuner.CalibrationFactors | None) -> tuple[list[str], dict[str, float]]:
    """Enumeration order, and the noise-free tokens/s per device of every layout that fits under the
    simulated truth (what the simulate backend centres its measurements on)."""
    model, cluster, training = SweepSpec.model_validate(PROBLEM).to_problem()
    valid = tuner.enumerate_layouts(model=model, cluster=cluster, training=training).valid
    kw = {} if factors is None else {"factors": factors}
    truth = {}
    for lay in valid:
        if tuner.estimate_memory(lay, model=model, cluster=cluster, training=training).fits:
            truth[lay.key] = tuner.estimate_time(lay, model=model, cluster=cluster, training=training,
                                                 **kw).tokens_per_s_per_device
    return [lay.key for lay in valid], truth


def trials_to_target(sessions, sweep_id: int, truth: dict[str, float], target: float) -> int | None:
    with sessions() as s:
        rows = store.all_trials(s, sweep_id=sweep_id)
    for t in sorted(rows, key=lambda t: t.number):
        if t.status == "completed" and truth.get(t.layout_key, 0.0) >= target:
            return t.number + 1
    return None


def run_truth(name: str, factors: tuner.CalibrationFactors | None, args: argparse.Namespace) -> None:
    order, truth = true_throughput(factors)
    best = max(truth.values())
    target = 0.98 * best
    targets = {k for k, v in truth.items() if v >= target}
    model_order, model_truth = true_throughput(None)
    model_best = max(model_truth, key=model_truth.get)
    grid_at = next(i + 1 for i, k in enumerate(order) if k in targets)
    random_expect = (len(order) + 1) / (len(targets) + 1)
    print(f"\n== truth '{name}': {len(order)} valid layouts, {len(truth)} fit; best {best:.1f} tokens/s/device; "
          f"{len(targets)} layouts within 2%; the model's favourite is at {truth[model_best] / best:.1%} of the best")
    results: dict[str, list[int | None]] = {m: [] for m in METHODS}
    seconds: dict[str, float] = {m: 0.0 for m in METHODS}
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'bench.db'}"
        engine, sessions = store.open_store(url)
        settings = Settings(database_url=url, home=Path(tmp), max_concurrent_trials=1)
        for seed in range(args.seeds):
            for method, search in METHODS.items():
                if method == "grid" and seed > 0:  # seed-independent: run once, reuse
                    results[method].append(results[method][0])
                    continue
                spec = SweepSpec.model_validate({
                    **PROBLEM, "name": f"{method}-{seed}", "backend": "simulate",
                    "search": {**search, "max_trials": args.max_trials, "remeasure_top_k": 0, "seed": seed},
                })
                with sessions() as s:
                    sweep_id = svc.create_sweep(s, spec=spec, owner="bench").id
                t0 = time.perf_counter()
                backend = lambda spec, seed=seed: SimulateBackend(seed=seed, factors=factors)  # noqa: E731
                SweepRunner(settings, sessions=sessions, backend_factory=backend).run_sweep(sweep_id)
                seconds[method] += time.perf_counter() - t0
                results[method].append(trials_to_target(sessions, sweep_id, truth, target))
            print(f"  seed {seed}: " + ", ".join(
                f"{m}={results[m][-1] or '>' + str(args.max_trials)}" for m in METHODS), flush=True)
        engine.dispose()

    cap = args.max_trials + 1  # a run that never got there counts as beyond the budget for the median
    print(f"  trials to reach within 2% of the best (median over {args.seeds} seeds, budget {args.max_trials}):")
    expected = {"random": f"expected {random_expect:.0f}", "grid": f"exact position {grid_at}"}
    for method, vals in results.items():
        med = statistics.median(v if v is not None else cap for v in vals)
        shown = f">{args.max_trials}" if med >= cap else f"{med:g}"
        reached = sum(v is not None for v in vals)
        runs = 1 if method == "grid" else len(vals)
        print(f"    {method:9s} median {shown:>6s}  reached in {reached}/{len(vals)} runs  "
              f"{expected.get(method, ''):>22s}  ({seconds[method] / runs:.1f} s per sweep)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--max-trials", type=int, default=300)
    ap.add_argument("--truth", choices=[*TRUTHS, "all"], default="all")
    args = ap.parse_args()
    for name, factors in TRUTHS.items():
        if args.truth in (name, "all"):
            run_truth(name, None if factors is None else tuner.CalibrationFactors(**factors), args)


if __name__ == "__main__":
    main()
