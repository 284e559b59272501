"""What the device-queue tests share: a fixed start time, a hang guard that waits on a condition, and
the most devices a set of trials held at once (from their stored intervals)."""

from __future__ import annotations

import time
from datetime import datetime, timezone

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def wait_for(predicate, timeout: float, what: str) -> None:  # noqa: ANN001 - a hang guard, not a threshold
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def peak_devices(rows, key=lambda t: True) -> int:  # noqa: ANN001
    """The most devices held at once by ``rows`` (their stored [started_at, finished_at) intervals)."""
    rows = [t for t in rows if key(t) and t.started_at and t.finished_at]
    return max((sum(o.world_size for o in rows if o.started_at <= t.started_at < o.finished_at) for t in rows),
               default=0)
