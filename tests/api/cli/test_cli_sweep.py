"""``meshtune sweep|sweeps|show|db``: end to end on the embedded default (simulate backend for speed,
one tiny real sweep on Ray CPU ranks), malformed specs and an unreachable database."""

from __future__ import annotations

import json

import pytest
import yaml

from api.cli import main


def _spec(tmp_path, name="s.yaml", **over):
    data = {"name": "cli", "model": "tiny", "cluster": "cpu-local", "training": {"global_batch": 16},
            "search": {"sampler": "tpe", "max_trials": 6, "remeasure_top_k": 1, "repeats": 2}, "backend": "simulate"}
    data.update(over)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_sweep_then_sweeps_then_show(home, capsys):
    assert main(["sweep", str(_spec(home)), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sweep"]["status"] == "completed" and out["sweep"]["n_trials"] == 7
    assert out["ranking"]["simulated"] and out["ranking"]["rows"][0]["rank"] == 1
    for row in out["ranking"]["rows"]:  # useful per device: the job's useful tokens/s over its devices
        lay = row["layout"]
        world = lay["tp"] * lay["pp"] * lay["dp"] * lay["cp"] * lay["ep"]
        assert row["useful_tokens_per_s_per_device"] == pytest.approx(row["useful_tokens_per_s"] / world)
        assert row["useful_tokens_per_s_per_device"] <= row["tokens_per_s_per_device"] * (1 + 1e-9)
    sweep_id = out["sweep"]["id"]
    assert main(["sweeps", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["total"] == 1 and listed["items"][0]["id"] == sweep_id
    assert main(["show", str(sweep_id), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert len(shown["trials"]) == 7 and any(p["on_front"] for p in shown["pareto"])
    assert main(["show", str(sweep_id), "--trials"]) == 0
    text = capsys.readouterr().out
    assert "SIMULATED" in text and "ranked by tokens_per_s_per_device" in text
    assert "median tok/s/dev" in text and "useful tok/s/dev" in text and "useful tok/s " not in text
    assert main(["show", str(sweep_id), "--metric", "useful_tokens_per_s"]) == 0
    assert "median useful tok/s (job)" in capsys.readouterr().out


def test_malformed_spec_exits_2_naming_file_and_field(home, capsys):
    bad = _spec(home, "bad.yaml", search={"max_trials": 0})
    assert main(["sweep", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.yaml" in err and "search.max_trials" in err and "Traceback" not in err
    worse = _spec(home, "worse.yaml", model={"preset": "tiny", "heads": 3})
    assert main(["sweep", str(worse)]) == 2
    assert "worse.yaml" in (err := capsys.readouterr().err) and "model.heads" in err
    assert main(["show", "424242"]) == 2
    assert "sweep 424242 does not exist" in capsys.readouterr().err


def test_unreachable_database_is_a_clear_error(home, capsys, monkeypatch):
    monkeypatch.setenv("MESHTUNE_DATABASE_URL", "postgresql+psycopg://bob:hunter2@127.0.0.1:1/meshtune")
    assert main(["sweeps"]) == 2
    err = capsys.readouterr().err
    assert "127.0.0.1:1/meshtune" in err and "hunter2" not in err and "Traceback" not in err


def test_db_upgrade_and_downgrade(home, capsys):
    assert main(["db", "upgrade"]) == 0
    assert "schema revision base" not in capsys.readouterr().out
    assert main(["db", "downgrade"]) == 0
    assert "base (empty)" in capsys.readouterr().out


@pytest.mark.slow
def test_tiny_real_sweep_on_ray_cpu_ranks(home, capsys, ray_local):
    # Two real runs of 2 gloo ranks: the model's favourite layout, then its re-measurement.
    spec = _spec(home, "real.yaml", backend="ray", cluster={"preset": "cpu-local", "devices_per_node": 2},
                 training={"global_batch": 8, "precision": "fp32"},
                 space={"tp": [1, 2], "pp": [1], "cp": [1], "zero": [0], "mbs": [1], "ac": ["none"], "sp": [False]},
                 search={"sampler": "tpe", "max_trials": 1, "warm_start_top_k": 1, "remeasure_top_k": 1, "repeats": 2},
                 trial={"warmup_steps": 1, "measure_steps": 2, "step_timeout_s": 60})
    assert main(["sweep", str(spec), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["ranking"]["rows"]
    assert out["sweep"]["status"] == "completed" and rows and not out["ranking"]["simulated"]
    assert rows[0]["n"] == 2 and rows[0]["tokens_per_s_per_device"] > 0 and rows[0]["peak_memory_bytes"] > 0


def _when(predicate, timeout: float = 30.0) -> None:
    import time

    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def test_ctrl_c_prints_a_hint_and_resume_finishes_with_every_trial_once(home, capsys):
    """Ctrl-C once: the trials in flight are recorded, the sweep stays unfinished with a hint. Ctrl-C
    twice: it stops at once, leaving a trial running. ``--resume`` then finishes it: every trial
    number has exactly one non-interrupted row, none lost, none duplicated."""
    import os
    import signal
    import threading
    from datetime import datetime, timezone

    from api import store
    from api.settings import Settings

    spec = _spec(home, backend="tests.helpers.engine_backends:ScriptedBackend", trial={"options": {"sleep_s": 0.4}},
                 search={"sampler": "random", "max_trials": 6, "remeasure_top_k": 1, "repeats": 2,
                         "warm_start_top_k": 0})
    url = Settings().resolved_database_url
    _, sessions = store.open_store(url)

    def rows():
        with sessions() as s:
            return store.all_trials(s, sweep_id=1)

    def fresh_running(ts) -> bool:  # a trial that started under 0.15 s ago (0.4 s to go): still in flight
        now = datetime.now(timezone.utc)
        return any(t.status == "running" and (now - t.started_at.replace(tzinfo=timezone.utc)).total_seconds() < 0.15
                   for t in ts)

    def interrupt(times: int, after: int) -> threading.Thread:
        def go():
            def ready() -> bool:
                ts = rows()
                return sum(t.status != "running" for t in ts) >= after and fresh_running(ts)

            _when(ready)
            for _ in range(times):
                os.kill(os.getpid(), signal.SIGINT)
                threading.Event().wait(0.05)
        th = threading.Thread(target=go)
        th.start()
        return th

    th = interrupt(1, after=1)
    assert main(["sweep", str(spec)]) == 130
    th.join()
    out = capsys.readouterr().out
    assert "meshtune sweep --resume 1" in out and "Traceback" not in out
    first = rows()
    assert 2 <= len(first) < 7 and all(t.status == "completed" for t in first)  # in-flight ones recorded

    th = interrupt(2, after=len(first) + 1)
    assert main(["sweep", "--resume", "1"]) == 130
    th.join()
    assert "meshtune sweep --resume 1" in capsys.readouterr().out
    assert any(t.status == "running" for t in rows())  # left in flight by the second Ctrl-C

    assert main(["sweep", "--resume", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sweep"]["status"] == "completed" and out["sweep"]["n_trials"] == 7
    final = rows()
    live = [t for t in final if t.status != "interrupted"]
    assert sorted(t.number for t in live) == list(range(7)) and all(t.status == "completed" for t in live)
    for t in final:
        if t.status == "interrupted":  # re-run under the same number as attempt + 1
            assert any(o.number == t.number and o.attempt == t.attempt + 1 for o in final)
    assert len({t.layout_key for t in live if t.phase == "search"}) == 6  # no layout measured twice

    assert main(["sweep", "--resume", "1"]) == 2  # finished: nothing to resume
    assert "already completed" in capsys.readouterr().err
    assert main(["sweep", str(spec), "--resume", "1"]) == 2
    assert main(["sweep"]) == 2
    assert main(["sweep", "--resume", "99"]) == 2
    assert "sweep 99 does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("over, needles", [
    ({"space": {"tp": [3]}}, ["space.tp=[3]", "no valid layout", "world size mismatch"]),
    ({"backend": "nosuch:mod"}, ["backend='nosuch:mod'", "cannot import module 'nosuch'"]),
])
def test_unrunnable_spec_exits_2_before_anything_is_stored(home, capsys, over, needles):
    bad = _spec(home, "unrunnable.yaml", **over)
    assert main(["sweep", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "unrunnable.yaml" in err and "Traceback" not in err
    assert all(n in err for n in needles), err
    assert main(["sweeps", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total"] == 0  # nothing stored, no failed sweep


def test_cli_sweep_is_created_running_under_its_own_runner(home, capsys, monkeypatch):
    """A coordinator (`meshtune serve`) on the same database cannot claim the CLI's sweep between
    its insert and its run."""
    from api import store
    from api.engine import SweepRunner
    from api.settings import Settings

    real = SweepRunner.run_sweep
    seen = {}

    def run_sweep(self, sweep_id, **kw):
        other = SweepRunner(Settings())
        with store.session_scope(other.sessions) as s:
            seen["claimed_by_serve"] = store.claim_sweep(s, runner_id=other.runner_id)
            seen["row"] = (store.get_sweep(s, sweep_id=sweep_id).status, store.get_sweep(s, sweep_id=sweep_id).runner_id)
        seen["cli_runner"] = self.runner_id
        return real(self, sweep_id, **kw)

    monkeypatch.setattr(SweepRunner, "run_sweep", run_sweep)
    assert main(["sweep", str(_spec(home)), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sweep"]["status"] == "completed"
    assert seen["claimed_by_serve"] is None
    assert seen["row"] == ("running", seen["cli_runner"])


def test_show_flags_diagnostic_sweeps_and_one_run_intervals(home, capsys):
    spec = _spec(home, "diag.yaml", trial={"options": {"sleep_per_step_s": 0.01}})
    assert main(["sweep", str(spec), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sweep"]["diagnostic"] is True and out["ranking"]["diagnostic"] is True
    assert main(["show", str(out["sweep"]["id"])]) == 0
    text = capsys.readouterr().out
    assert "diagnostic sweep" in text and "DIAGNOSTIC" in text
    assert "pooled over" in text  # single runs get their interval from the sweep's pooled noise
    bad = _spec(home, "badopt.yaml", trial={"options": {"fail": "explode"}})
    assert main(["sweep", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "badopt.yaml" in err and "trial.options.fail" in err and "Traceback" not in err


# --- what `sweeps` and `show` say --------------------------------------------------------------

@pytest.fixture
def measured_store(home, monkeypatch):
    """A store holding a real-backend sweep whose single fastest run (628.2, pp2 dp2) is not the
    ranking's best median (606.2, dp4 z1 mbs2), with a layout measured once far below; and a
    simulate-backend one. The CLI reads the same store."""
    from api import store
    from tests.helpers.dashboard_seed import seed_measured_sweep
    from tuner import Layout

    url = f"sqlite:///{home / 'measured.db'}"
    monkeypatch.setenv("MESHTUNE_DATABASE_URL", url)
    engine, sessions = store.open_store(url)
    rows = [(Layout(pp=2, dp=2), [628.2, 500.0, 505.0]), (Layout(dp=4, zero=1, mbs=2), [606.2, 607.0, 605.5]),
            (Layout(tp=2, dp=2), [603.0, 606.0, 609.0]), (Layout(dp=4), [300.0, 301.0, 299.0]), (Layout(tp=4), [68.5])]
    ids = {"real": seed_measured_sweep(sessions, rows, name="real-one"),
           "sim": seed_measured_sweep(sessions, rows[:2], name="sim-one", backend="simulate")}
    yield ids
    engine.dispose()


def test_sweeps_lists_the_rankings_best_not_the_fastest_run(measured_store, capsys):
    assert main(["sweeps"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "real-one" in x)
    assert "dp4 z1 mbs2" in line and "606.2" in line and "628" not in line


def test_show_explains_the_comparison_and_never_ties_a_single_run(measured_store, capsys):
    assert main(["show", str(measured_store["real"])]) == 0
    out = capsys.readouterr().out
    assert "2 other layouts are tied with the best." in out  # the best itself is not counted
    flat = " ".join(out.split())  # the legend is wrapped to the console's width
    assert "vs best — tied with best: its 95% interval overlaps" in flat and "not comparable: a single run" in flat
    rows = {x.split("│")[2].strip(): x for x in out.splitlines() if x.startswith("│") and x.split("│")[1].strip().isdigit()}
    assert set(rows) == {"dp2 pp2 1f1b", "dp4 z1 mbs2", "tp2 dp2", "dp4", "tp4 dp1"}  # short forms, whole
    # measured once, but the sweep's pooled noise gives it an interval clear of the best's: slower
    assert "slower than best" in rows["tp4 dp1"] and "tied" not in rows["tp4 dp1"] and " - " in rows["tp4 dp1"]
    assert "tied with best" in rows["tp2 dp2"] and "slower than" in rows["dp4"] and "best" in rows["dp4 z1 mbs2"]
    assert "…" not in out and "=1*" not in out  # nothing cut short; the old unexplained notation is gone
    assert "device-seconds=104.0" in out and "simulated" not in out.split("\n")[0]


def test_show_says_simulated_device_time_is_not_real(measured_store, capsys):
    assert main(["show", str(measured_store["sim"])]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "simulated device-seconds=48.0 (no real device time)" in first


def test_sweep_header_names_the_resolved_cluster_not_a_mapping(home, capsys):
    spec = _spec(home, cluster={"preset": "cpu-local"}, search={"max_trials": 2, "repeats": 1})
    assert main(["sweep", str(spec)]) == 0
    out = capsys.readouterr().out
    assert "tiny on cpu-local (1×4 cpu)" in out and "{'preset'" not in out


def test_a_node_lost_trial_counts_once_in_show_sweeps_and_the_api(home, capsys, monkeypatch):
    """A trial a node died under is re-run once under a new number (api/engine/_lost.py): the API's
    sweep, `meshtune sweeps` and `meshtune show` count the layout once (its re-run), while the trial
    lists keep the lost row, labelled node lost. Rows built in the store as the engine leaves them."""
    from fastapi.testclient import TestClient

    from api import store
    from api.main import create_app
    from api.settings import Settings
    from api.spec import SweepSpec
    from api.sweeps import service
    from tuner import Layout
    from workers import TrialError, TrialResult

    url = f"sqlite:///{home / 'lost.db'}"
    monkeypatch.setenv("MESHTUNE_DATABASE_URL", url)
    engine, sessions = store.open_store(url)
    spec = SweepSpec.model_validate({"name": "lost-one", "model": "tiny", "cluster": "cpu-local",
                                     "training": {"global_batch": 16}, "backend": "simulate"})
    lost = TrialResult(status="crash", backend="ray", device_seconds=1.0, error=TrialError(
        kind="crash", message="node lost: node abc died with ranks 0-1 of this trial", infra="node_lost"))
    done = TrialResult(status="completed", backend="ray", step_time_s=0.1, tokens_per_s=400.0,
                       tokens_per_s_per_device=100.0, peak_memory_bytes=2**30, device_seconds=2.0)
    with store.session_scope(sessions) as s:
        sid = service.create_sweep(s, spec=spec, owner="alice").id
        for number, lay, source, result in ((0, Layout(dp=4), "sampler", lost), (1, Layout(tp=2, dp=2), "sampler", done),
                                            (2, Layout(dp=4), "requeued", done)):
            store.insert_trial(s, sweep_id=sid, number=number, layout=lay.__dict__.copy(), layout_key=lay.key,
                               world_size=4, source=source, backend="ray")
            assert store.record_result(s, sweep_id=sid, number=number, attempt=0, result=result)
            store.refresh_sweep_cache(s, sweep_id=sid)  # as the engine does with each result
    engine.dispose()

    assert main(["show", str(sid), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["sweep"]["n_trials"], shown["sweep"]["n_completed"], shown["sweep"]["n_failed"]) == (2, 2, 0)
    assert [(t["number"], (t["error"] or {}).get("infra")) for t in shown["trials"]] == [
        (0, "node_lost"), (1, None), (2, None)]
    assert main(["show", str(sid), "--trials"]) == 0
    text = capsys.readouterr().out
    assert "trials=2 (completed 2, pruned 0, failed 0)" in text
    (lost_line,) = [x for x in text.splitlines() if "(node lost)" in x]
    assert lost_line.split("│")[1].strip() == "0" and "crash (node lost)" in lost_line
    assert main(["sweeps", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["items"][0]["n_trials"] == 2
    with TestClient(create_app(Settings(database_url=url), run_engine=False)) as c:
        sweep = c.get(f"/api/sweeps/{sid}").json()
        trials = c.get(f"/api/sweeps/{sid}/trials").json()
    assert (sweep["n_trials"], sweep["n_completed"], sweep["n_failed"]) == (2, 2, 0)
    assert trials["total"] == 3 and trials["items"][0]["error"]["infra"] == "node_lost"
