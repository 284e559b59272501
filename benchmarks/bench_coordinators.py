"""Several coordinators on one PostgreSQL and one simulated cluster: what the shared device queue
(api/store/_leases.py, api/engine/_shared.py) costs at the size of a shared cluster.

Two parts, each on a PostgreSQL database created for the run and dropped after it:

**queue** — the store alone, saturated: ``--coordinators`` processes, each a ``SharedLedger`` (its own
holder, as a coordinator has) over one pool of ``--devices`` devices, together holding ``--sweeps``
requests of ``--owners`` owners (world sizes 64/128/256/512, round robin). Each process loops over its
sweeps: a request is asked, a grant is held ``--hold-ms`` then released; no trial runs. It prints the
grants and releases per second the store sustained, the queue's decision time (``_dispatch`` inside
each transaction, every waiter ordered), the wait for the pool's lock, and each kind of transaction's
p50/p99.

**run** — the service, end to end: ``--sweeps`` sweeps of ``--owners`` owners (llama3-1b and -8b on
64-512 simulated H100s, random sampler, ``--trials`` trials each) stored first, then ``--coordinators``
``meshtune serve`` processes (API and engine each: replicas behind a load balancer) on the simulate
backend's cluster of ``--devices`` devices (``MESHTUNE_SIMULATE_DEVICES``) whose trials hold their
devices for ``--pace`` x the simulated run time (``MESHTUNE_SIMULATE_PACE``: the results stay
labelled simulated; the wall time is made up too), all naming one cluster (``MESHTUNE_CLUSTER_NAME``).
For ``--seconds`` it runs; meanwhile ``--clients`` closed-loop HTTP clients ask the coordinators in turn
(``GET /api/sweeps?limit=20``, ``GET /api/sweeps/{id}``) and their p50/p99 are printed
(``--api apart``: the coordinators run the engine alone and one ``meshtune serve --no-engine`` answers,
to see what sharing a process, and its interpreter lock, with a busy engine costs the API). Then, from the
lease history: grants and releases per second, the queue wait, the devices' utilisation, each owner's
share of the device-time, the peak held (never above the cluster); from each coordinator's counters
(``api.engine._shared.STATS``, written at exit): store transactions per second by kind (are the
beats a cost?), the decision time, the lock wait.

The machine is shared and has two cores: the defaults are sized for it and the numbers say what the
service costs when it competes for two cores with everything else (``uptime`` is printed before and
after: quote it with them).

    python benchmarks/bench_coordinators.py [--part queue|run|all] [--coordinators 3] [--sweeps 200]
        [--owners 20] [--devices 4096] [--seconds 150] [--api inside|apart] [--pace 0.5] [--trials 8] [--clients 8]
        [--hold-ms 20] [--queue-seconds 20] [--pg postgresql+psycopg://postgres@127.0.0.1:5432/postgres]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_api_latency import free_port, load, uptime  # noqa: E402

from api import store  # noqa: E402
from api.store._leases import lease_intervals, peak_held  # noqa: E402

SIZES = (64, 128, 256, 512)
CLUSTER = "bench-4096"


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def database(admin: str) -> tuple[str, Any]:
    name = f"bench_coord_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    engine = sa.create_engine(admin, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))

    def drop() -> None:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"), {"n": name})
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"'))
        engine.dispose()

    return admin.rsplit("/", 1)[0] + f"/{name}", drop


# --- queue: the store alone ------------------------------------------------------------------------


def queue_worker(url: str, index: int, args: argparse.Namespace, out: str) -> None:
    """One coordinator's ledger, looping over its share of the requests (see the module docstring)."""
    from datetime import datetime, timezone

    from api.engine._share import Claimant
    from api.engine._shared import STATS, SharedLedger

    _, sessions = store.open_store(url, upgrade_schema=False)
    ledger = SharedLedger(args.devices, sessions=sessions, pool="bench:queue", holder=f"bench:{os.getpid()}:{index}",
                          poll_s=0.005, sync_s=1.0)
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    mine = [i for i in range(args.sweeps) if i % args.coordinators == index]
    claimants = [(Claimant(i + 1, f"owner{i % args.owners}", "normal", t0), SIZES[i % len(SIZES)]) for i in mine]
    held: dict[int, tuple[Any, float]] = {}
    grants = releases = 0
    deadline = time.monotonic() + args.queue_seconds
    while time.monotonic() < deadline:
        before = grants + releases
        for c, n in claimants:
            now = time.monotonic()
            if c.sweep_id in held:
                if now >= held[c.sweep_id][1]:
                    ledger.release(held.pop(c.sweep_id)[0])
                    releases += 1
            else:
                g = ledger.try_acquire(c, n)
                if g is not None:
                    held[c.sweep_id] = (g, now + args.hold_ms / 1000)
                    grants += 1
        if grants + releases == before:  # nothing to do: leave the cores to the store (no spinning)
            time.sleep(0.002)
    for g, _ in held.values():
        ledger.release(g)
    Path(out).write_text(json.dumps({"grants": grants, "releases": releases, "stats": STATS.to_dict()}))


