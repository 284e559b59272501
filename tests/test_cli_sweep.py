"""``meshtune sweep|sweeps|show|db``: end to end on the embedded default (simulate backend for speed,
one tiny real sweep on Ray CPU ranks), malformed specs and an unreachable database."""

from __future__ import annotations

import json

import pytest
import yaml

from api.cli import main


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHTUNE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MESHTUNE_DATABASE_URL", raising=False)
    return tmp_path


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
