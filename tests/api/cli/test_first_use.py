"""What a new user's first tries found (the quick start on a busy machine, a sweep that cannot fit,
typos, flags): each test fails on the code before its fix. Simulate backend (labelled simulated) and
in-process CLI calls, except one subprocess for a pipe closed by its reader."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient

import tuner
from api import store
from api.cli import main
from api.main import create_app
from api.settings import Settings
from tuner import Layout, cluster_spec, model_spec, training_spec
from workers import TrialRequest
from workers.simulate import SimulateBackend

ROOT = Path(__file__).resolve().parents[3]



def _spec(tmp_path: Path, name: str = "s.yaml", **over) -> Path:
    data = {"name": "first", "model": "tiny", "cluster": "cpu-local", "training": {"global_batch": 16},
            "search": {"max_trials": 6, "remeasure_top_k": 2, "repeats": 3}, "backend": "simulate"}
    data.update(over)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


# --- item 4: the quick start's warning ------------------------------------------------------------

def test_sweep_ends_with_the_lines_show_prints_and_export_says_when_the_layout_is_tied(home, capsys):
    """On a noisy host the sweep printed its ranking ("tied with best") and nothing else; the noise
    warning, the calibration and memory-model lines were only in `meshtune show`."""
    assert main(["sweep", str(_spec(home, backend="tests.helpers.api_backends:NoisySimulate"))]) == 0
    swept = capsys.readouterr().out
    assert main(["show", "1"]) == 0
    shown = capsys.readouterr().out.splitlines()
    tail = shown[next(i for i, line in enumerate(shown) if line.startswith("vs best")):]
    assert any(line.startswith("host noise too high to trust the ranking") for line in tail), tail
    assert any(line.startswith("calibration") for line in tail) and any(line.startswith("memory model") for line in tail)
    for line in tail:
        assert line in swept, line
    assert main(["export", "1", "--format", "torchtitan"]) == 0
    header = [line for line in capsys.readouterr().out.splitlines() if line.startswith("#")][:3]
    assert any("tied with" in line and "95% intervals overlap" in line for line in header), header


# --- item 5: simulated labels ---------------------------------------------------------------------

def test_a_simulate_sweeps_pruned_trials_and_its_all_pruned_ranking_are_simulated(home, capsys, tmp_path):
    # llama3-8b on one H100 node: dp=8 without ZeRO cannot fit (pruned), tp=8 can
    spec = _spec(home, model="llama3-8b", cluster={"preset": "h100-sxm", "nodes": 1},
                 training={"global_batch": 64}, search={"layouts": [{"tp": 8}, {"dp": 8}]})
    assert main(["sweep", str(spec), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert main(["show", str(out["sweep"]["id"]), "--json"]) == 0
    trials = json.loads(capsys.readouterr().out)["trials"]
    assert {t["status"] for t in trials} == {"completed", "pruned"}
    assert all(t["simulated"] for t in trials), [(t["status"], t["simulated"]) for t in trials]

    from api.ranking import service as rankings
    from api.spec import SweepSpec
    from api.sweeps import service

    url = f"sqlite:///{tmp_path / 'pruned.db'}"  # a sweep whose every trial was pruned (no result to say simulated)
    engine, sessions = store.open_store(url)
    try:
        with store.session_scope(sessions) as s:
            sweep = service.create_sweep(s, spec=SweepSpec.model_validate(yaml.safe_load(spec.read_text())), owner="a")
            store.insert_trial(s, sweep_id=sweep.id, number=0, layout={"dp": 8}, layout_key="k", world_size=8,
                               status="pruned", cause="pruned by the memory model", backend="simulate")
            ranking = rankings.ranking(s, sweep_id=sweep.id)
            assert ranking.rows == [] and ranking.simulated is True
            assert [t.simulated for t in service.list_trials(s, sweep_id=sweep.id).items] == [True]
    finally:
        engine.dispose()


# --- item 8: what a new user's trial found ----------------------------------------------------------

NOFIT = {"model": "llama3-405b", "cluster": {"preset": "h100-sxm", "nodes": 1},
         "training": {"global_batch_tokens": 1048576}, "backend": "simulate", "search": {"max_trials": 5}}


def test_a_sweep_where_nothing_fits_is_refused_at_submission(home, capsys, tmp_path):
    assert main(["plan", str(_spec(home, "p.yaml", **NOFIT))]) == 0  # the plan reports it
    assert "No layout fits in device memory" in capsys.readouterr().out
    assert main(["sweep", str(_spec(home, **NOFIT))]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("store: ")]
    assert len(err) == 1 and "cluster: No layout fits in device memory" in err[0] and "memory exceeds device" in err[0]
    assert main(["sweeps", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total"] == 0  # nothing stored
    url = f"sqlite:///{tmp_path / 'api.db'}"
    store.upgrade(url)
    app = create_app(Settings(home=tmp_path, database_url=url, ray_address=None), run_engine=False)
    with TestClient(app) as c:
        r = c.post("/api/sweeps", json={**NOFIT, "name": "nofit"})
        assert r.status_code == 422 and r.json()["errors"][0]["field"] == "cluster", r.text
        assert "No layout fits in device memory" in r.json()["detail"]
        typo = c.post("/api/sweeps", json={"model": "tiny", "cluster": "cpu-local", "training": {"global_bach_tokens": 1024}})
        assert typo.status_code == 422 and "global_batch_tokens" in typo.json()["detail"], typo.text


def test_a_misspelt_training_field_lists_the_fields_the_readme_names(home, capsys):
    spec = _spec(home, training={"global_bach_tokens": 1024})
    for command in ("sweep", "plan"):
        assert main([command, str(spec)]) == 2
        err = capsys.readouterr().err
        assert "training.global_bach_tokens is not a known field" in err, err
        assert "global_batch_tokens" in err and "critical_batch_tokens" in err, err


def test_plan_and_sweeps_keep_one_headroom_rule():
    """Mixtral on 4 H100 nodes: the plan's first layout left 3.4 MB of 80 GiB free, while a sweep warm
    starts only what leaves its headroom. One rule now: a layout leaving less than 1% of the device
    free (tuner.MEMORY_HEADROOM) is *tight*: it still fits (neither pruned nor refused), the plan
    ranks it after every layout with room and marks it, and a sweep's warm start takes it last."""
    from api.engine import SweepModel
    from api.spec import SearchSettings

    model, cluster = model_spec("mixtral-8x7b"), cluster_spec({"preset": "h100-sxm", "nodes": 4})
    training = training_spec({"global_batch_tokens": 2097152}, seq_len=model.seq_len)
    tight = Layout(tp=1, cp=2, ep=2, dp=2, pp=4, zero=1, mbs=1, schedule="1f1b")
    mem = tuner.estimate_memory(tight, model=model, cluster=cluster, training=training)
    assert 0 < cluster.device_memory - mem.total < 4e6 and mem.fits and mem.tight  # 3.4 MB to spare
    planned = tuner.plan(problem=tuner.Problem(model=model, cluster=cluster, training=training))
    flags = [e.memory.tight for e in planned.entries]
    assert not flags[0] and flags == sorted(flags)  # every layout with room first, the tight ones after
    assert tight.key in {e.layout.key for e in planned.entries if e.memory.tight}
    assert planned.to_dict(top=1)["entries"][0]["memory"]["tight"] is False
    first = planned.entries[0]
    assert cluster.device_memory - first.memory.total >= tuner.MEMORY_HEADROOM * cluster.device_memory
    problem = SweepModel(tuner.Problem(model=model, cluster=cluster,
                                       training=training), layouts=[tight, first.layout])
    assert problem.predict(tight).fits  # not pruned: the plan keeps it too
    start = problem.warm_start(SearchSettings(warm_start_top_k=1))
    assert [lay.key for lay, _ in start] == [first.layout.key]  # the sweep launches the one with room first


