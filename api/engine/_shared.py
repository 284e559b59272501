"""The device ledger of a coordinator over the store's one queue (api/store/_leases.py): every
coordinator on the database that names the same cluster follows one order, so a grant goes to the
sweep that order names whichever coordinator runs it, and no coordinator's owners wait behind
another's.

``cluster_identity`` names the pool (``MESHTUNE_CLUSTER_NAME``, else the backend's cluster id, else
its name); grants use the least capacity the live coordinators report. Each change is one
``store.tend`` transaction; grants made elsewhere are polled every ``POLL_S``, the pool re-read every
``SYNC_S``. ``STATS`` counts the store calls.

The design (the cluster, its capacity, the store calls): docs/engine.md#several-coordinators.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from api import store
from api.engine._share import Claimant, DeviceLedger, Grant, OwnerLimits
from api.store._leases import LEASE_TTL_S, ClusterState, Held, Want, cluster_state, my_leases, tend

log = logging.getLogger("meshtune.engine")
POLL_S = 0.2  # how often a coordinator with a waiting sweep reads its live leases (grants others made)
SYNC_S = 1.0  # how long the pool's state is reused for reads (held_by, head_key)
LEASE_BEAT_S = 5.0  # how often a coordinator beats its member row (well inside store.LEASE_TTL_S)


def cluster_identity(backend: Any, configured: str | None = None) -> str:
    """The pool of ``backend``'s devices (docs/engine.md#several-coordinators)."""
    name = configured
    ident = getattr(backend, "cluster_id", None)
    if not name and callable(ident):
        try:
            name = ident()
        except Exception as exc:  # the backend's name alone: shared with every coordinator using it
            log.warning("backend %s could not name its cluster (%s); sharing by the backend's name",
                        getattr(backend, "name", "?"), exc)
    return f"{backend.name}:{name}" if name else str(backend.name)


@dataclass
class LedgerStats:
    """Store calls of every ledger of this process: kind -> [count, seconds, most seconds]; the
    seconds of each queue decision (``_dispatch`` inside a tend) and of each wait for the pool's lock."""

    calls: dict[str, list[float]] = field(default_factory=dict)
    decide_s: deque = field(default_factory=lambda: deque(maxlen=100_000))
    lock_s: deque = field(default_factory=lambda: deque(maxlen=100_000))
    granted: int = 0
    released: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, seconds: float) -> None:
        with self._lock:
            c = self.calls.setdefault(kind, [0, 0.0, 0.0])
            c[0] += 1
            c[1] += seconds
            c[2] = max(c[2], seconds)

    def to_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"calls": {k: {"count": int(v[0]), "seconds": v[1], "max_s": v[2]} for k, v in self.calls.items()},
                    "decide_s": list(self.decide_s), "lock_s": list(self.lock_s),
                    "granted": self.granted, "released": self.released}


STATS = LedgerStats()


