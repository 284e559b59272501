"""``SweepRunner``: the coordinator's background loop over stored sweeps, and ``run_sweep`` for the CLI.
The loop of one sweep is api/engine/_loop.py."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import tuner
from api import store
from api.engine._claim import KeepAlive, LostClaim
from api.engine._loop import SweepLoop
from api.engine._outage import is_transient
from api.engine._share import OwnerLimits
from api.engine._shared import SharedLedger, cluster_identity
from api.settings import Settings
from api.spec import SweepSpec
from api.store._models import utcnow
from workers import BackendUnavailable

log = logging.getLogger("meshtune.engine")
MAX_BACKOFF_S = 60.0
USAGE_TTL_S = 5.0  # how long an owner's device-hours of the last 24 h are reused before re-reading them
UNAVAILABLE_CAUSE = "backend unavailable: {exc}; re-run as attempt+1 when the sweep resumes"


def _default_backend(spec: SweepSpec, settings: Settings) -> Any:
    from workers.backends import get_backend

    name = spec.backend or settings.backend
    kwargs: dict[str, Any] = {}
    if name == "simulate":
        kwargs = {"seed": spec.search.seed, "devices": settings.simulate_devices, "pace": settings.simulate_pace}
    elif name == "ray":
        # A local Ray (no RAY_ADDRESS) gets a logical CPU per rank even on a 2-core machine.
        kwargs = {"address": settings.ray_address, "num_cpus": spec.to_problem().cluster.devices}
    return get_backend(name, **kwargs)


class SweepRunner:
    """Runs sweeps stored in the database. ``run_pending`` is the coordinator's background loop (up to
    ``max_concurrent_sweeps`` sweeps at once, one thread each, sharing the devices through one
    ``DeviceLedger`` per backend: api/engine/_share.py); ``run_sweep`` runs one sweep to its end (the
    CLI calls it synchronously)."""

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
        self._lock = threading.Lock()
        self._ledgers: dict[str, SharedLedger] = {}  # by cluster (api/engine/_shared.py)
        self._starting: set[int] = set()  # claimed, set-up not done (no devices asked for yet)
        self._live: set[int] = set()  # loops past set-up
        self._to_close: list[Any] = []  # backends of ended loops, closed once no loop runs
        self._usage: dict[str | None, tuple[float, float]] = {}  # owner -> (device-seconds in 24 h, read at)

    # --- sharing the devices between the loops ------------------------------------------------------

    def cluster_of(self, backend: Any) -> str:
        """The cluster ``backend``'s devices belong to (MESHTUNE_CLUSTER_NAME, else the backend's own)."""
        return cluster_identity(backend, self.settings.cluster_name)

    def ledger_for(self, pool: str, capacity: int) -> SharedLedger:
        """The ledger of one cluster's devices (``cluster_of``), shared by every loop of this runner and
        queued with every coordinator's on the database."""
        with self._lock:
            ledger = self._ledgers.get(pool)
            if ledger is None:
                ledger = SharedLedger(capacity, max_trials=self.settings.max_concurrent_trials,
                                      limits=self._owner_limits, sessions=self.sessions, pool=pool,
                                      holder=self.runner_id)
                self._ledgers[pool] = ledger
            else:
                ledger.set_capacity(capacity)  # a cluster that grew or shrank
            return ledger

    def _owner_limits(self, owner: str | None) -> OwnerLimits:
        st = self.settings
        cap = st.owner_limit(st.owner_max_devices, owner)
        hours = st.owner_limit(st.owner_device_hours_per_day, owner)
        spent = False
        if hours is not None:
            used, at = self._usage.get(owner, (0.0, -USAGE_TTL_S))
            if time.monotonic() - at >= USAGE_TTL_S:
                try:
                    with self.sessions() as s:
                        used = store.owner_device_seconds(s, owner=owner, since=utcnow() - timedelta(days=1))
                    self._usage[owner] = (used, time.monotonic())
                except Exception as exc:  # the database is away: keep the last figure
                    log.warning("could not read the device-hours of owner %r (%s)", owner, exc)
            spent = used / 3600 >= hours
        return OwnerLimits(max_devices=cap, spent=spent)

    def loop_started(self, sweep_id: int) -> None:
        with self._lock:
            self._starting.discard(sweep_id)
            self._live.add(sweep_id)

    def loop_ended(self, sweep_id: int, backend: Any) -> None:
        """Backends are closed once no loop of this runner runs: closing one frees the process's idle
        gangs and may shut down a Ray it started, which the other loops still use."""
        with self._lock:
            self._live.discard(sweep_id)
            self._to_close.append(backend)
            closing = [] if self._live or self._starting else self._to_close
            if closing:
                self._to_close = []
        for b in closing:
            try:
                b.close()
            except Exception as exc:
                log.warning("closing backend %s failed (%s)", getattr(b, "name", "?"), exc)

    # --- the coordinator's loop -------------------------------------------------------------------

    def run_pending(self, stop_event: threading.Event) -> None:
        """Run queued sweeps and resume unfinished ones until ``stop_event`` is set: up to
        ``max_concurrent_sweeps`` at once, each on its own thread, claimed in the queue's order
        (sweeps to take over first, then fair share, priority, age: ``store.queue_key``). No error
        ends this loop: one (e.g. the database unreachable) is logged and retried after an
        exponential back-off (poll_s doubling up to MAX_BACKOFF_S). A sweep whose backend is
        unavailable is left unfinished and is not claimed again for the same kind of back-off (its
        own), so the sweeps behind it still run."""
        failures = 0
        cooling: dict[int, tuple[int, float]] = {}  # sweep id -> (times unavailable, not before)
        active: dict[int, threading.Thread] = {}
        outcomes: dict[int, BaseException | None] = {}
        try:
            while not stop_event.is_set():
                self._reap(active, outcomes, cooling)
                for ledger in list(self._ledgers.values()):
                    ledger.flush()  # a release the store missed, the beat of what is held
                try:
                    sweep = None
                    with self._lock:
                        room = len(active) < self.settings.max_concurrent_sweeps and not self._starting
                    if room:
                        with store.session_scope(self.sessions) as s:
                            sweep = self._claim_next(s, cooling, set(active))
                    failures = 0
                    if sweep is None:
                        stop_event.wait(self.poll_s)
                        continue
                    with self._lock:
                        self._starting.add(sweep.id)
                    thread = threading.Thread(target=self._sweep_thread, args=(sweep.id, stop_event, outcomes),
                                              name=f"meshtune-sweep{sweep.id}", daemon=True)
                    active[sweep.id] = thread
                    thread.start()
                except Exception:
                    failures += 1
                    delay = min(MAX_BACKOFF_S, self.poll_s * 2 ** min(failures, 16))
                    log.exception("sweep engine: error in the coordinator loop; retrying in %.1f s", delay)
                    stop_event.wait(delay)
        finally:
            for thread in active.values():
                thread.join()

    def _sweep_thread(self, sweep_id: int, stop: threading.Event, outcomes: dict[int, BaseException | None]) -> None:
        try:
            self._run_claimed(sweep_id, stop, None)
            outcomes[sweep_id] = None
        except BaseException as exc:  # reported by _reap on the coordinator's thread
            outcomes[sweep_id] = exc
        finally:
            with self._lock:
                self._starting.discard(sweep_id)

    def _reap(self, active: dict[int, threading.Thread], outcomes: dict[int, BaseException | None],
              cooling: dict[int, tuple[int, float]]) -> None:
        for sweep_id in [i for i, th in active.items() if not th.is_alive()]:
            del active[sweep_id]
            exc = outcomes.pop(sweep_id, None)
            if isinstance(exc, BackendUnavailable):  # already logged and released by _run_claimed
                times = cooling.get(sweep_id, (0, 0.0))[0] + 1
                delay = min(MAX_BACKOFF_S, self.poll_s * 2 ** min(times, 16))
                cooling[sweep_id] = (times, time.monotonic() + delay)
                log.warning("sweep %s: not claimed again for %.1f s (%s)", sweep_id, delay, exc)
            elif exc is not None:
                log.error("sweep %s: its runner thread ended with %s: %s", sweep_id, type(exc).__name__, exc)
            else:
                cooling.pop(sweep_id, None)

    def _claim_next(self, s: Any, cooling: dict[int, tuple[int, float]], active: set[int] | None = None
                    ) -> store.Sweep | None:
        """The next takeable sweep: unfinished ones to take over (oldest first), then the queue in
        fair-share order (``store.queue_positions``); skipping this runner's own and those whose
        backend was unavailable a moment ago."""
        now = time.monotonic()
        skip = {sweep_id for sweep_id, (_, until) in cooling.items() if until > now} | (active or set())
        running = sorted((sw for sw in store.list_sweeps(s, status="running", limit=10_000)[0] if sw.id not in skip),
                         key=lambda sw: (sw.created_at, sw.id))
        positions = store.queue_positions(s)
        queued = sorted((i for i in positions if i not in skip), key=positions.__getitem__)
        for sweep_id in [sw.id for sw in running] + queued:
            if sweep_id in positions and not self._served_first(store.get_sweep(s, sweep_id=sweep_id)):
                break  # the rest of the queue is behind it too: it stays queued (with its position)
            claimed = store.claim_sweep(s, runner_id=self.runner_id, stale_after_s=self.stale_after_s,
                                        sweep_id=sweep_id)
            if claimed is not None:
                return claimed
        return None

    def _served_first(self, sweep: store.Sweep) -> bool:
        """Whether a queued sweep would get devices before every sweep already waiting in this runner
        (fair share, priority, age): only then is it claimed, so a sweep that would only wait stays
        queued and shows its place in the queue, and one that should go first is not kept out."""
        with self._lock:
            ledgers = list(self._ledgers.values())
        held = sum(ledger.held_by(sweep.owner) for ledger in ledgers)
        used = sum(ledger.used_by(sweep.owner) for ledger in ledgers)
        key = store.queue_key(owner_devices=held, priority=sweep.priority, owner_usage=used, since=sweep.created_at,
                              sweep_id=sweep.id)
        return all(head is None or key < head for head in (ledger.head_key() for ledger in ledgers))

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
            with KeepAlive(self.sessions, self.runner_id, sweep_id):  # building the problem can take a while on big spaces
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
                                            only_from=("running",), runner_id=self.runner_id,
                                            stop_reason=f"failed: {reason}")
            sweep = store.get_sweep(s, sweep_id=sweep_id)
            ours = sweep is not None and sweep.runner_id == self.runner_id
            if failed or (ours and sweep.status in store.FINISHED_SWEEP_STATUSES):
                # Nothing will finish its running trials now: say so on them (and in /metrics).
                store.mark_interrupted(s, sweep_id=sweep_id, cause=f"sweep failed: {reason}"[:2000])
                store.refresh_sweep_cache(s, sweep_id=sweep_id)


