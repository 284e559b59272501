"""Who runs a sweep: the owner heartbeats at least every ``HEARTBEAT_S`` (also while proposals are
only pruned, and from a helper thread during slow set-up such as starting a local Ray), and every
transaction that adds trial rows first re-asserts that this runner still owns the sweep
(``store.hold_sweep``). A runner that finds the sweep taken over (a heartbeat answered by another
owner, an insert whose number already exists, a result whose row is no longer its own) raises
``LostClaim``: it stops running the sweep at once and writes nothing more to it; the new owner
re-runs what was in flight (``Claim.recover``, the restart rule). The design: docs/engine.md#claims.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from api import store
from api.engine._context import LoopContext

HEARTBEAT_S = 2.0


class LostClaim(Exception):  # noqa: N818 - a control-flow signal, not an error of the sweep
    """Another coordinator owns the sweep now: stop running it, write nothing more to it."""


class KeepAlive:
    """Heartbeats the sweep from a helper thread while the loop's own thread is busy with slow set-up
    (building the problem, recovery, starting the backend: a local Ray takes ~40 s)."""

    def __init__(self, sessions: Any, runner_id: str, sweep_id: int) -> None:
        self.sessions, self.runner_id, self.sweep_id = sessions, runner_id, sweep_id
        self.lost = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"keepalive{sweep_id}", daemon=True)

    def _run(self) -> None:
        while not self._done.wait(HEARTBEAT_S):
            try:
                with store.session_scope(self.sessions) as s:
                    if store.heartbeat(s, sweep_id=self.sweep_id, runner_id=self.runner_id) is None:
                        self.lost = True
                        return
            except Exception:  # a transient DB error: the loop's own next beat decides
                continue

    def __enter__(self) -> KeepAlive:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


class Claim:
    """This runner's hold on one sweep: the restart rule on start, the check before each insert, the
    heartbeat (``status``: the sweep's status as the last beat read it)."""

    def __init__(self, ctx: LoopContext) -> None:
        self.ctx = ctx
        self.status: str | None = None
        self._beat_at: float | None = None  # monotonic time of the last beat (None: never beaten)

    def recover(self) -> list[store.Trial]:
        """The documented restart rule: a trial found "running" belonged to a coordinator that died;
        its row becomes "interrupted" and the trial re-runs under the same number as attempt + 1.
        Returns the rows to re-run; the context's rows are loaded."""
        ctx = self.ctx
        with store.session_scope(ctx.sessions) as s:
            self.hold(s)  # never interrupt the trials of a coordinator that took the sweep over
            store.mark_interrupted(s, sweep_id=ctx.sweep_id)
            rows = store.all_trials(s, sweep_id=ctx.sweep_id)
            live = {t.number for t in rows if t.status != "interrupted"}
            redo: dict[int, store.Trial] = {}
            for t in rows:
                if t.number not in live and (t.number not in redo or t.attempt > redo[t.number].attempt):
                    redo[t.number] = t
            for t in redo.values():
                self.inserted(store.insert_trial(
                    s, sweep_id=ctx.sweep_id, number=t.number, attempt=t.attempt + 1, phase=t.phase,
                    source=t.source, repeat=t.repeat, layout=t.layout, layout_key=t.layout_key,
                    world_size=t.world_size, predicted_memory_bytes=t.predicted_memory_bytes,
                    predicted_step_time_s=t.predicted_step_time_s,
                    predicted_tokens_per_s_per_device=t.predicted_tokens_per_s_per_device,
                    useful_fraction=t.useful_fraction, backend=t.backend,
                ), t.number)
        ctx.load_rows()
        return [t for t in ctx.trials() if t.status == "running"]

    def hold(self, s: Any) -> None:
        """First statement of every transaction that adds trial rows (see the module docstring)."""
        if not store.hold_sweep(s, sweep_id=self.ctx.sweep_id, runner_id=self.ctx.runner_id):
            raise LostClaim(f"sweep {self.ctx.sweep_id} is no longer run by {self.ctx.runner_id}")

    def inserted(self, inserted: bool, number: int) -> None:
        """``store.insert_trial``'s answer: False means another coordinator took the sweep and this number."""
        if not inserted:
            raise LostClaim(f"sweep {self.ctx.sweep_id}: trial number {number} was taken by another coordinator")

    def beat(self, *, now: bool = False) -> str | None:
        """The sweep's status, heartbeating it when the last beat is ``HEARTBEAT_S`` old (or ``now``)."""
        at = time.monotonic()
        if not now and self._beat_at is not None and at - self._beat_at < HEARTBEAT_S:
            return self.status
        self._beat_at = at
        with store.session_scope(self.ctx.sessions) as s:
            self.status = store.heartbeat(s, sweep_id=self.ctx.sweep_id, runner_id=self.ctx.runner_id)
        if self.status is None:
            raise LostClaim(f"sweep {self.ctx.sweep_id} was taken over by another coordinator")
        return self.status
