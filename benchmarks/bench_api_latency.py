"""p99 latency of GET /api/sweeps/{id}/ranking on a 10,000-trial sweep, 50 concurrent clients, over
loopback, on SQLite and on PostgreSQL, printed side by side (issue 5).

Per store: a fresh database (a temporary SQLite file; a PostgreSQL database created for the run and
dropped after it), migrated with Alembic, holding one sweep written through the store functions the
engine uses: 4,000 layouts of llama3-70b on 64 H100 pruned by the memory model, 4,000 measured once
and the best 1,000 of those re-measured twice (10,000 trial rows, 6,000 measurements; the numbers
come from the simulate backend and are stored with simulated=True). The coordinator is a real
`meshtune serve --no-engine` subprocess (uvicorn, one process); the load is ``--clients`` asyncio
tasks, each with its own httpx.AsyncClient, issuing ``--requests`` requests in all after a warm-up.

    python benchmarks/bench_api_latency.py [--trials 10000] [--clients 50] [--requests 500]
                                           [--pg postgresql+psycopg://postgres@127.0.0.1:5432/postgres]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from api import store  # noqa: E402
from api.services import sweeps as service  # noqa: E402
from api.spec import SweepSpec  # noqa: E402
from tuner import plan, to_dict  # noqa: E402
from workers import TrialRequest  # noqa: E402
from workers.simulate import SimulateBackend  # noqa: E402

SPEC = {
    "name": "bench-10k",
    "model": "llama3-70b",
    "cluster": {"preset": "h100-sxm", "nodes": 8},
    "training": {"global_batch_tokens": 4194304},
    "backend": "simulate",
}


def seed(url: str, n_trials: int) -> int:
    """Store one sweep of ``n_trials`` rows (40% pruned, 40% measured once, 20% re-measurements)."""
    spec = SweepSpec.model_validate(SPEC | {"search": {"max_trials": n_trials}})
    model, cluster, training = spec.to_problem()
    p = plan(model=model, cluster=cluster, training=training)
    n_pruned, n_measured = int(n_trials * 0.4), int(n_trials * 0.4)
    n_repeats = n_trials - n_pruned - n_measured
    assert len(p.infeasible) >= n_pruned and len(p.entries) >= n_measured, "problem too small for --trials"
    backend = SimulateBackend(seed=0)
    engine, sessions = store.open_store(url)
    number = 0
    with store.session_scope(sessions) as s:
        sid = service.create_sweep(s, spec=spec, owner="bench").id
        for entry in p.infeasible[:n_pruned]:
            store.insert_trial(
                s, sweep_id=sid, number=number, layout=to_dict(entry.layout), layout_key=entry.layout.key,
                world_size=entry.layout.world_size, status="pruned", cause="predicted memory exceeds the device",
                predicted_memory_bytes=int(entry.memory.total), backend="simulate",
            )
            number += 1
        measured = p.entries[:n_measured]
        plan_runs = [(e, 0) for e in measured] + [(measured[i // 2], 1 + i % 2) for i in range(n_repeats)]
        for entry, repeat in plan_runs:
            lay = entry.layout
            store.insert_trial(
                s, sweep_id=sid, number=number, layout=to_dict(lay), layout_key=lay.key, world_size=lay.world_size,
                phase="remeasure" if repeat else "search", repeat=repeat, backend="simulate",
                predicted_memory_bytes=int(entry.memory.total),
                predicted_tokens_per_s_per_device=entry.time.tokens_per_s_per_device,
                useful_fraction=1.0,
            )
            request = TrialRequest(model=model, cluster=cluster, training=training, layout=lay,
                                   trial_id=f"{sid}-{number}")
            result = backend.run(request)
            store.record_result(s, sweep_id=sid, number=number, attempt=0, result=result, useful_fraction=1.0)
            number += 1
        store.refresh_sweep_cache(s, sweep_id=sid)
    engine.dispose()
    return sid


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(url: str, home: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "MESHTUNE_DATABASE_URL": url, "MESHTUNE_HOME": str(home), "MESHTUNE_API_TOKENS": ""}
    proc = subprocess.Popen(
        [sys.executable, "-m", "api.cli", "serve", "--no-engine", "--no-access-log", "--log-level", "warning",
         "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"coordinator did not start: {proc.stderr.read() if proc.stderr else ''}")


async def load(base: str, path: str, *, clients: int, requests: int, warmup: int) -> tuple[list[float], float]:
    """Latencies (s) of ``requests`` GETs spread over ``clients`` concurrent clients, and the wall time."""
    remaining = requests + warmup
    latencies: list[float] = []
    lock = asyncio.Lock()

    async def client() -> None:
        nonlocal remaining
        async with httpx.AsyncClient(base_url=base, timeout=120) as http:
            while True:
                async with lock:
                    if remaining <= 0:
                        return
                    remaining -= 1
                    counted = remaining < requests  # the first `warmup` requests are not counted
                started = time.perf_counter()
                r = await http.get(path)
                elapsed = time.perf_counter() - started
                assert r.status_code == 200, r.text[:200]
                if counted:
                    latencies.append(elapsed)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return latencies, time.perf_counter() - started


def stats(lat: list[float], wall: float, single: list[float]) -> dict[str, float]:
    lat = sorted(lat)
    q = statistics.quantiles(lat, n=100, method="inclusive")
    return {"single": statistics.median(single), "p50": q[49], "p90": q[89], "p99": q[98], "max": lat[-1],
            "rps": len(lat) / wall, "n": len(lat)}


def measure(url: str, label: str, args: argparse.Namespace, home: Path) -> dict[str, dict[str, float]]:
    """Per request kind (the whole ranking; its first page of 20 rows): latency statistics."""
    t0 = time.perf_counter()
    sid = seed(url, args.trials)
    seeded = time.perf_counter() - t0
    proc, base = serve(url, home)
    out = {}
    try:
        for kind, path in (("full", f"/api/sweeps/{sid}/ranking"), ("top20", f"/api/sweeps/{sid}/ranking?limit=20")):
            with httpx.Client(base_url=base, timeout=120) as http:
                http.get("/healthz")  # connect first: time only the request
                started = time.perf_counter()
                body = http.get(path)
                first = time.perf_counter() - started
                single = []
                for _ in range(10):  # unloaded latency, one client
                    started = time.perf_counter()
                    http.get(path)
                    single.append(time.perf_counter() - started)
            lat, wall = asyncio.run(load(base, path, clients=args.clients, requests=args.requests, warmup=args.clients))
            out[kind] = stats(lat, wall, single) | {"first": first, "bytes": len(body.content)}
            print(f"  {label} {kind}: {len(body.json()['rows'])} of {body.json()['total']} layouts, "
                  f"{len(body.content) / 1e6:.2f} MB; first request {first * 1e3:.0f} ms", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"  {label}: seeded {args.trials} trials in {seeded:.1f} s", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10_000)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--requests", type=int, default=500, help="measured requests in all (after a warm-up)")
    parser.add_argument("--pg", default=os.environ.get("MESHTUNE_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"))
    args = parser.parse_args()

    results: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        print(f"GET /api/sweeps/{{id}}/ranking, {args.trials} trials, {args.clients} clients, {args.requests} requests")
        results["SQLite"] = measure(f"sqlite:///{home / 'bench.db'}", "SQLite", args, home)
        name = f"meshtune_bench_{uuid.uuid4().hex[:10]}"
        admin = sa.create_engine(args.pg, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        try:
            results["PostgreSQL"] = measure(args.pg.rsplit("/", 1)[0] + f"/{name}", "PostgreSQL", args, home)
        finally:
            with admin.connect() as conn:
                conn.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"),
                             {"n": name})
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"'))
            admin.dispose()

    rows = [("first request (cold cache)", "first", 1e3, "ms"), ("unloaded, 1 client, median", "single", 1e3, "ms"),
            ("p50", "p50", 1e3, "ms"), ("p90", "p90", 1e3, "ms"), ("p99", "p99", 1e3, "ms"), ("max", "max", 1e3, "ms"),
            ("throughput", "rps", 1, "req/s"), ("measured requests", "n", 1, "")]
    for kind, title in (("full", "whole ranking"), ("top20", "?limit=20")):
        print(f"\n{title:34s}{'SQLite':>12s}{'PostgreSQL':>12s}{'PG/SQLite':>11s}")
        for label, key, scale, unit in rows:
            a, b = results["SQLite"][kind][key] * scale, results["PostgreSQL"][kind][key] * scale
            print(f"{label + (' (' + unit + ')' if unit else ''):34s}{a:12.1f}{b:12.1f}{b / a:11.2f}")


if __name__ == "__main__":
    main()
