"""A real coordinator process (`meshtune serve` on a free loopback port, SQLite in a temporary
MESHTUNE_HOME) driven over HTTP: a sweep of REAL trials on CPU ranks ends with a ranking, and a
coordinator SIGKILLed mid-sweep and restarted finishes the sweep with every trial number once."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "tok-e2e-7c4f1a9b2d"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FINISHED = ("completed", "failed", "cancelled")

pytestmark = pytest.mark.slow


class Coordinator:
    """`meshtune serve --port 0` in a subprocess; the port is read from uvicorn's start-up line."""

    def __init__(self, home: Path, *, extra_env: dict[str, str] | None = None) -> None:
        env = {
            **os.environ,
            "MESHTUNE_HOME": str(home),
            "MESHTUNE_API_TOKENS": f"e2e:{TOKEN}",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        env.pop("MESHTUNE_DATABASE_URL", None)
        env.pop("RAY_ADDRESS", None)
        env.update(extra_env or {})
        self.log = home / f"coordinator-{time.monotonic_ns()}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "api.cli", "serve", "--host", "127.0.0.1", "--port", "0"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self.lines: list[str] = []
        self._port = threading.Event()
        self.url = ""
        threading.Thread(target=self._pump, daemon=True).start()
        if not self._port.wait(60):
            self.stop()
            raise AssertionError("coordinator did not start:\n" + "".join(self.lines[-40:]))
        self.http = httpx.Client(base_url=self.url, headers=AUTH, timeout=30)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        with self.log.open("w") as out:
            for line in self.proc.stdout:
                self.lines.append(line)
                out.write(line)
                match = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line)
                if match:
                    self.url = match.group(1)
                    self._port.set()

    def wait_for(self, sweep_id: int, predicate, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            sweep = self.http.get(f"/api/sweeps/{sweep_id}").json()
            if predicate(sweep):
                return sweep
            assert self.proc.poll() is None, "coordinator died:\n" + "".join(self.lines[-40:])
            time.sleep(0.5)
        raise AssertionError(f"timed out; last state {sweep}\n" + "".join(self.lines[-40:]))

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # uvicorn's graceful shutdown runs the lifespan's end
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()


@contextmanager
def coordinator(home: Path, **kwargs) -> Iterator[Coordinator]:
    c = Coordinator(home, **kwargs)
    try:
        yield c
    finally:
        c.stop()


@pytest.mark.browser
def test_real_sweep_over_http_ends_with_a_ranking(tmp_path: Path, ray_local: None, browser, artifacts_dir,
                                                 monkeypatch, capsys) -> None:
    """The coordinator joins the session's local Ray (RAY_ADDRESS), as it joins a cluster in production;
    starting a private Ray costs ~15-30 s on 2 cores. The same real sweep then proves the memory
    timelines (stored per rank, their maximum the reported peak, drawn on the trial page) and a confirm
    round asked from the dashboard's form (its report in the API, the dashboard and ``meshtune show``):
    one launch for all of it (the suite's time budget)."""
    import ray

    spec = {
        "name": "e2e-real",
        "model": "tiny",
        "cluster": {"preset": "cpu-local", "devices_per_node": 2},  # 2 CPU ranks on gloo
        "training": {"global_batch": 8, "precision": "fp32"},
        "space": {"cp": [1], "mbs": [1, 2], "ac": ["none"], "schedules": ["1f1b"]},
        "search": {"sampler": "tpe", "max_trials": 2, "warm_start_top_k": 2, "remeasure_top_k": 0},
        "trial": {"warmup_steps": 1, "measure_steps": 2, "step_timeout_s": 60},
        "backend": "ray",
    }
    with coordinator(tmp_path, extra_env={"RAY_ADDRESS": ray.get_runtime_context().gcs_address}) as c:
        health = c.http.get("/healthz").json()
        assert health["status"] == "ok" and health["database"]["ok"] is True and health["ray"]["ok"] is True
        r = httpx.post(f"{c.url}/api/sweeps", json=spec)
        assert r.status_code == 401
        r = c.http.post("/api/sweeps", json=spec)
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        sweep = c.wait_for(sid, lambda s: s["status"] in FINISHED, timeout=240)
        assert sweep["status"] == "completed", sweep
        assert sweep["owner"] == "e2e" and sweep["n_completed"] == 2 and sweep["device_seconds"] > 0
        trials = c.http.get(f"/api/sweeps/{sid}/trials").json()["items"]
        assert len(trials) == 2
        for t in trials:  # measured, not simulated
            assert t["status"] == "completed" and t["backend"] == "ray" and not t["simulated"], t
            assert t["world_size"] == 2 and t["tokens_per_s_per_device"] > 0 and len(t["step_times_s"]) == 2
            assert t["peak_memory_bytes"] > 0 and t["memory_measure"] and len(t["losses"]) == 3
            # where its ranks ran, as their processes said: nodes of this Ray (the rank -> node map)
            assert len(t["rank_nodes"]) == 2 and set(t["rank_nodes"]) <= {n["NodeID"] for n in ray.nodes()}, t
        ranking = c.http.get(f"/api/sweeps/{sid}/ranking").json()
        assert not ranking["simulated"] and len(ranking["rows"]) == 2
        best = ranking["rows"][0]
        assert best["rank"] == 1 and best["median"] == max(t["tokens_per_s_per_device"] for t in trials)
        csv_text = c.http.get(f"/api/sweeps/{sid}/ranking", headers={"Accept": "text/csv"}).text
        assert csv_text.splitlines()[1].startswith(f"1,{best['layout_key']},")
        metrics = c.http.get("/metrics").text
        assert 'meshtune_sweeps{state="completed"} 1.0' in metrics
        assert 'meshtune_trials{outcome="completed",simulated="false"} 2.0' in metrics
        for t in trials:
            _check_memory_timeline(c, sid, t, measured_step=1 + 2 - 1)  # warm-up 1, the last of 2 measured
        short = [(r["layout_key"], r["n"], r["trial_numbers"]) for r in ranking["rows"]]
        report = _confirm_from_the_dashboard(c, browser, sid, artifacts_dir)
        assert [(r["layout_key"], r["n"], r["trial_numbers"])  # confirm runs are not in the ranking
                for r in c.http.get(f"/api/sweeps/{sid}/ranking").json()["rows"]] == short
        from api.cli import main

        monkeypatch.setenv("MESHTUNE_HOME", str(tmp_path))  # the coordinator's store, read as a user would
        capsys.readouterr()
        assert main(["show", str(sid)]) == 0
        shown = capsys.readouterr().out
        assert "confirm round 0, top 2 x 16 measured steps" in shown and "Spearman" in shown
        assert report["verdict"].split(" over ")[0] in shown  # "winner kept: <layout> still has ..."
    assert TOKEN not in "".join(c.lines)  # the token is never logged


def _check_memory_timeline(c: Coordinator, sid: int, trial: dict, *, measured_step: int) -> None:
    """A real trial's memory timeline: one per rank, its maximum the trial's reported peak (by
    construction, and every sampled point below the kernel's high-water mark), the step's phases
    recorded, the peak placed, the memory model's parts beside it."""
    mem = c.http.get(f"/api/sweeps/{sid}/trials/{trial['id']}/memory").json()
    assert [r["rank"] for r in mem["ranks"]] == [0, 1], mem
    assert mem["timeline_max_bytes"] == mem["peak_memory_bytes"] == trial["peak_memory_bytes"] > 0
    assert mem["memory_measure"] == "cpu.VmHWM" and len(mem["predicted"]) == trial["layout"]["pp"]
    for r in mem["ranks"]:
        assert r["series"] == "cpu.VmRSS" and r["step"] == measured_step and 2 <= len(r["bytes"]) <= 241
        assert r["peak_bytes"] == max(r["before_bytes"], max(r["bytes"]), r["after_bytes"])
        assert max(r["bytes"]) == r["step_peak_bytes"]  # the kernel's mark is the series' top point
        assert {"forward", "backward", "optimizer"} <= {p[1] for p in r["phases"]}
        assert r["peak"]["where"] in ("before", "step", "after") and r["peak"]["phase"]
        # what malloc had handed out: its peak in a phase of the step that allocates (not the start)
        assert r["live_measure"] == "cpu.malloc_in_use" and len(r["live"]) == len(r["bytes"])
        assert r["live_peak"]["phase"] in ("forward", "backward", "loss", "optimizer", "gradient sync",
                                          "pipeline send/recv")
    assert max(r["peak_bytes"] for r in mem["ranks"]) == trial["peak_memory_bytes"]


def _confirm_from_the_dashboard(c: Coordinator, browser, sid: int, artifacts_dir: Path) -> dict:  # noqa: ANN001
    """Ask a confirm round of the top 2 layouts (16 steps: a tenth of the 15 kept is 2 steps, enough for
    a drift interval) with the sweep page's form, wait for the real long runs, and read the report in
    the API and on the pages: the confirm card, and a long run's memory drawn per rank."""
    from tests.helpers.browser import watched_page

    with watched_page(browser, c.url, width=1400, height=1000) as w:
        w.goto(f"/sweeps/{sid}")
        form = w.page.locator("#confirm-form")
        form.locator("input[name=top_k]").fill("2")
        form.locator("input[name=steps]").fill("16")
        form.locator("input[name=token]").fill(TOKEN)
        with w.page.expect_navigation():
            form.locator("button[type=submit]").click()
        assert w.page.url.endswith(f"/sweeps/{sid}#confirm-card")
        w.clean()
    c.wait_for(sid, lambda s: s["status"] == "completed" and (s["confirm"] or {}).get("round") == 0, timeout=300)
    report = c.http.get(f"/api/sweeps/{sid}/confirm").json()
    assert report["done"] and report["source"] == "request" and report["requested_by"] == "e2e"
    assert report["steps"] == 16 and report["compared"] == 2 and len(report["rows"]) == 2
    assert abs(report["spearman"]) == pytest.approx(1.0) and report["winner_kept"] in (True, False)
    for row in report["rows"]:  # every long run measured its 16 steps; the drift has its interval
        assert row["status"] == "completed" and row["steps"] == 16 and row["long_low"] <= row["long_median"]
        assert row["drift"]["steps"] == 2 and row["drift"]["low"] <= row["drift"]["change"] <= row["drift"]["high"]
    long_run = c.http.get(f"/api/sweeps/{sid}/trials/{report['rows'][0]['trial_id']}").json()
    assert long_run["phase"] == "confirm" and len(long_run["step_times_s"]) == 16
    _check_memory_timeline(c, sid, long_run, measured_step=1 + 16 - 1)
    with watched_page(browser, c.url, width=1400, height=1000) as w:
        w.goto(f"/sweeps/{sid}")
        assert w.page.locator("#confirm-verdict").inner_text().strip() == report["verdict"]
        assert w.page.locator("#confirm-table tbody tr").count() == 2
        assert w.page.locator("#ranking-table a.peak-link").count() == 2  # the peak column opens the timeline
        w.page.locator("#confirm-card").screenshot(path=str(artifacts_dir / "confirm-report.png"))
        w.goto(f"/sweeps/{sid}/trials/{long_run['id']}")
        w.page.wait_for_function("() => document.getElementById('plot-memory').dataset.drawn === '1'")
        drawn = w.page.evaluate("""() => { const d = document.getElementById('plot-memory');
            return {series: d.data.filter(t => t.name.startsWith('resident memory')).length,
                    allocated: d.data.filter(t => t.name.startsWith('allocated by malloc')).length,
                    peaks: d.layout.annotations.map(a => a.text),
                    parts: d.data.filter(t => t.type === 'bar').length}; }""")
        assert drawn["series"] == drawn["allocated"] == 2 and len(drawn["peaks"]) == 2 and drawn["parts"] > 0
        assert all(text.startswith("step peak ") for text in drawn["peaks"])
        assert w.page.locator("#memory-table tbody tr").count() == 2
        w.page.locator("#memory").screenshot(path=str(artifacts_dir / "memory-timeline.png"))
        w.clean()
    return report


def test_coordinator_killed_mid_sweep_resumes_every_trial_exactly_once(tmp_path: Path) -> None:
    """Simulate backend (labelled simulated) with 1 s per trial, one at a time, so the SIGKILL lands
    while a trial runs and after others finished; real runs would make this test minutes long."""
    n = 5
    spec = {
        "name": "e2e-restart",
        "model": "tiny",
        "cluster": "cpu-local",
        "training": {"global_batch": 16},
        "search": {"sampler": "random", "max_trials": n, "warm_start_top_k": 0, "remeasure_top_k": 0},
        "trial": {"options": {"delay_s": 1.0}},
        "backend": "tests.helpers.api_backends:SlowSimulate",
    }
    with coordinator(tmp_path) as first:
        sid = first.http.post("/api/sweeps", json=spec).json()["id"]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # kill once two trials are done and the next one runs
            statuses = Counter(t["status"] for t in first.http.get(f"/api/sweeps/{sid}/trials").json()["items"])
            if statuses["completed"] >= 2 and statuses["running"]:
                break
            time.sleep(0.2)
        first.kill()
    assert statuses["completed"] < n and statuses["running"], statuses
    with coordinator(tmp_path) as second:
        sweep = second.wait_for(sid, lambda s: s["status"] in FINISHED, timeout=90)
        assert sweep["status"] == "completed", sweep
        rows = second.http.get(f"/api/sweeps/{sid}/trials?limit=1000").json()["items"]
    live = [t for t in rows if t["status"] != "interrupted"]
    assert sorted(t["number"] for t in live) == list(range(n))  # no number lost, none twice
    assert all(t["status"] == "completed" and t["simulated"] for t in live)
    interrupted = [t for t in rows if t["status"] == "interrupted"]
    assert interrupted  # the attempt that was running when the process died
    attempts = Counter((t["number"], t["attempt"]) for t in rows)
    assert max(attempts.values()) == 1
    for t in interrupted:  # re-run under the same number as the next attempt
        assert any(r["number"] == t["number"] and r["attempt"] == t["attempt"] + 1 for r in live)
    assert sweep["n_trials"] == n
