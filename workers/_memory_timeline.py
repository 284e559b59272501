"""Memory over one measured step of a trial, per rank: the series the trial page draws, the step's
phases (stage, micro-batch, forward/backward, gradient sync, optimiser) and where the peak falls.

CPU: a sampler thread reads the process's ``VmRSS``/``VmHWM`` and glibc's ``mallinfo2`` every
``SAMPLE_S``, and each phase marker (``Phases.mark``) reads them too, so the phase in which the
step's high-water mark was reached is exact however late the sampler runs. CUDA: the caching
allocator's own history. The timeline's maximum equals the rank's reported peak by construction
(the before/step/after windows). How and why: docs/workers.md, "Memory timeline".
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
import time
from array import array
from typing import Any

import torch

from workers import measure
from workers._contract import timeline_max

SAMPLE_S = 0.002  # the sampler's period (every phase marker adds a reading as well)
MAX_POINTS = 240  # stored per rank: each of MAX_POINTS // 2 buckets keeps its lowest and highest sample
MAX_PHASES = 400  # stored phase markers per rank (a step with many micro-batches keeps its first ones)
MAX_SAMPLES = 4096  # readings kept while a step runs (8 s at 2 ms; then every other one, and half as often)
MAX_MARKS = 4096  # phase markers kept while a step runs (later ones are counted)
RSS_MEASURE = "cpu.VmRSS"
LIVE_MEASURE = "cpu.malloc_in_use"  # mallinfo2: uordblks + hblkhd
CUDA_SERIES = "cuda.memory_allocated"


class _MallInfo2(ctypes.Structure):  # glibc >= 2.33 struct mallinfo2 (malloc.h)
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mallinfo2() -> Any:
    """glibc's mallinfo2, or None (another libc, an older glibc)."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


class _Status:
    """This process's (VmRSS, VmHWM, malloc's in-use bytes) in bytes: one pread of /proc/self/status
    into a buffer allocated once, the file kept open (procfs regenerates it on a read from offset 0;
    ~3 us against ~30 us to open and read it), and one mallinfo2 (-1 where there is none)."""

    def __init__(self) -> None:
        self.fd = os.open("/proc/self/status", os.O_RDONLY)
        self.buf = bytearray(8192)
        self.mallinfo2 = _mallinfo2()

    def read(self) -> tuple[int, int, int]:
        n = os.preadv(self.fd, [self.buf], 0)
        data = self.buf

        def field(name: bytes) -> int:
            i = data.find(name, 0, n) + len(name)
            return int(data[i:data.find(b"kB", i, n)]) * 1024

        live = -1
        if self.mallinfo2 is not None:
            info = self.mallinfo2()
            live = info.uordblks + info.hblkhd
        return field(b"VmRSS:"), field(b"VmHWM:"), live

    def close(self) -> None:
        os.close(self.fd)


class _Readings:
    """(time, bytes, high-water mark) readings in arrays allocated and written before the step: the
    recorder allocates nothing that lives on while the step runs, so it does not grow the resident
    memory it measures (a list of tuples grew it by 434 kB over 2,000 markers, and by ~15 kB in a
    tiny model's step, as much as the step's own growth: tests/workers/test_memory_timeline.py). When full, every other reading is dropped and ``stride`` doubles (the sampler then
    reads half as often); with ``drop_when_full`` later readings are counted, not kept."""

    def __init__(self, capacity: int, *, drop_when_full: bool = False) -> None:
        self.capacity, self.drop_when_full = capacity, drop_when_full
        self.t = array("d", bytes(8 * capacity))
        self.b = array("q", bytes(8 * capacity))
        self.h = array("q", bytes(8 * capacity))
        self.live = array("q", bytes(8 * capacity))  # malloc's in-use bytes (CPU); -1 unknown
        self.tag = array("i", bytes(4 * 3 * capacity))  # (phase, stage, micro-batch) of a marker; -1 for none
        self.n = self.dropped = 0
        self.stride = 1

    def add(self, t: float, b: int, h: int, live: int, phase: int = -1, stage: int = -1, mb: int = -1) -> None:
        if self.n == self.capacity:
            if self.drop_when_full:
                self.dropped += 1
                return
            self._halve()
        i = self.n
        self.t[i], self.b[i], self.h[i], self.live[i] = t, b, h, live
        self.tag[3 * i], self.tag[3 * i + 1], self.tag[3 * i + 2] = phase, stage, mb
        self.n = i + 1

    def _halve(self) -> None:
        keep = range(0, self.n, 2)
        for j, i in enumerate(keep):
            self.t[j], self.b[j], self.h[j], self.live[j] = self.t[i], self.b[i], self.h[i], self.live[i]
        self.n, self.stride = len(keep), self.stride * 2

    def rows(self) -> list[tuple[float, int, int, int, int, int, int]]:
        """(time, bytes, high-water mark, in-use bytes, phase, stage, micro-batch) in order of adding."""
        return [(self.t[i], self.b[i], self.h[i], self.live[i], *self.tag[3 * i:3 * i + 3]) for i in range(self.n)]


