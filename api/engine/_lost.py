"""A node lost is the cluster's fault, not the layout's (mixed into SweepLoop).

A trial that crashed because a node died under it (``infra="node_lost"``) is recorded as a result
but not told to the sampler, taught to the memory model nor counted in the budget; its layout is
re-queued once on the nodes that remain (derived from the stored rows, so a restart keeps it). A
trial that no longer fits the nodes left is recorded as ``infra="cluster_shrank"``, counted as a
trial so that the sweep ends.

Why each rule: docs/engine.md#lost-nodes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from api import store
from tuner import BackendError, Layout
from workers import TrialError, TrialResult

NODE_LOST = "node_lost"
CLUSTER_SHRANK = "cluster_shrank"
REQUEUED = "requeued"


def infra_of(row: Any) -> str | None:
    """The row's (or result's) cluster failure: "node_lost", "cluster_shrank" or None."""
    error = getattr(row, "error", None)
    if isinstance(error, dict):
        return error.get("infra")
    return getattr(error, "infra", None)


class LostNodes:
    """Reads the loop's ``proposer``, ``_rows``, ``ledger``, ``backend``; ``_tell`` is Learning's,
    ``_refresh_capacity`` Sharing's."""

    proposer: Any
    any_lost: bool
    ledger: Any
    backend: Any
    _rows: Callable[[], list[store.Trial]]
    _tell: Callable[..., None]
    _refresh_capacity: Callable[..., None]

    def _refused(self, exc: BackendError) -> TrialResult:
        """The backend refused a trial (a ``BackendError``, not unavailable). If the trial fitted the
        cluster once (the ledger shrank since), that is its result; else the spec never fitted the
        cluster and the error ends the sweep (the spec is at fault, not the cluster)."""
        self._refresh_capacity(now=True)
        if not self.ledger.shrank():
            raise exc
        return TrialResult(status="crash", backend=getattr(self.backend, "name", "?"), error=TrialError(
            kind="crash", message=f"refused: it no longer fits the cluster left after a node loss: {exc}"[:500],
            exception_type=type(exc).__name__, infra=CLUSTER_SHRANK))

    def _teach(self, layout: Layout, handle: Any, row: store.Trial) -> None:
        """``_tell`` every outcome but the cluster's failures (docs/engine.md#lost-nodes)."""
        if infra_of(row) is None:
            self._tell(layout, handle, row)
        elif handle is not None:  # an asked Optuna trial must end: FAIL, which its samplers ignore
            self.proposer.tell(layout, handle, values=None, violation=0.0, status=row.status)

    def _note_lost(self, row: store.Trial) -> None:
        """After a result: a node lost under it makes the live cluster smaller, at once for the claims."""
        if infra_of(row) == NODE_LOST:
            self.any_lost = True
            self._refresh_capacity(now=True)

    def _requeue_next(self) -> store.Trial | None:
        """The lost row whose layout runs once more next, or None."""
        last: dict[tuple[str, str, int], store.Trial] = {}
        lost: dict[tuple[str, str, int], int] = {}
        for t in sorted(self._rows(), key=lambda t: t.number):
            key = (t.layout_key, t.phase, t.repeat)
            last[key] = t
            if infra_of(t) == NODE_LOST:
                lost[key] = lost.get(key, 0) + 1
        for key, times in lost.items():
            if times == 1 and infra_of(last[key]) == NODE_LOST:
                return last[key]
        return None
