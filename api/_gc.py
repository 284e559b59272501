"""The serving process's cyclic garbage collector: full passes kept off the request path.

A full collection walks every object the collector tracks and holds the GIL while it does: with the
~130,000 objects the coordinator imports and a 10,000-trial sweep's cached dashboard state (~150,000
more), each pass stalled every request for 45-170 ms (measured with ``gc.callbacks`` at 50 clients,
benchmarks/bench_api_latency.py), which alone decided the API's 99th percentile. These objects live as
long as the process or their cache entry, so scanning them again finds nothing:

* ``serve_quietly()`` (``meshtune serve``, once started): collect, then freeze what is alive
  (``gc.freeze``: later passes skip it; reference counting still frees what is released) and run the
  young generation less often (its objects mostly die by reference count first).
* ``settle()`` after a large long-lived cache entry is built (on the slow path that built it): one
  collection there, then the survivors frozen too. The collection before each freeze means no cyclic
  garbage is frozen with them; a cached state is a tree of dicts and lists (no cycles), so evicting it
  later frees it by reference count. Outside ``meshtune serve`` (tests, the CLI) ``settle`` does nothing.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = (20_000, 20, 10)  # CPython's default is (700, 10, 10)
_serving = False


def serve_quietly() -> None:
    global _serving
    gc.collect()
    gc.freeze()
    gc.set_threshold(*YOUNG_THRESHOLD)
    _serving = True


def settle() -> None:
    if _serving:
        gc.collect()
        gc.freeze()
