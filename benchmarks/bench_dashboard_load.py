"""Load time of the dashboard's sweep page for a small and a 2,000-trial sweep, side by side.

Goal: "the page stays responsive with a sweep of 2,000 trials". Stores two sweeps (simulate
backend, written through the store functions) in a temporary SQLite file, serves them with the
coordinator app (uvicorn, engine off) and opens each sweep page in headless Chromium. Per size, the
median of ``--repeats`` cold page loads (new browser context each time) of:

    cold     time to the first byte of the HTML on the first load (every trial read from SQLite,
             ranking, charts' data, rendering); later loads of a finished sweep are served from
             the dashboard's cache of finished sweeps:
    server   the same on the later loads
    paint    first contentful paint (facts and tables show before plotly.js has run)
    read     CPU time of the dashboard's uncached read of the sweep (what a live refresh of a
             running sweep costs the coordinator), in process
    json_kb  size of data.json (what the live refresh fetches every few seconds)
    html     HTML size
    dom      DOMContentLoaded (HTML parsed, plotly.js + dashboard.js run, first chart drawn)
    plots    every chart drawn (Pareto, heatmap, timeline, stages, losses)
    import.  parameter importance drawn (fetched after the charts; Optuna PED-ANOVA on the server)
    main_cpu the browser main thread's busy time until then (CDP TaskDuration): the work itself,
             less sensitive than wall times to other processes on a shared machine

and the ratio large/small, measured in one run on the same machine.

    python benchmarks/bench_dashboard_load.py [--small 200] [--large 2000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the seeding helper the dashboard tests use (tests.helpers)

from api import store  # noqa: E402
from api.dashboard import data  # noqa: E402
from api.main import create_app  # noqa: E402
from api.settings import Settings  # noqa: E402
from api.sweeps import service as service  # noqa: E402
from tests.helpers.dashboard_seed import seed_sweep  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
PLOTS = """() => ['plot-pareto', 'plot-heatmap-0', 'plot-timeline', 'plot-stages', 'plot-losses']
    .every(id => { const d = document.getElementById(id); return d && d._fullLayout && d.querySelector('.main-svg'); })"""
IMPORTANCE = "() => { const d = document.getElementById('plot-importance'); return d && d.data && d.data.length > 0; }"


def _serve(url: str):
    import uvicorn

    app = create_app(Settings(database_url=url, api_tokens={}, read_requires_auth=False), run_engine=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{port}"


def _browser_load(browser, url: str) -> dict[str, float]:
    ctx = browser.new_context(viewport={"width": 1440, "height": 900})
    page = ctx.new_page()
    cdp = ctx.new_cdp_session(page)
    cdp.send("Performance.enable")
    errors: list[str] = []
    page.on("console", lambda m: m.type == "error" and errors.append(m.text))
    t0 = time.perf_counter()
    page.goto(url, wait_until="domcontentloaded")
    dom = time.perf_counter() - t0
    page.wait_for_function(PLOTS, timeout=120_000, polling=20)
    plots = time.perf_counter() - t0
    page.wait_for_function(IMPORTANCE, timeout=120_000, polling=20)
    importance = time.perf_counter() - t0
    nav = page.evaluate("() => performance.getEntriesByType('navigation')[0].toJSON()")
    paint = page.evaluate("() => performance.getEntriesByName('first-contentful-paint')[0].startTime")
    metrics = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
    ctx.close()
    assert not errors, errors
    return {"server": (nav["responseStart"] - nav["requestStart"]) / 1000, "paint": paint / 1000, "dom": dom,
            "plots": plots, "importance": importance, "html_kb": nav["transferSize"] / 1024,
            "main_cpu": metrics["TaskDuration"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=200)
    parser.add_argument("--large", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/meshtune.db"
        engine, sessions = store.open_store(url)
        warm = seed_sweep(sessions, n_trials=10, name="warm-up", rich=True, seed=7)
        sizes = {n: seed_sweep(sessions, n_trials=n, name=f"{n} trials", rich=True, seed=n) for n in (args.small, args.large)}
        server, base = _serve(url)
        results: dict[int, dict[str, float]] = {}
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                        args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
            # First-request costs (imports, templates) and V8's code cache for plotly.js, which
            # Chromium keeps only after a script has run a few times: warm both before measuring.
            for _ in range(3):
                _browser_load(browser, f"{base}/sweeps/{warm}")
            runs: dict[int, list[dict[str, float]]] = {n: [] for n in sizes}
            for i in range(args.repeats + 1):  # sizes interleaved, so drifting load hits both alike
                for n, sid in sizes.items():
                    runs[n].append(_browser_load(browser, f"{base}/sweeps/{sid}?r={i}"))
            for n, sid in sizes.items():
                cold = runs[n].pop(0)["server"]
                reads = []
                for _ in range(args.repeats):
                    with sessions() as session:
                        sweep = service.get_sweep(session, sweep_id=sid)
                        t0 = time.thread_time()
                        data._read_state(session, sweep)
                        reads.append(time.thread_time() - t0)
                size = len(httpx.get(f"{base}/sweeps/{sid}/data.json").content)
                results[n] = {k: statistics.median(r[k] for r in runs[n]) for k in runs[n][0]}
                results[n] |= {"cold": cold, "read": statistics.median(reads), "json_kb": size / 1024}
            browser.close()
        server.should_exit = True
        engine.dispose()

    cols = [("cold", "s"), ("server", "s"), ("read", "s"), ("json_kb", "kB"), ("html_kb", "kB"), ("paint", "s"),
            ("dom", "s"), ("plots", "s"), ("importance", "s"), ("main_cpu", "s")]
    small, large = results[args.small], results[args.large]
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'trials':>8} " + " ".join(f"{c + ' ' + u:>12}" for c, u in cols))
    for n in (args.small, args.large):
        print(f"{n:>8} " + " ".join(f"{results[n][c]:>12.3f}" for c, _ in cols))
    print(f"{'ratio':>8} " + " ".join(f"{large[c] / small[c]:>12.2f}" for c, _ in cols))


if __name__ == "__main__":
    main()
