"""The Ray backend on 4 real CPU ranks (gloo): a measured trial, reuse of rank processes, and the
errors that must come before any process starts."""

from __future__ import annotations

import math
import socket

import pytest

from tuner import BackendError, Layout, LayoutError, cluster_spec, model_spec, training_spec
from workers import TrialRequest


def _request(layout: Layout, *, cluster: object = "cpu-local", global_batch: int = 8) -> TrialRequest:
    return TrialRequest(
        model=model_spec("tiny"),
        cluster=cluster_spec(cluster),
        training=training_spec({"global_batch": global_batch}),
        layout=layout,
        warmup_steps=2,
        measure_steps=3,
        step_timeout_s=60,
    )


def _pids() -> set[int]:
    from workers._gangs import POOL

    return {s.info["pid"] for g in POOL._gangs for s in g.ranks if s.info}


def test_tp2_dp2_trial_is_measured_and_rank_processes_are_reused(ray_backend) -> None:
    result = ray_backend.run(_request(Layout(tp=2, dp=2)))
    assert result.status == "completed", result.error
    assert (result.backend, result.simulated, result.error) == ("ray", False, None)
    assert len(result.losses) == 5 and all(math.isfinite(x) and x > 0 for x in result.losses)
    assert len(result.step_times_s) == 3 and all(t > 0 for t in result.step_times_s)
    assert result.step_time_s == sorted(result.step_times_s)[1]
    assert result.tokens_per_s == pytest.approx(8 * 64 / result.step_time_s)
    assert result.tokens_per_s_per_device == pytest.approx(result.tokens_per_s / 4)
    assert result.mfu is None  # CPU: no meaningful peak
    assert len(result.peak_memory_per_rank) == 4 and min(result.peak_memory_per_rank) > 50 * 2**20
    assert result.peak_memory_bytes == max(result.peak_memory_per_rank)
    assert result.memory_measure == "cpu.VmHWM"
    assert result.stage_times_s and result.stage_imbalance == pytest.approx(1.0)
    assert result.env["torch"] and result.env["world_size"] == 4 and result.env["hosts"]
    assert result.device_seconds == pytest.approx(result.wall_s * 4)

    pids = _pids()
    again = ray_backend.run(_request(Layout(dp=4)))  # another layout of the same world size
    assert again.status == "completed"
    assert _pids() == pids  # the same processes: torch was imported once
    assert again.losses[0] == pytest.approx(result.losses[0], rel=1e-4)  # same model, same first batch


def _no_process_may_start(monkeypatch) -> None:
    import workers._gangs as gangs

    def forbidden(*a, **k):
        raise AssertionError("a rank process was about to start")

    monkeypatch.setattr(gangs.POOL, "acquire", forbidden)
    monkeypatch.setattr(gangs, "ensure_actors", forbidden)


def test_layout_not_matching_world_size_fails_before_any_process(ray_backend, monkeypatch) -> None:
    _no_process_may_start(monkeypatch)
    with pytest.raises(LayoutError, match=r"=2 does not equal the device count 4"):
        ray_backend.run(_request(Layout(dp=2)))


def test_layout_beyond_ray_resources_fails_before_any_process(ray_backend, monkeypatch) -> None:
    _no_process_may_start(monkeypatch)
    big = {"preset": "cpu-local", "devices_per_node": 8}
    with pytest.raises(BackendError, match=r"world size 8 .* but the Ray cluster has 4 CPU"):
        ray_backend.run(_request(Layout(dp=8), cluster=big))


def test_unreachable_ray_address_is_named(monkeypatch) -> None:
    from workers.backends import get_backend

    with socket.socket() as s:  # a port that was just free and that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    monkeypatch.setenv("RAY_ADDRESS", address)
    with pytest.raises(BackendError, match=f"RAY_ADDRESS='{address}'"):
        get_backend("ray")
