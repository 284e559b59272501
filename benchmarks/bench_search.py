"""Search efficiency of the sweep engine on worlds meshtune's model was not written for.

Ground truths (all simulated, labelled so): the three hand-written ones (benchmarks/truths:
``roofline``, ``congested``, ``jittery``, each on its own problem with 10,000-22,000 valid layouts)
and the generated misspecified worlds (benchmarks/truths/worlds.py: ``world-0`` .. ``world-19``,
memory per part from 0.5x to 3x of the textbook counts with mixed signs, fixed overheads, their own
GEMM curves, exposed communication, luck and noise; llama3-8b/70b or mixtral-8x7b on 16-32 H100),
plus ``world-mem2x`` / ``world-memhalf`` (memory 2x / half the model's own prediction). Every
world reports OOMs as CUDA does: the failing allocation and what was in use, never the peak
(benchmarks/truth_backend.py). They plug into the real engine and a fresh SQLite store per run.

For each world and seed the default search (surrogate), TPE and random each run one sweep with
default settings except ``max_trials``. Per sweep: **launched** trials (pruned ones excluded: no
device time) until a layout within 2% of the true noise-free best was measured, OOMs launched,
how the sweep ended (status and ``stop_reason`` where the engine records one) and, for a sweep that
ended before ``max_trials``, how many unseen layouts truly fit. Then, per world, a second
sweep on the same cluster fingerprint, after one of the same model (the cold sweep itself) and
after one of another model (``--first-trials``, default 20), against the cold one (same seed).
The table aggregates the generated worlds per method (medians over worlds and seeds) and lists
each hand-written truth and special world apart.

    python benchmarks/bench_search.py --quick                        # 3 worlds, 20 trials, minutes
    python benchmarks/bench_search.py --json a.json --worlds 10      # split over processes, then
    python benchmarks/bench_search.py --merge a.json b.json c.json   # one table from their records
"""

from __future__ import annotations

import argparse
import json
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
from benchmarks.truths.worlds import SPECIAL, by_name, generate  # noqa: E402

H100 = {"preset": "h100-sxm"}
PROBLEMS = {
    "roofline": {"model": "llama3-70b", "cluster": {**H100, "nodes": 8}, "training": {"global_batch_tokens": 4194304}},
    "congested": {"model": "mixtral-8x7b", "cluster": {**H100, "nodes": 4}, "training": {"global_batch_tokens": 2097152}},
    "jittery": {"model": "llama3-8b", "cluster": {**H100, "nodes": 4}, "training": {"global_batch_tokens": 2097152}},
}
# the other model of a learning-across-models second sweep, on the same cluster
OTHER = {"roofline": "llama3-8b", "congested": "llama3-8b", "jittery": "llama3-1b"}
METHODS = {  # default search settings, only the sampler differs (api.spec.SearchSettings)
    "surrogate": {},
    "tpe": {"sampler": "tpe"},
    "random": {"sampler": "random", "warm_start_top_k": 0},  # no model-ranked warm start: the baseline
}
TARGET = 0.98  # within 2% of the true noise-free best


def truth_table(truth, problem: dict) -> tuple[int, dict[str, float]]:
    """Valid layout count and the noise-free tokens/s per device of every layout that fits."""
    problem = SweepSpec.model_validate(problem).to_problem()
    model, cluster, training = problem.model, problem.cluster, problem.training
    valid = tuner.enumerate_layouts(problem=tuner.Problem(model=model, cluster=cluster,
                                                          training=training)).valid
    tokens = training.global_batch * model.seq_len / cluster.devices
    out = {}
    for lay in valid:
        a = truth.answer(lay, model, cluster, training)
        if a.step_s is not None:
            out[lay.key] = tokens / a.step_s
    return len(valid), out


