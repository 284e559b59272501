"""Search efficiency of the sweep engine against ground truths meshtune's model was not written from.

Three truths (benchmarks/truths: ``roofline``, ``congested``, ``jittery``), each its own GEMM
efficiency curve, exposed collectives, memory overheads and per-layout noise, each on its own problem
with >= 1,000 valid layouts. They plug into the real engine and store (SQLite) through
benchmarks/truth_backend.py (results labelled simulated). For each truth and seed every method runs a
full sweep, one trial at a time, and we count **launched** trials (pruned-by-model ones excluded: they
cost no device time) until a layout whose noise-free true throughput is within 2% of the true best
was measured, and the OOMs launched in the whole sweep. Reported: the median over seeds, next to
random search's exact expectation without replacement ((N+1)/(K+1) for K targets among N layouts).

Then learning across sweeps: on the ``roofline`` cluster a sweep of llama3-8b runs first; a sweep of
llama3-70b on the same cluster fingerprint then starts from what it learned, against a cold one.

    python benchmarks/bench_search.py --seeds 10 --max-trials 30      # the README's table
    python benchmarks/bench_search.py --truth none --seeds 10 --max-trials 30   # learning across sweeps only
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tuner  # noqa: E402
from api import store  # noqa: E402
from api.engine import SweepRunner  # noqa: E402
from api.settings import Settings  # noqa: E402
from api.spec import SweepSpec  # noqa: E402
from api.sweeps import service as svc  # noqa: E402
from benchmarks.truth_backend import TruthBackend  # noqa: E402
from benchmarks.truths import registry  # noqa: E402

H100 = {"preset": "h100-sxm"}
PROBLEMS = {
    "roofline": {"model": "llama3-70b", "cluster": {**H100, "nodes": 8}, "training": {"global_batch_tokens": 4194304}},
    "congested": {"model": "mixtral-8x7b", "cluster": {**H100, "nodes": 4}, "training": {"global_batch_tokens": 2097152}},
    "jittery": {"model": "llama3-8b", "cluster": {**H100, "nodes": 4}, "training": {"global_batch_tokens": 2097152}},
}
TRANSFER = ("roofline", {"model": "llama3-8b", "cluster": {**H100, "nodes": 8}, "training": {"global_batch_tokens": 4194304}})
METHODS = {
    "surrogate": {"sampler": "surrogate", "warm_start_top_k": 3},  # the default (api.spec.SearchSettings)
    "tpe+warm": {"sampler": "tpe", "warm_start_top_k": 3},  # Optuna 5 TPE: multivariate by default
    "random": {"sampler": "random", "warm_start_top_k": 0},
}
# Optuna's GPSampler costs ~100 s of coordinator time per 40-trial sweep on one core: --gp adds it.
GP = {"gp+warm": {"sampler": "gp", "warm_start_top_k": 3}}


def truth_table(truth, problem: dict) -> tuple[int, dict[str, float]]:
    """Valid layout count and the noise-free tokens/s per device of every layout that fits."""
    model, cluster, training = SweepSpec.model_validate(problem).to_problem()
    valid = tuner.enumerate_layouts(model=model, cluster=cluster, training=training).valid
    tokens = training.global_batch * model.seq_len / cluster.devices
    out = {}
    for lay in valid:
        a = truth.answer(lay, model, cluster, training)
        if a.step_s is not None:
            out[lay.key] = tokens / a.step_s
    return len(valid), out


def run_sweep(sessions, settings, truth, problem: dict, search: dict, seed: int, max_trials: int, name: str):
    spec = SweepSpec.model_validate({**problem, "name": name, "backend": "simulate", "search": {
        **search, "max_trials": max_trials, "remeasure_top_k": 0, "seed": seed}})
    with sessions() as s:
        sweep_id = svc.create_sweep(s, spec=spec, owner="bench").id
    backend = lambda spec, seed=seed: TruthBackend(truth, seed=seed)  # noqa: E731
    SweepRunner(settings, sessions=sessions, backend_factory=backend).run_sweep(sweep_id)
    with sessions() as s:
        return sorted(store.all_trials(s, sweep_id=sweep_id), key=lambda t: t.number)


def score(rows, truth: dict[str, float], target: float) -> tuple[int | None, int]:
    launched, ooms, reached = 0, 0, None
    for t in rows:
        if t.status == "pruned":
            continue
        launched += 1
        ooms += t.status == "oom"
        if reached is None and t.status == "completed" and truth.get(t.layout_key, 0.0) >= target:
            reached = launched
    return reached, ooms


def med(vals: list[int | None], cap: int) -> str:
    m = statistics.median(v if v is not None else cap + 1 for v in vals)
    return f">{cap}" if m > cap else f"{m:g}"


def run_truth(name: str, truth, args, table: list[str]) -> None:
    n_valid, truth_tps = truth_table(truth, PROBLEMS[name])
    best = max(truth_tps.values())
    targets = sum(v >= 0.98 * best for v in truth_tps.values())
    expect = (n_valid + 1) / (targets + 1)
    print(f"\n== truth '{name}' ({PROBLEMS[name]['model']}, {PROBLEMS[name]['cluster']['nodes'] * 8} H100): "
          f"{n_valid} valid layouts, {len(truth_tps)} fit; {targets} within 2% of the best", flush=True)
    methods = {**METHODS, **(GP if args.gp else {})}
    res = {m: ([], []) for m in methods}
    secs = {m: 0.0 for m in methods}
    for seed in range(args.seed_start, args.seed_start + args.seeds):
        for method, search in methods.items():
            # a fresh store per sweep: every sweep here is cold (nothing learned from the others)
            with tempfile.TemporaryDirectory() as tmp:
                url = f"sqlite:///{Path(tmp) / 'bench.db'}"
                engine, sessions = store.open_store(url)
                settings = Settings(database_url=url, home=Path(tmp), max_concurrent_trials=1)
                t0 = time.perf_counter()
                rows = run_sweep(sessions, settings, truth, PROBLEMS[name], search, seed, args.max_trials,
                                 f"{name}-{method}-{seed}")
                secs[method] += time.perf_counter() - t0
                engine.dispose()
            reached, ooms = score(rows, truth_tps, 0.98 * best)
            res[method][0].append(reached)
            res[method][1].append(ooms)
        print(f"  seed {seed}: " + ", ".join(f"{m}={res[m][0][-1] or '-'}/{res[m][1][-1]}oom" for m in methods),
              flush=True)
    for method, (reach, ooms) in res.items():
        table.append(f"| {name} | {n_valid} | {method} | {med(reach, args.max_trials)} | "
                     f"{sum(r is not None for r in reach)}/{len(reach)} | {statistics.median(ooms):g} | "
                     f"{expect:.0f} | {secs[method] / len(reach):.1f} |")


def run_transfer(args) -> None:
    name, first = TRANSFER
    truth = registry()[name]
    problem = PROBLEMS[name]
    _, truth_tps = truth_table(truth, problem)
    target = 0.98 * max(truth_tps.values())
    cold, warm = [], []
    for seed in range(args.seed_start, args.seed_start + args.seeds):
        for out, learn in ((cold, False), (warm, True)):
            with tempfile.TemporaryDirectory() as tmp:
                url = f"sqlite:///{Path(tmp) / 'bench.db'}"
                engine, sessions = store.open_store(url)
                settings = Settings(database_url=url, home=Path(tmp), max_concurrent_trials=1)
                if learn:  # another model on the same cluster first
                    run_sweep(sessions, settings, truth, first, METHODS["surrogate"], seed + 100, args.max_trials, "first")
                rows = run_sweep(sessions, settings, truth, problem, METHODS["surrogate"], seed, args.max_trials, "second")
                out.append(score(rows, truth_tps, target)[0])
                with sessions() as s:
                    learned = (store.get_sweep(s, sweep_id=rows[0].sweep_id).calibration or {}).get("learned_from", [])
                if learn and not learned:
                    raise SystemExit("the second sweep learned from no earlier sweep: the transfer was not exercised")
                engine.dispose()
        print(f"  seed {seed}: cold={cold[-1] or '-'} after {first['model']}={warm[-1] or '-'} "
              f"(learned from sweeps {learned})", flush=True)
    print(f"\nlearning across sweeps ({name} cluster; {problem['model']} after a {first['model']} sweep): "
          f"median launched trials to within 2% over {args.seeds} seeds: cold {med(cold, args.max_trials)}, "
          f"after learning {med(warm, args.max_trials)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--seed-start", type=int, default=0, help="first seed (to split the seeds over processes)")
    ap.add_argument("--max-trials", type=int, default=40)
    ap.add_argument("--truth", choices=[*PROBLEMS, "all", "none"], default="all")
    ap.add_argument("--no-transfer", action="store_true")
    ap.add_argument("--gp", action="store_true", help="also Optuna's GPSampler (slow)")
    args = ap.parse_args()
    print(f"load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f} on {os.cpu_count()} CPUs",
          flush=True)
    table = ["| truth | valid layouts | method | median launched trials to 2% | reached | median OOMs launched | "
             "random expected | s/sweep |", "|---|---|---|---|---|---|---|---|"]
    for name, truth in registry().items():
        if args.truth in (name, "all"):
            run_truth(name, truth, args, table)
    print("\n" + "\n".join(table))
    if not args.no_transfer:
        run_transfer(args)


if __name__ == "__main__":
    main()