def queue_part(admin: str, args: argparse.Namespace) -> dict[str, Any]:
    url, drop = database(admin)
    try:
        store.upgrade(url)
        tmp = Path(tempfile.mkdtemp(prefix="bench-queue-"))
        procs = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--queue-worker", str(i), "--url", url,
                                   "--out", str(tmp / f"worker{i}.json")], cwd=ROOT) for i in range(args.coordinators)]
        for p in procs:
            p.wait()
        outs = [json.loads((tmp / f"worker{i}.json").read_text()) for i in range(len(procs))]
        with store.open_store(url, upgrade_schema=False)[1]() as s:
            leases = lease_intervals(s, pool="bench:queue")
            waiters = s.scalar(sa.select(sa.func.count()).select_from(store.DeviceWaiter))
    finally:
        drop()
    grants = sum(o["grants"] for o in outs)
    releases = sum(o["releases"] for o in outs)
    kinds: dict[str, list[float]] = {}
    decide = [x for o in outs for x in o["stats"]["decide_s"]]
    lock = [x for o in outs for x in o["stats"]["lock_s"]]
    for o in outs:
        for k, v in o["stats"]["calls"].items():
            c = kinds.setdefault(k, [0, 0.0, 0.0])
            c[0] += v["count"]
            c[1] += v["seconds"]
            c[2] = max(c[2], v["max_s"])
    peak, _ = peak_held(leases)
    return {"grants_per_s": grants / args.queue_seconds, "releases_per_s": releases / args.queue_seconds,
            "decide_p50_ms": 1e3 * pct(decide, 0.5), "decide_p99_ms": 1e3 * pct(decide, 0.99),
            "lock_p50_ms": 1e3 * pct(lock, 0.5), "lock_p99_ms": 1e3 * pct(lock, 0.99),
            "calls": {k: {"count": int(v[0]), "mean_ms": 1e3 * v[1] / max(1, v[0]), "max_ms": 1e3 * v[2]}
                      for k, v in sorted(kinds.items())},
            "peak": peak, "waiting_at_end": waiters}


# --- run: the service end to end -------------------------------------------------------------------

# uvicorn re-raises the SIGTERM it shut down on once it has (so atexit would not run): this handler,
# which it restores first, writes the counters then.
SERVE = """
import json, os, signal, sys
from api.engine._shared import STATS
def dump(*_):
    open(os.environ["BENCH_STATS"], "w").write(json.dumps(STATS.to_dict()))
    os._exit(0)
signal.signal(signal.SIGTERM, dump)
if os.environ["BENCH_SERVE"] == "engine":  # a coordinator without an API
    import threading
    from api.engine import SweepRunner
    SweepRunner().run_pending(threading.Event())
from api.cli import main
sys.exit(main(["serve", "--host", "127.0.0.1", "--port", os.environ["BENCH_PORT"], "--no-access-log",
               "--log-level", "warning", *os.environ["BENCH_SERVE"].split()]))
"""


