"""The serving process's cyclic garbage collector: full passes kept off the request path.

``serve_quietly()`` (``meshtune serve``) collects, freezes what is alive and runs the young generation
less often; ``settle()`` collects and freezes again after a large long-lived cache entry is built
(a no-op outside ``meshtune serve``). Why (full passes stalled every request for 45-170 ms) and why
nothing leaks: docs/api.md#garbage-collection-while-serving.
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
