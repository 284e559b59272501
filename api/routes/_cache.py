"""A small versioned response cache for the read routes that recompute a whole sweep (ranking, Pareto).

A ranking is a pure function of the sweep's measurements, and every recorded result goes with a
refresh of the sweep row's counters in the same transaction (api.engine), so the sweep row's counters
and calibration are a version of its ranking: a cached answer is served only while that version is
unchanged. On a 10,000-trial sweep the ranking takes ~1 s of CPU to compute and a coordinator serving
50 concurrent readers would otherwise recompute it for each of them (see benchmarks/bench_api_latency.py).

Concurrent misses for one key compute once (single flight); the others wait for that result.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")


def sweep_version(sweep: Any) -> tuple:
    """What changes whenever a trial of the sweep is recorded or its calibration is refitted."""
    calibration = sweep.calibration
    return (
        sweep.created_at, sweep.status, sweep.n_trials, sweep.n_completed, sweep.n_pruned, sweep.n_failed, sweep.device_seconds,
        sweep.best_tokens_per_s_per_device, repr(sorted(calibration.items())) if calibration else None,
    )


class VersionedCache:
    def __init__(self, max_entries: int = 32) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[Hashable, tuple[Hashable, Any]] = OrderedDict()
        self._guard = threading.Lock()
        self._key_locks: dict[Hashable, threading.Lock] = {}

    def get(self, key: Hashable, version: Hashable, compute: Callable[[], T]) -> T:
        hit = self._lookup(key, version)
        if hit is not None:
            return hit[0]
        with self._guard:
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:  # single flight: whoever holds it computes, the rest find its result
            hit = self._lookup(key, version)
            if hit is not None:
                return hit[0]
            value = compute()
            with self._guard:
                self._entries[key] = (version, value)
                self._entries.move_to_end(key)
                while len(self._entries) > self.max_entries:
                    old, _ = self._entries.popitem(last=False)
                    self._key_locks.pop(old, None)
            return value

    def _lookup(self, key: Hashable, version: Hashable) -> tuple[Any] | None:
        with self._guard:
            entry = self._entries.get(key)
            if entry is not None and entry[0] == version:
                self._entries.move_to_end(key)
                return (entry[1],)
        return None
