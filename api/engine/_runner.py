"""``SweepRunner``: the coordinator's background loop over stored sweeps, and ``run_sweep`` for the CLI.
The loop of one sweep is api/engine/_loop.py."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import sqlalchemy.exc

import tuner
from api import store
from api.engine._loop import KeepAlive, LostClaim, SweepLoop
from api.settings import Settings
from api.spec import SweepSpec

log = logging.getLogger("meshtune.engine")
MAX_BACKOFF_S = 60.0


def is_transient(exc: BaseException) -> bool:
    """A database error that a later attempt may not meet (connection lost, server restarting,
    SQLite busy): the sweep is released for a later claim instead of failed for good."""
    if isinstance(exc, sqlalchemy.exc.DBAPIError) and exc.connection_invalidated:
        return True
    return isinstance(exc, (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError,
                            sqlalchemy.exc.TimeoutError, sqlalchemy.exc.DisconnectionError))


def _default_backend(spec: SweepSpec, settings: Settings) -> Any:
    from workers.backends import get_backend

    name = spec.backend or settings.backend
    kwargs: dict[str, Any] = {}
    if name == "simulate":
        kwargs = {"seed": spec.search.seed}
    elif name == "ray":
        # A local Ray (no RAY_ADDRESS) gets a logical CPU per rank even on a 2-core machine.
        kwargs = {"address": settings.ray_address, "num_cpus": spec.to_problem()[1].devices}
    return get_backend(name, **kwargs)


class SweepRunner:
    """Runs sweeps stored in the database. ``run_pending`` is the coordinator's background loop;
    ``run_sweep`` runs one sweep to its end (the CLI calls it synchronously)."""

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        sessions: Any = None,
        backend_factory: Callable[[SweepSpec], Any] | None = None,
        stale_after_s: float = 60.0,
        poll_s: float = 1.0,
    ) -> None:
        self.settings = settings or Settings()
        if sessions is None:
            _, sessions = store.open_store(self.settings.resolved_database_url)
        self.sessions = sessions
        self.backend_factory = backend_factory or (lambda spec: _default_backend(spec, self.settings))
        self.stale_after_s = stale_after_s
        self.poll_s = poll_s
        self.runner_id = store.new_runner_id()

    # --- the coordinator's loop -------------------------------------------------------------------

    def run_pending(self, stop_event: threading.Event) -> None:
        """Run queued sweeps and resume unfinished ones (oldest first) until ``stop_event`` is set.
        No error ends this loop: one (e.g. the database unreachable) is logged and retried after an
        exponential back-off (poll_s doubling up to MAX_BACKOFF_S)."""
        failures = 0
        while not stop_event.is_set():
            try:
                with store.session_scope(self.sessions) as s:
                    sweep = store.claim_sweep(s, runner_id=self.runner_id, stale_after_s=self.stale_after_s)
                if sweep is None:
                    failures = 0
                    stop_event.wait(self.poll_s)
                    continue
                self._run_claimed(sweep.id, stop_event, None)
                failures = 0
            except Exception:
                failures += 1
                delay = min(MAX_BACKOFF_S, self.poll_s * 2 ** min(failures, 16))
                log.exception("sweep engine: error in the coordinator loop; retrying in %.1f s", delay)
                stop_event.wait(delay)

    def run_sweep(
        self,
        sweep_id: int,
        *,
        stop_event: threading.Event | None = None,
        on_progress: Callable[[dict[str, Any]], None] | None = None,
    ) -> store.Sweep:
        """Claim and run one sweep until it ends (or ``stop_event``); returns the final row."""
        with store.session_scope(self.sessions) as s:
            sweep = store.get_sweep(s, sweep_id=sweep_id)
            if sweep is None:
                raise tuner.NotFoundError(f"sweep {sweep_id} does not exist")
            if sweep.status not in store.FINISHED_SWEEP_STATUSES:
                claimed = store.claim_sweep(s, runner_id=self.runner_id, stale_after_s=self.stale_after_s,
                                            sweep_id=sweep_id)
                if claimed is None:
                    raise tuner.ConflictError(f"sweep {sweep_id} is being run by another coordinator ({sweep.runner_id})")
        if sweep.status not in store.FINISHED_SWEEP_STATUSES:
            try:
                self._run_claimed(sweep_id, stop_event or threading.Event(), on_progress)
            finally:  # stopped or interrupted before the end: let a resume take it over at once
                with store.session_scope(self.sessions) as s:
                    store.release_sweep(s, sweep_id=sweep_id, runner_id=self.runner_id)
        with self.sessions() as s:
            return store.get_sweep(s, sweep_id=sweep_id)

    def _run_claimed(self, sweep_id: int, stop: threading.Event, on_progress: Any) -> None:
        try:
            with KeepAlive(self, sweep_id):  # building the problem can take a while on big spaces
                loop = SweepLoop(self, sweep_id, stop, on_progress)
            loop.run()
        except LostClaim as exc:  # another coordinator runs it now: leave the sweep and its rows alone
            log.warning("sweep %s: %s; this coordinator stops running it", sweep_id, exc)
        except Exception as exc:
            if is_transient(exc):  # not the sweep's fault: let this or another coordinator resume it
                log.warning("sweep %s: database error (%s: %s); releasing it for a later resume",
                            sweep_id, type(exc).__name__, exc)
                self._release_quietly(sweep_id)
                return
            # The sweep fails with its cause; the coordinator lives on. A user error (bad spec or
            # backend) is one line in the log, a bug keeps its traceback.
            if isinstance(exc, tuner.MeshtuneError):
                log.error("sweep %s failed: %s", sweep_id, exc)
            else:
                log.exception("sweep %s failed", sweep_id)
            self._fail(sweep_id, f"{type(exc).__name__}: {exc}")

    def _release_quietly(self, sweep_id: int) -> None:
        try:
            with store.session_scope(self.sessions) as s:
                store.release_sweep(s, sweep_id=sweep_id, runner_id=self.runner_id)
        except Exception as exc:  # still unreachable: the claim goes stale and is taken over then
            log.warning("sweep %s: could not release it (%s); it is resumed once its heartbeat is stale",
                        sweep_id, exc)

    def _fail(self, sweep_id: int, reason: str) -> None:
        """Mark the sweep failed, only while this runner owns it; then (and only then) its running
        trials are marked interrupted with the cause. A stale runner changes nothing."""
        with store.session_scope(self.sessions) as s:
            failed = store.set_sweep_status(s, sweep_id=sweep_id, status="failed", error=reason,
                                            only_from=("running",), runner_id=self.runner_id)
            sweep = store.get_sweep(s, sweep_id=sweep_id)
            ours = sweep is not None and sweep.runner_id == self.runner_id
            if failed or (ours and sweep.status in store.FINISHED_SWEEP_STATUSES):
                # Nothing will finish its running trials now: say so on them (and in /metrics).
                store.mark_interrupted(s, sweep_id=sweep_id, cause=f"sweep failed: {reason}"[:2000])
                store.refresh_sweep_cache(s, sweep_id=sweep_id)


