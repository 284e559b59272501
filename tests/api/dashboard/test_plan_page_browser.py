"""The dashboard's "how many GPUs" page (/plan) in headless Chromium: the plotly figure of the
cluster-size comparison draws (its traces are the figure /api/plan/sizes gives), the table has a
row per size, a line names the figures (a stored probe's, or the datasheet's and why), no console
error and no request leaves 127.0.0.1. One coordinator per test (a probe row stored directly)."""

from __future__ import annotations

from pathlib import Path

import pytest

from api import store
from api.main import create_app
from api.settings import Settings
from tests.helpers.browser import serve, watched_page
from tests.helpers.probe_raw import store_probe, truth
from tuner import cluster_spec, model_spec, training_spec

pytestmark = pytest.mark.browser


def test_plan_page_draws_the_size_comparison(tmp_path, browser, artifacts_dir: Path):
    url = f"sqlite:///{tmp_path / 'meshtune.db'}"
    engine, sessions = store.open_store(url)
    tiny = model_spec("tiny")  # a probe of one cpu-local node: the comparison's figures at every size
    pid = store_probe(sessions, truth(), model=tiny, cluster=cluster_spec("cpu-local"),
                      training=training_spec({"global_batch_tokens": 1024}, seq_len=tiny.seq_len))
    app = create_app(Settings(database_url=url, api_tokens={}, read_requires_auth=False), run_engine=False)
    query = ("/plan?model=tiny&cluster=cpu-local&nodes=1,2,4&global_batch_tokens=1024&critical_batch_tokens=1024"
             "&train_tokens=1e9&price_per_device_hour=0.5&scale_batch=1")
    try:
        with serve(app) as base, watched_page(browser, base, width=1280, height=900) as w:
            page = w.page
            w.goto(query)
            page.wait_for_selector("#plan-plot .main-svg")
            names = page.evaluate("() => document.getElementById('plan-plot').data.map(t => t.name)")
            assert names == ["tokens/s", "useful tokens/s (critical batch)", "MFU", "cost per 1M tokens"]
            xs = page.evaluate("() => document.getElementById('plan-plot').data[0].x")
            assert xs == [4, 8, 16]
            margin = page.evaluate("() => document.getElementById('plan-plot').layout.margin")  # the page's data-layout
            assert margin == {"t": 40, "r": 80, "b": 60, "l": 70}
            assert page.locator("#plan-table tbody tr").count() == 3
            line = page.locator("#plan-figures .figures-line")
            assert line.count() == 1 and line.get_attribute("data-source") == "probed"
            assert line.get_attribute("data-probe") == str(pid)
            text = line.inner_text()
            assert text.startswith(f"cluster figures: probe #{pid} of ") and ", measured on 1 node (" in text
            assert text.endswith("datasheet for the network at 2 and 4 nodes (none on the probe's 1 node)")
            assert page.locator("header a.nav", has_text="how many GPUs").count() == 1
            page.screenshot(path=str(artifacts_dir / "plan-sizes.png"), full_page=True)
            w.clean()
    finally:
        engine.dispose()


def test_plan_page_compares_device_types(tmp_path, browser, artifacts_dir: Path):
    """The device-type selector: tick two types, price them, pick the stack, submit the form; the table
    has a row per (type, size), the fastest and the cheapest marked, and the figure a line per type."""
    url = f"sqlite:///{tmp_path / 'meshtune.db'}"
    engine, _ = store.open_store(url)
    app = create_app(Settings(database_url=url, api_tokens={}, read_requires_auth=False), run_engine=False)
    try:
        with serve(app) as base, watched_page(browser, base, width=1280, height=1100) as w:
            page = w.page
            w.goto("/plan")
            page.select_option("select[name=model]", "llama3-8b")
            page.uncheck("#device-types input[value=h100-sxm]")
            for device in ("h100-sxm", "b200", "mi300x"):
                page.check(f"#device-types input[value={device}]")
            page.fill("input[name=nodes]", "1,2")
            page.fill("input[name=global_batch_tokens]", "1048576")
            page.fill("input[name=train_tokens]", "1e12")
            page.fill("input[name=price_per_device_hour]", "h100-sxm=2.5,b200=5.0,mi300x=2.8")
            page.select_option("#stack", "megatron")
            page.click("#plan-form button[type=submit]")
            page.wait_for_selector("#plan-plot .main-svg")
            rows = page.locator("#devices-table tbody tr")
            assert rows.count() == 6
            assert [rows.nth(i).get_attribute("data-device") for i in range(6)] == [  # the form's order
                "b200", "b200", "h100-sxm", "h100-sxm", "mi300x", "mi300x"]
            assert page.locator("#devices-table tr[data-fastest]").count() == 1
            assert page.locator("#devices-table tr[data-cheapest]").count() == 1
            assert page.locator("#devices-table tr[data-fastest] .badge", has_text="fastest").count() == 1
            names = page.evaluate("() => document.getElementById('plan-plot').data.map(t => t.name)")
            assert names[:3] == ["b200", "h100-sxm", "mi300x"] and "fastest / cheapest" in names
            assert "stack megatron" in page.locator(".card .caption").first.inner_text()
            lines = page.locator("#plan-figures .figures-line")  # one per device type, each saying why
            assert [lines.nth(i).get_attribute("data-device") for i in range(lines.count())] == [
                "b200", "h100-sxm", "mi300x"]
            for i in range(3):
                assert lines.nth(i).inner_text().endswith(
                    "cluster figures: datasheet (a probe measures meshtune's workers, not the megatron stack)")
            assert page.locator("#stack").input_value() == "megatron"  # the form keeps what was asked
            assert page.locator("#device-types input:checked").count() == 3
            page.screenshot(path=str(artifacts_dir / "plan-devices.png"), full_page=True)
            w.clean()
    finally:
        engine.dispose()
