"""Confirm runs (``Confirm``, one of the loop's collaborators): the ranking's top K layouts run again
for N measured steps each, as their own phase ("confirm"), so the winner of short runs is checked
against long ones.

A round is asked by ``search.confirm`` in the spec or on a completed sweep (api/confirm/service.py)
and kept on the sweep (``sweeps.confirm``); its plan is a function of the stored rows, so a restart
goes on with the same round. Confirm rows are not short-run measurements: not ranked, not pooled,
not held to the search's budget.

The design: docs/engine.md#confirm-runs.
"""

from __future__ import annotations

from typing import Any

from api import store
from api.engine._claim import Claim
from api.engine._context import LoopContext
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
    """The sweep's confirm round: ``asked`` is the latest one asked (``sweeps.confirm``), begun through
    ``claim`` (the insert check) when the spec asks one; reads the context's rows and spec."""

    def __init__(self, ctx: LoopContext, claim: Claim, asked: dict[str, Any] | None) -> None:
        self.ctx = ctx
        self.claim = claim
        self.asked = asked

    @property
    def round(self) -> int:
        assert self.asked is not None, "no confirm round was asked"
        return int(self.asked["round"])

    def reopened(self) -> bool:
        """The sweep was reopened for a confirm round: its search and re-measurements had ended."""
        return bool(self.asked and self.asked.get("reopened"))

    def begin(self) -> bool:
        """At the end of the re-measurements: whether a confirm round is due. The spec's
        ``search.confirm`` asks one the first time (stored now, so a restart keeps it)."""
        ctx = self.ctx
        asked = ctx.spec.search.confirm
        if self.asked is None and asked is not None:
            steps = asked.steps or default_steps(ctx.spec.trial.measure_steps)
            with store.session_scope(ctx.sessions) as s:
                self.claim.hold(s)
                self.asked = confirm_request(s, sweep_id=ctx.sweep_id, top_k=asked.top_k, steps=steps,
                                             source="spec", previous=None)
                if self.asked is not None:
                    store.set_confirm(s, sweep_id=ctx.sweep_id, confirm=self.asked)
        return self.next_layout() is not None

    def next_layout(self) -> Layout | None:
        """The round's next layout to launch (None: every one has started)."""
        if not self.asked:
            return None
        round_ = self.asked["round"]
        started = {t.layout_key for t in self.ctx.trials() if t.phase == CONFIRM and t.repeat == round_}
        for key, layout in zip(self.asked["keys"], self.asked["layouts"], strict=True):
            if key not in started:
                return Layout(**layout)
        return None

    def measure_steps(self, phase: str) -> int:
        if phase == CONFIRM and self.asked:
            return int(self.asked["steps"])
        return self.ctx.spec.trial.measure_steps
