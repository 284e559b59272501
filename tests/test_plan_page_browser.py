"""The dashboard's "how many GPUs" page (/plan) in headless Chromium: the plotly figure of the
cluster-size comparison draws (its traces are the figure /api/plan/sizes gives), the table has a
row per size, no console error and no request leaves 127.0.0.1. One coordinator on an empty store."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from api import store
from api.main import create_app
from api.settings import Settings

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_plan_page_draws_the_size_comparison(tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium)")
    import uvicorn
    from playwright.sync_api import sync_playwright

    url = f"sqlite:///{tmp_path / 'meshtune.db'}"
    engine, _ = store.open_store(url)
    app = create_app(Settings(database_url=url, api_tokens={}, read_requires_auth=False), run_engine=False)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    base = f"http://127.0.0.1:{port}"
    query = ("/plan?model=tiny&cluster=cpu-local&nodes=1,2,4&global_batch_tokens=1024&critical_batch_tokens=1024"
             "&train_tokens=1e9&price_per_device_hour=0.5&scale_batch=1")
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                        args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []
            foreign: list[str] = []
            page.on("console", lambda m: m.type == "error" and errors.append(m.text))
            page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
            page.on("request", lambda r: None if r.url.startswith((base, "data:")) else foreign.append(r.url))
            resp = page.goto(base + query, wait_until="load")
            assert resp is not None and resp.status == 200
            page.wait_for_selector("#plan-plot .main-svg", timeout=60_000)
            names = page.evaluate("() => document.getElementById('plan-plot').data.map(t => t.name)")
            assert names == ["tokens/s", "useful tokens/s (critical batch)", "MFU", "cost per 1M tokens"]
            xs = page.evaluate("() => document.getElementById('plan-plot').data[0].x")
            assert xs == [4, 8, 16]
            assert page.locator("#plan-table tbody tr").count() == 3
            assert page.locator("header a.nav", has_text="how many GPUs").count() == 1
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "plan-sizes.png"), full_page=True)
            assert errors == [] and foreign == [], (errors, foreign)
            browser.close()
    finally:
        server.should_exit = True
        thread.join(10)
        engine.dispose()
