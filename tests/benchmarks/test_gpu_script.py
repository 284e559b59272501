"""benchmarks/gpu_layouts.py in its CPU smoke mode: the prepared device script must run end to end
here (a real trial on a fresh rank process, a real out-of-memory classified, the table and the
JSON report), and its time budget must skip, and say so, whatever would start past it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_layouts.py"

# The device machine's image has torch but neither Ray nor the coordinator's packages: the script
# and its rank processes must not import them (a sitecustomize on PYTHONPATH makes them missing).
ABSENT_ON_DEVICE = ("ray", "api", "fastapi", "pydantic", "pydantic_settings", "sqlalchemy", "optuna", "psycopg")
BLOCKER = f"""
import sys
class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {ABSENT_ON_DEVICE!r}:
            raise ImportError(f"{{name}} is not installed on the device image (blocked by the test)")
sys.meta_path.insert(0, _Absent())
"""


def _run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "gpu.json"
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "tiny", "--device", "cpu", "--out", str(out), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=240, env=env,
    )
    assert out.exists(), proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


def test_smoke_mode_probes_first_measures_a_layout_and_classifies_a_real_oom(tmp_path):
    proc, report = _run(tmp_path, "--cases", "ws1-mbs2-ac_none,oom-huge-alloc", "--warmup", "1", "--measure", "2",
                        "--probe-budget-s", "20")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    trial, oom = report["trials"]
    assert (trial["case"], trial["status"]) == ("ws1-mbs2-ac_none", "completed")
    result = trial["result"]
    assert result["tokens_per_s"] > 0 and len(result["step_times_s"]) == 2
    assert result["tokens_per_s_per_device"] == result["tokens_per_s"]  # world size 1
    assert result["peak_memory_bytes"] > 50 * 2**20 and result["memory_measure"] == "cpu.VmHWM"
    assert result["mfu"] is None  # CPU: no meaningful peak
    assert trial["prediction"]["tokens_per_s"] > 0 and trial["prediction"]["peak_memory_bytes"] > 0
    # The probe ran first (the rank program of `meshtune probe`, on a fresh process) and the
    # predictions read its figures; the datasheet's prediction is kept beside them.
    probe = report["probe"]
    assert probe["figures"]["matmul_flops"] > 0 and [x["tp"] for x in probe["figures"]["layers"]] == [1]
    assert "figures probed" in probe["summary"] and any(r["source"] == "probed" for r in probe["rows"])
    assert trial["prediction"]["figures"] == "probed" and trial["prediction"]["datasheet"]["tokens_per_s"] > 0
    assert trial["prediction"]["tokens_per_s"] != trial["prediction"]["datasheet"]["tokens_per_s"]
    assert oom["status"] == "oom" and oom["result"]["error"]["bytes_requested"] == 2**50
    assert [c["ok"] for c in report["checks"]] == [True, True, True]
    assert any("cp cuda pytest" in s for s in report["skipped"]) and report["over_budget"] == []
    assert "tok/s" in proc.stdout and "ws1-mbs2-ac_none" in proc.stdout and "3/3 checks passed" in proc.stdout
    assert "matmul FLOP/s per device" in proc.stdout  # the probed figures beside the datasheet's


def test_budget_skips_the_rest_and_says_so(tmp_path):
    proc, report = _run(tmp_path, "--budget-s", "0")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert report["trials"] == [] and report["checks"] == []
    assert "ws1-mbs1-ac_none" in report["over_budget"] and "oom-huge-alloc" in report["over_budget"]
    assert "probe" in report["over_budget"]
    assert "skipped, over the 0 s budget" in proc.stdout
