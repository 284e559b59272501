"""One rank of one trial: environment, process group, memory cap, the rank program, clean-up.

``run_rank`` is what every launcher calls in the rank's process (a reused Ray actor, or a process of
plain ``torchrun``). It never raises for a failed trial: it returns ``{"report": {...}}`` or
``{"error": {...}, "in_collective": bool}`` as plain dicts, so the driver needs no torch to read
them. In order: rendezvous env, the optional memory cap, ``init_process_group`` (gloo on CPU, NCCL
on CUDA) on a fresh port, a step hook beating ``Progress`` for the watchdog, the rank program
(``workers.train.train_trial``), and always the clean-up that lets a reused process start the next
trial clean. Each step and the NCCL timeouts: docs/workers.md, "One rank of a trial".
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import os
import resource
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from workers._contract import TrialRequest
from workers.failures import classify, install_oom_observer, reset_oom_record

# The group timeout is the backstop for a peer that died; it must exceed the step watchdog.
GROUP_TIMEOUT_FLOOR_S = 30.0


def group_timeout_s(request: TrialRequest, init_timeout_s: float) -> float:
    return max(GROUP_TIMEOUT_FLOOR_S, 2.0 * request.step_timeout_s + 10.0, init_timeout_s + 10.0)


class Progress:
    """What a rank is doing, for a watchdog in another thread (or, via Ray, another process).

    ``phase``: "idle" -> "init" (process group, model build, first step) -> "steps" -> "idle".
    ``beat()`` is called after every optimizer step; ``idle_s`` is the time since the last beat
    (or since the phase began), measured on this process's clock so clocks never mix.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.phase = "idle"
        self.steps = 0
        self._last = time.monotonic()
        self.thread_id: int | None = None

    def start(self) -> None:
        with self._lock:
            self.phase, self.steps, self._last = "init", 0, time.monotonic()
            self.thread_id = threading.get_ident()

    def beat(self) -> None:
        with self._lock:
            self.phase = "steps"
            self.steps += 1
            self._last = time.monotonic()

    def stop(self) -> None:
        with self._lock:
            self.phase, self._last = "idle", time.monotonic()

    def snapshot(self, *, with_stack: bool = False) -> dict[str, Any]:
        with self._lock:
            snap: dict[str, Any] = {
                "phase": self.phase,
                "steps": self.steps,
                "idle_s": time.monotonic() - self._last,
            }
            tid = self.thread_id
        if with_stack and tid is not None:
            frame = sys._current_frames().get(tid)
            if frame is not None:
                snap["stack"] = "".join(traceback.format_stack(frame)[-5:])
        return snap


def _vm_data_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmData:"):
            return int(line.split()[1]) * 1024
    raise OSError("no VmData in /proc/self/status")


@contextlib.contextmanager
def memory_cap(cap_bytes: int | None, device: Any) -> Iterator[None]:
    """A real per-rank memory cap for the duration of a trial (a test and diagnosis hook).

    CUDA: ``torch.cuda.set_per_process_memory_fraction(cap / device total)`` — the caching
    allocator then raises ``torch.OutOfMemoryError`` past the cap.
    CPU: the soft ``RLIMIT_DATA`` is lowered to (the process's VmData now + cap) and restored after;
    since Linux 4.7 RLIMIT_DATA counts every private writable mapping, so an allocation past it
    fails with ENOMEM and torch's ``DefaultCPUAllocator`` raises its "can't allocate memory: you
    tried to allocate N bytes" error (classified ``oom``). The cap counts from the trial's start:
    what the reused process already held (interpreter, torch, Ray) is not charged to the trial.
    """
    if not cap_bytes:
        yield
        return
    if isinstance(cap_bytes, bool) or not isinstance(cap_bytes, int) or cap_bytes < 0:
        raise ValueError(f"options.memory_cap_bytes must be a non-negative integer, got {cap_bytes!r}")
    import torch

    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), device)
        try:
            yield
        finally:
            # No empty_cache here: this runs before run_rank tears the process group down, and
            # after a failure a cached block may still be in use by an NCCL kernel waiting for a
            # departed peer, which empty_cache would wait for. run_rank empties it after the abort.
            torch.cuda.set_per_process_memory_fraction(1.0, device)
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = _vm_data_bytes() + cap_bytes
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def set_rendezvous_env(*, rank: int, world_size: int, local_rank: int, master_addr: str, master_port: int) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(local_rank),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
    )


