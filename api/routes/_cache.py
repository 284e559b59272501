"""A small versioned response cache for the sweep read routes (ranking pages, Pareto), and ETags.

The ranking is stored and kept in order as results land (api/store/_ranking.py), with a results
version per sweep: an answer (a page, or the whole 2.6 MB ranking of a 10,000-trial sweep) is a pure
function of that version and the sweep's calibration (``api.sweeps.service.ranking_tag``), so its
serialised bytes are kept and served while the version is unchanged, and the same version is the
answer's ETag (``If-None-Match`` gets 304). The Pareto answer keys on the sweep row's counters
(``sweep_version``), which each recorded result refreshes in the same transaction (api.engine).

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


def etag_matches(if_none_match: str | None, etag: str) -> bool:
    """RFC 9110 section 13.1.2: ``If-None-Match`` matches when it is ``*`` or lists the entity tag
    (weak comparison: a ``W/`` prefix is ignored)."""
    if not if_none_match:
        return False
    if if_none_match.strip() == "*":
        return True
    return any(tag.strip().removeprefix("W/") == etag for tag in if_none_match.split(","))


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