def _request(layout: Layout, **options) -> TrialRequest:
    model, cluster = model_spec("llama3-8b"), cluster_spec("h100-sxm")
    return TrialRequest(model=model, cluster=cluster, training=training_spec({"global_batch": 64}, seq_len=model.seq_len),
                        layout=layout, warmup_steps=1, measure_steps=3, step_timeout_s=30.0, trial_id="t",
                        options=options)


def test_the_simulate_backend_honours_the_diagnostic_options():
    """``trial.options: {fail: crash}`` was ignored by the simulate backend: every trial completed."""
    backend, lay = SimulateBackend(), Layout(tp=8)
    plain = backend.run(_request(lay))
    assert plain.status == "completed"
    for fail, status in (("crash", "crash"), ("hang", "timeout"), ("oom", "oom"), ("nan", "nan")):
        r = backend.run(_request(lay, fail=fail, fail_rank=3, fail_step=2))
        assert (r.status, r.simulated, r.error.kind) == (status, True, status), r
        assert r.error.rank == 3 and "simulated" in r.error.message or status == "timeout"
    assert backend.run(_request(lay, fail="crash", fail_rank=8)).status == "completed"  # no rank 8 in tp=8
    assert backend.run(_request(lay, fail="crash", fail_step=4)).status == "completed"  # 1 + 3 steps: 0..3
    cap = backend.run(_request(lay, memory_cap_bytes=2**30))
    assert cap.status == "oom" and "memory_cap_bytes" in cap.error.message
    slow = backend.run(_request(lay, sleep_per_step_s=1.0))
    assert slow.step_times_s == pytest.approx([t + 1.0 for t in plain.step_times_s])
    assert backend.run(_request(lay, min_step_s=100.0)).step_time_s == 100.0


