"""Riding out a store outage (a PostgreSQL restart or failover, a network blip) without abandoning the
trials in flight (mixed into SweepLoop, api/engine/_loop.py).

A database error that may pass (``is_transient``) makes the loop wait for the store (``OUTAGE_S`` at
most, checked every ``PROBE_S``), re-read the sweep's rows and re-enter, its trials still running;
what a broken transaction left half-known is settled from the store. Past ``OUTAGE_S`` the sweep is
released for a resume (api/engine/_runner.py).

What is settled and how: docs/engine.md#store-outages.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
import sqlalchemy.exc

from api.engine._ticket import Ticket
from tuner import Layout

log = logging.getLogger("meshtune.engine")
OUTAGE_S = 600.0  # how long a loop waits for its store to come back before giving the sweep up
PROBE_S = 1.0


def is_transient(exc: BaseException) -> bool:
    """A database error that a later attempt may not meet (connection lost, server restarting,
    SQLite busy): the sweep is released for a later claim instead of failed for good."""
    if isinstance(exc, sqlalchemy.exc.DBAPIError) and exc.connection_invalidated:
        return True
    return isinstance(exc, (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError,
                            sqlalchemy.exc.TimeoutError, sqlalchemy.exc.DisconnectionError))


class Outages:
    """Reads and sets SweepLoop's ``r``, ``sweep_id``, ``stop``, ``rows``, ``in_flight``, ``reruns``,
    ``seen``, ``next_number``, ``last_beat``."""

    r: Any
    sweep_id: int
    stop: Any
    rows: dict[int, Any]
    in_flight: dict[Any, Any]
    reruns: list[Any]
    seen: set[str]
    next_number: int
    last_beat: float
    _load_rows: Callable[[], None]
    _beat: Callable[[], Any]

    def _through_outages(self, body: Callable[[], Any]) -> Any:
        """``body()``, re-entered after each store outage it meets (docs/engine.md#store-outages)."""
        while True:
            try:
                return body()
            except Exception as exc:
                if not is_transient(exc) or not self._store_back(exc):
                    raise
                self._settle()

    def _store_back(self, exc: BaseException) -> bool:
        log.warning("sweep %s: the store did not answer (%s: %s); waiting for it, %d trial(s) in flight go on",
                    self.sweep_id, type(exc).__name__, str(exc).strip().splitlines()[0] if str(exc).strip() else "",
                    len(self.in_flight))
        deadline = time.monotonic() + OUTAGE_S
        t0 = time.monotonic()
        while time.monotonic() < deadline:
            try:
                with self.r.sessions() as s:
                    s.execute(sa.text("SELECT 1"))
                log.warning("sweep %s: the store answers again after %.1f s", self.sweep_id, time.monotonic() - t0)
                return True
            except Exception as again:
                if not is_transient(again):
                    raise
            if self.stop.wait(PROBE_S):
                return False
        return False

    def _settle(self) -> None:
        """After an outage: what the store holds decides (docs/engine.md#store-outages)."""
        self._load_rows()
        rows = list(self.rows.values())
        self.next_number = max((t.number for t in rows), default=-1) + 1  # every number taken is stored, or not taken
        self.seen |= {t.layout_key for t in rows if t.phase == "search"}
        known = {(t.number, t.attempt) for t in [*self.in_flight.values(), *self.reruns]}

        for t in rows:
            if t.status == "running" and (t.number, t.attempt) not in known:
                log.warning("sweep %s: trial %s was stored but its launch not seen (the outage broke its commit's "
                            "answer); it runs now", self.sweep_id, t.number)
                self.reruns.append(Ticket(t.number, t.attempt, Layout(**t.layout), t.phase, None))
        self.last_beat = 0.0
        self._beat()  # LostClaim if another coordinator took the sweep during the outage