def _report_dict(report: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(report) and not isinstance(report, type):
        return dataclasses.asdict(report)
    if isinstance(report, dict):
        return dict(report)
    raise TypeError(f"train_trial returned {type(report).__name__}, expected a RankReport dataclass")


def _in_collective(exc: BaseException) -> bool:
    """Whether ``exc`` came out of a torch.distributed call (a peer's failure seen by this rank,
    e.g. gloo's "Connection closed by peer"), judged by the frame that raised it."""
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last, tb = tb, tb.tb_next
    return last is not None and f"{os.sep}torch{os.sep}distributed{os.sep}" in last.tb_frame.f_code.co_filename


def _end_process_group(dist: Any, *, abort: bool) -> bool:
    """Tear down this trial's process groups; True when nothing of them is left running.

    After a failure on NCCL the groups are *aborted* (ncclCommAbort: local, immediate), not
    destroyed: ``destroy_process_group`` first finalizes every communicator, which waits for this
    rank's outstanding collectives, and after a mid-step failure (e.g. an OutOfMemoryError) one of
    them may wait for a peer that will never join: the failing rank would then hang in clean-up and
    its trial end as ``timeout`` instead of ``oom``/``crash``. Its peers block inside their own
    collective; the launcher kills them after its error grace (NCCL peers do not notice a departed
    rank the way gloo's closed sockets make them fail)."""
    if not dist.is_initialized():
        return True
    try:
        if abort:
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group()
        else:
            dist.destroy_process_group()
        return True
    except Exception:  # noqa: BLE001 - clean-up must not mask the trial's own result
        return False


def release_mesh_caches() -> None:
    """Empty torch's process-wide DTensor caches, which keep every ``DeviceMesh`` a trial used alive.

    ``destroy_process_group`` forgets a trial's groups, but a group lives as long as a Python or C++
    reference to it does, and each ``DeviceMesh`` holds its dimensions' groups (``_pg_registry``);
    a gloo group's worker threads ("pt_gloo_runloop", 2 per group) and its device's event loop
    ("gloo_tcp_loop") only stop when it is freed. The sharding-propagation caches (C++ fast path and
    Python, keyed by specs that hold the mesh), the redistribution-plan caches (``_planner_cache`` is
    keyed by a weak reference to the mesh, but its planners hold the mesh strongly) and the mesh
    topology cache held them: a reused rank process kept one trial's groups per distinct mesh shape
    (tens of threads each, hundreds after a test run). A mesh also equals any mesh of the same
    shape, so a later trial's DTensors got a past trial's mesh object from a cache hit (its
    ``get_group`` still found the current group, by name; measured with torch 2.13).
    Call after ``destroy_process_group``, in the thread that ran the trial (two caches are per
    thread), then collect garbage (planners and their cost closures are reference cycles). A cache
    a torch version lacks is skipped: tests/workers/test_actor_threads.py notices a release that no longer
    frees the groups."""
    if "torch.distributed.tensor" not in sys.modules:
        return  # no DTensor was ever made in this process: nothing is cached
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _collective_utils as collective_utils
    from torch.distributed.tensor import _redistribute as redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    clears = [
        getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None),  # C++ fast path, per thread
        getattr(getattr(propagator, "propagate_op_sharding", None), "cache_clear", None),  # per thread
        getattr(getattr(propagator, "_propagate_tensor_meta_cached", None), "cache_clear", None),
        getattr(getattr(redistribute, "_gen_transform_infos", None), "cache_clear", None),
        getattr(redistribute, "clear_redistribute_planner_cache", None),
        getattr(getattr(getattr(collective_utils, "MeshTopoInfo", None), "build_from_mesh", None), "cache_clear",
                None),
    ]
    for clear in clears:
        if clear is not None:
            with contextlib.suppress(Exception):  # clean-up must not mask the trial's own result
                clear()


