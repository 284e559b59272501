"""The dashboard in a real headless Chromium (Debian's /usr/bin/chromium driven by Playwright).

One coordinator (``api.main.create_app``, engine off) serves a SQLite store holding four sweeps
written through the store functions: a 46-trial sweep with every outcome, a 2,006-trial sweep
(load time measured and written to the artifacts), a "running" sweep that grows while a page
watches it, and a 4-layout tiny-moe sweep for the "check migration" control (one layout ep>1,
which the reshard check refuses). Every page must load with no console error and no request
leaving 127.0.0.1.

The coordinator's reshard-check runner is ``StubReshardRunner`` (labelled TEST STUB: it runs
nothing and answers "ok" after 1 s): the endpoint's validation and storage are real, the check
itself is tested in test_reshard.py.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator

import httpx
import pytest

from api import store
from api.main import create_app
from api.settings import Settings
from api.spec import SweepSpec
from api.sweeps import service
from tests.helpers.browser import Watched, serve, watched_page
from tests.helpers.dashboard_seed import (
    StubReshardRunner,
    add_running_trial,
    seed_migration_sweep,
    seed_sweep,
    summary_of,
)

pytestmark = pytest.mark.browser

TOKEN = "s3cret-token"
GiB = 2**30


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory) -> Iterator[dict]:
    url = f"sqlite:///{tmp_path_factory.mktemp('dashboard') / 'meshtune.db'}"
    engine, sessions = store.open_store(url)
    t0 = time.perf_counter()
    ids = {
        "small": seed_sweep(sessions, n_trials=40, name="llama3-8b on 32 H100", rich=True),
        "big": seed_sweep(sessions, n_trials=2000, name="llama3-8b, 2000 trials", seed=1),
        "live": seed_sweep(sessions, n_trials=10, name="still running", status="running", seed=2),
        "moe": seed_migration_sweep(sessions),
    }
    seed_s = time.perf_counter() - t0
    settings = Settings(database_url=url, api_tokens={"alice": TOKEN}, read_requires_auth=False, backend="simulate")
    app = create_app(settings, run_engine=False)
    app.state.reshard_runner = runner = StubReshardRunner(delay_s=1.0)  # TEST STUB (see the module docstring)
    try:
        with serve(app) as base:
            yield {"base": base, "sessions": sessions, "ids": ids, "seed_s": seed_s, "reshard_runner": runner}
    finally:
        engine.dispose()


@pytest.fixture
def coordinator_page(browser, coordinator) -> Iterator[Watched]:
    with watched_page(browser, coordinator["base"], width=1440, height=900) as w:
        yield w


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
    firstRank: document.querySelector('#ranking-table tbody tr td:nth-child(4)').textContent.trim(),
  };
}"""


def _close(a: float, b: float, rel: float = 1e-3) -> bool:
    return math.isclose(a, b, rel_tol=rel)


def test_sweeps_list_loads_with_stored_sweeps(coordinator_page, coordinator):
    coordinator_page.goto("/")
    rows = coordinator_page.page.locator("#sweeps-table tbody tr")
    assert rows.count() == 4
    text = coordinator_page.page.locator("#sweeps-table").inner_text()
    assert "llama3-8b on 32 H100" in text and "still running" in text and "alice" in text
    assert "46 / 46" in text  # 40 search trials + 3 layouts re-measured twice
    coordinator_page.clean()


