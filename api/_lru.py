"""One bounded, thread-safe least-recently-used cache for the answers the coordinator keeps (plans,
rankings, Pareto fronts, confirm reports, dashboard states): at most ``max_entries``, one lock, and
single flight (concurrent misses of one key build it once; the others wait for that value).

A ``version`` given with a key keeps one entry per key: a stale version is rebuilt and replaces it.
The cached values are shared: callers read them and never mutate them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")
_NONE = object()


class LRU(Generic[V]):
    def __init__(self, max_entries: int) -> None:
        assert max_entries >= 1, max_entries
        self.max_entries = max_entries
        self._entries: OrderedDict[Hashable, tuple[Hashable, V]] = OrderedDict()
        self._guard = threading.Lock()
        self._building: dict[Hashable, threading.Lock] = {}

    def get(self, key: Hashable, version: Hashable = None) -> V | None:
        """The value kept under ``key`` (at ``version``), or None."""
        hit = self._lookup(key, version)
        return None if hit is _NONE else hit  # type: ignore[return-value]

    def put(self, key: Hashable, value: V, version: Hashable = None) -> V:
        with self._guard:
            self._entries[key] = (version, value)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                old, _ = self._entries.popitem(last=False)
                self._building.pop(old, None)
        return value

    def get_or_build(self, key: Hashable, build: Callable[[], V], version: Hashable = None) -> V:
        """The kept value, or ``build()`` kept: built once however many callers miss it at once."""
        hit = self._lookup(key, version)
        if hit is not _NONE:
            return hit  # type: ignore[return-value]
        with self._guard:
            lock = self._building.setdefault(key, threading.Lock())
        with lock:  # whoever holds it builds; the rest find its value
            hit = self._lookup(key, version)
            if hit is not _NONE:
                return hit  # type: ignore[return-value]
            return self.put(key, build(), version)

    def clear(self) -> None:
        with self._guard:
            self._entries.clear()
            self._building.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def _lookup(self, key: Hashable, version: Hashable) -> object:
        with self._guard:
            entry = self._entries.get(key)
            if entry is None or entry[0] != version:
                return _NONE
            self._entries.move_to_end(key)
            return entry[1]