def threads_by_name() -> dict[str, int]:
    """This process's threads, counted by name, native ones included: /proc/self/task lists every
    thread, while ``threading`` sees only Python's (gloo's "pt_gloo_runloop"/"gloo_tcp_loop" are
    native). A diagnostic of a reused rank process (``RankWorker.threads``)."""
    counts: dict[str, int] = {}
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended since the listing
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            counts[name] = counts.get(name, 0) + 1
    return counts


def run_rank(
    request: TrialRequest,
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    master_addr: str,
    master_port: int,
    device: str,
    progress: Progress | None = None,
    init_timeout_s: float = 120.0,
    init_method: str | None = None,
    program: Any = None,
) -> dict[str, Any]:
    """Run ``request`` as ``rank`` of ``world_size``; ``{"report": ...}`` or ``{"error": ...}``.

    ``init_method`` defaults to ``tcp://master_addr:master_port`` (rank 0 hosts the store on the
    fresh port); under torchrun pass ``"env://"`` to use the agent's store. ``program`` replaces the
    rank program ``workers.train.train_trial`` (called the same way, ``program(request, device=...)``,
    returning a dataclass or dict), e.g. reshard-check's (workers/reshard.py).
    """
    import torch
    import torch.distributed as dist
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from workers.env import fingerprint

    progress = progress or Progress()
    progress.start()
    set_rendezvous_env(
        rank=rank, world_size=world_size, local_rank=local_rank, master_addr=master_addr, master_port=master_port
    )
    dev = torch.device(device)
    hook = None
    failed = True
    try:
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
            install_oom_observer()
            reset_oom_record()
        with memory_cap(request.options.get("memory_cap_bytes"), dev):
            dist.init_process_group(
                "nccl" if dev.type == "cuda" else "gloo",
                init_method=init_method or f"tcp://{master_addr}:{master_port}",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=group_timeout_s(request, init_timeout_s)),
                **({"device_id": dev} if dev.type == "cuda" else {}),
            )
            hook = register_optimizer_step_post_hook(lambda *_: progress.beat())
            if program is None:
                from workers.train import train_trial as program

            report = _report_dict(program(request, device=dev))
        report["env"] = fingerprint(dev.type)
        failed = False
        return {"report": report}
    except BaseException as exc:  # noqa: BLE001 - every failure of the rank program is a result
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        return {"error": dataclasses.asdict(classify(exc, rank=rank)), "in_collective": _in_collective(exc)}
    finally:
        if hook is not None:
            hook.remove()
        released = _end_process_group(dist, abort=failed and dev.type == "cuda")
        release_mesh_caches()
        # Collect now, success or failure: a traceback kept in a reference cycle (e.g. ``oom = ...;
        # raise oom from exc`` leaves the frame and its exception pointing at each other) keeps the
        # mesh and so the gloo/NCCL communicators alive after destroy_process_group (peers then
        # block in their collective until the group timeout instead of failing at once), and FSDP's
        # hooks keep the model and optimizer of a finished trial in cycles that would otherwise
        # hold their (GPU) memory in this reused process until the next automatic collection.
        gc.collect()
        if dev.type == "cuda" and released:
            # Give the trial's cached blocks back to the device. Not after a failed abort: a block
            # still in use by a hung NCCL kernel would make empty_cache wait for it.
            with contextlib.suppress(Exception):
                torch.cuda.empty_cache()
        progress.stop()
