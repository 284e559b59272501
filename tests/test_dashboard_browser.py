"""The dashboard in a real headless Chromium (Debian's /usr/bin/chromium driven by Playwright).

One coordinator (``api.main.create_app``, engine off) serves a SQLite store holding three sweeps
written through the store functions: a 46-trial sweep with every outcome, a 2,006-trial sweep
(load time measured and written to the artifacts), and a "running" sweep that grows while a page
watches it. Every page must load with no console error and no request leaving 127.0.0.1.
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from _dashboard_seed import add_running_trial, seed_sweep, summary_of

from api import store
from api.main import create_app
from api.settings import Settings

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
TOKEN = "s3cret-token"
GiB = 2**30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory) -> Iterator[dict]:
    import uvicorn

    url = f"sqlite:///{tmp_path_factory.mktemp('dashboard') / 'meshtune.db'}"
    engine, sessions = store.open_store(url)
    t0 = time.perf_counter()
    ids = {
        "small": seed_sweep(sessions, n_trials=40, name="llama3-8b on 32 H100", rich=True),
        "big": seed_sweep(sessions, n_trials=2000, name="llama3-8b, 2000 trials", seed=1),
        "live": seed_sweep(sessions, n_trials=10, name="still running", status="running", seed=2),
    }
    seed_s = time.perf_counter() - t0
    settings = Settings(database_url=url, api_tokens={"alice": TOKEN}, read_requires_auth=False, backend="simulate")
    app = create_app(settings, run_engine=False)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield {"base": f"http://127.0.0.1:{port}", "sessions": sessions, "ids": ids, "seed_s": seed_s}
    finally:
        server.should_exit = True
        thread.join(10)
        engine.dispose()


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        yield b
        b.close()


class Watched:
    """A page with its console errors, uncaught exceptions and off-host requests recorded."""

    def __init__(self, page, base: str) -> None:
        self.page, self.base = page, base
        self.errors: list[str] = []
        self.foreign: list[str] = []
        page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        page.on("request", lambda r: None if r.url.startswith((base, "data:")) else self.foreign.append(r.url))

    def goto(self, path: str):
        resp = self.page.goto(self.base + path, wait_until="load")
        assert resp is not None and resp.status == 200, f"{path}: HTTP {resp and resp.status}"
        return resp

    def clean(self) -> None:
        assert self.errors == [], f"console errors: {self.errors}"
        assert self.foreign == [], f"requests that left the coordinator: {self.foreign}"


@pytest.fixture
def page(browser, coordinator) -> Iterator[Watched]:
    ctx = browser.new_context(viewport={"width": 1440, "height": 900})
    ctx.set_default_timeout(60_000)  # generous: the machine is shared; load times are reported, not asserted
    w = Watched(ctx.new_page(), coordinator["base"])
    yield w
    ctx.close()


PLOTS_DRAWN = """() => ['plot-pareto', 'plot-heatmap-0', 'plot-timeline', 'plot-stages', 'plot-losses', 'plot-importance']
    .every(id => { const d = document.getElementById(id); return d && d._fullLayout && d.querySelector('.main-svg'); })
    && document.getElementById('plot-importance').data !== undefined"""

READ_PLOTS = """() => {
  const g = id => document.getElementById(id);
  const pick = t => ({name: t.name, group: t.legendgroup, type: t.type, x: t.x, y: t.y, z: t.z, n: (t.x || []).length});
  return {
    pareto: g('plot-pareto').data.map(pick),
    paretoPoints: g('plot-pareto').querySelectorAll('.scatterlayer .trace .points path').length,
    heatmap: g('plot-heatmap-0').data.map(pick),
    timeline: g('plot-timeline').data.map(pick),
    stages: g('plot-stages').data.map(pick),
    losses: g('plot-losses').data.map(pick),
    importance: g('plot-importance').data.map(pick),
    rankingRows: document.querySelectorAll('#ranking-table tbody tr').length,
    firstRank: document.querySelector('#ranking-table tbody tr td:nth-child(12)').textContent.trim(),
  };
}"""


def _close(a: float, b: float, rel: float = 1e-3) -> bool:
    return math.isclose(a, b, rel_tol=rel)


def test_sweeps_list_loads_with_stored_sweeps(page, coordinator):
    page.goto("/")
    rows = page.page.locator("#sweeps-table tbody tr")
    assert rows.count() == 3
    text = page.page.locator("#sweeps-table").inner_text()
    assert "llama3-8b on 32 H100" in text and "still running" in text and "alice" in text
    assert "46 / 46" in text  # 40 search trials + 3 layouts re-measured twice
    page.clean()


def test_sweep_page_plots_the_stored_sweep(page, coordinator, artifacts_dir):
    sid = coordinator["ids"]["small"]
    truth = summary_of(coordinator["sessions"], sid)
    page.goto(f"/sweeps/{sid}")
    page.page.wait_for_function(PLOTS_DRAWN, timeout=60_000)
    page.page.wait_for_function("() => document.getElementById('plot-importance').data.length > 0", timeout=60_000)
    plots = page.page.evaluate(READ_PLOTS)

    # Pareto: one point per measured layout (the service's medians), colour traces by TP, front drawn.
    tp_traces = [t for t in plots["pareto"] if t["name"].startswith("TP=")]
    assert sum(t["n"] for t in tp_traces) == len(truth["pareto"]) == plots["paretoPoints"]
    assert {t["name"] for t in tp_traces} == {f"TP={p.layout['tp']}" for p in truth["pareto"]}
    front = sorted((p for p in truth["pareto"] if p.on_front), key=lambda p: p.peak_memory_bytes)
    drawn = next(t for t in plots["pareto"] if t["name"] == "Pareto front")
    assert len(drawn["x"]) == len(front) >= 1
    for x, y, p in zip(drawn["x"], drawn["y"], front, strict=True):
        assert _close(x, p.peak_memory_bytes / GiB) and _close(y, p.tokens_per_s_per_device)
    assert any(t["name"].startswith("PP=") for t in plots["pareto"])  # symbol legend

    # Heatmap over TP x PP: its best cell is the best layout's median.
    z = [v for row in plots["heatmap"][0]["z"] for v in row if v is not None]
    assert _close(max(z), truth["best"])

    # Timeline: a trace for every outcome the sweep stored.
    assert {t["group"] for t in plots["timeline"]} >= set(truth["statuses"]) >= {
        "completed", "pruned", "oom", "timeout", "crash", "nan"}
    assert sum(t["n"] for t in plots["timeline"]) == truth["n_trials"]

    # Stage bars of pipeline layouts, losses against the reference, importance from Optuna.
    assert plots["stages"] and all(t["name"].count("PP") and len(t["y"]) >= 2 for t in plots["stages"])
    assert plots["losses"][0]["name"].startswith("reference:") and len(plots["losses"]) >= 2
    imp = plots["importance"][0]
    assert set(imp["y"]) <= {"tp", "pp", "dp", "cp", "ep", "zero", "mbs", "ac", "sp", "schedule", "vpp"}
    assert all(0 <= v <= 1 for v in imp["x"]) and _close(sum(imp["x"]), 1.0, rel=0.01)

    # Ranked table: every ranked layout (one page), best first with the service's median.
    assert plots["rankingRows"] == min(50, len(truth["ranking"].rows))
    assert float(plots["firstRank"].replace(",", "")) == pytest.approx(truth["ranking"].rows[0].median, rel=1e-3)
    assert page.page.locator(".banner.sim").count() == 1  # simulate results are labelled

    shot = artifacts_dir / "dashboard-sweep.png"
    page.page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 50_000
    page.clean()


def test_submit_form_shows_the_api_validation_message(page, coordinator):
    page.goto("/")
    page.page.fill("input[name=max_trials]", "0")
    page.page.fill("input[name=token]", TOKEN)
    page.page.click("form.submit button[type=submit]")
    page.page.wait_for_selector("#form-errors")
    shown = page.page.locator("#form-errors li").all_inner_texts()
    assert shown == ["search.max_trials=0: Input should be greater than or equal to 1"]
    assert "invalid" in (page.page.get_attribute("input[name=max_trials]", "class") or "")
    # The API says the same for the same body.
    body = {"name": "sweep", "model": "tiny", "cluster": "cpu-local",
            "training": {"global_batch": 16, "precision": "fp32"},
            "search": {"sampler": "tpe", "max_trials": 0}, "backend": "simulate"}
    api = httpx.post(coordinator["base"] + "/api/sweeps", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
    assert api.status_code == 422 and api.json()["detail"] == shown[0]

    # A valid submission lands on the new sweep's page, owned by the token's name.
    page.page.fill("input[name=max_trials]", "5")
    page.page.fill("input[name=name]", "from the form")
    page.page.fill("input[name=token]", TOKEN)
    page.page.click("form.submit button[type=submit]")
    page.page.wait_for_url("**/sweeps/*")
    assert "from the form" in page.page.locator("h1").inner_text()
    assert "owner alice" in page.page.locator("main").inner_text()
    page.errors = [e for e in page.errors if "422" not in e]  # the invalid POST's own status line
    page.clean()


def test_trial_detail_pages(page, coordinator):
    sid = coordinator["ids"]["small"]
    page.goto(f"/sweeps/{sid}")
    page.page.click("#ranking-table tbody tr:first-child a")
    page.page.wait_for_selector("#measurements")
    assert "tokens/s per device" in page.page.locator("#measurements").inner_text()
    assert "simulate" in page.page.locator("#environment").inner_text()
    page.page.wait_for_function("() => document.getElementById('plot-trial').data.length == 2")
    # A crashed trial shows its error text.
    page.goto(f"/sweeps/{sid}?trial_status=crash")
    page.page.click("#trials-table tbody tr:first-child a")
    page.page.wait_for_selector("#trial-error")
    assert "injected crash on rank 1" in page.page.locator("#trial-error").inner_text()
    page.clean()


def test_running_sweep_refreshes_itself(page, coordinator):
    sid = coordinator["ids"]["live"]
    page.goto(f"/sweeps/{sid}?refresh_ms=500")
    page.page.wait_for_function(PLOTS_DRAWN, timeout=60_000)
    count = "() => document.getElementById('plot-pareto').data.filter(t => t.name.startsWith('TP=')).reduce((n, t) => n + t.x.length, 0)"
    before = page.page.evaluate(count)
    add_running_trial(coordinator["sessions"], sweep_id=sid, tokens=123456.0, peak=3 * GiB)
    page.page.wait_for_function(f"() => ({count})() === {before + 1}", timeout=30_000)
    page.page.wait_for_function(
        "() => document.querySelector('[data-fact=\"summary.best_tokens_per_s_per_device\"]').textContent.includes('123')",
        timeout=30_000,
    )
    # When the sweep ends the page says so and stops polling.
    with store.session_scope(coordinator["sessions"]) as session:
        store.set_sweep_status(session, sweep_id=sid, status="completed")
    page.page.wait_for_function("() => document.getElementById('refreshed').textContent === 'finished'", timeout=30_000)
    assert page.page.locator('[data-fact="status"]').inner_text() == "completed"
    requests: list[str] = []
    page.page.on("request", lambda r: requests.append(r.url))
    page.page.wait_for_timeout(1500)
    assert not [u for u in requests if "data.json" in u]
    page.clean()


def test_page_with_2000_trials_stays_responsive(page, coordinator, artifacts_dir):
    sid = coordinator["ids"]["big"]
    t0 = time.perf_counter()
    page.goto(f"/sweeps/{sid}")
    loaded = time.perf_counter() - t0
    page.page.wait_for_function(PLOTS_DRAWN, timeout=60_000)
    drawn = time.perf_counter() - t0
    page.page.wait_for_function("() => document.getElementById('plot-importance').data.length > 0", timeout=60_000)
    with_importance = time.perf_counter() - t0
    nav = page.page.evaluate("""() => { const n = performance.getEntriesByType('navigation')[0];
        return {ttfb: n.responseStart - n.requestStart, html_bytes: n.transferSize,
                dom: n.domContentLoadedEventEnd, load: n.loadEventEnd}; }""")
    plots = page.page.evaluate(READ_PLOTS)
    truth = summary_of(coordinator["sessions"], sid)
    assert truth["n_trials"] == 2006
    assert sum(t["n"] for t in plots["pareto"] if t["name"].startswith("TP=")) == len(truth["pareto"])
    assert sum(t["n"] for t in plots["timeline"]) == 2006
    assert plots["rankingRows"] == 50  # paginated
    assert page.page.locator("#trials-table tbody tr").count() == 100
    report = {
        "trials": 2006, "measured_layouts": len(truth["pareto"]),
        "server_html_s": round(nav["ttfb"] / 1000, 3), "html_bytes": nav["html_bytes"],
        "dom_content_loaded_s": round(nav["dom"] / 1000, 3), "load_event_s": round(nav["load"] / 1000, 3),
        "goto_s": round(loaded, 3), "all_plots_drawn_s": round(drawn, 3),
        "importance_drawn_s": round(with_importance, 3), "seed_s": round(coordinator["seed_s"], 1),
    }
    (artifacts_dir / "dashboard-load-2000.json").write_text(json.dumps(report, indent=2))
    print("dashboard load, 2,000 trials:", report)
    page.clean()