def submit(url: str, args: argparse.Namespace) -> list[int]:
    from api.spec import SweepSpec
    from api.sweeps import service

    _, sessions = store.open_store(url, upgrade_schema=False)
    shapes = [("llama3-1b", 8), ("llama3-1b", 16), ("llama3-8b", 32), ("llama3-8b", 64)]  # 64..512 devices
    specs = [SweepSpec.model_validate({
        "model": m, "cluster": {"preset": "h100-sxm", "nodes": n}, "training": {"global_batch_tokens": 1048576},
        "backend": "simulate", "search": {"sampler": "random", "max_trials": args.trials, "remeasure_top_k": 0}})
        for m, n in shapes]
    ids = []
    with sessions() as s:
        for i in range(args.sweeps):  # every owner gets every shape in turn: the owners' demands are alike
            base = specs[(i // args.owners) % len(specs)]
            spec = base.model_copy(update={"search": base.search.model_copy(update={"seed": i})})
            ids.append(service.create_sweep(s, spec=spec, owner=f"owner{i % args.owners}").id)
    return ids


def run_part(admin: str, args: argparse.Namespace) -> dict[str, Any]:
    url, drop = database(admin)
    tmp = Path(tempfile.mkdtemp(prefix="bench-coord-"))
    procs: list[subprocess.Popen] = []
    try:
        store.upgrade(url)
        t = time.monotonic()
        ids = submit(url, args)
        submit_s = time.monotonic() - t
        # inside: each coordinator is a `meshtune serve` (API and engine in one process); apart: the
        # coordinators run the engine only and one `meshtune serve --no-engine` answers the API.
        ports = [free_port() for _ in range(args.coordinators if args.api == "inside" else 1)]
        for i in range(args.coordinators + (args.api == "apart")):
            api_only = args.api == "apart" and i == args.coordinators
            env = {**os.environ, "PYTHONPATH": str(ROOT), "MESHTUNE_DATABASE_URL": url, "MESHTUNE_HOME": str(tmp),
                   "MESHTUNE_API_TOKENS": "", "MESHTUNE_CLUSTER_NAME": CLUSTER, "MESHTUNE_BACKEND": "simulate",
                   "MESHTUNE_SIMULATE_DEVICES": str(args.devices), "MESHTUNE_SIMULATE_PACE": str(args.pace),
                   "MESHTUNE_SCHEDULER_ENABLED": "false", "BENCH_STATS": str(tmp / f"stats{i}.json"),
                   "BENCH_PORT": str(ports[0 if api_only else i] if (api_only or args.api == "inside") else 0),
                   "BENCH_SERVE": "--no-engine" if api_only else ("" if args.api == "inside" else "engine")}
            procs.append(subprocess.Popen([sys.executable, "-c", SERVE], cwd=ROOT, env=env,
                                          stdout=subprocess.DEVNULL, stderr=(tmp / f"serve{i}.log").open("w")))
        for port in ports:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit(f"a coordinator did not start: {(tmp / 'serve0.log').read_text()[-2000:]}")
                time.sleep(0.5)
        started = time.time()
        api: dict[str, list[float]] = {"/api/sweeps?limit=20": [], "/api/sweeps/{id}": []}
        # The clients' rounds, spread over the run (after a first third, so the queue is in use).
        time.sleep(args.seconds / 3)
        rounds = 3
        for r in range(rounds):
            for path in api:
                port = ports[r % len(ports)]
                real = path.replace("{id}", str(ids[(r * 37) % len(ids)]))
                lat, _ = asyncio.run(load(port, real, clients=args.clients, requests=args.requests, warmup=args.clients))
                api[path] += lat
            time.sleep(max(0.0, started + args.seconds * (1 / 3 + (r + 1) * 2 / (3 * rounds)) - time.time()))
        time.sleep(max(0.0, started + args.seconds - time.time()))
        ended = time.time()
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(90)
            except subprocess.TimeoutExpired:
                p.kill()
    try:
        _, sessions = store.open_store(url, upgrade_schema=False)
        with sessions() as s:
            leases = lease_intervals(s, pool=f"simulate:{CLUSTER}")
            statuses = Counter(sw.status for sw in store.list_sweeps(s, limit=10_000)[0])
            trials = s.execute(sa.select(store.Trial.status, store.Trial.simulated)
                               .where(store.Trial.started_at.is_not(None), store.Trial.status != "pruned")).all()
    finally:
        drop()
    stats = [json.loads((tmp / f"stats{i}.json").read_text()) for i in range(len(procs))
             if (tmp / f"stats{i}.json").exists()]
    in_run = [x for x in leases if started <= x.granted_at.timestamp() < ended]
    released = [x for x in leases if x.released_at and started <= x.released_at.timestamp() < ended]
    window = ended - started
    held_s = sum(max(0.0, min((x.released_at.timestamp() if x.released_at else ended), ended)
                     - max(x.granted_at.timestamp(), started)) * x.devices for x in leases)
    by_owner: Counter = Counter()
    for x in leases:
        by_owner[x.owner] += max(0.0, min((x.released_at.timestamp() if x.released_at else ended), ended)
                                 - x.granted_at.timestamp()) * x.devices
    total = sum(by_owner.values()) or 1.0
    shares = sorted(v / total * args.owners for v in by_owner.values())
    kinds: dict[str, list[float]] = {}
    for st in stats:
        for k, v in st["calls"].items():
            c = kinds.setdefault(k, [0, 0.0, 0.0])
            c[0] += v["count"]
            c[1] += v["seconds"]
            c[2] = max(c[2], v["max_s"])
    decide = [x for st in stats for x in st["decide_s"]]
    lock = [x for st in stats for x in st["lock_s"]]
    peak, _ = peak_held(leases)
    return {
        "submit_s": submit_s, "window_s": window, "sweeps": dict(statuses),
        "trials_started": len(trials),
        "trials_simulated": all(t.simulated for t in trials if t.status not in ("running", "interrupted")),
        "grants_per_s": len(in_run) / window, "releases_per_s": len(released) / window,
        "queue_wait_p50_s": pct([(x.granted_at - x.asked_at).total_seconds() for x in in_run], 0.5),
        "queue_wait_p99_s": pct([(x.granted_at - x.asked_at).total_seconds() for x in in_run], 0.99),
        "utilisation": held_s / (args.devices * window), "peak": peak,
        "owner_share_min": shares[0] if shares else float("nan"), "owner_share_max": shares[-1] if shares else float("nan"),
        "owners_served": len(by_owner),
        "decide_p50_ms": 1e3 * pct(decide, 0.5), "decide_p99_ms": 1e3 * pct(decide, 0.99),
        "lock_p50_ms": 1e3 * pct(lock, 0.5), "lock_p99_ms": 1e3 * pct(lock, 0.99),
        "calls_per_s": {k: v[0] / window for k, v in sorted(kinds.items())},
        "calls_mean_ms": {k: 1e3 * v[1] / max(1, v[0]) for k, v in sorted(kinds.items())},
        "api": {p: {"p50_ms": 1e3 * pct(v, 0.5), "p99_ms": 1e3 * pct(v, 0.99), "n": len(v)} for p, v in api.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("queue", "run", "all"), default="all")
    ap.add_argument("--coordinators", type=int, default=3)
    ap.add_argument("--sweeps", type=int, default=200)
    ap.add_argument("--owners", type=int, default=20)
    ap.add_argument("--devices", type=int, default=4096)
    ap.add_argument("--seconds", type=float, default=150.0, help="how long the run part runs")
    ap.add_argument("--pace", type=float, default=0.5, help="wall seconds per simulated second of a trial")
    ap.add_argument("--trials", type=int, default=8, help="search.max_trials of each sweep")
    ap.add_argument("--api", choices=("inside", "apart"), default="inside",
                    help="inside: each coordinator serves the API too; apart: engines alone plus one API process")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=200, help="requests per path per round (3 rounds)")
    ap.add_argument("--hold-ms", type=float, default=20.0, help="queue part: how long a grant is held")
    ap.add_argument("--queue-seconds", type=float, default=20.0)
    ap.add_argument("--pg", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    ap.add_argument("--queue-worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--url", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.queue_worker is not None:
        queue_worker(args.url, args.queue_worker, args, args.out)
        return
    print(f"load before: {uptime()}")
    print(f"{args.coordinators} coordinators, {args.sweeps} sweeps of {args.owners} owners, a simulated cluster of "
          f"{args.devices} devices, PostgreSQL ({args.pg.rsplit('@', 1)[-1]})")
    if args.part in ("queue", "all"):
        q = queue_part(args.pg, args)
        print(f"\n[queue] the store alone, saturated ({args.queue_seconds:g} s, grants held {args.hold_ms:g} ms):")
        print(f"  grants/s {q['grants_per_s']:.0f}   releases/s {q['releases_per_s']:.0f}   peak held {q['peak']} "
              f"of {args.devices}")
        print(f"  queue decision (every waiter ordered) p50 {q['decide_p50_ms']:.2f} ms  p99 {q['decide_p99_ms']:.2f} ms; "
              f"lock wait p50 {q['lock_p50_ms']:.2f} ms  p99 {q['lock_p99_ms']:.2f} ms")
        for k, v in q["calls"].items():
            print(f"  {k:<24} {v['count']:>7}  mean {v['mean_ms']:7.2f} ms  max {v['max_ms']:8.1f} ms")
    if args.part in ("run", "all"):
        r = run_part(args.pg, args)
        how = "meshtune serve" if args.api == "inside" else "engine (+ one meshtune serve --no-engine for the API)"
        print(f"\n[run] {args.coordinators} x {how}, {args.seconds:g} s, trials at {args.pace:g} x their "
              f"simulated time (stored {args.sweeps} sweeps in {r['submit_s']:.0f} s first):")
        print(f"  sweeps at the end: {r['sweeps']}; trials started {r['trials_started']} (all simulated: "
              f"{r['trials_simulated']})")
        print(f"  grants/s {r['grants_per_s']:.2f}   releases/s {r['releases_per_s']:.2f}   queue wait p50 "
              f"{r['queue_wait_p50_s']:.2f} s  p99 {r['queue_wait_p99_s']:.1f} s")
        print(f"  devices granted: {100 * r['utilisation']:.0f}% of {args.devices} over the run; peak {r['peak']}; "
              f"owners' share of the device-time vs fair: {r['owner_share_min']:.2f}-{r['owner_share_max']:.2f} "
              f"({r['owners_served']} owners served)")
        print(f"  queue decision p50 {r['decide_p50_ms']:.2f} ms  p99 {r['decide_p99_ms']:.2f} ms; lock wait p50 "
              f"{r['lock_p50_ms']:.2f} ms  p99 {r['lock_p99_ms']:.2f} ms")
        print("  store calls per second, all coordinators (mean ms): " + ", ".join(
            f"{k} {v:.2f} ({r['calls_mean_ms'][k]:.1f})" for k, v in r["calls_per_s"].items()))
        for p, v in r["api"].items():
            print(f"  API {p:<22} p50 {v['p50_ms']:6.1f} ms  p99 {v['p99_ms']:6.1f} ms  ({v['n']} requests, "
                  f"{args.clients} clients)")
    print(f"\nload after: {uptime()}")


if __name__ == "__main__":
    main()
