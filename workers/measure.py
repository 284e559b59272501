"""Timing and peak-memory helpers for one rank of a trial (CPU/gloo and CUDA/NCCL).

Peak memory is measured, never estimated: CUDA reads the caching allocator's
``max_memory_allocated``/``max_memory_reserved``; CPU reads ``VmHWM``, the whole process's
resident-set high-water mark, reset through ``/proc/self/clear_refs``. A reset starts from what the
process holds now, so a reused rank process first releases what earlier trials left
(``release_memory``). Why these sources: docs/workers.md, "Measuring".
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

CUDA_MEASURE = "cuda.max_memory_allocated"
CPU_MEASURE = "cpu.VmHWM"


def synchronize(device: torch.device) -> None:
    """Wait for queued device work so host timestamps cover it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _malloc_trim() -> None:
    """Return glibc's free heap pages to the OS (no-op elsewhere)."""
    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def release_memory(device: torch.device) -> None:
    """Free what no live object uses any more: garbage cycles, then the allocator's free memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        _malloc_trim()


def reset_peak_memory(device: torch.device) -> None:
    """Start a trial's peak-memory window from the memory live now (see the module docstring)."""
    release_memory(device)
    reset_high_water_mark(device)


def reset_high_water_mark(device: torch.device) -> None:
    """Restart the peak window from what the process holds now, freeing nothing (the memory timeline
    splits a trial into windows so: workers/_memory_timeline.py)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):  # not Linux, or not allowed: VmHWM then covers the process life
        Path("/proc/self/clear_refs").write_text("5")


def _vm_hwm_bytes() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    return None


def peak_memory(device: torch.device) -> tuple[int | None, int | None, str]:
    """(peak bytes, peak reserved bytes or None, name of the measure) since the last reset."""
    if device.type == "cuda":
        return (
            int(torch.cuda.max_memory_allocated(device)),
            int(torch.cuda.max_memory_reserved(device)),
            CUDA_MEASURE,
        )
    peak = _vm_hwm_bytes()
    if peak is None:  # no procfs: getrusage's ru_maxrss (kB on Linux) cannot be reset, say so
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, None, "cpu.ru_maxrss"
    return peak, None, CPU_MEASURE


class ComputeTimer:
    """Accumulates the duration of compute spans in one step without synchronising the device.

    CUDA: a pair of events per span, read once at the end of the step (after a synchronize);
    CPU: ``perf_counter`` around the span (the CPU computes synchronously).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._host_s = 0.0

    @contextlib.contextmanager
    def span(self) -> Iterator[None]:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events.append((start, end))
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._host_s += time.perf_counter() - t0

    def take(self) -> float:
        """Seconds spent in spans since the last ``take`` (call after ``synchronize``)."""
        total = self._host_s + sum(s.elapsed_time(e) for s, e in self._events) / 1000.0
        self._events.clear()
        self._host_s = 0.0
        return total


def agreed_max(value: float, device: torch.device) -> float:
    """The maximum of ``value`` over all ranks (so that every rank reports the same step time)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def start_barrier(device: torch.device) -> None:
    """Line every rank up before a timed step (an all-reduce: cheaper than ``barrier`` on NCCL)."""
    t = torch.zeros(1, device=device)
    dist.all_reduce(t)
    synchronize(device)