PHASE_NAMES = ("forward", "backward", "loss", "pipeline send/recv", "gradient sync", "optimizer")
_PHASE_INDEX = {name: i for i, name in enumerate(PHASE_NAMES)}


class Phases:
    """The step's phase markers: ``mark(phase, stage, micro_batch)`` records when a phase begins, with
    the memory and the high-water mark then (a reading of the series too: the curve has a point at
    every phase boundary however sparse the sampler's). A no-op unless armed (only the recorded step).
    ``phase`` is one of ``PHASE_NAMES``."""

    def __init__(self) -> None:
        self.armed = False
        self.marks: _Readings | None = None
        self.micro_batch: int | None = None  # the last one marked (the pipeline's loss names it)
        self._read: Any = None

    def arm(self, read: Any, marks: _Readings) -> None:
        """``read()`` -> (bytes, high-water mark, in-use bytes); ``marks``: where the readings go."""
        self.marks, self._read, self.armed = marks, read, True

    def disarm(self) -> None:
        self.armed = False

    def mark(self, phase: str, stage: int | None = None, micro_batch: int | None = None) -> None:
        if self.armed:
            assert self.marks is not None
            b, h, live = self._read()
            self.marks.add(time.perf_counter(), b, h, live, _PHASE_INDEX[phase], -1 if stage is None else stage,
                           -1 if micro_batch is None else micro_batch)
            if micro_batch is not None:
                self.micro_batch = micro_batch


