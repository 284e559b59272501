"""A Hugging Face model end to end through the CLI as a new user runs it: ``meshtune plan`` on the
published Qwen3-30B-A3B config.json, a real CPU sweep (Ray, 2 gloo ranks) of the transformers
implementation (``workload: hf``) of the shrunken Qwen3-MoE config, ``meshtune show``, and
``meshtune export`` of every ranked layout to the four formats, each read back by the framework's
own classes (the read-backs of tests/helpers/frameworks.py, shared with test_export.py). Then the bad inputs of
the Hugging Face path that tests/tuner/test_hf_config.py, test_workload_contract.py and test_export.py do not cover:
an unreadable config, a wrong-typed or empty config object, a spec file's missing relative path,
a workload that does not meet the contract over HTTP — each one line, exit 2 or 422, nothing stored."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from api.cli import main
from tests.helpers.frameworks import (
    check_deepspeed_export,
    check_megatron_export,
    check_nemo_export,
    check_torchtitan_export,
    service_header,
)
from tuner import EXPORT_FORMATS, Layout, export_layout, load_hf_config

HF = Path(__file__).resolve().parents[3] / "examples" / "hf"
TINY = HF / "qwen3-moe-tiny.json"
# megatron-core warns about Transformer Engine features on CPU (as in tests/api/export/test_export.py).
pytestmark = pytest.mark.filterwarnings(r"ignore::UserWarning:megatron\.core\..*")



def _sweeps_stored(capsys) -> int:
    assert main(["sweeps", "--json"]) == 0
    return json.loads(capsys.readouterr().out)["total"]


# Two layouts the hf workload realises for a MoE model (pp, ZeRO, ac) on 2 gloo ranks (half the
# processes of 4 on a busy 2-core host), measured once each: the fewest real trials that give a
# winner and a runner-up, whose exports cover a pipeline split and ZeRO-3.
SWEEP = {
    "name": "hf-e2e", "workload": "hf", "model": {"hf_config": str(TINY), "seq_len": 32},
    "cluster": {"preset": "cpu-local", "devices_per_node": 2}, "training": {"global_batch": 4, "precision": "fp32"},
    "search": {"layouts": [{"pp": 2, "schedule": "1f1b"}, {"dp": 2, "zero": 3, "ac": "full"}], "repeats": 1},
    "trial": {"warmup_steps": 1, "measure_steps": 1, "step_timeout_s": 120},
}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_plan_sweep_show_and_export_a_qwen3_moe_config(home, capsys, ray_local, monkeypatch):
    from api.spec import SweepSpec

    # Plan the published model on 8 H100 nodes.
    assert main(["plan", "--model", f"hf:{HF / 'qwen3-30b-a3b.json'}", "--cluster", "h100-sxm", "--nodes", "8",
                 "--global-batch-tokens", str(4 * 2**20), "--top", "3", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["model"]["name"], plan["model"]["experts"], plan["model"]["top_k"]) == ("qwen3-30b-a3b", 128, 8)
    assert plan["cluster"]["nodes"] == 8 and len(plan["entries"]) == 3
    assert all(e["memory"]["fits"] and e["time"]["tokens_per_s"] > 0 for e in plan["entries"])

    # A real sweep of the transformers model built from the shrunken config of the same architecture.
    spec = home / "hf-e2e.yaml"
    spec.write_text(yaml.safe_dump(SWEEP))
    assert main(["sweep", str(spec), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    sid, rows = out["sweep"]["id"], out["ranking"]["rows"]
    assert out["sweep"]["status"] == "completed" and not out["ranking"]["simulated"]
    assert out["sweep"]["spec"]["workload"] == "hf" and out["sweep"]["spec"]["model"]["hf_config"]
    assert len(rows) == 2 and [r["rank"] for r in rows] == [1, 2]
    assert all(r["tokens_per_s_per_device"] > 0 and r["peak_memory_bytes"] > 0 for r in rows)
    assert rows[0]["tokens_per_s_per_device"] >= rows[1]["tokens_per_s_per_device"]
    assert main(["show", str(sid)]) == 0
    shown = capsys.readouterr().out
    assert "hf-e2e: completed" in shown and "workload=hf" in shown and "ranked by tokens_per_s_per_device" in shown

    # Every ranked layout, in every format, is what tuner.export_layout writes for it (after the
    # service's header), and the framework's own classes accept it.
    spec_obj = SweepSpec.model_validate({**SWEEP, "model": {"hf_config": load_hf_config(TINY),
                                                            "name": "qwen3-moe-tiny", "seq_len": 32}})
    problem = spec_obj.to_problem()
    model, cluster, training = problem.model, problem.cluster, problem.training
    for row in rows:
        layout = Layout(**row["layout"])
        for fmt in EXPORT_FORMATS:
            assert main(["export", str(sid), "--rank", str(row["rank"]), "--format", fmt]) == 0
            printed = capsys.readouterr()
            header = service_header(printed.err.splitlines())  # header and caveats on stderr
            assert header[0].startswith(f"sweep {sid} (hf-e2e), rank {row['rank']} of 2")
            want = export_layout(layout, model=model, cluster=cluster, training=training, format=fmt,
                                 header=header)
            # DeepSpeed, imported by the read-backs below in this process, logs its accelerator to stdout.
            out = "".join(line for line in printed.out.splitlines(True) if "[real_accelerator.py:" not in line)
            assert out == want.text and printed.err.splitlines()[:len(want.notes)] == list(want.notes)
        case = (row["layout_key"], model, cluster, training, layout)
        titan_dir = home / f"titan-{row['rank']}"
        titan_dir.mkdir()
        check_torchtitan_export(case, titan_dir)
        check_megatron_export(case)
        check_deepspeed_export(case, monkeypatch)
        check_nemo_export(case)
    assert any(Layout(**r["layout"]).pp == 2 for r in rows)  # a pipeline split was exported and read back


# --- bad input not covered elsewhere: one line naming field and value, exit 2 / HTTP 422, nothing stored


def _one_line(err: str, prefix: str) -> str:
    assert err.startswith(prefix) and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_an_unreadable_config_is_one_line_in_plan_run_trial_and_sweep(home, capsys):
    binary = home / "binary.json"
    binary.write_bytes(b"\xff\xfe{}")
    for argv in (["plan"], ["run-trial", "--layout", "dp=4", "--backend", "simulate"]):
        assert main([*argv, "--model", f"hf:{binary}"]) == 2
        err = _one_line(capsys.readouterr().err, f"meshtune {argv[0]}: error: --model='{binary}': cannot read")
        assert "UnicodeDecodeError" in err
    if os.geteuid() != 0:  # root reads a file of mode 000
        locked = home / "locked.json"
        locked.write_text(TINY.read_text())
        locked.chmod(0)
        assert main(["plan", "--model", f"hf:{locked}"]) == 2
        _one_line(capsys.readouterr().err, f"meshtune plan: error: --model='{locked}': cannot read")
    # A spec file's relative path is read from the file's directory; missing there, it is named.
    spec = home / "missing.yaml"
    spec.write_text(yaml.safe_dump({**SWEEP, "model": {"hf_config": "nope/config.json"}, "backend": "simulate"}))
    assert main(["sweep", str(spec)]) == 2
    _one_line(capsys.readouterr().err, "meshtune sweep: error: ")
    assert _sweeps_stored(capsys) == 0


def test_api_refuses_a_wrong_typed_or_empty_config_and_a_workload_off_contract(tmp_path):
    from api import store
    from tests.helpers.api_client import ALICE, client_for

    url = f"sqlite:///{tmp_path / 'api.db'}"
    store.upgrade(url)
    body = {"cluster": "cpu-local", "training": {"global_batch": 8}, "backend": "simulate",
            "search": {"max_trials": 2}}
    cases = [
        ({"hf_config": [1, 2]}, None, "model.hf_config must be a config object (config.json's content), got list"),
        ({"hf_config": None}, None, "model.hf_config must be a config object (config.json's content), got NoneType"),
        ({"hf_config": {}}, None, "model.hf_config: model_type=None is not supported (supported: llama, "),
        ({"hf_config": load_hf_config(TINY)}, "json:dumps",
         "workload='json:dumps' is a function, not a workers.workload.Workload"),
    ]
    with client_for(url) as c:
        for model, workload, line in cases:
            r = c.post("/api/sweeps", json={**body, "model": model, **({"workload": workload} if workload else {})},
                       headers=ALICE)
            assert r.status_code == 422, r.text
            detail = r.json()["detail"]
            assert detail.startswith(line) and "\n" not in detail, detail
        assert c.get("/api/sweeps", headers=ALICE).json()["total"] == 0


def test_run_trial_of_the_hf_workload_without_a_config_is_one_line(home, capsys):
    assert main(["run-trial", "--workload", "hf", "--layout", "dp=4", "--backend", "simulate"]) == 2
    err = _one_line(capsys.readouterr().err, "meshtune run-trial: error: workload='hf': needs model.hf_config")
    assert err.count("workload='hf'") == 1 and "model 'tiny' has none" in err
