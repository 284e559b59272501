"""One failure must not turn into several: a rank process killed for real (SIGKILL) is a crash of
its own trial only, the next trial on the same backend completes; a Ray that does not start in time
is retried and then one clear line, never a traceback; a trial whose every rank hangs says so."""

from __future__ import annotations

import os
import signal
import threading
import time
from types import SimpleNamespace

import psutil
import pytest
import ray

from tuner import Layout, cluster_spec, model_spec, training_spec
from workers import BackendUnavailable, TrialRequest


def _request(**kw: object) -> TrialRequest:
    base: dict = dict(model=model_spec("tiny"), cluster=cluster_spec("cpu-local"),
                      training=training_spec({"global_batch": 8}), layout=Layout(dp=4),
                      warmup_steps=1, measure_steps=2, step_timeout_s=60)
    return TrialRequest(**{**base, **kw})


def _gang():
    from workers._gangs import POOL

    (gang,) = [g for g in POOL._gangs if g.key == ("CPU", (4,))]
    return gang


def _wait_until(what: str, ready, timeout_s: float = 400.0) -> None:
    """Poll a condition (an event we cannot subscribe to) with a generous safety deadline: a hang guard,
    not a speed check — starting four fresh rank actors took over 120 s with both cores busy."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.timeout(900)  # hang guard: fresh actors start slowly on a loaded machine
def test_rank_killed_mid_trial_is_one_crash_and_the_next_trial_completes(ray_backend) -> None:
    out: dict = {}
    # Long enough to be killed in the middle of: the kill comes once rank 2 is in its timed steps.
    slow = _request(measure_steps=200, options={"sleep_per_step_s": 0.2})
    th = threading.Thread(target=lambda: out.setdefault("r", ray_backend.run(slow)))
    th.start()
    _wait_until("the gang's ranks to start", lambda: _busy_gang() is not None)
    gang = _busy_gang()
    victim = gang.ranks[2].actor
    _wait_until("rank 2 to run its steps", lambda: ray.get(victim.snapshot.remote())["phase"] == "steps")
    pids = [s.info["pid"] for s in gang.ranks]
    os.kill(pids[2], signal.SIGKILL)
    th.join(120)
    assert not th.is_alive()
    result = out["r"]
    assert result.status == "crash" and result.error.rank == 2 and "process died" in result.error.message

    # Rank 0's process dies too, while the gang is idle: it must be noticed before reuse as well.
    os.kill(pids[0], signal.SIGKILL)
    _wait_until("the killed process to exit", lambda: not psutil.pid_exists(pids[0]))
    # The next trial on the same backend runs, on fresh ranks 0 and 2 (no dead handle is reused).
    again = ray_backend.run(_request())
    assert again.status == "completed", again.error
    now = [s.info["pid"] for s in _gang().ranks]
    # The dead ranks are fresh processes. Survivors are reused only if they answer the pre-reuse health
    # check in time (still unwinding their broken gloo group they may not, and are then replaced too):
    # either way no dead handle is called.
    assert now[0] != pids[0] and now[2] != pids[2]


def _busy_gang():
    from workers._gangs import POOL

    busy = [g for g in POOL._gangs if g.key == ("CPU", (4,)) and g.busy and g.ranks and all(s.info for s in g.ranks)]
    return busy[0] if busy else None


def test_every_rank_hung_says_all_ranks_not_rank_none(ray_local) -> None:
    from workers._gangs import Slot
    from workers.ray_backend import RayBackend

    class Hung:  # a rank's control endpoint: no step for a long time, stack outside torch.distributed
        class snapshot:  # noqa: N801 - mimics an actor method (``actor.snapshot.remote(...)``)
            @staticmethod
            def remote(with_stack: bool = False):
                snap = {"phase": "steps", "steps": 1, "idle_s": 50.0}
                if with_stack:
                    snap["stack"] = '  File "/x/workers/train.py", line 1, in _run_trial\n    time.sleep(s)\n'
                return ray.put(snap)

    ranks = [Slot(actor=Hung()) for _ in range(4)]
    pending = {object(): r for r in range(4)}
    error, culprits = RayBackend()._stalled(pending, ranks, _request(step_timeout_s=5), 10.0, time.monotonic())
    assert sorted(culprits) == [0, 1, 2, 3]
    assert "None" not in error.message and error.message.startswith("all 4 ranks made no progress for 50.0 s")
    assert error.rank is None and error.kind == "timeout"
    # A subset of the ranks is named as such.
    pending = {object(): r for r in (1, 3)}
    error, _ = RayBackend()._stalled(pending, ranks, _request(step_timeout_s=5), 10.0, time.monotonic())
    assert error.message.startswith("ranks 1, 3 made no progress")


def test_ranks_that_never_answer_the_watchdog_time_out(ray_local) -> None:
    """A rank too starved (or stuck below Python) to answer its snapshot is not waited for forever."""
    from ray.exceptions import GetTimeoutError

    from workers._gangs import Slot
    from workers.ray_backend import RayBackend

    class Silent:
        class snapshot:  # noqa: N801
            @staticmethod
            def remote(with_stack: bool = False):
                raise GetTimeoutError("no answer")

    ranks = [Slot(actor=Silent()) for _ in range(2)]
    pending = {object(): 0, object(): 1}
    request, now = _request(step_timeout_s=5), time.monotonic()
    assert RayBackend()._stalled(pending, ranks, request, 10.0, now, [now - 14.0]) is None  # not yet
    error, culprits = RayBackend()._stalled(pending, ranks, request, 10.0, now, [now - 16.0])
    assert culprits == [0, 1] and error.kind == "timeout"
    assert error.message.startswith("all 2 ranks made no progress for 16.0 s (not answering the watchdog)")


def test_timeout_error_wording() -> None:
    from workers.failures import timeout_error

    one = timeout_error(rank=3, seconds=4.0, what="a training step", steps_done=2)
    assert one.message.startswith("rank 3 made no progress for 4.0 s (a training step) after 2 optimizer steps")
    some = timeout_error(ranks=[2, 0], world_size=4, seconds=4.0, what="a training step")
    assert some.message.startswith("ranks 0, 2 made no progress") and some.rank is None
    every = timeout_error(ranks=[0, 1], world_size=2, seconds=4.0, what="a training step")
    assert every.message.startswith("all 2 ranks made no progress")
    assert timeout_error(ranks=[1], world_size=2, seconds=1.0, what="x").rank == 1


# --- a Ray that does not start in time --------------------------------------------------------------

SLOW_START = "The current node timed out during startup. This could happen because some of the raylet failed to startup"


@pytest.fixture
def ray_start_times_out(monkeypatch):
    """Ray's start fails as it does on a loaded machine: a bare Exception after its fixed 30 s wait
    (ray/_private/node.py). The session Ray, if any, is hidden rather than touched."""
    import workers._ray_start as start
    import workers.ray_backend as rb

    calls: list[dict] = []

    def init(**kwargs):
        calls.append(kwargs)
        raise Exception(SLOW_START)  # noqa: TRY002 - exactly what Ray raises

    # Only the start-up code sees a Ray that is not running (the gang pool, say, must not).
    fake = SimpleNamespace(is_initialized=lambda: False, init=init, shutdown=lambda *a, **k: None)
    monkeypatch.setattr(start, "ray", fake)
    monkeypatch.setattr(rb.RayBackend, "start_retry_delays_s", (0.0, 0.0))
    # The session Ray's processes are this process's children: its clean-up must not see them.
    monkeypatch.setattr(start, "clean_failed_start", lambda before: calls.append({"cleaned": True}))
    return calls


def test_slow_ray_start_is_retried_then_one_backend_unavailable(ray_start_times_out) -> None:
    from workers.ray_backend import RayBackend

    with pytest.raises(BackendUnavailable, match=r"cannot start a local Ray after 3 attempts: .*timed out during startup"):
        RayBackend().run(_request())
    # Each attempt starts a new local Ray (address="local": never another Ray found on the machine),
    # and each failed attempt cleaned up.
    assert [sorted(c) for c in ray_start_times_out] == [
        ["address", "include_dashboard", "log_to_driver", "num_cpus"], ["cleaned"]] * 3
    assert {c["address"] for c in ray_start_times_out[::2]} == {"local"}


def test_a_failed_ray_start_leaves_no_ray_process_behind(monkeypatch) -> None:
    """What the failed attempt spawned (Ray's binaries live under .../ray/...) is killed; other
    children of the process are not."""
    import subprocess
    import sys

    import workers._ray_start as start

    monkeypatch.setattr(start, "ray", SimpleNamespace(is_initialized=lambda: False))  # leave a session Ray alone
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    raylet = subprocess.Popen([*sleeper, f"{os.sep}x{os.sep}ray{os.sep}core{os.sep}raylet"])
    other = subprocess.Popen(sleeper)
    try:  # "before the attempt": every child but these two (a session Ray's are not touched)
        start.clean_failed_start(start.child_pids() - {raylet.pid, other.pid})
        assert raylet.wait(timeout=30) is not None and other.poll() is None
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize("command", [
    ["run-trial", "--backend", "ray", "--layout", "dp=4"],
    ["reshard-check", "--from", "tp=2,dp=2", "--to", "dp=4"],
])
def test_cli_says_one_line_when_ray_does_not_start(ray_start_times_out, capsys, command) -> None:
    from api.cli import main

    code = main(command)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"meshtune {command[0]}: error: cannot start a local Ray after 3 attempts")
