"""A node lost is the cluster's fault, not the layout's (issue 15; mixed into SweepLoop).

The Ray backend marks a trial that crashed because a node died under it ``TrialError.infra =
"node_lost"`` (workers/ray_backend.py). Such a trial is a result (``crash``, with the node-lost
cause), but it teaches nothing about its layout: the sampler is not told it (an asked Optuna trial
ends as FAIL, which TPE and GP ignore; never infeasible), the memory model learns nothing from a
crash, and it does not count against ``max_trials`` nor ``patience`` (api/engine/_budget.py).

Its layout is re-queued **once** on the nodes that remain (a new trial number, same phase and
repeat, source ``requeued``) rather than left to the sampler: grid, random and listed sweeps never
come back to a layout, and a sampler that might would spend a proposal rediscovering it. Once, so a
cluster that keeps losing nodes cannot hold a sweep on one layout. The re-queue is derived from the
stored rows (a lost row with no later row of its layout, phase and repeat), so a restart keeps it.

A trial that fitted the cluster once but no longer fits the nodes that remain (the backend refuses
it, e.g. more nodes than are left) is recorded as its result, ``crash`` with the backend's reason and
``infra="cluster_shrank"``: not told to the sampler either, but counted as a trial, so a sweep that
can no longer fit anywhere ends instead of proposing forever.
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
        cluster and the error ends the sweep, as it always did."""
        self._refresh_capacity(now=True)
        if not self.ledger.shrank():
            raise exc
        return TrialResult(status="crash", backend=getattr(self.backend, "name", "?"), error=TrialError(
            kind="crash", message=f"refused: it no longer fits the cluster left after a node loss: {exc}"[:500],
            exception_type=type(exc).__name__, infra=CLUSTER_SHRANK))

    def _teach(self, layout: Layout, handle: Any, row: store.Trial) -> None:
        """``_tell`` every outcome but the cluster's failures (see the module docstring)."""
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