class Store:
    """One SQLite store in a temporary directory (a fresh cluster history)."""

    def __enter__(self):
        self.tmp = tempfile.TemporaryDirectory()
        url = f"sqlite:///{Path(self.tmp.name) / 'bench.db'}"
        self.engine, self.sessions = store.open_store(url)
        self.settings = Settings(database_url=url, home=Path(self.tmp.name), max_concurrent_trials=1)
        return self

    def __exit__(self, *exc) -> None:
        self.engine.dispose()
        self.tmp.cleanup()

    def sweep(self, truth, problem: dict, search: dict, seed: int, max_trials: int, name: str):
        spec = SweepSpec.model_validate({**problem, "name": name, "backend": "simulate", "search": {
            **search, "max_trials": max_trials, "seed": seed}})
        with self.sessions() as s:
            sweep_id = svc.create_sweep(s, spec=spec, owner="bench").id
        backend = lambda spec, seed=seed: TruthBackend(truth, seed=seed)  # noqa: E731
        t0 = time.perf_counter()
        SweepRunner(self.settings, sessions=self.sessions, backend_factory=backend).run_sweep(sweep_id)
        wall = time.perf_counter() - t0
        with self.sessions() as s:
            row = store.get_sweep(s, sweep_id=sweep_id)
            trials = sorted(store.all_trials(s, sweep_id=sweep_id), key=lambda t: t.number)
            # stop_reason is new in the engine: read it where it exists, the status says the rest
            end = {"status": str(getattr(row.status, "value", row.status)),
                   "stop_reason": getattr(row, "stop_reason", None),
                   "learned_from": list((row.calibration or {}).get("learned_from", []) or [])}
        return trials, end, wall


def score(trials, end: dict, tps: dict[str, float], max_trials: int, wall: float) -> dict:
    best = max(tps.values())
    launched, ooms, reached = 0, 0, None
    for t in trials:
        if t.status == "pruned":
            continue
        launched += 1
        ooms += t.status == "oom"
        if reached is None and t.status == "completed" and tps.get(t.layout_key, 0.0) >= TARGET * best:
            reached = launched
    # the search's own trials (re-measurements of the leaders come after it and do not count)
    searched = len({t.number for t in trials if getattr(t, "phase", "search") == "search"})
    early = searched < max_trials
    tried = {t.layout_key for t in trials}
    # what an unfinished sweep left: untried layouts the truth says fit (a measurement would say so)
    unseen_fit = sum(k not in tried for k in tps) if early else 0
    return {"reached": reached, "launched": launched, "ooms": ooms, "rows": searched, "early": early,
            "unseen_fit": unseen_fit, "wall_s": round(wall, 1), **end}


def run_world(family: str, name: str, truth, problem: dict, other: dict | None, args, out: list[dict]) -> None:
    n_valid, tps = truth_table(truth, problem)
    best = max(tps.values())
    n_target = sum(v >= TARGET * best for v in tps.values())
    cl = problem["cluster"]["nodes"] * 8
    print(f"\n== {name} ({problem['model']} on {cl} H100): {n_valid} valid layouts, {len(tps)} truly fit, "
          f"{n_target} within 2% of the best (random expects {(n_valid + 1) / (n_target + 1):.0f} trials)", flush=True)
    seeds = range(args.seed_start, args.seed_start + args.seeds)
    for seed in seeds:
        for method in args.methods:
            with Store() as st:
                trials, end, wall = st.sweep(truth, problem, METHODS[method], seed, args.max_trials, f"{name}-{method}")
                rec = score(trials, end, tps, args.max_trials, wall)
                second = None
                if method == "surrogate" and other is not None and not args.no_second:
                    trials, end, wall = st.sweep(truth, problem, METHODS[method], seed, args.max_trials, f"{name}-again")
                    second = score(trials, end, tps, args.max_trials, wall)
            rec.update(family=family, world=name, method=method, seed=seed, n_valid=n_valid, kind="first")
            out.append(rec)
            print(f"  seed {seed} {method}: " + line(rec), flush=True)
            if second is not None:
                second.update(family=family, world=name, method=method, seed=seed, n_valid=n_valid, kind="same-model")
                out.append(second)
                print(f"  seed {seed} second sweep, same model: " + line(second), flush=True)
                with Store() as st:
                    st.sweep(truth, other, METHODS[method], seed + 100, args.first_trials or args.max_trials,
                             f"{name}-other")
                    trials, end, wall = st.sweep(truth, problem, METHODS[method], seed, args.max_trials, f"{name}-after")
                rec = score(trials, end, tps, args.max_trials, wall)
                rec.update(family=family, world=name, method=method, seed=seed, n_valid=n_valid, kind="other-model",
                           other=other["model"])
                out.append(rec)
                print(f"  seed {seed} second sweep, after {other['model']}: " + line(rec), flush=True)


