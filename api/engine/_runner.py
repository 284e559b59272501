"""``SweepRunner``: the coordinator's background loop over stored sweeps, and ``run_sweep`` for the CLI.
The loop of one sweep is api/engine/_loop.py."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy.exc

import tuner
from api import store
from api.engine._loop import KeepAlive, LostClaim, SweepLoop
from api.settings import Settings
from api.spec import SweepSpec
from workers import BackendUnavailable

log = logging.getLogger("meshtune.engine")
MAX_BACKOFF_S = 60.0
UNAVAILABLE_CAUSE = "backend unavailable: {exc}; re-run as attempt+1 when the sweep resumes"


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
        exponential back-off (poll_s doubling up to MAX_BACKOFF_S). A sweep whose backend is
        unavailable is left unfinished and is not claimed again for the same kind of back-off (its
        own), so the sweeps behind it still run."""
        failures = 0
        cooling: dict[int, tuple[int, float]] = {}  # sweep id -> (times unavailable, not before)
        while not stop_event.is_set():
            sweep_id = None
            try:
                with store.session_scope(self.sessions) as s:
                    sweep = self._claim_next(s, cooling)
                if sweep is None:
                    failures = 0
                    stop_event.wait(self.poll_s)
                    continue
                sweep_id = sweep.id
                self._run_claimed(sweep.id, stop_event, None)
                failures = 0
                cooling.pop(sweep_id, None)
            except BackendUnavailable as exc:  # already logged and released by _run_claimed
                times = cooling.get(sweep_id, (0, 0.0))[0] + 1
                delay = min(MAX_BACKOFF_S, self.poll_s * 2 ** min(times, 16))
                cooling[sweep_id] = (times, time.monotonic() + delay)
                log.warning("sweep %s: not claimed again for %.1f s (%s)", sweep_id, delay, exc)
            except Exception:
                failures += 1
                delay = min(MAX_BACKOFF_S, self.poll_s * 2 ** min(failures, 16))
                log.exception("sweep engine: error in the coordinator loop; retrying in %.1f s", delay)
                stop_event.wait(delay)

    def _claim_next(self, s: Any, cooling: dict[int, tuple[int, float]]) -> store.Sweep | None:
        """The oldest takeable sweep, skipping those whose backend was unavailable a moment ago."""
        now = time.monotonic()
        skip = {sweep_id for sweep_id, (_, until) in cooling.items() if until > now}
        if not skip:
            return store.claim_sweep(s, runner_id=self.runner_id, stale_after_s=self.stale_after_s)
        candidates = [sw for status in ("queued", "running")
                      for sw in store.list_sweeps(s, status=status, limit=10_000)[0] if sw.id not in skip]
        for sw in sorted(candidates, key=lambda sw: (sw.created_at, sw.id)):
            claimed = store.claim_sweep(s, runner_id=self.runner_id, stale_after_s=self.stale_after_s,
                                        sweep_id=sw.id)
            if claimed is not None:
                return claimed
        return None

    def run_sweep(
        self,
        sweep_id: int,
        *,
        stop_event: threading.Event | None = None,
        on_progress: Callable[[dict[str, Any]], None] | None = None,
    ) -> store.Sweep:
        """Claim and run one sweep until it ends (or ``stop_event``); returns the final row. Raises
        ``BackendUnavailable`` when its backend stayed unavailable through every retry: the sweep is
        then left unfinished (released, resumable), never failed."""
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
        except BackendUnavailable as exc:
            # Infrastructure, not the sweep: retried already (SweepLoop._retrying); never fail the
            # sweep for it. Its trials in flight say why they stopped, and it is released for a resume.
            log.warning("sweep %s: backend unavailable (%s); leaving it unfinished for a resume", sweep_id, exc)
            self._interrupt_and_release(sweep_id, UNAVAILABLE_CAUSE.format(exc=exc)[:2000])
            raise BackendUnavailable(
                f"sweep {sweep_id} is left unfinished (resume it with `meshtune sweep --resume {sweep_id}`;"
                f" a coordinator on the same database retries it): {exc}"
            ) from exc
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

    def _interrupt_and_release(self, sweep_id: int, cause: str) -> None:
        """While this runner still owns the sweep: its running rows become "interrupted" with
        ``cause`` (a resume re-runs each as attempt + 1), then the sweep is released."""
        try:
            with store.session_scope(self.sessions) as s:
                if store.hold_sweep(s, sweep_id=sweep_id, runner_id=self.runner_id):
                    store.mark_interrupted(s, sweep_id=sweep_id, cause=cause)
                    store.refresh_sweep_cache(s, sweep_id=sweep_id)
        except Exception as exc:  # the rows stay "running"; a resume interrupts them with the restart cause
            log.warning("sweep %s: could not mark its trials interrupted (%s)", sweep_id, exc)
        self._release_quietly(sweep_id)

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


