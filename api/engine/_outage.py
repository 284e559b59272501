"""Riding out a store outage (a PostgreSQL restart or failover, a network blip) without abandoning the
trials in flight (``Outages``, one of the collaborators of api/engine/_loop.py).

A database error that may pass (``is_transient``) makes the loop wait for the store (``OUTAGE_S`` at
most, checked every ``PROBE_S``), re-read the sweep's rows and re-enter, its trials still running;
what a broken transaction left half-known is settled from the store. Past ``OUTAGE_S`` the sweep is
released for a resume (api/engine/_runner.py).

What is settled and how: docs/engine.md#store-outages.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sized
from typing import TypeVar

import sqlalchemy as sa
import sqlalchemy.exc

from api.engine._claim import Claim
from api.engine._context import LoopContext
from api.engine._ticket import Ticket
from tuner import Layout

log = logging.getLogger("meshtune.engine")
OUTAGE_S = 600.0  # how long a loop waits for its store to come back before giving the sweep up
PROBE_S = 1.0
T = TypeVar("T")


def is_transient(exc: BaseException) -> bool:
    """A database error that a later attempt may not meet (connection lost, server restarting,
    SQLite busy): the sweep is released for a later claim instead of failed for good."""
    if isinstance(exc, sqlalchemy.exc.DBAPIError) and exc.connection_invalidated:
        return True
    return isinstance(exc, (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError,
                            sqlalchemy.exc.TimeoutError, sqlalchemy.exc.DisconnectionError))


class Outages:
    """Waits for the context's store (its sessions, its stop flag) and settles the context's rows and
    ``claim`` after it."""

    def __init__(self, ctx: LoopContext, claim: Claim) -> None:
        self.ctx = ctx
        self.claim = claim

    def through(self, body: Callable[[], T], *, settle: Callable[[], None], in_flight: Sized) -> T:
        """``body()``, re-entered after each store outage it meets, once ``settle()`` has read what the
        store holds (``in_flight``: the trials that go on meanwhile; docs/engine.md#store-outages)."""
        while True:
            try:
                return body()
            except Exception as exc:
                if not is_transient(exc) or not self._store_back(exc, in_flight):
                    raise
                settle()

    def _store_back(self, exc: BaseException, in_flight: Sized) -> bool:
        ctx = self.ctx
        log.warning("sweep %s: the store did not answer (%s: %s); waiting for it, %d trial(s) in flight go on",
                    ctx.sweep_id, type(exc).__name__, str(exc).strip().splitlines()[0] if str(exc).strip() else "",
                    len(in_flight))
        deadline = time.monotonic() + OUTAGE_S
        t0 = time.monotonic()
        while time.monotonic() < deadline:
            try:
                with ctx.sessions() as s:
                    s.execute(sa.text("SELECT 1"))
                log.warning("sweep %s: the store answers again after %.1f s", ctx.sweep_id, time.monotonic() - t0)
                return True
            except Exception as again:
                if not is_transient(again):
                    raise
            if ctx.stop.wait(PROBE_S):
                return False
        return False

    def settle(self, known: Collection[Ticket]) -> tuple[int, list[Ticket]]:
        """After an outage: what the store holds decides (docs/engine.md#store-outages). ``known``: the
        trials launched or queued to re-run as far as the loop knows. Returns the next trial number
        and the stored trials to run that the loop did not know of."""
        ctx = self.ctx
        ctx.load_rows()
        rows = ctx.trials()
        next_number = max((t.number for t in rows), default=-1) + 1  # every number taken is stored, or not taken
        ctx.seen |= {t.layout_key for t in rows if t.phase == "search"}
        launched = {(t.number, t.attempt) for t in known}
        found = []
        for t in rows:
            if t.status == "running" and (t.number, t.attempt) not in launched:
                log.warning("sweep %s: trial %s was stored but its launch not seen (the outage broke its commit's "
                            "answer); it runs now", ctx.sweep_id, t.number)
                found.append(Ticket(t.number, t.attempt, Layout(**t.layout), t.phase, None))
        self.claim.beat(now=True)  # LostClaim if another coordinator took the sweep during the outage
        return next_number, found
