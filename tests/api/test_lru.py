"""api/_lru.py, the one cache of the coordinator's kept answers: bounded least-recently-used, one
entry per key at its version, and single flight (concurrent misses build once)."""

from __future__ import annotations

import threading

from api._lru import LRU


def test_the_least_recently_used_entry_goes_first_and_a_stale_version_is_rebuilt():
    cache: LRU[str] = LRU(max_entries=2)
    cache.put("a", "A")
    cache.put("b", "B")
    assert cache.get("a") == "A"  # read: now the most recent
    cache.put("c", "C")
    assert (cache.get("a"), cache.get("b"), cache.get("c"), len(cache)) == ("A", None, "C", 2)
    built = []
    assert cache.get_or_build("v", lambda: built.append(1) or "v1", version=1) == "v1"
    assert cache.get_or_build("v", lambda: built.append(2) or "v1 again", version=1) == "v1"
    assert cache.get_or_build("v", lambda: built.append(3) or "v2", version=2) == "v2"  # replaces, not beside
    assert built == [1, 3] and cache.get("v", version=1) is None and cache.get("v", version=2) == "v2"


def test_concurrent_misses_of_one_key_build_it_once():
    cache: LRU[int] = LRU(max_entries=4)
    started, release, calls = threading.Event(), threading.Event(), []

    def build() -> int:
        calls.append(1)
        started.set()
        release.wait(30)
        return 42

    first = threading.Thread(target=lambda: cache.get_or_build("k", build))
    first.start()
    assert started.wait(30)  # the first caller is building
    got: list[int] = []
    others = [threading.Thread(target=lambda: got.append(cache.get_or_build("k", build))) for _ in range(3)]
    for t in others:
        t.start()
    release.set()
    for t in [first, *others]:
        t.join(30)
    assert got == [42, 42, 42] and calls == [1]