class StepMemory:
    """Records one step's memory on this rank: ``start()`` before it, ``stop()`` after it, ``finish()``
    at the trial's end (see the module docstring); ``timeline()`` is what the rank reports."""

    def __init__(self, device: torch.device, phases: Phases, *, step: int, sample_s: float = SAMPLE_S) -> None:
        self.device, self.phases, self.step, self.sample_s = device, phases, step, sample_s
        self.cuda = device.type == "cuda"
        self.samples = _Readings(MAX_SAMPLES)
        self.marks = _Readings(MAX_MARKS, drop_when_full=True)
        self._stop, self._go, self._ready = threading.Event(), threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        self._recording = False  # the CUDA allocator's history is on
        self._status: _Status | None = None
        self.trace: list[dict[str, Any]] = []
        self.before = self.before_reserved = self.after = self.after_reserved = None
        self.step_peak = self.step_reserved = None
        self.measure = ""

    # --- readings: the series' bytes (VmRSS, or the caching allocator's allocated bytes) and the
    # high-water mark (VmHWM, or max_memory_allocated) ---------------------------------------------

    def _read(self) -> tuple[int, int, int]:
        if self.cuda:  # the series is the allocator's own (its history): no separate in-use reading
            return int(torch.cuda.memory_allocated(self.device)), int(torch.cuda.max_memory_allocated(self.device)), -1
        assert self._status is not None
        return self._status.read()

    def _sample(self) -> None:
        t = time.perf_counter()
        self.samples.add(t, *self._read())

    def _run(self) -> None:
        # Warm before the step's window opens: this thread's stack and the readings' code paths are
        # resident before the high-water mark is reset (they would otherwise be the step's first growth).
        self._read()
        self._ready.set()
        self._go.wait()
        # time.sleep, not Event.wait: ~30 us of this thread's CPU per sample instead of 45-65 (measured
        # at 2 ms, load 8-14 on 2 cores: 1.4-1.6% of one core, against 2.3-8.7% every 1 ms)
        while not self._stop.is_set():
            time.sleep(self.sample_s * self.samples.stride)
            self._sample()

    # --- the step --------------------------------------------------------------------------------

    def start(self) -> None:
        if self.cuda:
            self.start_allocated = int(torch.cuda.memory_allocated(self.device))
        else:
            self._status = _Status()
            self._thread = threading.Thread(target=self._run, name="meshtune-memory", daemon=True)
            self._thread.start()
            self._ready.wait()
        self.phases.arm(self._read, self.marks)
        self.before, self.before_reserved, self.measure = measure.peak_memory(self.device)
        measure.reset_high_water_mark(self.device)
        self.epoch0, self.t0 = time.time(), time.perf_counter()
        self._sample()
        if self.cuda:
            torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                                     max_entries=200_000, clear_history=True)
            self._recording = True
        self._go.set()

    def stop(self) -> None:
        self.phases.disarm()
        self._end_sampler()
        self._sample()
        if self.cuda:
            snapshot = torch.cuda.memory._snapshot()
            self._end_history()
            traces = snapshot.get("device_traces") or []
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self.trace = list(traces[index]) if index < len(traces) else []
        self.step_peak, self.step_reserved, _ = measure.peak_memory(self.device)
        measure.reset_high_water_mark(self.device)
        self._end_status()

    def finish(self) -> None:
        self.after, self.after_reserved, _ = measure.peak_memory(self.device)

    def close(self) -> None:
        """Stop recording, whatever state a failed step left (idempotent): a reused rank process keeps
        no sampler thread and no allocator history after its trial."""
        self.phases.disarm()
        self._end_sampler()
        self._end_history()
        self._end_status()

    def _end_status(self) -> None:
        if self._status is not None:
            self._status.close()
            self._status = None

    def _end_sampler(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._go.set()
            self._thread.join()
            self._thread = None

    def _end_history(self) -> None:
        if self._recording:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording = False

    # --- the report ------------------------------------------------------------------------------

    def _series(self) -> list[tuple[float, int, int | None]]:
        """(seconds from the step's start, bytes, in-use bytes or None): RSS and malloc's in-use bytes
        read by the sampler and at every phase marker, or the allocator history's allocated bytes."""
        if not self.cuda or not self.trace:
            got = sorted((t, b, live) for t, b, _, live, *_ in self.samples.rows() + self.marks.rows())
            return [(t - self.t0, b, None if live < 0 else live) for t, b, live in got]
        events, live = [], self.start_allocated
        for e in self.trace:
            action, size = e.get("action"), int(e.get("size") or 0)
            if action == "alloc":
                live += size
            elif action == "free_requested":  # the allocated bytes drop when the tensor is freed
                live -= size
            else:
                continue
            events.append((e["time_us"] / 1e6 - self.epoch0 if e.get("time_us") else None, live))
        duration = self.samples.t[self.samples.n - 1] - self.t0
        if any(t is None or not -1.0 <= t <= duration + 1.0 for t, _ in events):
            # no wall-clock time on the entries (or another clock): their order, spread over the step
            events = [(duration * (i + 1) / (len(events) + 1), b) for i, (_, b) in enumerate(events)]
        return [(0.0, self.start_allocated, None), *((t, b, None) for t, b in events)]

    def _readings(self) -> list[tuple[float, int]]:
        """Every high-water mark read during the step (samples and markers), in time order."""
        return sorted((t - self.t0, hwm) for t, _, hwm, *_ in self.samples.rows() + self.marks.rows())

    def timeline(self) -> dict[str, Any]:
        """What the rank reports: the downsampled series with the peak point, the phases, the peak's
        phase and the three windows' high-water marks; ``peak_bytes`` is their maximum."""
        assert self.step_peak is not None and self.after is not None, "timeline() after stop() and finish()"
        marks = [(t - self.t0, PHASE_NAMES[p], None if s < 0 else s, None if m < 0 else m)
                 for t, _, _, _, p, s, m in self.marks.rows()]
        series = self._series()
        readings = self._readings()
        # The first reading that saw the step's final high-water mark; the peak lies in the interval
        # before it, in the phase in force at the reading before (no phase began in between).
        j = next((i for i, (_, hwm) in enumerate(readings) if hwm >= self.step_peak), len(readings) - 1)
        lo, hi = (readings[j - 1][0] if j else 0.0), readings[j][0]
        in_force = [m for m in marks if m[0] <= lo]
        phase = list(in_force[-1][1:]) if in_force else ["start", None, None]
        peak_t = (lo + hi) / 2
        points = downsample(series, MAX_POINTS)
        if max((b for _, b, _ in points), default=-1) < self.step_peak:  # the kernel's mark, between samples
            points = sorted([*points, (peak_t, self.step_peak, None)], key=lambda row: row[0])
        windows = {"before": int(self.before or 0), "step": max(b for _, b, _ in points), "after": int(self.after or 0)}
        where = max(("step", "before", "after"), key=lambda k: (windows[k], k == "step"))
        out: dict[str, Any] = {
            "step": self.step,
            "series": CUDA_SERIES if self.cuda else RSS_MEASURE,
            "peak_measure": self.measure,
            "duration_ms": round((readings[-1][0]) * 1000, 3),
            "samples": len(series),
            "t_ms": [round(t * 1000, 3) for t, _, _ in points],
            "bytes": [int(b) for _, b, _ in points],
            "phases": [[round(t * 1000, 3), p, s, m] for t, p, s, m in marks[:MAX_PHASES]],
            "phases_total": len(marks) + self.marks.dropped,
            "before_bytes": windows["before"],
            "step_peak_bytes": windows["step"],
            "after_bytes": windows["after"],
            "peak": {"where": where, "t_ms": round(peak_t * 1000, 3), "between_ms": [round(lo * 1000, 3),
                     round(hi * 1000, 3)], "phase": phase[0], "stage": phase[1], "micro_batch": phase[2],
                     # the first reading already saw it: what the step began with was never exceeded
                     "held_from_start": j == 0},
        }
        out["peak_bytes"] = timeline_max(out)  # the rank's reported peak: the timeline's maximum
        in_use = [(t, live) for t, _, live in series if live is not None]
        if in_use:  # where the step's allocations peak: the phase that produced the highest reading
            t_top, top = max(in_use, key=lambda row: row[1])
            before_top = [m for m in marks if m[0] < t_top]
            ph = list(before_top[-1][1:]) if before_top else ["start", None, None]
            out.update(live=[None if v is None else int(v) for _, _, v in points], live_measure=LIVE_MEASURE,
                       live_peak={"t_ms": round(t_top * 1000, 3), "bytes": int(top), "phase": ph[0], "stage": ph[1],
                                  "micro_batch": ph[2]})
        if self.cuda:
            out["peak_reserved_bytes"] = max(int(x or 0) for x in (self.before_reserved, self.step_reserved,
                                                                    self.after_reserved))
        return out


def downsample(series: list[tuple], max_points: int) -> list[tuple]:
    """At most ``max_points`` rows of ``series`` ((time, value, ...) in time order): the first and the
    last, and in each of a number of equal runs of the rest the rows holding each value column's lowest
    and highest (None values skipped): the shape and every extreme survive, which a plain stride drops."""
    if len(series) <= max_points:
        return list(series)
    columns = [c for c in range(1, len(series[0])) if any(row[c] is not None for row in series)]
    inner = series[1:-1]
    buckets = max(1, (max_points - 2) // (2 * max(1, len(columns))))
    out = [series[0]]
    for k in range(buckets):
        run = inner[k * len(inner) // buckets:(k + 1) * len(inner) // buckets]
        keep: set[int] = set()
        for c in columns:
            have = [i for i in range(len(run)) if run[i][c] is not None]
            if have:
                keep |= {min(have, key=lambda i: run[i][c]), max(have, key=lambda i: run[i][c])}
        out += [run[i] for i in sorted(keep)]
    out.append(series[-1])
    return out
