"""`meshtune plan`: table, JSON, flags over spec files, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from api.cli import main


def test_table_lists_layouts_and_rejections(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "tiny" in out and "cpu-local" in out and "Top 3 of" in out
    for column in ("tp·cp·ep·dp·pp", "zero", "mbs", "schedule", "placement", "MiB total", "tok/s/dev", "MFU"):
        assert column in out
    assert "stages exceed layers" in out


def test_json_has_memory_parts_in_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "llama3-8b", "--cluster", "h100-sxm", "--nodes", "2",
            "--global-batch-tokens", str(2**20), "--top", "4", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["name"] == "llama3-8b" and data["cluster"]["nodes"] == 2
    assert data["training"]["global_batch"] == 128
    assert len(data["entries"]) == 4 and data["rejected"]
    speeds = [e["time"]["tokens_per_s_per_device"] for e in data["entries"]]
    assert speeds == sorted(speeds, reverse=True)
    for e in data["entries"]:
        mem = e["memory"]
        assert {"params", "grads", "optimizer", "activations", "total"} <= set(mem)
        assert mem["total"] <= 80 * 2**30 and e["placement"]["summary"].startswith(("tp:intra", "cp:", "dp:", "pp:"))


def test_spec_file_with_flag_overrides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "s.yaml"
    spec.write_text("model: small\ncluster: cpu-local\ntraining: {global_batch: 8, precision: fp32}\n"
                    "space: {tp: [2], zero: [0]}\n")
    assert main(["plan", str(spec), "--json", "--global-batch", "16", "--top", "100"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["training"]["global_batch"] == 16 and data["training"]["precision"] == "fp32"
    assert {e["layout"]["tp"] for e in data["entries"]} == {2} and {e["layout"]["zero"] for e in data["entries"]} == {0}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nodes", "0"], "cluster.nodes must be a positive integer, got 0"),
        (["--model", "gpt5"], "model.preset='gpt5' is not a known preset"),
        (["--cluster", "tpu"], "cluster.preset='tpu' is not a known preset"),
        (["--global-batch", "-4"], "training.global_batch must be a positive integer, got -4"),
        (["--global-batch-tokens", "100"], "training.global_batch_tokens=100 is not a multiple of model.seq_len=64"),
        (["--top", "0"], "--top must be a positive integer, got 0"),
        (["missing.yaml"], "missing.yaml: spec file not found"),
    ],
)
def test_errors_are_one_line_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshtune plan: error: ") and message in err
    assert "\n" not in err and "Traceback" not in err


def test_bad_spec_file_field_via_subprocess(tmp_path: Path) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text("model: tiny\ncluster: cpu-local\ntraining: {global_batch: 0}\n")
    proc = subprocess.run([sys.executable, "-m", "api.cli", "plan", str(spec)], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).resolve().parents[3])
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"meshtune plan: error: {spec}: training.global_batch must be a positive integer, got 0"
    assert proc.stdout == ""
    # argparse's own errors (not an int) also exit 2 without a traceback.
    proc = subprocess.run([sys.executable, "-m", "api.cli", "plan", "--nodes", "two"], capture_output=True,
                          text=True, timeout=60, cwd=Path(__file__).resolve().parents[3])
    assert proc.returncode == 2 and "'two' is not a whole number of nodes" in proc.stderr and "Traceback" not in proc.stderr


def test_no_valid_layout_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "s.toml"
    spec.write_text('model = "tiny"\ncluster = "cpu-local"\n[training]\nglobal_batch = 8\n[space]\ntp = [3]\n')
    assert main(["plan", str(spec)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("meshtune plan: error: no valid layout of model tiny on 4 devices with "
                   "training.global_batch=8: world size mismatch (96)")  # 4 zero x 4 mbs x 3 ac x 2 sp