def test_a_simulate_sweep_with_fail_crash_records_crashes(home, capsys):
    assert main(["sweep", str(_spec(home, trial={"options": {"fail": "crash"}},
                                    search={"layouts": [{"dp": 4}, {"tp": 2, "dp": 2}]})), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sweep"]["n_failed"] == 2 and out["sweep"]["n_completed"] == 0 and out["sweep"]["diagnostic"] is True


@pytest.mark.parametrize("argv, needle", [
    (["plan", "--nodes", "2.5"], "argument --nodes: '2.5' is not a whole number of nodes"),
    (["plan", "--train-tokens", "1Q"], "argument --train-tokens: '1Q' is not a token count"),
    (["plan", "--top", "x"], "argument --top: invalid int value: 'x'"),
    (["plan", "--model", "examples/hf/llama3.1-8b.json"], "a Hugging Face config.json is given as hf:PATH"),
])
def test_a_bad_flag_is_one_line(argv, needle, capsys):
    """argparse printed its whole usage block before the error."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors leave through parser.exit
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err


def test_token_budgets_are_read_in_the_form_the_tool_prints_them(home, capsys):
    from api import format as fmt
    from tuner._presets import token_count

    for n in (1e12, 1.5e13, 2.1e9, 4.19e6, 1000.0, 2.5e15):
        assert token_count("x", fmt.tokens_text(n)) == pytest.approx(n, rel=1e-3)
    assert main(["plan", "--model", "tiny", "--train-tokens", "1T", "--top", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["training"]["train_tokens"] == 1e12
    spec = _spec(home, training={"global_batch": 16, "train_tokens": "15T"})
    assert main(["sweep", str(spec), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ranking"]["budget"]["train_tokens"] == 15e12


def test_output_cut_by_its_reader_ends_quietly(tmp_path):
    """`meshtune plan --json | head` ended in a BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "api.cli", "plan", "--model", "llama3-70b", "--cluster", "h100-sxm",
                             "--nodes", "8", "--global-batch-tokens", "4194304", "--json", "--top", "3000"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "MESHTUNE_HOME": str(tmp_path)})
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(10)
    proc.stdout.close()  # as `head` does
    err = proc.stderr.read().decode()
    assert proc.wait(120) == 1 and err == "", err
