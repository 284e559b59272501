"""p50/p99 latency of the ranking endpoint on a 10,000-trial sweep, 50 concurrent clients, over
loopback, on SQLite and on PostgreSQL, printed side by side with /healthz on the same server.

Per store: a fresh database (a temporary SQLite file; a PostgreSQL database created for the run and
dropped after it), migrated with Alembic, holding one sweep written through the store functions the
engine uses: 4,000 layouts of llama3-70b on 128 H100 pruned by the memory model, 4,000 measured once
and the best 1,000 of those re-measured twice (10,000 trial rows, 6,000 measurements; the numbers
come from the simulate backend and are stored with simulated=True); the rows are written in bulk
and ranked once into the stored ranking (api/store/_ranking.py) that the engine's results maintain.
The coordinator is a real ``meshtune serve`` subprocess as the README runs it (its defaults: one
uvicorn process, uvloop/httptools when installed), with ``--no-engine`` so that it does not start
the seeded sweep. The load is ``--clients`` asyncio tasks, each on its own keep-alive connection
(a minimal HTTP/1.1 client, so that the load generator's own CPU stays small beside the server's),
issuing ``--requests`` requests per kind, the kinds taking turns in ``--rounds`` rounds (each round
after a short warm-up), so that the shared machine's changing load falls on all kinds alike. Kinds:

    /healthz                     the framework's floor on the same server
    ranking                      the whole ranking (all layouts, ~2.6 MB of JSON)
    ranking?limit=20             its first page
    ranking?limit=20 + ETag      the same with If-None-Match of the page's ETag (304)
    /sweeps/{id}                 the dashboard's sweep page (HTML: one page of the ranking and trials)
    /sweeps/{id} + ETag          the same with If-None-Match of its ETag (304)
    /sweeps/{id}/data.json       the charts' data the page fetches once loaded (~0.7 MB at 10,000 trials)

the dashboard's three asked as a browser asks (Accept-Encoding: gzip; sizes printed are those sent)

with p50/p99 under load, the unloaded median (one client), the server's CPU per request (from
/proc), and each p99 as a multiple of /healthz's. Repeat requests of an unchanged answer are
replayed before routing (api/_answers.py: one coalesced version read per wave of callers, then the
kept bytes), so the ranking's pages and the sweep page cost the server ~0.1-0.2 ms each; /healthz
does a database round trip every time, by design. The clients are a closed loop (each sends its next
request when its answer arrives), so on one server process a kind's median is about ``--clients``
times its server time per request (Little's law): 50 clients at 1 ms each is ~50 ms, idle or not. "serialise" is the whole ranking's JSON
serialisation alone, in process (what the whole ranking costs besides sending it). The machine's
load average (``uptime``) is printed before and after: quote it with the numbers.

    python benchmarks/bench_api_latency.py [--trials 10000] [--clients 50] [--requests 1000]
                                           [--pg postgresql+psycopg://postgres@127.0.0.1:5432/postgres]
                                           [--sqlite-only] [--rounds 5] [--kinds top20,page,page304]
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
from datetime import datetime, timezone
from pathlib import Path

import httpx
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from api import store  # noqa: E402
from api.ranking import service as rankings  # noqa: E402
from api.spec import SweepSpec  # noqa: E402
from api.sweeps import service  # noqa: E402
from tuner import Problem, plan, to_dict  # noqa: E402
from workers import TrialRequest  # noqa: E402
from workers.simulate import SimulateBackend  # noqa: E402

SPEC = {
    "name": "bench-10k",
    "model": "llama3-70b",
    "cluster": {"preset": "h100-sxm", "nodes": 16},  # 128 devices: > 4,000 valid layouts
    "training": {"global_batch_tokens": 4194304},
    "backend": "simulate",
}


TITLES = (("healthz", "/healthz"), ("full", "whole ranking"), ("top20", "ranking?limit=20"),
          ("etag", "?limit=20, If-None-Match (304)"), ("page", "dashboard sweep page (gzip)"),
          ("page304", "sweep page, If-None-Match (304)"), ("data", "sweep page's data.json (gzip)"))
KINDS = tuple(k for k, _ in TITLES if k != "healthz")


def seed(url: str, n_trials: int) -> int:
    """Store one sweep of ``n_trials`` rows (40% pruned, 40% measured once, 20% re-measurements).
    The rows are written in bulk (a loaded 2-core machine would take many minutes through one
    ``record_result`` each), then ranked once by ``store.refresh_sweep_cache`` — the same stored
    ranking that per-result folding maintains (tests/api/sweeps/test_ranking_incremental.py shows they agree)."""
    spec = SweepSpec.model_validate(SPEC | {"search": {"max_trials": n_trials}})
    problem = spec.to_problem()
    model, cluster, training = problem.model, problem.cluster, problem.training
    p = plan(problem=Problem(model=model, cluster=cluster, training=training))
    n_pruned, n_measured = int(n_trials * 0.4), int(n_trials * 0.4)
    n_repeats = n_trials - n_pruned - n_measured
    assert len(p.infeasible) >= n_pruned and len(p.entries) >= n_measured, "problem too small for --trials"
    backend = SimulateBackend(seed=0)
    engine, sessions = store.open_store(url)
    now = datetime.now(timezone.utc)
    with store.session_scope(sessions) as s:
        sid = service.create_sweep(s, spec=spec, owner="bench").id
        rows = []
        for entry in p.infeasible[:n_pruned]:
            rows.append(dict(
                sweep_id=sid, number=len(rows), attempt=0, phase="search", source="sampler", repeat=0,
                layout=to_dict(entry.layout), layout_key=entry.layout.key, world_size=entry.layout.world_size,
                status="pruned", cause="predicted memory exceeds the device", predicted_memory_bytes=int(entry.memory.total),
                backend="simulate", simulated=False, device_seconds=0.0, created_at=now, finished_at=now,
            ))
        measured = p.entries[:n_measured]
        plan_runs = [(e, 0) for e in measured] + [(measured[i // 2], 1 + i % 2) for i in range(n_repeats)]
        for entry, repeat in plan_runs:
            lay = entry.layout
            result = backend.run(TrialRequest(model=model, cluster=cluster, training=training, layout=lay,
                                              trial_id=f"{sid}-{len(rows)}"))
            rows.append(dict(
                sweep_id=sid, number=len(rows), attempt=0, phase="remeasure" if repeat else "search",
                source="remeasure" if repeat else "sampler", repeat=repeat, layout=to_dict(lay), layout_key=lay.key,
                world_size=lay.world_size, status=result.status, predicted_memory_bytes=int(entry.memory.total),
                predicted_tokens_per_s_per_device=entry.time.tokens_per_s_per_device, useful_fraction=1.0,
                step_time_s=result.step_time_s, tokens_per_s=result.tokens_per_s,
                tokens_per_s_per_device=result.tokens_per_s_per_device, useful_tokens_per_s=result.tokens_per_s,
                mfu=result.mfu, peak_memory_bytes=result.peak_memory_bytes, step_times_s=list(result.step_times_s),
                losses=[float(x) for x in result.losses], env=result.env or None, backend="simulate",
                simulated=True, device_seconds=float(result.device_seconds or 0.0), created_at=now, started_at=now,
                finished_at=now,
            ))
        for i in range(0, len(rows), 1000):
            s.execute(sa.insert(store.Trial), rows[i:i + 1000])
        store.refresh_sweep_cache(s, sweep_id=sid)
        store.set_sweep_status(s, sweep_id=sid, status="running")
        store.set_sweep_status(s, sweep_id=sid, status="completed")  # a finished sweep, as people read them
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
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=(home / "serve.log").open("w"), text=True,
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
    raise SystemExit(f"coordinator did not start: {(home / 'serve.log').read_text()}")


class Connection:
    """One keep-alive HTTP/1.1 connection issuing GETs (Content-Length bodies, as uvicorn sends them)."""

    def __init__(self, port: int) -> None:
        self.port = port

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)

    async def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}\r\n".encode())
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        fields = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        body = await self.reader.readexactly(int(fields.get("content-length", "0")))
        return status, fields, body

    def close(self) -> None:
        self.writer.close()


async def load(port: int, path: str, *, clients: int, requests: int, warmup: int,
               headers: dict[str, str] | None = None, expect: int = 200) -> tuple[list[float], float]:
    """Latencies (s) of ``requests`` GETs spread over ``clients`` concurrent connections, and the wall time."""
    remaining = requests + warmup
    latencies: list[float] = []

    async def client() -> None:
        nonlocal remaining
        conn = Connection(port)
        await conn.open()
        try:
            while remaining > 0:  # one event loop: no lock needed between the check and the decrement
                remaining -= 1
                counted = remaining < requests  # the first `warmup` requests are not counted
                started = time.perf_counter()
                status, _, body = await conn.get(path, headers)
                elapsed = time.perf_counter() - started
                assert status == expect, (status, body[:200])
                if counted:
                    latencies.append(elapsed)
        finally:
            conn.close()

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return latencies, time.perf_counter() - started


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (and its reaped children), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def stats(lat: list[float], wall: float, single: list[float], cpu: float) -> dict[str, float]:
    lat = sorted(lat)
    q = statistics.quantiles(lat, n=100, method="inclusive")
    return {"single": statistics.median(single), "p50": q[49], "p90": q[89], "p99": q[98], "max": lat[-1],
            "rps": len(lat) / wall, "n": len(lat), "cpu": cpu / len(lat)}


def serialise_alone(url: str, sid: int, repeats: int = 5) -> dict[str, float]:
    """Seconds to read the whole stored ranking (services) and to serialise it as JSON, in process."""
    from api.ranking.schemas import RankingOut

    engine, sessions = store.open_store(url, upgrade_schema=False)
    read, dump = [], []
    try:
        for _ in range(repeats):
            with sessions() as s:
                t0 = time.perf_counter()
                result = rankings.ranking(s, sweep_id=sid)
                t1 = time.perf_counter()
                RankingOut.model_validate(result, from_attributes=True).model_dump_json()
                t2 = time.perf_counter()
            read.append(t1 - t0)
            dump.append(t2 - t1)
    finally:
        engine.dispose()
    return {"read": statistics.median(read), "serialise": statistics.median(dump)}


def measure(url: str, label: str, args: argparse.Namespace, home: Path) -> dict[str, dict[str, float]]:
    """Per request kind: latency statistics under load, unloaded, and server CPU per request."""
    t0 = time.perf_counter()
    sid = seed(url, args.trials)
    seeded = time.perf_counter() - t0
    proc, base = serve(url, home)
    port = int(base.rsplit(":", 1)[1])
    out: dict[str, dict[str, float]] = {}
    ranking = f"/api/sweeps/{sid}/ranking"
    try:
        etag = httpx.get(f"{base}{ranking}?limit=20").headers["etag"]
        started = time.perf_counter()  # the page's first load reads every trial and renders it (then cached)
        page_etag = httpx.get(f"{base}/sweeps/{sid}", timeout=120).headers["etag"]
        print(f"  {label} sweep page, cold (reads the sweep's trials, renders): {(time.perf_counter() - started) * 1e3:.0f} ms",
              flush=True)
        browser = {"Accept-Encoding": "gzip, deflate, br"}  # what every browser asks the dashboard for
        kinds = [("healthz", "/healthz", None, 200), ("full", ranking, None, 200), ("top20", f"{ranking}?limit=20", None, 200),
                 ("etag", f"{ranking}?limit=20", {"If-None-Match": etag}, 304), ("page", f"/sweeps/{sid}", browser, 200),
                 ("page304", f"/sweeps/{sid}", browser | {"If-None-Match": page_etag}, 304),
                 ("data", f"/sweeps/{sid}/data.json", browser, 200)]
        kinds = [k for k in kinds if k[0] == "healthz" or k[0] in args.kinds]
        firsts: dict[str, tuple[float, list[float], bytes]] = {}
        for kind, path, headers, _ in kinds:
            async def single_client(path=path, headers=headers) -> tuple[float, list[float], bytes]:
                conn = Connection(port)
                await conn.open()
                try:
                    started = time.perf_counter()
                    _, _, body = await conn.get(path, headers)
                    first = time.perf_counter() - started
                    single = []
                    for _ in range(10):  # unloaded latency, one client
                        started = time.perf_counter()
                        await conn.get(path, headers)
                        single.append(time.perf_counter() - started)
                    return first, single, body
                finally:
                    conn.close()

            firsts[kind] = asyncio.run(single_client())
            print(f"  {label} {kind}: {len(firsts[kind][2]) / 1e6:.3f} MB; first request {firsts[kind][0] * 1e3:.1f} ms",
                  flush=True)
        # The kinds take turns in --rounds rounds, so that a change in the shared machine's load
        # during the run falls on all of them alike (their ratios to /healthz are then comparable).
        lat_of: dict[str, list[float]] = {k: [] for k, *_ in kinds}
        wall_of, cpu_of = dict.fromkeys(lat_of, 0.0), dict.fromkeys(lat_of, 0.0)
        for _ in range(args.rounds):
            for kind, path, headers, expect in kinds:
                n = (min(args.requests, 200) if kind == "data" else args.requests) // args.rounds  # data: ~1 MB
                cpu0 = cpu_seconds(proc.pid)
                lat, wall = asyncio.run(load(port, path, clients=args.clients, requests=n,
                                             warmup=args.clients // 5, headers=headers, expect=expect))
                cpu_of[kind] += cpu_seconds(proc.pid) - cpu0
                lat_of[kind] += lat
                wall_of[kind] += wall
        for kind, *_ in kinds:
            first, single, body = firsts[kind]
            out[kind] = stats(lat_of[kind], wall_of[kind], single, cpu_of[kind]) | {"first": first, "bytes": len(body)}
    except AssertionError:
        print((home / "serve.log").read_text()[-3000:], file=sys.stderr)
        raise
    finally:
        proc.terminate()
        proc.wait(30)
    out["serialise"] = serialise_alone(url, sid)
    print(f"  {label}: seeded {args.trials} trials in {seeded:.1f} s", flush=True)
    return out


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10_000)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--requests", type=int, default=1000, help="measured requests per kind (after a warm-up)")
    parser.add_argument("--pg", default=os.environ.get("MESHTUNE_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"))
    parser.add_argument("--rounds", type=int, default=5, help="the request kinds take turns this many times")
    parser.add_argument("--sqlite-only", action="store_true", help="skip PostgreSQL")
    parser.add_argument("--kinds", default=",".join(KINDS), type=lambda v: [k for k in v.split(",") if k],
                        help=f"request kinds to measure, comma-separated (of {','.join(KINDS)}; /healthz always)")
    args = parser.parse_args()
    if unknown := [k for k in args.kinds if k not in KINDS]:
        parser.error(f"--kinds: {unknown[0]!r} is not a kind (one of {', '.join(KINDS)})")

    before = uptime()
    results: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        print(f"ranking of {args.trials} trials, {args.clients} clients, {args.requests} requests per kind")
        print(f"load before: {before}")
        results["SQLite"] = measure(f"sqlite:///{home / 'bench.db'}", "SQLite", args, home)
        if not args.sqlite_only:
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
    after = uptime()

    stores = list(results)
    titles = [(k, t) for k, t in TITLES if k in results[stores[0]]]
    print(f"\n{'':34s}" + "".join(f"{s + ' ' + c:>16s}" for s in stores for c in ("p50", "p99")) +
          "".join(f"{s + ' p99/healthz':>24s}" for s in stores))
    for kind, title in titles:
        cells = "".join(f"{results[s][kind][k] * 1e3:13.1f} ms" for s in stores for k in ("p50", "p99"))
        ratio = "".join(f"{results[s][kind]['p99'] / results[s]['healthz']['p99']:24.2f}" for s in stores)
        print(f"{title:34s}{cells}{ratio}")
    print(f"\n{'':34s}" + "".join(f"{s:>16s}" for s in stores))
    for label, kind, key, scale, unit in (
        ("unloaded ?limit=20, 1 client", "top20", "single", 1e3, "ms"),
        ("unloaded whole ranking, 1 client", "full", "single", 1e3, "ms"),
        ("whole ranking: read (in process)", "serialise", "read", 1e3, "ms"),
        ("whole ranking: serialise alone", "serialise", "serialise", 1e3, "ms"),
        ("server CPU per /healthz", "healthz", "cpu", 1e3, "ms"),
        ("server CPU per ?limit=20", "top20", "cpu", 1e3, "ms"),
        ("server CPU per whole ranking", "full", "cpu", 1e3, "ms"),
        ("server CPU per sweep page", "page", "cpu", 1e3, "ms"),
        ("server CPU per chart data.json", "data", "cpu", 1e3, "ms"),
        ("sweep page size, gzip", "page", "bytes", 1e-6, "MB"),
        ("chart data.json size, gzip", "data", "bytes", 1e-6, "MB"),
        ("throughput ?limit=20", "top20", "rps", 1, "req/s"),
        ("whole ranking size", "full", "bytes", 1e-6, "MB"),
    ):
        if kind not in results[stores[0]]:
            continue
        print(f"{label + ' (' + unit + ')':34s}" + "".join(f"{results[s][kind][key] * scale:16.2f}" for s in stores))
    print(f"\nload before: {before}\nload after:  {after}")


if __name__ == "__main__":
    main()
