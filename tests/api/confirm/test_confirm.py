"""Confirm runs: the statistics (tuner/_confirm.py), the engine's phase (api/engine/_confirm.py) on the
simulate backend (labelled simulated), the request's refusals over the API and the CLI, and the
report in the API and ``meshtune show``. Real long runs: test_api_e2e.py (the session's real sweep)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient

from api import store
from api.cli import main
from api.confirm import service as confirm
from api.dashboard import data
from api.engine import SweepRunner
from api.main import create_app
from api.ranking import service as rankings
from api.settings import Settings
from api.spec import SweepSpec
from api.sweeps import service as svc
from tuner import ConflictError, SpecError
from tuner._confirm import compare, drift, spearman, tenth

# --- statistics --------------------------------------------------------------------------------------


def test_spearman_with_ties_and_degenerate_cases():
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(math.sqrt(3) / 2)  # average ranks for the tie
    assert spearman([1], [1]) is None and spearman([2, 2], [1, 3]) is None
    with pytest.raises(ValueError):
        spearman([1, 2], [1])


def _steps(rng: random.Random, level: float, n: int, sigma: float = 0.02) -> list[float]:
    return [level * rng.lognormvariate(0.0, sigma) for _ in range(n)]


def test_compare_says_when_the_winner_changed_and_how_clearly():
    rng = random.Random(7)
    short = [_steps(rng, 100, 6), _steps(rng, 96, 6), _steps(rng, 80, 3)]
    medians = [sorted(s)[len(s) // 2] for s in short]
    # the long runs: #1 slows down to 90 (below #2's 97); #3 stays last
    kept = compare(medians, short, [_steps(rng, 101, 30), _steps(rng, 96, 30), _steps(rng, 80, 30)], seed=1)
    changed = compare(medians, short, [_steps(rng, 90, 30), _steps(rng, 97, 30), _steps(rng, 80, 30)], seed=1)
    assert kept.winner_kept and kept.long_best == 0 and kept.p_best > 0.95 and kept.rho == pytest.approx(1.0)
    assert not changed.winner_kept and changed.long_best == 1 and changed.p_best < 0.05
    assert changed.rho == pytest.approx(0.5)
    for c in (kept, changed):
        assert -1 <= c.rho_low <= c.rho <= c.rho_high <= 1
        assert all(lo <= m <= hi for lo, m, hi in zip(c.long_low, c.long_median, c.long_high, strict=True))


def test_drift_is_the_last_tenth_against_the_first_with_an_interval():
    rng = random.Random(3)
    flat = drift(_steps(rng, 100, 30))
    slowed = drift(_steps(rng, 100, 15) + _steps(rng, 90, 15))
    assert flat.steps == tenth(30) == 3 and flat.drifted is False and flat.low <= 0 <= flat.high
    assert slowed.drifted is True and slowed.change == pytest.approx(-0.10, abs=0.04) and slowed.high < 0
    short = drift([100.0, 95.0, 90.0])  # a tenth of 3 steps is one step: a change, no interval
    assert short.steps == 1 and short.change == pytest.approx(-0.10) and short.low is None and short.drifted is None
    assert drift([100.0]) is None


# --- the engine, the service, the API and the CLI (simulate backend) --------------------------------

SPEC = {"name": "confirm", "model": "tiny", "cluster": "cpu-local", "training": {"global_batch": 16},
        "backend": "simulate", "search": {"max_trials": 5, "remeasure_top_k": 2, "repeats": 2}}


@pytest.fixture
def env(tmp_path):
    url = f"sqlite:///{tmp_path / 'c.db'}"
    store.upgrade(url)
    engine, sessions = store.open_store(url)
    settings = Settings(home=tmp_path, database_url=url)
    try:
        yield settings, sessions, SweepRunner(settings, sessions=sessions)
    finally:
        engine.dispose()


def _run(sessions, runner, spec: dict) -> int:
    with sessions() as s:
        sid = svc.create_sweep(s, spec=SweepSpec.model_validate(spec), owner="alice").id
    assert runner.run_sweep(sid).status == "completed"
    return sid


def _snapshot(sessions, sid: int) -> tuple:
    with sessions() as s:
        sw = svc.get_sweep(s, sweep_id=sid)
        trials = [(t.number, t.attempt, t.status, t.phase) for t in store.all_trials(s, sweep_id=sid)]
        return sw.status, sw.confirm, sw.n_trials, trials


def test_search_confirm_runs_the_top_layouts_longer_as_their_own_phase(env):
    _, sessions, runner = env
    sid = _run(sessions, runner, SPEC | {"search": SPEC["search"] | {"confirm": {"top_k": 3, "steps": 12}}})
    with sessions() as s:
        rows = store.all_trials(s, sweep_id=sid)
        longs = [t for t in rows if t.phase == "confirm"]
        ranking = rankings.ranking(s, sweep_id=sid)
        assert [t.layout_key for t in longs] == [r.layout_key for r in ranking.rows[:3]]  # in ranking order
        assert all(t.repeat == 0 and t.status == "completed" and len(t.step_times_s) == 12 for t in longs)
        # not in the ranking: the stored ranking equals the one recomputed from the short runs
        assert all(t.number not in r.trial_numbers for r in ranking.rows for t in longs)
        assert [r.layout_key for r in ranking.rows] == [r.layout_key for r in rankings.ranking_from_trials(s, sweep_id=sid).rows]
        report = confirm.confirm_report(s, sweep_id=sid)
    assert report.done and report.source == "spec" and report.steps == 12 and report.compared == 3
    assert report.simulated and report.winner_kept is not None and -1 <= report.spearman <= 1
    assert all(r.long_median and r.drift is not None for r in report.rows)
    assert report.verdict.startswith(("winner kept", "winner changed")) and "Spearman" in report.verdict


def test_a_completed_sweep_confirms_on_request_and_bad_requests_change_nothing(env):
    _, sessions, runner = env
    sid = _run(sessions, runner, SPEC)
    before = _snapshot(sessions, sid)
    with sessions() as s:
        for kwargs, error, text in [
            ({"top_k": 6}, SpecError, "top_k=6 is more than the 5 ranked layouts of sweep"),
            ({"top_k": 0}, SpecError, "top_k=0 must be at least 1"),
            ({"top_k": 2, "steps": 0}, SpecError, "steps=0 must be at least 1"),
            ({"top_k": 2, "steps": 10_001}, SpecError, "steps=10001 is more than 10,000"),
        ]:
            with pytest.raises(error, match=text):
                confirm.request_confirm(s, sweep_id=sid, **kwargs)
    assert _snapshot(sessions, sid) == before
    with sessions() as s:
        sweep = confirm.request_confirm(s, sweep_id=sid, top_k=2)  # default steps: 10x the sweep's 3
        assert sweep.status == "queued" and sweep.confirm["steps"] == 30 and sweep.confirm["reopened"]
        with pytest.raises(ConflictError, match=f"sweep {sid} is still queued"):
            confirm.request_confirm(s, sweep_id=sid, top_k=2)
    final = runner.run_sweep(sid)
    assert final.status == "completed"
    status, asked, n_trials, trials = _snapshot(sessions, sid)
    assert [t for t in trials if t[3] == "confirm"] == [(n, 0, "completed", "confirm") for n in (7, 8)]
    assert n_trials == 9 and [t for t in trials if t[3] != "confirm"] == [t for t in before[3]]  # no search ran
    with sessions() as s:  # the sweeps list counts the two long runs apart from the 7 budgeted short runs
        (row,) = [r for r in data.sweeps_page(s, status=None, page=1)["sweeps"] if r["id"] == sid]
    assert (row["done"], row["confirm_runs"]) == (7, 2)


def test_nothing_completed_or_not_completed_is_refused(env):
    _, sessions, _ = env
    with sessions() as s:  # a completed sweep whose one trial ran out of memory
        sid = svc.create_sweep(s, spec=SweepSpec.model_validate(SPEC), owner="alice").id
        store.insert_trial(s, sweep_id=sid, number=0, layout={"dp": 4}, layout_key="dp4", world_size=4, status="oom")
        store.set_sweep_status(s, sweep_id=sid, status="completed")
        s.commit()
        with pytest.raises(ConflictError, match=f"sweep {sid} has no completed trial to confirm"):
            confirm.request_confirm(s, sweep_id=sid, top_k=1)
        other = svc.create_sweep(s, spec=SweepSpec.model_validate(SPEC), owner="alice").id
        svc.cancel_sweep(s, sweep_id=other)
        with pytest.raises(ConflictError, match=f"sweep {other} is cancelled: only a completed sweep"):
            confirm.request_confirm(s, sweep_id=other, top_k=1)


def test_api_routes_answer_one_line_and_report(env):
    settings, sessions, runner = env
    sid = _run(sessions, runner, SPEC)
    with TestClient(create_app(settings, run_engine=False), raise_server_exceptions=False) as client:
        assert client.get(f"/api/sweeps/{sid}/confirm").status_code == 404
        for body, field, value in [({"top_k": 9}, "top_k", 9), ({"top_k": 2, "steps": 0}, "steps", 0)]:
            r = client.post(f"/api/sweeps/{sid}/confirm", json=body)
            assert r.status_code == 422, r.text
            detail = r.json()["detail"]
            assert "\n" not in detail and field in detail and str(value) in detail
        assert client.post("/api/sweeps/999/confirm", json={"top_k": 1}).status_code == 404
        bad = SPEC | {"search": SPEC["search"] | {"confirm": {"top_k": 2, "steps": 0}}}
        r = client.post("/api/sweeps", json=bad)
        assert r.status_code == 422 and "search.confirm.steps" in r.json()["detail"]
        r = client.post(f"/api/sweeps/{sid}/confirm", json={"top_k": 2, "steps": 8})
        assert r.status_code == 202 and r.json()["status"] == "queued" and r.json()["confirm"]["steps"] == 8
        r = client.post(f"/api/sweeps/{sid}/confirm", json={"top_k": 2})
        assert r.status_code == 409 and f"sweep {sid} is still queued" in r.json()["detail"]
        assert runner.run_sweep(sid).status == "completed"
        report = client.get(f"/api/sweeps/{sid}/confirm").json()
        assert report["done"] and report["steps"] == 8 and [r["status"] for r in report["rows"]] == ["completed"] * 2
        assert report["rows"][0]["short_rank"] == 1 and report["compared"] == 2 and report["verdict"]
        assert report["spearman"] in (-1.0, 1.0) or abs(report["spearman"]) == pytest.approx(1.0)
        trial = client.get(f"/api/sweeps/{sid}/trials?limit=1").json()["items"][0]
        memory = client.get(f"/api/sweeps/{sid}/trials/{trial['id']}/memory").json()
        assert memory["ranks"] == [] and memory["timeline_max_bytes"] is None  # simulated: no process ran
        assert len(memory["predicted"]) == trial["layout"]["pp"]


def test_cli_confirm_and_show(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MESHTUNE_HOME", str(tmp_path / "home"))
    spec = Path(tmp_path / "s.yaml")
    spec.write_text(yaml.safe_dump(SPEC))
    assert main(["sweep", str(spec)]) == 0
    capsys.readouterr()
    assert main(["confirm", "1", "--top", "9"]) == 2
    assert capsys.readouterr().err.strip() == "meshtune confirm: error: --top=9 is more than the 5 ranked layouts of sweep 1"
    assert main(["confirm", "1", "--steps", "0"]) == 2
    assert capsys.readouterr().err.strip() == "meshtune confirm: error: --steps=0 must be at least 1"
    assert main(["confirm", "1", "--top", "2", "--steps", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sweep"]["status"] == "completed" and out["confirm"]["done"] and len(out["confirm"]["rows"]) == 2
    assert main(["show", "1"]) == 0
    text = capsys.readouterr().out
    assert "confirm round 0, top 2 x 6 measured steps (SIMULATED)" in text and "Spearman" in text
    assert "drift, last vs first tenth" in text and ("winner kept" in text or "winner changed" in text)
