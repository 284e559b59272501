"""A node lost is the cluster's fault, not the layout's (``LostNodes``, one of the loop's collaborators).

A trial that crashed because a node died under it (``infra="node_lost"``) is recorded as a result
but not told to the sampler, taught to the memory model nor counted in the budget; its layout is
re-queued once on the nodes that remain (derived from the stored rows, so a restart keeps it). A
trial that no longer fits the nodes left is recorded as ``infra="cluster_shrank"``, counted as a
trial so that the sweep ends.

Why each rule: docs/engine.md#lost-nodes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from api import store
from tuner import BackendError
from workers import TrialError, TrialResult

if TYPE_CHECKING:
    from api.engine._context import LoopContext
    from api.engine._share import Sharing

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
    """Reads the context's rows; re-reads the live capacity through ``sharing`` (its ledger's)."""

    def __init__(self, ctx: LoopContext, sharing: Sharing, *, backend_name: str) -> None:
        self.ctx = ctx
        self.sharing = sharing
        self.backend_name = backend_name
        # A row lost with its node exists: only then is ``requeue_next`` asked.
        self.any_lost = any(t.status in store.TERMINAL_TRIAL_STATUSES and infra_of(t) == NODE_LOST
                            for t in ctx.trials())

    def refused(self, exc: BackendError) -> TrialResult:
        """The backend refused a trial (a ``BackendError``, not unavailable). If the trial fitted the
        cluster once (the ledger shrank since), that is its result; else the spec never fitted the
        cluster and the error ends the sweep (the spec is at fault, not the cluster)."""
        self.sharing.refresh_capacity(now=True)
        if not self.sharing.ledger.shrank():
            raise exc
        return TrialResult(status="crash", backend=self.backend_name, error=TrialError(
            kind="crash", message=f"refused: it no longer fits the cluster left after a node loss: {exc}"[:500],
            exception_type=type(exc).__name__, infra=CLUSTER_SHRANK))

    def note_lost(self, row: store.Trial) -> None:
        """After a result: a node lost under it makes the live cluster smaller, at once for the claims."""
        if infra_of(row) == NODE_LOST:
            self.any_lost = True
            self.sharing.refresh_capacity(now=True)

    def requeue_next(self) -> store.Trial | None:
        """The lost row whose layout runs once more next, or None."""
        if not self.any_lost:
            return None
        last: dict[tuple[str, str, int], store.Trial] = {}
        lost: dict[tuple[str, str, int], int] = {}
        for t in sorted(self.ctx.trials(), key=lambda t: t.number):
            key = (t.layout_key, t.phase, t.repeat)
            last[key] = t
            if infra_of(t) == NODE_LOST:
                lost[key] = lost.get(key, 0) + 1
        for key, times in lost.items():
            if times == 1 and infra_of(last[key]) == NODE_LOST:
                return last[key]
        return None
