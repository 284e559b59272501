"""The schedules and trends pages: rendered over HTTP, and in a real headless Chromium with the
regression marked on the chart. Runs use the simulate backend (labelled simulated on the page)."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api import store
from api.engine import SweepRunner
from api.schedules import Scheduler, _store
from api.schedules import service as svc
from api.schedules._launch import pinned_space
from api.schedules.schemas import ScheduleIn
from api.settings import Settings
from tests.helpers.browser import serve, watched_page
from tuner import Layout

ONE_RANK = {
    "name": "nightly", "model": "tiny", "cluster": {"preset": "cpu-local", "devices_per_node": 1, "peak_flops": 1e11},
    "training": {"global_batch": 8}, "space": pinned_space(Layout()),
    "search": {"sampler": "grid", "max_trials": 1, "warm_start_top_k": 0, "repeats": 3, "remeasure_top_k": 1},
    "trial": {"warmup_steps": 1, "measure_steps": 3}, "backend": "simulate",
}


def _app(url: str):
    from api.dashboard import trends
    from api.main import create_app

    app = create_app(Settings(database_url=url, api_tokens={}), run_engine=False)
    app.include_router(trends.router)  # how the coordinator links the pages (see api/dashboard/trends.py)
    return app


@pytest.fixture(scope="module")
def nightly_schedule(tmp_path_factory) -> Iterator[dict]:
    """A schedule with three simulated runs; the third on half the FLOP/s: a regression."""
    url = f"sqlite:///{tmp_path_factory.mktemp('trends') / 'meshtune.db'}"
    engine, sessions = store.open_store(url)
    with sessions() as s:
        sid = svc.create_schedule(s, data=ScheduleIn(name="nightly-sim", cron="0 2 * * *", template=ONE_RANK),
                                  owner="t").id
    runner = SweepRunner(Settings(database_url=url), sessions=sessions)
    scheduler = Scheduler(sessions=sessions, replica_id="r1")
    for night in range(3):
        if night == 2:
            slower = {**ONE_RANK, "cluster": {**ONE_RANK["cluster"], "peak_flops": 5e10}}
            with store.session_scope(sessions) as s:
                _store.update_schedule(s, schedule_id=sid, values={"template": slower})
        with sessions() as s:
            fire = svc.run_now(s, schedule_id=sid, by="t")
        for sweep_id in fire.sweep_ids:
            runner.run_sweep(sweep_id)
        scheduler.tick()
    try:
        yield {"url": url, "sid": sid, "sessions": sessions}
    finally:
        engine.dispose()


def test_pages_render_with_the_regression(nightly_schedule) -> None:
    with TestClient(_app(nightly_schedule["url"])) as c:
        listing = c.get("/schedules")
        assert listing.status_code == 200
        assert "nightly-sim" in listing.text and f"/schedules/{nightly_schedule['sid']}/trends" in listing.text
        page = c.get(f"/schedules/{nightly_schedule['sid']}/trends")
        assert page.status_code == 200
        assert 'id="trend-plot"' in page.text and "alert-regression" in page.text and 'class="banner sim"' in page.text
        data = c.get(f"/schedules/{nightly_schedule['sid']}/trends.json").json()
        marks = [t for t in data["traces"] if t["name"] == "regression"]
        assert len(marks) == 1 and len(marks[0]["x"]) == 1 and data["simulated"] is True
        # the page embeds the same traces for static/figure.js to draw
        embedded = re.search(r"data-figure='(.*?)'", page.text, re.S)
        assert embedded and json.loads(html.unescape(embedded[1]))["data"] == data["traces"]
        assert c.get("/dashboard/static/figure.js").status_code == 200
        assert c.get("/schedules/999/trends").status_code == 404


@pytest.mark.browser
def test_trends_page_in_chromium_marks_the_regression(nightly_schedule, browser, artifacts_dir: Path) -> None:
    with serve(_app(nightly_schedule["url"])) as base, watched_page(browser, base) as w:
        page = w.page
        w.goto("/schedules")
        page.click(f"a[href='/schedules/{nightly_schedule['sid']}/trends']")
        page.wait_for_selector("#trend-plot .main-svg", timeout=30_000)
        names = page.evaluate("() => document.getElementById('trend-plot').data.map(t => t.name)")
        points = page.locator("#trend-plot .scatterlayer .trace").count()
        axis = page.evaluate("() => document.getElementById('trend-plot').layout.yaxis")  # the page's data-layout
        assert axis["title"]["text"] == "best tokens/s" and axis["rangemode"] == "tozero"
        page.screenshot(path=str(artifacts_dir / "schedule-trends.png"), full_page=True)
        assert page.locator("#alerts-table tr.alert-regression").count() == 1
        assert names == [Layout().short, "regression"] and points == 2  # legends show Layout.short
        w.clean()
