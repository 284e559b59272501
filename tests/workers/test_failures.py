"""The failure taxonomy with real, induced failures: oom, timeout, crash, nan.

Classification unit tests use real exceptions (a real allocator failure, a real NonFiniteLoss);
the trial tests induce each failure in 4 real CPU ranks through the Ray backend and check what
comes back, that only the failing trial's processes are killed, and that the pool keeps working.
"""

from __future__ import annotations

import os
import time

import psutil
import pytest
import torch

from tuner import Layout, cluster_spec, model_spec, training_spec
from workers import TrialRequest
from workers.failures import classify, timeout_error
from workers.train import NonFiniteLoss


def _raise(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001
        return caught


def test_cpu_allocator_failure_is_oom_with_the_exact_bytes() -> None:
    nbytes = 2**50  # no machine has a PiB: the real allocator fails
    with pytest.raises(RuntimeError) as info:
        torch.empty(nbytes, dtype=torch.uint8)
    err = classify(info.value, rank=3)
    assert (err.kind, err.rank, err.bytes_requested) == ("oom", 3, nbytes)


def test_torch_out_of_memory_error_is_oom() -> None:
    exc = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity")
    err = classify(_raise(exc), rank=0)
    assert err.kind == "oom" and err.bytes_requested == 2 * 2**30
    assert err.exception_type == "torch.OutOfMemoryError"


def test_non_finite_loss_is_nan_and_anything_else_a_crash_with_traceback() -> None:
    assert classify(_raise(NonFiniteLoss(4, float("nan"))), rank=1).kind == "nan"

    def deep_failure() -> None:
        raise ValueError("boom in the rank program")

    try:
        deep_failure()
    except ValueError as exc:
        err = classify(exc, rank=2)
    assert (err.kind, err.rank, err.exception_type) == ("crash", 2, "builtins.ValueError")
    assert "deep_failure" in err.traceback_tail and "boom in the rank program" in err.traceback_tail
    assert err.bytes_requested is None


def test_timeout_error_names_rank_and_seconds() -> None:
    err = timeout_error(rank=1, seconds=3.25, what="a training step", steps_done=2)
    assert err.kind == "timeout" and err.rank == 1 and "3.2" in err.message and "2 optimizer steps" in err.message


# --- real induced failures through the Ray backend (4 CPU ranks) ------------------------------------


def _request(*, model: object = "tiny", layout: Layout | None = None, **kw: object) -> TrialRequest:
    spec = model_spec(model)
    return TrialRequest(
        model=spec,
        cluster=cluster_spec("cpu-local"),
        training=training_spec({"global_batch": 8}),
        layout=layout or Layout(dp=4),
        warmup_steps=1,
        measure_steps=2,
        **kw,
    )


def test_injected_crash_is_classified_with_rank_type_and_traceback(ray_backend) -> None:
    result = ray_backend.run(_request(options={"fail": "crash", "fail_rank": 2}, step_timeout_s=30))
    assert result.status == "crash" and not result.ok
    err = result.error
    assert err.rank == 2  # the rank that raised, not a peer that saw its connection close
    assert err.exception_type == "builtins.RuntimeError"
    assert "injected crash on rank 2" in err.traceback_tail and "_inject_before_step" in err.traceback_tail
    assert result.wall_s > 0 and result.device_seconds == pytest.approx(result.wall_s * 4)


def test_non_finite_loss_is_nan(ray_backend) -> None:
    result = ray_backend.run(_request(options={"fail": "nan"}, step_timeout_s=30))
    assert result.status == "nan"
    assert result.error.exception_type == "workers.train.NonFiniteLoss"


def test_huge_allocation_is_oom_with_bytes(ray_backend) -> None:
    result = ray_backend.run(_request(options={"fail": "oom", "fail_rank": 1}, step_timeout_s=30))
    assert result.status == "oom"
    assert result.error.rank == 1 and result.error.bytes_requested == 2**50


def test_memory_cap_makes_a_too_big_model_oom_for_real(ray_backend) -> None:
    # vocab 2^19 x hidden 64 fp32: the embedding alone is one 128 MiB allocation; the cap leaves
    # 120 MiB for the trial (enough for the process groups' threads), so model build fails in
    # torch's CPU allocator on every rank.
    big = {"preset": "tiny", "vocab": 2**19}
    result = ray_backend.run(_request(model=big, options={"memory_cap_bytes": 120 * 2**20}, step_timeout_s=30))
    assert result.status == "oom", result.error
    assert result.error.bytes_requested == 2**19 * 64 * 4
    # The cap is lifted after the trial: the same processes run a normal trial.
    assert ray_backend.run(_request()).status == "completed"


def _rank_pids() -> list[int]:
    from workers._gangs import POOL

    (gang,) = [g for g in POOL._gangs if g.key == ("CPU", (4,))]
    return [s.info["pid"] if s.info else -1 for s in gang.ranks]


class _SnapActor:
    """A rank's control methods as the watchdog calls them, answering at once (no Ray)."""

    def __init__(self, idle_s: float, stack: str) -> None:
        self.snapshot = self
        self.idle_s, self.stack = idle_s, stack

    def remote(self, with_stack: bool = False) -> dict:
        snap = {"phase": "steps", "steps": 1, "idle_s": self.idle_s}
        return snap | {"stack": self.stack} if with_stack else snap


_IN_GLOO = f'  File "/site-packages{os.sep}torch{os.sep}distributed{os.sep}distributed_c10d.py", line 3252, in all_reduce\n'
_ASLEEP = '  File "/work/workers/train.py", line 121, in _inject_before_step\n'


@pytest.mark.parametrize("hung_idle_s", [3.5, 2.9], ids=["hung-rank-stalled-too", "only-its-peers-stalled"])
def test_the_hung_rank_is_the_one_not_in_a_collective_whichever_ranks_are_over_the_limit(monkeypatch, hung_idle_s):
    import ray as ray_module

    from workers import _watchdog
    from workers._gangs import Slot

    monkeypatch.setattr(ray_module, "get", lambda refs, timeout=None: refs)
    ranks = [Slot(actor=_SnapActor(3.2, _IN_GLOO)) for _ in range(3)] + [Slot(actor=_SnapActor(hung_idle_s, _ASLEEP))]
    request = _request(step_timeout_s=3.0)
    verdict = _watchdog.stalled_verdict({i: i for i in range(4)}, ranks, request, 60.0, time.monotonic())
    assert verdict is not None
    error, culprits = verdict
    assert culprits == [3] and error.rank == 3 and error.kind == "timeout"


def test_hang_is_a_timeout_that_kills_only_the_hung_process_and_the_pool_recovers(ray_backend) -> None:
    assert ray_backend.run(_request()).status == "completed"  # warm gang
    before = _rank_pids()
    result = ray_backend.run(_request(options={"fail": "hang", "fail_rank": 3}, step_timeout_s=3.0))
    assert result.status == "timeout"
    assert result.error.rank == 3  # the hung rank, told apart from peers blocked in a collective
    assert "no progress" in result.error.message and "rank 3" in result.error.traceback_tail
    assert result.wall_s < 60
    deadline = time.monotonic() + 30  # ray.kill is asynchronous: the process exits shortly after
    while psutil.pid_exists(before[3]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not psutil.pid_exists(before[3])  # the hung rank's process is gone ...
    assert all(psutil.pid_exists(pid) for pid in before[:3]) and psutil.pid_exists(os.getpid())  # ... no other
    # The next trial on the same backend succeeds: the peers are reused, rank 3 is a fresh process.
    after = ray_backend.run(_request())
    assert after.status == "completed" and len(after.losses) == 3
    now = _rank_pids()
    assert now[:3] == before[:3] and now[3] != before[3]


def test_cuda_oom_observer_is_attached_once_per_process(monkeypatch) -> None:
    """A reused rank process installs the observer every trial; torch's allocator keeps every observer
    it is given, so each trial would add one more callback to every later OOM."""
    from workers import failures

    attached = []
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", attached.append, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(failures, "_observer_installed", False)
    assert failures.install_oom_observer() and failures.install_oom_observer()
    assert len(attached) == 1
    attached[0](0, 12345, 0, 0)  # the allocator's call: (device, bytes asked, allocated, free)
    assert failures._last_cuda_oom_bytes == 12345
    failures.reset_oom_record()
