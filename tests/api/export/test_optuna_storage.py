"""A sweep's trials as an Optuna study in Optuna's own storage (api/export/optuna.py): exported from
a finished seeded sweep (no Ray), incremental on re-export, read back by Optuna, by
``meshtune optuna-export`` and by a real ``optuna-dashboard`` process through its HTTP API."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import optuna
import pytest
import sqlalchemy as sa

from api import store
from api.export.optuna import EXPORTED_STATUSES, TRIAL_ID_ATTR, default_storage, export_sweep
from tests.helpers.dashboard_seed import add_running_trial, seed_sweep


@pytest.fixture(scope="module")
def exported_sweep(tmp_path_factory):
    """One finished seeded sweep (failures, pruned layouts, re-measurements) exported once to the
    default storage beside its store; the mirror and export tests each add a trial after it."""
    home = tmp_path_factory.mktemp("optuna")
    url = f"sqlite:///{home / 'meshtune.db'}"
    engine, sessions = store.open_store(url)
    sid = seed_sweep(sessions, n_trials=24, name="nightly", rich=True)
    storage = default_storage(url, home)
    with sessions() as s:
        first = export_sweep(s, sweep_id=sid, storage=storage)
    yield url, sessions, sid, storage, first
    engine.dispose()


def _expected(sessions, sid: int) -> list:
    with sessions() as s:
        return [t for t in store.all_trials(s, sweep_id=sid) if t.status in EXPORTED_STATUSES]


def test_cli_exports_and_bad_input(exported_sweep, tmp_path, capsys, monkeypatch):
    from api.cli import main

    url, _, sid, _, _ = exported_sweep
    monkeypatch.setenv("MESHTUNE_DATABASE_URL", url)
    target = f"sqlite:///{tmp_path / 'o.db'}"
    assert main(["optuna-export", str(sid), "--storage", target]) == 0
    out = capsys.readouterr().out
    assert f"study '{sid}-nightly'" in out and f"optuna-dashboard {target}" in out
    assert main(["optuna-export", "999999", "--storage", target]) == 2
    assert "sweep 999999 does not exist" in capsys.readouterr().err
    assert main(["optuna-export", str(sid), "--storage", f"sqlite:///{tmp_path / 'nowhere' / 'o.db'}"]) == 2
    assert "--storage=" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:  # noqa: S310 - a loopback IP literal
        return json.loads(r.read())


def test_optuna_dashboard_opens_the_finished_sweep(exported_sweep):
    exe = shutil.which("optuna-dashboard") or str(Path(sys.executable).with_name("optuna-dashboard"))
    url, sessions, sid, storage, _ = exported_sweep
    port = _free_port()
    proc = subprocess.Popen([exe, storage, "--host", "127.0.0.1", "--port", str(port), "--server", "wsgiref", "--quiet"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "NO_PROXY": "*"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:  # readiness: poll its API until it answers (or it exits, or a minute passes)
            try:
                studies = _get(f"{base}/api/studies")["study_summaries"]
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
                assert time.monotonic() < deadline, "optuna-dashboard did not answer within 60 s"
                time.sleep(0.1)
        (study,) = [x for x in studies if x["study_name"] == f"{sid}-nightly"]
        detail = _get(f"{base}/api/studies/{study['study_id']}")
        trials = detail["trials"]
        expected = _expected(sessions, sid)
        assert len(trials) == len(expected)
        completed = sorted(t.tokens_per_s_per_device for t in expected if t.status == "completed")
        assert sorted(t["values"][0] for t in trials if t["state"] == "Complete") == pytest.approx(completed, rel=1e-12)
        failed = [t for t in trials if t["state"] == "Fail"]
        assert len(failed) == len(expected) - len(completed)
        attrs = {a["key"]: a["value"] for a in failed[0]["user_attrs"]}
        assert attrs["status"] in EXPORTED_STATUSES and attrs["error"]
        assert detail["best_trials"][0]["values"][0] == pytest.approx(completed[-1], rel=1e-12)
    finally:
        proc.terminate()
        proc.wait(30)


def test_mirror_follows_results_as_they_land(exported_sweep, tmp_path):
    """``meshtune serve --optuna-storage``'s mirror: its first pass exports every ranked sweep, a pass
    with no new result adds nothing, and a result landing is in the study after the next pass."""
    from api.export.optuna import OptunaMirror

    url, sessions, sid, _, first = exported_sweep
    mirror = OptunaMirror(sessions, storage=f"sqlite:///{tmp_path / 'live.db'}", interval_s=0.05)
    assert mirror.sync_once() == first.total and mirror.sync_once() == 0  # unchanged version: no export
    mirror.start()
    try:
        add_running_trial(sessions, sweep_id=sid, tokens=321.0, peak=2**30)
        passes = mirror.passes
        assert mirror.wait_passes(passes + 2, timeout=120)  # a whole pass after the result committed
        study = optuna.load_study(study_name=f"{sid}-nightly", storage=mirror.storage)
        assert len(study.trials) == first.total + 1 and 321.0 in [t.value for t in study.trials]
    finally:
        mirror.stop()
    assert not mirror.is_alive()
    with pytest.raises(ValueError, match="interval_s"):
        OptunaMirror(sessions, storage=mirror.storage, interval_s=0)


def test_export_is_a_standard_study_and_incremental(exported_sweep):
    url, sessions, sid, storage, first = exported_sweep
    assert storage == url.replace("meshtune.db", "meshtune-optuna.db")  # its own file beside the store
    expected = _expected(sessions, sid)
    assert {t.status for t in expected} >= {"completed", "pruned", "timeout", "crash", "nan"}
    assert first.study_name == f"{sid}-nightly" and first.added == first.total
    assert first.total == len([t for t in expected if t.number < 30])  # the seeded 24 + 6 re-measurements
    with sessions() as s:
        assert export_sweep(s, sweep_id=sid, storage=storage).added == len(expected) - first.total  # since
        assert export_sweep(s, sweep_id=sid, storage=storage).added == 0  # nothing twice
    add_running_trial(sessions, sweep_id=sid, tokens=123.0, peak=2**30)
    with sessions() as s:
        assert export_sweep(s, sweep_id=sid, storage=storage).added == 1  # only what finished since

    study = optuna.load_study(study_name=f"{sid}-nightly", storage=storage)
    assert study.direction == optuna.study.StudyDirection.MAXIMIZE and study.user_attrs["meshtune_sweep_id"] == sid
    by_id = {t.user_attrs[TRIAL_ID_ATTR]: t for t in study.trials}
    expected = _expected(sessions, sid)
    assert sorted(by_id) == sorted(t.id for t in expected)
    for t in expected:
        got = by_id[t.id]
        assert got.params == {k: t.layout[k] for k in got.params} and set(got.params) >= {"tp", "pp", "dp", "ac"}
        if t.status == "completed":
            assert got.state == optuna.trial.TrialState.COMPLETE and got.value == t.tokens_per_s_per_device
        else:
            assert got.state == optuna.trial.TrialState.FAIL and got.value is None
            assert got.user_attrs["status"] == t.status and got.user_attrs["error"] == t.cause
            assert got.user_attrs["infeasible"] is (t.status in ("pruned", "oom", "timeout"))
    assert study.best_value == max(t.tokens_per_s_per_device for t in expected if t.status == "completed")
    # Optuna's schema lives in its own file: meshtune's database has no Optuna table.
    engine = sa.create_engine(url)
    assert "studies" not in sa.inspect(engine).get_table_names()
    engine.dispose()