class SharedLedger(DeviceLedger):
    """``DeviceLedger``'s interface over the store's queue of ``pool``, as coordinator ``holder``."""

    def __init__(self, capacity: int, *, sessions: Any, pool: str, holder: str, max_trials: int = 0,
                 limits: Callable[[str | None], OwnerLimits] | None = None, ttl_s: float = LEASE_TTL_S,
                 sync_s: float = SYNC_S, poll_s: float = POLL_S) -> None:
        super().__init__(capacity, max_trials=max_trials, limits=limits)
        self.sessions, self.pool, self.holder = sessions, pool, holder
        self.ttl_s, self.sync_s, self.poll_s = ttl_s, sync_s, poll_s
        self._enqueued: dict[int, Want] = {}  # the requests the store holds as this coordinator's waiters
        self._pending: dict[int, Held] = {}  # sweep -> a lease granted to its request, not taken yet
        self._drop: set[int] = set()  # lease ids to release with the next tend
        self._withdrawn: set[int] = set()  # sweeps whose waiter rows the next tend deletes
        self._state = ClusterState(capacity=self.capacity)
        self._state_at = self._poll_at = self._beat_at = -math.inf
        self._told: tuple[int, int] | None = None  # (seen, cluster's) last logged as a disagreement
        self._failing = False  # the last tend failed (the store is away)
        self._member = False  # has joined the pool (its member row exists unless found dead since)

    # --- the store ---------------------------------------------------------------------------------

    def _request(self, claimant: Claimant, n: int) -> Want | None:
        """What the store should hold for this waiter, or None when this coordinator holds it back
        (its owner's device-hours are spent; it runs MESHTUNE_MAX_CONCURRENT_TRIALS already)."""
        lim = self.limits(claimant.owner)
        if lim.spent or (self.max_trials and len(self._grants) + len(self._pending) >= self.max_trials):
            return None
        return Want(claimant.sweep_id, claimant.owner, claimant.priority, n, lim.max_devices)

    def _tend(self, *, force: bool = False) -> bool:
        """Send what changed (requests, withdrawals, releases) in one transaction, and beat when due.
        False: the store did not answer (everything is kept for the next call)."""
        want = []
        for sid, (claimant, n, _) in self._waiting.items():
            if sid in self._pending:
                continue
            w = self._request(claimant, n)
            if w is None:
                if sid in self._enqueued:
                    self._withdrawn.add(sid)
            elif self._enqueued.get(sid) != w:
                want.append(w)
        busy = self._grants or self._waiting or self._pending
        due = busy and time.monotonic() - self._beat_at >= LEASE_BEAT_S
        if not (want or self._withdrawn or self._drop or due or force):
            return True
        withdrawn, drop = set(self._withdrawn), set(self._drop)
        keep = {g.lease_id for g in self._grants if g.lease_id is not None}
        keep |= {h.lease_id for sid, h in self._pending.items() if sid not in withdrawn}
        kind = "+".join(k for k, v in (("request", want), ("withdraw", withdrawn), ("release", drop)) if v) or "beat"
        t0 = time.perf_counter()
        try:
            with store.session_scope(self.sessions) as s:
                state = tend(s, pool=self.pool, holder=self.holder, capacity=self.seen, want=want,
                             withdraw=withdrawn, release=drop, keep=keep, ttl_s=self.ttl_s)
        except Exception as exc:  # the store is away: requests wait, releases are retried
            STATS.add("failed", time.perf_counter() - t0)
            if not self._failing:  # once per outage, not on every loop's pass
                log.warning("cluster %s: the device queue did not answer (%s); requests wait, releases are "
                            "retried", self.pool, str(exc).strip().splitlines()[0] if str(exc).strip() else exc)
            self._failing = True
            return False
        if self._failing:
            log.warning("cluster %s: the device queue answers again", self.pool)
            self._failing = False
        STATS.add(kind, time.perf_counter() - t0)
        STATS.decide_s.append(state.timings.get("decide", 0.0))
        STATS.lock_s.append(state.timings.get("lock", 0.0))
        STATS.released += len(drop)
        self._beat_at = time.monotonic()
        self._withdrawn -= withdrawn
        self._drop -= drop
        if not state.joined and self._member:  # another found this one dead: its leases and waiters went
            self._enqueued.clear()
            if self._grants:
                log.warning("cluster %s: %d device leases of %s were released while held (not beaten for %.0f s): "
                            "other coordinators may use those devices", self.pool, len(self._grants), self.holder,
                            self.ttl_s)
        self._member = True
        for sid in withdrawn:
            self._enqueued.pop(sid, None)
        self._enqueued.update({w.sweep_id: w for w in want})
        if state.gone:
            log.warning("cluster %s: coordinator(s) %s found gone; their devices are free again", self.pool,
                        ", ".join(state.gone))
        self._absorb(state)
        return True

    def _absorb(self, state: ClusterState) -> None:
        """Take in the pool as the store saw it: the cluster's capacity, this coordinator's grants."""
        self._state, self._state_at = state, time.monotonic()
        if state.capacity:
            self.capacity = state.capacity
            self.peak = max(self.peak, self.capacity)
            if state.capacity < self.seen and self._told != (self.seen, state.capacity):
                self._told = (self.seen, state.capacity)
                log.warning("cluster %s: this coordinator sees %d devices, another live one fewer; grants use %d "
                            "(the least any live coordinator sees: %s)", self.pool, self.seen, state.capacity,
                            ", ".join(f"{h} {c}" for h, c in sorted(state.members.items())))
        self._see_mine(state.mine(self.holder))

    def _see_mine(self, leases: list[Held]) -> None:
        """This coordinator's live leases: a new one is its waiting sweep's grant (or, if that sweep no
        longer waits, released with the next tend)."""
        self._poll_at = time.monotonic()
        live = {h.lease_id for h in leases}
        for sid in [sid for sid, h in self._pending.items() if h.lease_id not in live]:
            del self._pending[sid]  # released meanwhile (found dead by another coordinator)
        known = {g.lease_id for g in self._grants} | {h.lease_id for h in self._pending.values()} | self._drop
        for h in leases:
            if h.lease_id in known:
                continue
            self._enqueued.pop(h.sweep_id, None)  # the grant took its waiter row
            if h.sweep_id in self._waiting and h.sweep_id not in self._pending:
                self._pending[h.sweep_id] = h
                STATS.granted += 1
                self._cond.notify_all()
            else:
                self._drop.add(h.lease_id)

    def _poll(self) -> None:
        """Read this coordinator's live leases (at most every ``poll_s``, and only while the store holds
        one of its requests)."""
        if not self._enqueued or time.monotonic() - self._poll_at < self.poll_s:
            return
        t0 = time.perf_counter()
        try:
            with self.sessions() as s:
                leases = my_leases(s, pool=self.pool, holder=self.holder)
        except Exception as exc:
            if not self._failing:
                log.warning("cluster %s: could not read this coordinator's device leases (%s)", self.pool, exc)
            self._failing = True
            self._poll_at = time.monotonic()
            return
        STATS.add("poll", time.perf_counter() - t0)
        self._see_mine(leases)

    def _view(self) -> ClusterState:
        if time.monotonic() - self._state_at >= self.sync_s:
            t0 = time.perf_counter()
            try:
                with self.sessions() as s:
                    state = cluster_state(s, pool=self.pool, ttl_s=self.ttl_s)
                STATS.add("view", time.perf_counter() - t0)
                self._absorb(state)
            except Exception as exc:  # keep the last figures
                if not self._failing:
                    log.warning("cluster %s: could not read the device queue (%s)", self.pool, exc)
                self._failing = True
                self._state_at = time.monotonic()
        return self._state

    def flush(self) -> None:
        """Send what is owed to the store (a release that failed, the beat); the runner calls it while
        idle, so a release is not left to the TTL when no loop asks for devices any more."""
        with self._cond:
            self._tend()

    # --- DeviceLedger's interface -------------------------------------------------------------------

    def set_capacity(self, capacity: int) -> None:
        with self._cond:
            changed = max(1, int(capacity)) != self.seen
            self.seen = max(1, int(capacity))
            self.read_at = time.monotonic()
            # The cluster's figure changes with it (the least any live coordinator sees).
            if changed and not self._tend(force=True):
                self.capacity = min(self.capacity, self.seen)
            self._cond.notify_all()

    def in_use(self, owner: str | None = None, *, any_owner: bool = True) -> int:
        with self._cond:
            state = self._view()
            return state.held if any_owner else state.by_owner().get(owner, 0)

    def free(self) -> int:
        with self._cond:
            held = self._view().held  # first: the read may change the cluster's capacity too
            return self.capacity - held

    def used_by(self, owner: str | None) -> float:
        with self._cond:
            return self._view().usage.get(owner, 0.0)

    def waiting(self) -> list[int]:
        """Sweep ids waiting for devices on this cluster, every coordinator's, in the order they will be served."""
        with self._cond:
            return [w.sweep_id for w in self._view().order]

    def head_key(self) -> tuple | None:
        with self._cond:
            state = self._view()
            by_owner = state.by_owner()
            for w in state.order:
                if (w.owner_max is None or by_owner.get(w.owner, 0) + w.devices <= w.owner_max) \
                        and w.devices <= state.capacity:
                    return store.queue_key(owner_devices=by_owner.get(w.owner, 0), priority=w.priority,
                                           owner_usage=state.usage.get(w.owner, 0.0), since=store.as_utc(w.since),
                                           sweep_id=w.sweep_id)
            return None

    def _take(self, claimant: Claimant) -> Grant | None:
        held = self._pending.pop(claimant.sweep_id, None)
        if held is None:
            return None
        self._waiting.pop(claimant.sweep_id, None)
        return self._grant(claimant, held.devices, held.lease_id)

    def try_acquire(self, claimant: Claimant, n: int) -> Grant | None:
        with self._cond:
            if n > self.capacity:  # can never fit: let the backend refuse it with its numbers
                self.withdraw(claimant.sweep_id)
                return self._grant(claimant, 0, None)
            self._want(claimant, n)
            got = self._take(claimant)
            if got is None:
                self._tend()  # a new request is stored (and may be granted at once)
                self._poll()
                got = self._take(claimant)
            return got

    def withdraw(self, sweep_id: int) -> None:
        with self._cond:
            asked = self._waiting.pop(sweep_id, None) is not None
            held = self._pending.pop(sweep_id, None)
            if held is not None:
                self._drop.add(held.lease_id)
            if sweep_id in self._enqueued:
                self._withdrawn.add(sweep_id)
            self._tend()  # also the beat, from every loop's pass
            if asked:
                self._cond.notify_all()

    def _gave_back(self, grant: Grant) -> None:
        if grant.lease_id is not None:  # released with the dispatch it frees devices for
            self._drop.add(grant.lease_id)
            self._tend()

    def wait_change(self, timeout: float) -> None:
        """Block until one of this coordinator's waiters is granted (read every ``poll_s``), a grant is
        released or a waiter leaves here, or ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                self._tend()
                self._poll()
                left = deadline - time.monotonic()
                if left <= 0 or any(sid in self._pending for sid in self._waiting):
                    return
                if self._cond.wait(min(left, self.poll_s)):
                    return
