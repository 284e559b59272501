"""Backend selection (built-ins and module:attr plug-ins), the simulate backend, result aggregation,
and ``meshtune run-trial`` on the light backends. No process is started here."""

from __future__ import annotations

import json
import statistics
import textwrap

import pytest

import tuner
from api.cli import main
from tuner import BackendError, Layout, LayoutError, cluster_spec, model_spec, training_spec
from workers import TrialRequest, TrialResult
from workers.aggregate import aggregate, model_flops_per_token
from workers.backends import get_backend
from workers.simulate import SimulateBackend

PLUGIN = '''
from workers import TrialResult

class EchoBackend:
    """A user's launcher: reports the world size it was asked for as its step time."""
    name = "echo"
    def __init__(self, scale=1.0):
        self.scale = scale
    def run(self, request):
        return TrialResult(status="completed", backend=self.name, step_time_s=self.scale * request.layout.world_size)

def make(scale=2.0):
    return EchoBackend(scale=scale)

class DictOnly:  # no name, capacity or close; returns a plain dict
    def run(self, request):
        return {"status": "crash", "backend": "dictonly"}

instance = EchoBackend(scale=3.0)
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch) -> str:
    (tmp_path / "my_launcher.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_launcher"


def _request(model="tiny", cluster="cpu-local", layout=None, global_batch=8, **kw) -> TrialRequest:
    return TrialRequest(
        model=model_spec(model),
        cluster=cluster_spec(cluster),
        training=training_spec({"global_batch": global_batch}),
        layout=layout or Layout(tp=2, dp=2),
        **kw,
    )


def test_module_attr_plugins_class_factory_and_instance(plugin) -> None:
    req = _request()
    cls = get_backend(f"{plugin}:EchoBackend", scale=0.5)
    assert cls.name == "echo" and cls.run(req).step_time_s == 2.0 and cls.capacity() == 1
    assert get_backend(f"{plugin}:make").run(req).step_time_s == 8.0
    assert get_backend(f"{plugin}:instance").run(req).step_time_s == 12.0
    minimal = get_backend(f"{plugin}:DictOnly")
    assert minimal.name == f"{plugin}:DictOnly"
    out = minimal.run(req)
    assert isinstance(out, TrialResult) and out.status == "crash"
    minimal.close()


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("nope", ["'nope'", "ray", "simulate"]),
        ("no_such_module_xyz:Thing", ["no_such_module_xyz"]),
        ("json:NoSuchAttr", ["NoSuchAttr"]),
        ("json:decoder", ["module"]),  # a module object is neither a class nor a factory
    ],
)
def test_unknown_backends_are_named(name: str, words: list[str]) -> None:
    with pytest.raises(BackendError) as info:
        get_backend(name)
    for word in words:
        assert word in str(info.value)


def test_simulate_is_labelled_seeded_and_centred_on_the_model() -> None:
    backend = get_backend("simulate")
    assert isinstance(backend, SimulateBackend)
    req = _request("llama3-8b", "h100-sxm", Layout(tp=2, dp=4, zero=3), global_batch=64, trial_id="a",
                   measure_steps=25)
    result = backend.run(req)
    assert (result.status, result.backend, result.simulated) == ("completed", "simulate", True)
    est = tuner.estimate_time(req.layout, model=req.model, cluster=req.cluster, training=req.training)
    assert result.step_time_s == pytest.approx(est.step_time_s, rel=0.05)
    assert statistics.pstdev(result.step_times_s) > 0  # there is noise ...
    assert backend.run(req).step_times_s == result.step_times_s  # ... and it is seeded
    other = backend.run(TrialRequest(**{**req.__dict__, "trial_id": "b"}))
    assert other.step_times_s != result.step_times_s
    assert 0 < result.mfu < 1 and result.peak_memory_bytes > 0
    assert result.tokens_per_s == pytest.approx(64 * 8192 / result.step_time_s)


def test_simulate_ooms_when_the_model_predicts_too_much_memory() -> None:
    result = get_backend("simulate").run(_request("llama3-8b", "h100-sxm", Layout(dp=8), global_batch=64))
    assert (result.status, result.simulated) == ("oom", True)
    assert result.error.bytes_requested > cluster_spec("h100-sxm").device_memory
    assert "simulated" in result.error.message


def test_simulate_validates_the_layout_like_a_real_backend() -> None:
    with pytest.raises(LayoutError, match="device count 4"):
        get_backend("simulate").run(_request(layout=Layout(dp=2)))


def test_aggregate_takes_last_stage_losses_median_and_stage_imbalance() -> None:
    req = _request("llama3-1b", "h100-sxm", Layout(pp=2, dp=4), global_batch=16)

    def report(rank: int, stage: int, compute: float) -> dict:
        return {
            "rank": rank, "pp_stage": stage, "losses": [float(stage), 1.0], "step_times_s": [1.0, 3.0, 2.0],
            "stage_compute_s": [compute] * 3, "peak_memory_bytes": 100 + rank, "peak_reserved_bytes": None,
            "memory_measure": "cuda.max_memory_allocated", "env": {"host": f"h{rank % 2}", "torch": "x"},
        }

    reports = [report(r, r // 4, 1.0 if r < 4 else 3.0) for r in range(8)]
    out = aggregate(reports, req, backend="ray", wall_s=10.0)
    assert out.step_time_s == 2.0 and out.losses == [1.0, 1.0]
    assert out.stage_times_s == [1.0, 3.0] and out.stage_imbalance == pytest.approx(1.5)
    assert out.peak_memory_bytes == 107 and out.peak_memory_per_rank == list(range(100, 108))
    tokens_per_s = 16 * 2048 / 2.0
    assert out.mfu == pytest.approx(model_flops_per_token(req.model) * tokens_per_s / (8 * 989e12))
    assert out.env["hosts"] == ["h0", "h1"] and out.device_seconds == 80.0


def test_cli_run_trial_simulate_json(capsys) -> None:
    code = main(["run-trial", "--model", "tiny", "--cluster", "cpu-local", "--layout", "tp=2,dp=2",
                 "--global-batch", "8", "--backend", "simulate", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["simulated"] is True and data["backend"] == "simulate"
    assert data["status"] == "completed" and data["tokens_per_s"] > 0


def test_cli_run_trial_summary_and_plugin(plugin, capsys) -> None:
    assert main(["run-trial", "--layout", "dp=4", "--backend", "simulate"]) == 0
    assert "SIMULATED" in capsys.readouterr().out
    assert main(["run-trial", "--layout", "dp=4", "--backend", f"{plugin}:DictOnly"]) == 1  # a failed trial
    assert "crash" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("layout", "words"),
    [
        ("tp=3,dp=1", ["tp*cp*ep*dp*pp", "3", "device count 4"]),
        ("tp=two", ["tp", "'two'"]),
        ("bogus=1", ["'bogus'"]),
        ("tp=2,dp=2,zero=7", ["zero", "7"]),
        ("tp=2,dp=2,schedule=zigzag", ["schedule", "zigzag"]),
        ("dp", ["'dp'", "key=value"]),
    ],
)
def test_cli_bad_layout_exits_2_naming_field_and_value(layout: str, words: list[str], capsys) -> None:
    code = main(["run-trial", "--layout", layout, "--backend", "simulate"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    for word in words:
        assert word in err


def test_cli_unknown_backend_exits_2(capsys) -> None:
    assert main(["run-trial", "--layout", "dp=4", "--backend", "nope"]) == 2
    assert "'nope'" in capsys.readouterr().err
