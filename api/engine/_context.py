"""What the collaborators of one sweep's loop share (api/engine/_loop.py composes them): the sweep's
id and spec, the store's sessions and this coordinator's runner id, the sweep's model, the stop flag,
and the sweep's live trial rows with the device-seconds they held and the layouts already proposed.
The loop is the only writer of the rows while it runs (one thread: api/engine/_loop.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from api import store

if TYPE_CHECKING:
    from api.engine._model import SweepModel
    from api.spec import SweepSpec


@dataclass
class LoopContext:
    sweep_id: int
    spec: SweepSpec
    sessions: Any  # the store's session factory
    runner_id: str  # this coordinator, as the sweep's claim names it
    problem: SweepModel  # the sweep's model (api/engine/_model.py)
    stop: threading.Event  # set: the coordinator is stopping, the loop ends soon
    rows: dict[int, store.Trial] = field(default_factory=dict)  # live rows (not "interrupted") by number
    spent: float = 0.0  # device-seconds held by every recorded trial (interrupted ones too)
    seen: set[str] = field(default_factory=set)  # layout keys proposed to the search (pruned ones too)

    @property
    def search(self) -> Any:
        return self.spec.search

    def load_rows(self) -> None:
        """Read the sweep's rows and the device-seconds they spent from the store."""
        with self.sessions() as s:
            trials = store.all_trials(s, sweep_id=self.sweep_id)
            self.rows = {t.number: t for t in trials if t.status != "interrupted"}
            self.spent = sum(t.device_seconds or 0.0 for t in trials)

    def trials(self) -> list[store.Trial]:
        return list(self.rows.values())

    def reload(self, s: Any, number: int, attempt: int | None = None) -> store.Trial:
        """Re-read one row in session ``s`` (after the loop wrote it) into the cache."""
        row = store.get_trial_by_number(s, sweep_id=self.sweep_id, number=number, attempt=attempt)
        self.rows[number] = row
        return row