def test_sweep_page_plots_the_stored_sweep(coordinator_page, coordinator, artifacts_dir):
    sid = coordinator["ids"]["small"]
    truth = summary_of(coordinator["sessions"], sid)
    coordinator_page.goto(f"/sweeps/{sid}")
    coordinator_page.page.wait_for_function(PLOTS_DRAWN, timeout=60_000)
    coordinator_page.page.wait_for_function("() => document.getElementById('plot-importance').data.length > 0", timeout=60_000)
    plots = coordinator_page.page.evaluate(READ_PLOTS)

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
    assert plots["stages"] and all(" pp" in t["name"] and len(t["y"]) >= 2 for t in plots["stages"])
    assert plots["losses"][0]["name"].startswith("reference:") and len(plots["losses"]) >= 2
    imp = plots["importance"][0]
    assert set(imp["y"]) <= {"tp", "pp", "dp", "cp", "ep", "zero", "mbs", "ac", "sp", "schedule", "vpp"}
    assert all(0 <= v <= 1 for v in imp["x"]) and _close(sum(imp["x"]), 1.0, rel=0.01)

    # Ranked table: every ranked layout (one page), best first with the service's median.
    assert plots["rankingRows"] == min(50, len(truth["ranking"].rows))
    assert float(plots["firstRank"].replace(",", "")) == pytest.approx(truth["ranking"].rows[0].median, rel=1e-3)
    assert coordinator_page.page.locator(".banner.sim").count() == 1  # simulate results are labelled

    shot = artifacts_dir / "dashboard-sweep.png"
    coordinator_page.page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 50_000
    coordinator_page.clean()