def line(r: dict) -> str:
    end = r["status"] + (f" ({r['stop_reason']})" if r.get("stop_reason") else "")
    early = f", ended after {r['rows']} search trials with {r['unseen_fit']} unseen fitting layouts" if r["early"] else ""
    learned = f", learned from {r['learned_from']}" if r.get("learned_from") else ""
    return (f"2% at {r['reached'] or '-'} launched, {r['launched']} launched, {r['ooms']} OOM, {end}{early}{learned}, "
            f"{r['wall_s']:.0f}s")


def med(vals: list, cap: int) -> str:
    if not vals:
        return "-"
    m = statistics.median(v if v is not None else cap + 1 for v in vals)
    return f">{cap}" if m > cap else f"{m:g}"


def table(records: list[dict], max_trials: int) -> str:
    """The README's table: one row per family (generated worlds together) and method, then the
    second sweeps against the cold ones."""
    def fam(r: dict) -> str:
        return "generated worlds" if r["family"] == "generated" else r["world"]

    rows = ["| world | method | runs | median launched to 2% | reached 2% within "
            f"{max_trials} | median OOMs launched | ended early | early without stop_reason | "
            "early with unseen fitting layouts | s/sweep |", "|---|---|---|---|---|---|---|---|---|---|"]
    firsts = [r for r in records if r["kind"] == "first"]
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in firsts:
        groups.setdefault((fam(r), r["method"]), []).append(r)
    for (f, m), rs in groups.items():
        n = len(rs)
        reach = sum(r["reached"] is not None for r in rs)
        early = [r for r in rs if r["early"]]
        rows.append(f"| {f} | {m} | {n} | {med([r['reached'] for r in rs], max_trials)} | {reach}/{n} "
                    f"({100 * reach / n:.0f}%) | {statistics.median(r['ooms'] for r in rs):g} | {len(early)} | "
                    f"{sum(not r.get('stop_reason') for r in early)} | {sum(r['unseen_fit'] > 0 for r in early)} | "
                    f"{statistics.mean(r['wall_s'] for r in rs):.0f} |")
    cold = {(r["world"], r["seed"]): r for r in firsts if r["method"] == "surrogate"}
    seconds = [r for r in records if r["kind"] != "first"]
    if seconds:
        rows += ["", "| world | second sweep (surrogate) | runs | median launched to 2%: cold | second | "
                 "worlds where second <= cold | second ended early without stop_reason |", "|---|---|---|---|---|---|---|"]
        sg: dict[tuple[str, str], list[dict]] = {}
        for r in seconds:
            sg.setdefault((fam(r), r["kind"]), []).append(r)
        for (f, kind), rs in sg.items():
            per_world: dict[str, tuple[list, list]] = {}
            for r in rs:
                c, w = per_world.setdefault(r["world"], ([], []))
                c.append(cold[(r["world"], r["seed"])]["reached"])
                w.append(r["reached"])
            cap = max_trials + 1
            ok = sum(statistics.median(v if v is not None else cap for v in w)
                     <= statistics.median(v if v is not None else cap for v in c) for c, w in per_world.values())
            label = "same model" if kind == "same-model" else f"after {rs[0].get('other', 'another model')}"
            if f == "generated worlds" and kind == "other-model":
                label = "after another model"
            rows.append(f"| {f} | {label} | {len(rs)} | {med([cold[(r['world'], r['seed'])]['reached'] for r in rs], max_trials)} "
                        f"| {med([r['reached'] for r in rs], max_trials)} | {ok}/{len(per_world)} | "
                        f"{sum(r['early'] and not r.get('stop_reason') for r in rs)} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, default=20, help="generated worlds world-<start>.. (0: none)")
    ap.add_argument("--world-start", type=int, default=0)
    ap.add_argument("--special", choices=["all", "none", *SPECIAL], default="all")
    ap.add_argument("--truths", default="all", help="hand-written truths: all, none or a comma list")
    ap.add_argument("--seeds", type=int, default=1, help="search seeds per world")
    ap.add_argument("--seed-start", type=int, default=0)
    ap.add_argument("--max-trials", type=int, default=60)
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {', '.join(METHODS)}")
    ap.add_argument("--no-second", action="store_true", help="skip the second sweeps")
    ap.add_argument("--first-trials", type=int, default=20,
                    help="max_trials of the other model's first sweep (0: --max-trials)")
    ap.add_argument("--quick", action="store_true", help="3 worlds, 20 trials, no hand-written truth")
    ap.add_argument("--json", help="also write every run's record here")
    ap.add_argument("--merge", nargs="+", help="print the table from these --json files and exit")
    args = ap.parse_args()
    if args.merge:
        recs, mt, seen = [], set(), set()
        for p in args.merge:
            d = json.loads(Path(p).read_text())
            for r in d["records"]:  # overlapping runs: the first file's record of a sweep counts
                key = (r["world"], r["method"], r["seed"], r["kind"])
                if key not in seen:
                    seen.add(key)
                    recs.append(r)
            mt.add(d["max_trials"])
        if len(mt) != 1:
            raise SystemExit(f"--merge: the files ran different max_trials {sorted(mt)}")
        print(table(recs, mt.pop()))
        return
    if args.quick:
        args.worlds, args.max_trials, args.truths, args.special = min(args.worlds, 3), 20, "none", "none"
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        raise SystemExit(f"--methods: unknown {bad}; choose from {list(METHODS)}")
    truths = [] if args.truths == "none" else list(registry()) if args.truths == "all" else args.truths.split(",")
    unknown = [t for t in truths if t not in PROBLEMS]
    if unknown:
        raise SystemExit(f"--truths: unknown {unknown}; choose from {list(PROBLEMS)}")
    print(f"load: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs; simulated truths",
          flush=True)
    records: list[dict] = []
    t0 = time.perf_counter()

    def save() -> None:  # after every world: a run cut short keeps what it measured
        if args.json:
            Path(args.json).write_text(json.dumps({"max_trials": args.max_trials, "records": records}, indent=1))

    for w in range(args.world_start, args.world_start + args.worlds):
        world = generate(w)
        other = {**world.problem, "model": world.other_model}
        run_world("generated", world.name, world, world.problem, other, args, records)
        save()
    specials = [] if args.special == "none" else list(SPECIAL) if args.special == "all" else [args.special]
    for name in specials:
        world = by_name(name)
        run_world("special", name, world, world.problem, {**world.problem, "model": world.other_model}, args, records)
        save()
    hand = registry()
    for name in truths:
        run_world("hand-written", name, hand[name], PROBLEMS[name], {**PROBLEMS[name], "model": OTHER[name]}, args,
                  records)
        save()
    print(f"\n{len(records)} sweeps in {time.perf_counter() - t0:.0f}s; load now "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print(table(records, args.max_trials), flush=True)


if __name__ == "__main__":
    main()
