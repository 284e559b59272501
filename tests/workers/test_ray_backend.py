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

    # The cluster probe (workers/probe.py) on the same gang, cut short (few repetitions): every
    # collective on the node's link, compute, layers of tp=1 and tp=2 with sp, a real step, memory.
    from api.probes import service as probes
    from tuner import ProbedFigures
    from tuner._figures import OPS

    probe = probes.measure(ray_backend, model=model_spec("tiny"), cluster=cluster_spec("cpu-local"),
                           training=training_spec({"global_batch": 8}), target_s=0.002, layer_reps=2,
                           layouts=[Layout(dp=4, ac="full"), Layout(tp=2, dp=2, sp=True)])
    assert _pids() == pids  # the trials' own rank processes
    fig = ProbedFigures.from_dict(probe["figures"])
    assert [(x.tier, x.op, x.group) for x in fig.links] == [("intra", op, 2 if op == "send_recv" else 4) for op in OPS]
    assert fig.matmul_flops > 1e8 and fig.attention_flops > 1e7 and fig.dtype == "float32"
    assert [(x.tp, x.sp) for x in fig.layers] == [(1, False), (2, True)] and not any("skipped" in n for n in fig.notes)
    assert fig.step_s is not None and fig.step_layer_s is not None and fig.dp_overlap is not None
    assert set(probe["raw"]["layers"][0]["recompute_fb_s"]) == {"full"} and fig.compute_sharing is not None
    assert fig.memory_overhead_bytes > 50 * 2**20 and 0 <= fig.allocator_overhead < 1
    assert probe["env"]["device_kind"] == "cpu" and probe["env_fingerprint"] and probe["raw"]["world"] == 4


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


# --- a reused rank process starts each trial clean --------------------------------------------------

_LEFTOVERS = """
import sys, torch
from workers import measure
dev = torch.device("cpu")
measure.reset_peak_memory(dev)
base = measure.peak_memory(dev)[0]
junk = [torch.ones(16 * 1024) for _ in range(8000)]  # 500 MiB of 64 KiB tensors: malloc's heap
keep = junk[::20]  # a few survive, so glibc cannot shrink its heap from the top by itself
del junk
class Trial:  # an earlier trial's state, alive only through a reference cycle (as FSDP hooks make)
    pass
t = Trial(); t.self = t; t.params = torch.ones(64 * 2**20); del t  # 256 MiB
measure.reset_peak_memory(dev)
print((measure.peak_memory(dev)[0] - base) / 2**20)
"""


def test_cpu_peak_memory_reset_starts_from_live_memory_not_an_earlier_trials_leftovers() -> None:
    """VmHWM after a reset is the RSS at the reset: freed-but-kept heap pages and garbage cycles of a
    previous trial in the same process would otherwise count as this trial's peak (~760 MiB here
    without gc + malloc_trim, ~30 MiB with)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _LEFTOVERS], capture_output=True, text=True, timeout=120,
                         check=True)
    grown_mib = float(out.stdout.strip().splitlines()[-1])
    assert grown_mib < 200, f"peak after reset is {grown_mib:.0f} MiB above the baseline"


def _program_leaving_a_cycle(request, *, device):
    import gc
    import weakref

    import torch

    class Model:
        pass

    model = Model()
    model.self, model.weight = model, torch.ones(1024)  # a cycle, as FSDP's hooks make one
    _program_leaving_a_cycle.ref = weakref.ref(model)
    assert not gc.isenabled()
    return {"ok": True}


def test_a_completed_trial_leaves_no_model_behind_in_the_reused_process() -> None:
    import gc

    from workers._launch import run_rank

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gc.disable()  # only run_rank's own collection may free the cycle
    try:
        out = run_rank(_request(Layout()), rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1",
                       master_port=port, device="cpu", init_timeout_s=30, program=_program_leaving_a_cycle)
        assert out["report"]["ok"] is True
        assert _program_leaving_a_cycle.ref() is None
    finally:
        gc.enable()


def test_gpu_ranks_use_their_own_ray_gpu_and_local_rank_names_the_same_device() -> None:
    """Ray hands GPUs to a node's actors in any order; each rank must use the GPU Ray gave it, and its
    LOCAL_RANK must be that device's index in the node's shared CUDA_VISIBLE_DEVICES."""
    from workers._gangs import Slot
    from workers.ray_backend import local_rank_and_device

    visible = {"a": ["1", "3"], "b": ["0", "2"]}
    given = [("a", "3"), ("a", "1"), ("b", "0"), ("b", "2")]
    ranks = [Slot(info={"node_id": n, "gpu_ids": [g], "visible": visible[n]}) for n, g in given]
    got = [local_rank_and_device(ranks, r, gpu=True) for r in range(4)]
    assert got == [(1, "cuda:1"), (0, "cuda:0"), (0, "cuda:0"), (1, "cuda:1")]
    for (node, gpu), (_, device) in zip(given, got, strict=True):
        assert visible[node][int(device.split(":")[1])] == gpu
    cpu = [Slot(info={"node_id": n}) for n in ("a", "a", "b")]
    assert [local_rank_and_device(cpu, r, gpu=False) for r in range(3)] == [(0, "cpu"), (1, "cpu"), (0, "cpu")]
