"""Confirm runs (mixed into SweepLoop): the ranking's top K layouts run again for N measured steps
each, as their own phase ("confirm"), so the winner of short runs is checked against long ones.

A round is asked by ``search.confirm`` in the spec or on a completed sweep (api/confirm/service.py)
and kept on the sweep (``sweeps.confirm``); its plan is a function of the stored rows, so a restart
goes on with the same round. Confirm rows are not short-run measurements: not ranked, not pooled,
not held to the search's budget.

The design: docs/engine.md#confirm-runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from api import store
from api.store._models import utcnow
from tuner import Layout

CONFIRM = "confirm"
STEPS_FACTOR = 10  # a confirm run's default length: 10x the sweep's measured steps


def default_steps(measure_steps: int) -> int:
    return STEPS_FACTOR * measure_steps


def confirm_request(session: Any, *, sweep_id: int, top_k: int, steps: int, source: str,
                    previous: dict[str, Any] | None, requested_by: str | None = None) -> dict[str, Any] | None:
    """The next round's request: the stored ranking's first ``top_k`` layouts (fewer when fewer are
    ranked; None when none is), in ranking order."""
    store.ensure_ranked(session, sweep_id=sweep_id)
    rows = store.ranked_rows(session, sweep_id=sweep_id, metric="tokens_per_s_per_device", limit=top_k)
    if not rows:
        return None
    return {
        "round": (previous or {}).get("round", -1) + 1, "top_k": top_k, "steps": steps, "source": source,
        "keys": [r.layout_key for r in rows], "layouts": [r.layout for r in rows],
        "requested_by": requested_by, "requested_at": utcnow().isoformat(), "reopened": source != "spec",
    }


class Confirm:
    """Reads the loop's ``r``, ``sweep_id``, ``spec`` and ``_rows`` (set by SweepLoop)."""

    r: Any
    sweep_id: int
    spec: Any
    confirm: dict[str, Any] | None
    _rows: Callable[[], list[store.Trial]]

    def _confirm_only(self) -> bool:
        """The sweep was reopened for a confirm round: its search and re-measurements had ended."""
        return bool(self.confirm and self.confirm.get("reopened"))

    def _confirm_begin(self) -> bool:
        """At the end of the re-measurements: whether a confirm round is due. The spec's
        ``search.confirm`` asks one the first time (stored now, so a restart keeps it)."""
        asked = self.spec.search.confirm
        if self.confirm is None and asked is not None:
            steps = asked.steps or default_steps(self.spec.trial.measure_steps)
            with store.session_scope(self.r.sessions) as s:
                self._hold(s)  # type: ignore[attr-defined]  # Claim's
                self.confirm = confirm_request(s, sweep_id=self.sweep_id, top_k=asked.top_k, steps=steps,
                                               source="spec", previous=None)
                if self.confirm is not None:
                    store.set_confirm(s, sweep_id=self.sweep_id, confirm=self.confirm)
        return self._confirm_next() is not None

    def _confirm_next(self) -> Layout | None:
        """The round's next layout to launch (None: every one has started)."""
        if not self.confirm:
            return None
        round_ = self.confirm["round"]
        started = {t.layout_key for t in self._rows() if t.phase == CONFIRM and t.repeat == round_}
        for key, layout in zip(self.confirm["keys"], self.confirm["layouts"], strict=True):
            if key not in started:
                return Layout(**layout)
        return None

    def _measure_steps(self, phase: str) -> int:
        if phase == CONFIRM and self.confirm:
            return int(self.confirm["steps"])
        return self.spec.trial.measure_steps