def test_submit_form_shows_the_api_validation_message(coordinator_page, coordinator):
    coordinator_page.goto("/")
    coordinator_page.page.fill("input[name=max_trials]", "0")
    coordinator_page.page.fill("input[name=token]", TOKEN)
    coordinator_page.page.click("form.submit button[type=submit]")
    coordinator_page.page.wait_for_selector("#form-errors")
    shown = coordinator_page.page.locator("#form-errors li").all_inner_texts()
    assert shown == ["search.max_trials=0: Input should be greater than or equal to 1"]
    assert "invalid" in (coordinator_page.page.get_attribute("input[name=max_trials]", "class") or "")
    # The API says the same for the same body.
    body = {"name": "sweep", "model": "tiny", "cluster": "cpu-local",
            "training": {"global_batch": 16, "precision": "fp32"},
            "search": {"sampler": "tpe", "max_trials": 0}, "backend": "simulate"}
    api = httpx.post(coordinator["base"] + "/api/sweeps", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
    assert api.status_code == 422 and api.json()["detail"] == shown[0]

    # A valid submission lands on the new sweep's page, owned by the token's name.
    coordinator_page.page.fill("input[name=max_trials]", "5")
    coordinator_page.page.fill("input[name=name]", "from the form")
    coordinator_page.page.fill("input[name=token]", TOKEN)
    coordinator_page.page.click("form.submit button[type=submit]")
    coordinator_page.page.wait_for_url("**/sweeps/*")
    assert "from the form" in coordinator_page.page.locator("h1").inner_text()
    assert "owner alice" in coordinator_page.page.locator("main").inner_text()
    coordinator_page.errors = [e for e in coordinator_page.errors if "422" not in e]  # the invalid POST's own status line
    coordinator_page.clean()


def test_trial_detail_pages(coordinator_page, coordinator):
    sid = coordinator["ids"]["small"]
    coordinator_page.goto(f"/sweeps/{sid}")
    coordinator_page.page.click("#ranking-table tbody tr:first-child a")
    coordinator_page.page.wait_for_selector("#measurements")
    assert "tokens/s per device" in coordinator_page.page.locator("#measurements").inner_text()
    assert "simulate" in coordinator_page.page.locator("#environment").inner_text()
    coordinator_page.page.wait_for_function("() => document.getElementById('plot-trial').data.length == 2")
    # A crashed trial shows its error text.
    coordinator_page.goto(f"/sweeps/{sid}?trial_status=crash")
    coordinator_page.page.click("#trials-table tbody tr:first-child a")
    coordinator_page.page.wait_for_selector("#trial-error")
    assert "injected crash on rank 1" in coordinator_page.page.locator("#trial-error").inner_text()
    coordinator_page.clean()


# A UI STUB: what POST /api/sweeps/{id}/reshard-check answers (ReshardCheckOut) for a corrupted
# reshard, with made-up numbers. page.route serves it ONLY to test how the page renders a verdict;
# the page's real request is then sent to the real endpoint (below, and test_dashboard_pages.py).
UI_STUB_CORRUPTED = {
    "id": 9999, "sweep_id": 0, "owner": "alice", "verdict": "corrupted", "from_key": "?", "to_key": "?",
    "steps_before": 2, "steps_after": 2, "tensors_checked": 58, "mismatch_count": 2,
    "mismatches": [{"key": "model/layers.0.attention.wq.weight", "max_abs_diff": 0.0625, "detail": "values differ"},
                   {"key": "optim/layers.0.attention.wq.weight/exp_avg", "max_abs_diff": 0.001, "detail": "values differ"}],
    "max_abs_diff": 0.0625, "losses_before": [5.6, 5.4], "losses_a": [5.2, 5.0], "losses_b": [5.9, 5.8],
    "max_rel_loss_diff": 0.16, "tolerance": 1e-05, "corrupt": None, "backend": "ui-stub", "error": None,
    "save_s": 0.4, "load_s": 0.6, "wall_s": 11.0, "created_at": "2026-11-29T18:00:00Z",
}
RESHARD_POST = "**/api/sweeps/*/reshard-check"
ROW_IS = "([id, status]) => [...document.querySelectorAll('#sweeps-table tbody tr')].some(tr => " \
    "tr.cells[0].textContent.trim() === String(id) && tr.cells[2].textContent.trim() === status)"


def test_migration_check_button_posts_and_shows_the_verdict(coordinator_page, coordinator, artifacts_dir):
    p, runner = coordinator_page.page, coordinator["reshard_runner"]
    coordinator_page.goto(f"/sweeps/{coordinator['ids']['small']}")  # simulated: no check offered, and the page says why
    assert p.locator("button.mig-open").count() == 0
    assert "is simulated (backend=simulate)" in p.locator("#migration-refused").inner_text()
    sid = coordinator["ids"]["moe"]  # a sweep of the ray backend
    coordinator_page.goto(f"/sweeps/{sid}")
    rows = p.locator("#ranking-table tbody tr")
    best, third = json.loads(rows.nth(0).get_attribute("data-layout")), json.loads(rows.nth(2).get_attribute("data-layout"))
    rows.nth(2).locator("button.mig-open").click()
    panel = p.locator("tr.mig-panel")
    assert panel.locator("select.mig-to option:checked").inner_text().endswith("(best)")  # default target
    panel.locator("input.mig-token").fill(TOKEN)
    expected = {"from_layout": third, "to_layout": best, "steps_before": 2, "steps_after": 2}

    # 1. UI STUB: the page's POST is held (spinner shown meanwhile), then answered with UI_STUB_CORRUPTED.
    held: list = []

    def hold(route) -> None:  # answered below, once the spinner has been seen
        held.append(route)

    p.route(RESHARD_POST, hold)
    panel.locator("button.mig-run").click()
    p.wait_for_selector("tr.mig-panel .spinner")
    deadline = time.monotonic() + 30
    while not held:
        assert time.monotonic() < deadline, "the page did not post the check"
        p.wait_for_timeout(20)
    request = held[0].request
    assert request.method == "POST" and request.post_data_json == expected
    assert request.headers["authorization"] == f"Bearer {TOKEN}"
    assert panel.locator("button.mig-run").is_disabled()
    held[0].fulfill(status=200, content_type="application/json",
                    body=json.dumps(UI_STUB_CORRUPTED | {"from_layout": third, "to_layout": best}))
    p.wait_for_selector("tr.mig-panel .mig-verdict.v-corrupted")
    shown = panel.locator(".mig-verdict").inner_text()
    assert "corrupted" in shown and "2 of 58 tensors differ" in shown and "model/layers.0.attention.wq.weight" in shown
    assert panel.locator(".spinner").count() == 0 and not panel.locator("button.mig-run").is_disabled()
    p.unroute(RESHARD_POST, hold)

    # 2. The same request to the real endpoint (validation, storage, the list): only its runner is the stub.
    jobs = len(runner.jobs)
    panel.locator("button.mig-run").click()
    p.wait_for_selector("tr.mig-panel .spinner")  # the stub runner takes 1 s
    p.wait_for_selector("tr.mig-panel .mig-verdict.v-ok", timeout=30_000)
    assert len(runner.jobs) == jobs + 1
    job = runner.jobs[-1]
    assert (job.from_layout.__dict__, job.to_layout.__dict__) == (third, best)
    assert "Safe to move" in panel.locator(".mig-verdict").inner_text()
    listed = p.locator("#migrations-table tbody tr")  # the tables were re-fetched; the panel survived it
    assert listed.count() >= 1 and listed.first.get_attribute("data-verdict") == "ok"
    assert p.locator("tr.mig-panel").count() == 1
    p.set_viewport_size({"width": 1440, "height": 1500})  # the ranking, the open panel and the checks list
    p.locator("#ranking-card").evaluate("e => e.scrollIntoView({block: 'start'})")
    p.screenshot(path=str(artifacts_dir / "dashboard-migration-check.png"))

    # 3. A layout the check cannot move (ep>1): the endpoint's 422 message, shown as it says it.
    coordinator_page.goto(f"/sweeps/{sid}")
    ep_row = p.locator("#ranking-table tbody tr[data-key^='tp1-cp1-ep2-']")
    ep_row.locator("button.mig-open").click()
    p.locator("tr.mig-panel input.mig-token").fill(TOKEN)
    p.locator("tr.mig-panel button.mig-run").click()
    p.wait_for_selector("tr.mig-panel .mig-error")
    refused = p.locator("tr.mig-panel .mig-error").inner_text()
    assert refused.startswith("Refused (HTTP 422): from_layout.ep=2: expert-parallel weights"), refused
    p.locator("tr.mig-panel").screenshot(path=str(artifacts_dir / "dashboard-migration-refused.png"))
    assert len(runner.jobs) == jobs + 1  # nothing ran
    coordinator_page.errors = [e for e in coordinator_page.errors if "422" not in e]  # the refused POST's own status line
    coordinator_page.clean()


OVERFLOW = """() => ({
  page: document.documentElement.scrollWidth - document.documentElement.clientWidth,
  boxes: [...document.querySelectorAll('.scroll, .card')].map(e => ({id: e.id || e.firstElementChild?.id || e.className,
                                                                     over: e.scrollWidth - e.clientWidth}))
                                                          .filter(b => b.over > 0),
})"""


@pytest.mark.parametrize("which", ["small", "moe", "list"])  # ranking with and without migration; the list
def test_pages_fit_1400_px_without_horizontal_scrolling(coordinator_page, coordinator, artifacts_dir, which):
    coordinator_page.page.set_viewport_size({"width": 1400, "height": 1000})
    if which == "list":
        coordinator_page.goto("/")
        card = "#sweeps-card"
    else:
        coordinator_page.goto(f"/sweeps/{coordinator['ids'][which]}")
        coordinator_page.page.wait_for_function(PLOTS_DRAWN, timeout=60_000)
        card = "#ranking-card"
    coordinator_page.page.locator(card).screenshot(path=str(artifacts_dir / f"dashboard-1400-{which}.png"))
    assert coordinator_page.page.evaluate(OVERFLOW) == {"page": 0, "boxes": []}
    coordinator_page.clean()


def test_layouts_measured_once_are_shown_neutral_and_never_as_tied(coordinator_page, coordinator, artifacts_dir):
    """A layout measured once is never shown tied unless its interval overlaps the best's: with the
    sweep's pooled noise a single run has an interval and reads "slower" when it is clear
    of the best; without any interval it reads "measured once — not comparable", in a neutral badge."""
    p, sid = coordinator_page.page, coordinator["ids"]["small"]
    coordinator_page.goto(f"/sweeps/{sid}")
    ranking = p.request.get(coordinator["base"] + f"/api/sweeps/{sid}/ranking").json()["rows"]
    best = ranking[0]
    singles = [r for r in ranking if r["n"] == 1]
    assert singles and len(ranking) > len(singles)
    for r in singles:
        row = p.locator(f"#ranking-table tbody tr[data-key='{r['layout_key']}']")
        versus, badge = row.get_attribute("data-versus"), row.locator(".badge").first
        if r["low"] is None or best["low"] is None:
            assert versus == "not comparable" and badge.inner_text() == "measured once — not comparable"
            assert badge.evaluate("e => getComputedStyle(e).backgroundColor") == "rgb(255, 255, 255)"
        elif r["high"] < best["low"]:  # clear of the best: slower, never "tied with best" (the ≈
            # mark is about the row above, tested with the tables fragment in test_display)
            assert versus == "slower" and "tied" not in badge.inner_text()
    assert any(r["high"] is not None and best["low"] is not None and r["high"] < best["low"] for r in singles)
    tied = p.locator("#ranking-table tbody tr[data-versus='tied']").count()
    sentence = p.locator("#tied-count").inner_text()
    assert sentence == ("No other layout is tied with the best." if tied == 0 else
                        f"{tied} other layout{'' if tied == 1 else 's'} {'is' if tied == 1 else 'are'} tied with the best.")
    assert "not comparable" in p.locator("#ranking-legend").inner_text()
    p.locator("#ranking-card").screenshot(path=str(artifacts_dir / "dashboard-ranking-versus-best.png"))
    coordinator_page.clean()


def test_charts_show_a_loading_line_until_they_are_drawn(coordinator_page, coordinator):
    p, held = coordinator_page.page, []
    p.route("**/dashboard/vendor/plotly.min.js", lambda route: held.append(route))  # plotly.js held back
    # (deferred scripts hold DOMContentLoaded back: wait for the response only, then for the held request)
    p.goto(coordinator["base"] + f"/sweeps/{coordinator['ids']['big']}", wait_until="commit")
    deadline = time.monotonic() + 30
    while not held:
        assert time.monotonic() < deadline, "the page did not ask for plotly.js"
        p.wait_for_timeout(20)
    p.wait_for_selector("#plot-losses > .loading")
    for plot in ("plot-pareto", "plot-heatmaps", "plot-importance", "plot-stages", "plot-losses"):
        assert p.locator(f"#{plot} > .loading .spinner").is_visible(), plot
    held[0].continue_()
    p.wait_for_function(PLOTS_DRAWN, timeout=60_000)
    p.wait_for_function("() => document.getElementById('plot-importance').data.length >= 0 && "
                        "!document.querySelector('#plot-importance > .loading')", timeout=60_000)
    assert p.locator(".plot > .loading, #plot-heatmaps > .loading").count() == 0
    # the big sweep's trials have no stage times (the seed adds them only to the small one): the
    # empty chart says so instead of "no completed pipeline layout yet"
    stages = p.evaluate("() => document.getElementById('plot-stages').layout.annotations[0].text")
    stages = stages.replace("<br>", " ")  # broken into lines that fit the plot (dashboard.js wrapNote)
    assert stages.startswith("no per-stage times: the simulate backend records none (") and "all simulated)" in stages
    coordinator_page.clean()


def test_running_sweep_refreshes_itself(coordinator_page, coordinator):
    sid = coordinator["ids"]["live"]
    coordinator_page.goto(f"/sweeps/{sid}?refresh_ms=500")
    coordinator_page.page.wait_for_function(PLOTS_DRAWN, timeout=60_000)
    count = "() => document.getElementById('plot-pareto').data.filter(t => t.name.startsWith('TP=')).reduce((n, t) => n + t.x.length, 0)"
    before = coordinator_page.page.evaluate(count)
    add_running_trial(coordinator["sessions"], sweep_id=sid, tokens=123456.0, peak=3 * GiB)
    coordinator_page.page.wait_for_function(f"() => ({count})() === {before + 1}", timeout=30_000)
    coordinator_page.page.wait_for_function(
        "() => document.querySelector('[data-fact=\"summary.best_tokens_per_s_per_device\"]').textContent.includes('123')",
        timeout=30_000,
    )
    assert not coordinator_page.page.locator("#stop-reason").is_visible()  # running: no reason yet
    # When the sweep ends the page says so, and why, and stops polling.
    with store.session_scope(coordinator["sessions"]) as session:
        store.set_sweep_status(session, sweep_id=sid, status="completed", stop_reason="reached max_trials=5")
    coordinator_page.page.wait_for_function("() => document.getElementById('refreshed').textContent === 'finished'", timeout=30_000)
    assert coordinator_page.page.locator('[data-fact="status"]').inner_text() == "completed"
    assert coordinator_page.page.locator("#stop-reason").inner_text() == "Stopped: reached max_trials=5"
    requests: list[str] = []
    coordinator_page.page.on("request", lambda r: requests.append(r.url))
    coordinator_page.page.wait_for_timeout(1500)
    assert not [u for u in requests if "data.json" in u]
    coordinator_page.clean()


def test_page_with_2000_trials_stays_responsive(coordinator_page, coordinator, artifacts_dir):
    sid = coordinator["ids"]["big"]
    t0 = time.perf_counter()
    coordinator_page.goto(f"/sweeps/{sid}")
    loaded = time.perf_counter() - t0
    coordinator_page.page.wait_for_function(PLOTS_DRAWN, timeout=60_000)
    drawn = time.perf_counter() - t0
    coordinator_page.page.wait_for_function("() => document.getElementById('plot-importance').data.length > 0", timeout=60_000)
    with_importance = time.perf_counter() - t0
    nav = coordinator_page.page.evaluate("""() => { const n = performance.getEntriesByType('navigation')[0];
        return {ttfb: n.responseStart - n.requestStart, html_bytes: n.transferSize,
                dom: n.domContentLoadedEventEnd, load: n.loadEventEnd}; }""")
    plots = coordinator_page.page.evaluate(READ_PLOTS)
    truth = summary_of(coordinator["sessions"], sid)
    assert truth["n_trials"] == 2006
    assert sum(t["n"] for t in plots["pareto"] if t["name"].startswith("TP=")) == len(truth["pareto"])
    assert sum(t["n"] for t in plots["timeline"]) == 2006
    assert plots["rankingRows"] == 50  # paginated
    assert coordinator_page.page.locator("#trials-table tbody tr").count() == 100
    report = {
        "trials": 2006, "measured_layouts": len(truth["pareto"]),
        "server_html_s": round(nav["ttfb"] / 1000, 3), "html_bytes": nav["html_bytes"],
        "dom_content_loaded_s": round(nav["dom"] / 1000, 3), "load_event_s": round(nav["load"] / 1000, 3),
        "goto_s": round(loaded, 3), "all_plots_drawn_s": round(drawn, 3),
        "importance_drawn_s": round(with_importance, 3), "seed_s": round(coordinator["seed_s"], 1),
    }
    (artifacts_dir / "dashboard-load-2000.json").write_text(json.dumps(report, indent=2))
    print("dashboard load, 2,000 trials:", report)
    coordinator_page.clean()


def test_sweeps_list_refreshes_while_a_sweep_is_queued_or_running(coordinator_page, coordinator):
    p, sessions = coordinator_page.page, coordinator["sessions"]
    with store.session_scope(sessions) as session:  # only this test's sweep is live
        for status in ("queued", "running"):
            for sw in service.list_sweeps(session, status=status, limit=500).items:
                service.cancel_sweep(session, sweep_id=sw.id)
        spec = SweepSpec.model_validate({"name": "list refresh probe", "model": "tiny", "cluster": "cpu-local",
                                         "backend": "simulate", "training": {"global_batch": 8}})
        sid = service.create_sweep(session, spec=spec, owner="alice").id
    coordinator_page.goto("/?refresh_ms=500")
    assert p.evaluate(ROW_IS, [sid, "queued"]) and p.get_attribute("[data-live]", "data-live") == "1"
    p.fill("input[name=name]", "half-typed")  # the refresh leaves the submit form alone
    with store.session_scope(sessions) as session:
        store.set_sweep_status(session, sweep_id=sid, status="running")
    p.wait_for_function(ROW_IS, arg=[sid, "running"], timeout=30_000)
    with store.session_scope(sessions) as session:
        store.set_sweep_status(session, sweep_id=sid, status="completed")
    p.wait_for_function(ROW_IS, arg=[sid, "completed"], timeout=30_000)
    assert p.get_attribute("[data-live]", "data-live") == "0" and p.input_value("input[name=name]") == "half-typed"
    polled: list[str] = []
    p.on("request", lambda r: polled.append(r.url))
    p.wait_for_timeout(1500)  # three periods: no sweep is live, so no more polling
    assert not [u for u in polled if "/sweeps-table" in u]
    coordinator_page.clean()
