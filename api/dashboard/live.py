"""A running sweep's trial rows, kept formatted between the dashboard's reads and refreshed with
what changed since (``data.sweep_state``), instead of reading and formatting every row each
``LIVE_TTL_S``.

A row whose status is final (``FINAL``) never changes again, so a refresh reads only the rows above
the highest id read, the rows not final when read, and ids missing from the sweep's row count.
``Kept`` is a running sweep's whole kept state (rows, ranking, last state), returned again with the
same version while none of its inputs changed.

Why this is complete (every statement that writes trials): docs/api.md#live-trial-rows.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from operator import itemgetter
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from api.dashboard.state import assemble
from api.ranking import service as rankings
from api.store import TERMINAL_TRIAL_STATUSES, Trial

# "interrupted" is final too: mark_interrupted's UPDATE is the last that touches the row (its re-run
# is a new row).
FINAL = frozenset((*TERMINAL_TRIAL_STATUSES, "interrupted"))
_CHUNK = 500  # ids per IN (...) (SQLite's bound-parameter limit is 999 in older builds)
_ORDER = itemgetter("number", "attempt")  # list_trials' order


class TrialRows:
    """One sweep's trials as ``fmt(row)`` dicts in (number, attempt) order (``rows``); ``refresh``
    reads what may have changed. ``fmt`` is called with a Core row of the trials table (the ORM
    instance's attribute names) and must be a pure function of it."""

    def __init__(self, sweep_id: int, fmt: Callable[[Any], dict[str, Any]]) -> None:
        self.sweep_id = sweep_id
        self._fmt = fmt
        self.reads = 0  # rows read from the database, all refreshes (what the tests count)
        self._reset()

    def _reset(self) -> None:
        self._by_id: dict[int, dict[str, Any]] = {}
        self._open: set[int] = set()  # ids read while not final: read again on each refresh
        self._max_id = 0
        self.rows: list[dict[str, Any]] = []

    def refresh(self, session: Session) -> bool:
        """Read the new rows and the rows that may have changed; True when any formatted row changed."""
        table = Trial.__table__
        mine = table.c.sweep_id == self.sweep_id
        fetched = list(session.execute(sa.select(table).where(mine, table.c.id > self._max_id)).all())
        open_ids = sorted(self._open)
        for i in range(0, len(open_ids), _CHUNK):
            fetched += session.execute(sa.select(table).where(table.c.id.in_(open_ids[i:i + _CHUNK]))).all()
        # Counted after the reads: a row inserted meanwhile makes the count larger, never smaller.
        total = session.scalar(sa.select(sa.func.count()).select_from(table).where(mine)) or 0
        known = self._by_id.keys() | {r.id for r in fetched}
        if total > len(known):  # rows committed after one with a higher id was read
            missing = [i for i in session.scalars(sa.select(table.c.id).where(mine)) if i not in known]
            for i in range(0, len(missing), _CHUNK):
                fetched += session.execute(sa.select(table).where(table.c.id.in_(missing[i:i + _CHUNK]))).all()
        elif total < len(known):  # rows gone: only with their sweep, which the caller keys on; start over
            self._reset()
            self.refresh(session)
            return True
        self.reads += len(fetched)
        changed = False
        for r in fetched:
            row = self._fmt(r)
            if self._by_id.get(r.id) != row:
                self._by_id[r.id] = row
                changed = True
            if r.status in FINAL:
                self._open.discard(r.id)
            else:
                self._open.add(r.id)
            self._max_id = max(self._max_id, r.id)
        if changed:
            self.rows = sorted(self._by_id.values(), key=_ORDER)
        return changed


class Kept:
    """A running sweep's kept state. ``ident``: what its rows were formatted under — the sweep (its
    id may be taken again once it is deleted) and its calibration (a refit is rare: it starts over).
    ``prob``: data.problem's (the spec never changes after creation); ``fmt``: data.trial_row's."""

    def __init__(self, sweep: Any, prob: dict[str, Any], fmt: Callable[[Any], dict[str, Any]]) -> None:
        self.ident = ident(sweep)
        self.prob = prob
        self.rows = TrialRows(sweep.id, fmt)
        self.lock = threading.Lock()  # one refresh at a time; who waited gets its result
        self.read_at = -math.inf
        self.tag: str | None = None
        self.ranking: Any = None
        self.parts: dict[str, Any] = {}  # state.assemble's, of the last state
        self.inputs: tuple[Any, ...] | None = None
        self.state: dict[str, Any] | None = None

    def refresh(self, session: Session, sweep: Any, header: dict[str, Any]) -> dict[str, Any]:
        """The state now (``header``: data.sweep_header's of ``sweep``, read now): the rows that may
        have changed are read, the ranking if its tag moved, and the state is assembled again only
        when an input changed."""
        changed = self.rows.refresh(session)
        tag = rankings.ranking_tag(session, sweep_id=sweep.id)  # before the ranking: never newer than it
        if tag != self.tag:
            self.ranking, self.tag, changed = rankings.ranking(session, sweep_id=sweep.id), tag, True
        inputs = (header, sweep.status, sweep.device_seconds)
        if changed or self.state is None or inputs != self.inputs:
            self.state = assemble(sweep, self.prob, self.rows.rows, self.ranking, header=dict(header),
                                  kept=self.parts)
            self.inputs = inputs
        return self.state


def ident(sweep: Any) -> tuple[Any, ...]:
    return sweep.id, sweep.created_at, json.dumps(sweep.calibration, sort_keys=True, default=str)


KEEP = 8  # running sweeps whose state is kept (~3 kB a trial)...
IDLE_S = 600.0  # ...while a page reads it
_kept: OrderedDict[int, Kept] = OrderedDict()
_lock = threading.Lock()


def kept(sweep: Any, new: Callable[[], Kept]) -> Kept:
    """The sweep's kept state, ``new()`` when there is none for it (or one of an earlier sweep of
    that id, or calibration); drops the least recently read beyond KEEP and those idle IDLE_S."""
    with _lock:
        entry = _kept.get(sweep.id)
        if entry is None or entry.ident != ident(sweep):
            entry = _kept[sweep.id] = new()
        _kept.move_to_end(sweep.id)
        idle = time.monotonic() - IDLE_S
        while (oldest := next(iter(_kept.values()))) is not entry and (len(_kept) > KEEP or oldest.read_at < idle):
            _kept.popitem(last=False)
        return entry


def take(sweep: Any) -> Kept | None:
    """Remove and return the sweep's kept state (it has just finished), if it is of this sweep."""
    with _lock:
        entry = _kept.pop(sweep.id, None)
    return entry if entry is not None and entry.ident == ident(sweep) else None
