"""Sharing one cluster between the sweeps a coordinator runs at once, and between coordinators
(api/engine/_shared.py).

Every trial takes its devices (its world size) from one ledger per cluster before its row is written
and gives them back after its result is recorded. The next free devices go to the waiting sweep whose
owner holds the fewest (fair share), then the higher priority, then the longest wait (a strict order;
per-owner limits make a sweep wait, never fail). The ledger re-reads the live capacity from the
backend. ``DeviceLedger`` keeps the queue in this process; ``SharedLedger`` is the same interface
over the store's queue.

The design (the order, the live capacity, a shrunk cluster): docs/engine.md#sharing-the-cluster.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from api import store
from api.engine._context import LoopContext
from api.store._models import utcnow

if TYPE_CHECKING:
    from api.engine._ticket import Ticket

log = logging.getLogger("meshtune.engine")
CAPACITY_TTL_S = 2.0  # how long a backend's capacity is reused before a claim re-reads it


@dataclass(frozen=True)
class Claimant:
    """A sweep asking for devices, with what orders it in the queue."""

    sweep_id: int
    owner: str | None
    priority: str
    created_at: datetime

    def __post_init__(self) -> None:
        if self.priority not in store.SWEEP_PRIORITIES:
            raise ValueError(f"priority={self.priority!r} is not one of {', '.join(store.SWEEP_PRIORITIES)}")


@dataclass
class Grant:
    claimant: Claimant
    devices: int  # counted against the ledger (0 for a trial larger than the ledger)
    since: float = field(default_factory=time.monotonic)
    released: bool = False
    lease_id: int | None = None  # its row in the store's device_leases (None: in-process, or 0 devices)


@dataclass(frozen=True)
class OwnerLimits:
    max_devices: float | None = None  # devices its trials may hold at once
    spent: bool = False  # its device-hours of the last 24 h are used up


class DeviceLedger:
    """The queue of one process's sweeps over ``capacity`` devices (no store)."""

    poll_s = 0.5  # how soon a loop with trials in flight asks again while it waits for devices

    def __init__(self, capacity: int, *, max_trials: int = 0,
                 limits: Callable[[str | None], OwnerLimits] | None = None) -> None:
        self.capacity = max(1, int(capacity))  # what grants are checked against
        self.seen = self.capacity  # what this process's backend reports (the same here)
        self.peak = self.capacity  # the most it has had: below it, the cluster lost devices
        self.read_at = time.monotonic()
        self.max_trials = max_trials
        self.limits = limits or (lambda owner: OwnerLimits())
        self._grants: list[Grant] = []
        self._waiting: dict[int, tuple[Claimant, int, datetime]] = {}  # sweep -> (who, devices, since)
        self._cond = threading.Condition()

    def set_capacity(self, capacity: int) -> None:
        """The backend's devices now (a cluster that grew or lost a node)."""
        with self._cond:
            self.capacity = self.seen = max(1, int(capacity))
            self.peak = max(self.peak, self.capacity)
            self.read_at = time.monotonic()
            self._cond.notify_all()

    def shrank(self) -> bool:
        """Whether the cluster has fewer devices now than it once had (a node was lost)."""
        return self.capacity < self.peak

    # --- reads -----------------------------------------------------------------------------------

    def in_use(self, owner: str | None = None, *, any_owner: bool = True) -> int:
        with self._cond:
            return sum(g.devices for g in self._grants if any_owner or g.claimant.owner == owner)

    def held_by(self, owner: str | None) -> int:
        return self.in_use(owner, any_owner=False)

    def used_by(self, owner: str | None) -> float:
        """The owner's device-seconds of late, as the queue weighs them (none kept in process)."""
        return 0.0

    def free(self) -> int:
        return self.capacity - self.in_use()

    def waiting(self) -> list[int]:
        """Sweep ids waiting for devices, in the order they will be served."""
        with self._cond:
            return [c.sweep_id for c, _, _ in self._order()]

    def head_key(self) -> tuple | None:
        """``store.queue_key`` of the waiter served next, or None when nobody (allowed) waits."""
        with self._cond:
            order = self._order()
            if not order:
                return None
            c, _, since = order[0]
            return store.queue_key(owner_devices=self._held(c.owner), priority=c.priority, since=since,
                                   sweep_id=c.sweep_id)

    # --- requests ------------------------------------------------------------------------------

    def _held(self, owner: str | None) -> int:
        return sum(g.devices for g in self._grants if g.claimant.owner == owner)

    def _allowed(self, claimant: Claimant, n: int) -> bool:
        """Whether the owner's limits let this request start now (else it waits, out of the order)."""
        lim = self.limits(claimant.owner)
        if lim.spent:
            return False
        return lim.max_devices is None or self._held(claimant.owner) + n <= lim.max_devices

    def _order(self) -> list[tuple[Claimant, int, datetime]]:
        allowed = [w for w in self._waiting.values() if self._allowed(w[0], w[1])]
        return sorted(allowed, key=lambda w: store.queue_key(
            owner_devices=self._held(w[0].owner), priority=w[0].priority, since=w[2], sweep_id=w[0].sweep_id))

    def _want(self, claimant: Claimant, n: int) -> None:
        """``claimant`` waits for ``n`` devices (a request already waiting keeps its place)."""
        since = self._waiting.get(claimant.sweep_id, (None, None, utcnow()))[2]
        self._waiting[claimant.sweep_id] = (claimant, n, since)

    def try_acquire(self, claimant: Claimant, n: int) -> Grant | None:
        """``n`` devices for one trial of ``claimant``'s sweep now, or None (it is then queued and
        asks again; ``withdraw`` when it no longer wants them)."""
        with self._cond:
            if n > self.capacity:  # can never fit: let the backend refuse it with its numbers
                self._waiting.pop(claimant.sweep_id, None)
                return self._grant(claimant, 0, None)
            self._want(claimant, n)
            order = self._order()
            if not order or order[0][0].sweep_id != claimant.sweep_id:
                return None
            if n > self.capacity - sum(g.devices for g in self._grants):
                return None
            if self.max_trials and len(self._grants) >= self.max_trials:
                return None
            del self._waiting[claimant.sweep_id]
            return self._grant(claimant, n, None)

    def _grant(self, claimant: Claimant, n: int, lease_id: int | None) -> Grant:
        grant = Grant(claimant, n, lease_id=lease_id)
        self._grants.append(grant)
        self._cond.notify_all()
        return grant

    def withdraw(self, sweep_id: int) -> None:
        with self._cond:
            if self._waiting.pop(sweep_id, None) is not None:
                self._cond.notify_all()

    def release(self, grant: Grant | None) -> None:
        if grant is None:
            return
        with self._cond:
            if grant.released:
                return
            grant.released = True
            self._grants.remove(grant)
            self._gave_back(grant)
            self._cond.notify_all()

    def _gave_back(self, grant: Grant) -> None:
        """After ``release`` took ``grant`` off the books (a store-backed ledger tells the store)."""

    def wait_change(self, timeout: float) -> None:
        """Block until a grant is released or a waiter leaves (or ``timeout``)."""
        with self._cond:
            self._cond.wait(timeout)


class Sharing:
    """The loop's side of ``ledger`` (its devices, asked as ``claimant``) and of cancelling trials on
    ``backend``. ``held``: devices granted for the next launch, kept across pruned proposals until a
    launch takes them (``hand_over``) or the loop lets them go."""

    def __init__(self, ctx: LoopContext, ledger: DeviceLedger, backend: Any, claimant: Claimant) -> None:
        self.ctx = ctx
        self.ledger = ledger
        self.backend = backend
        self.claimant = claimant
        self.held: Grant | None = None

    def take_devices(self, world: int) -> bool:
        """Devices for the next launch from the coordinator's ledger (fair share, priority, owner
        limits); False: wait for them."""
        if self.held is None:
            self.refresh_capacity()
            self.held = self.ledger.try_acquire(self.claimant, world)
        return self.held is not None

    def hand_over(self) -> Grant | None:
        """The devices taken, to the trial launched now (it releases them once its result is stored)."""
        grant, self.held = self.held, None
        return grant

    def let_go(self) -> None:
        """Stop waiting and give back the devices taken (not asking now: the sweeps behind get them)."""
        self.ledger.withdraw(self.ctx.sweep_id)
        self.ledger.release(self.held)
        self.held = None

    def release(self, grant: Grant | None) -> None:
        self.ledger.release(grant)

    def give_back(self, in_flight: Iterable[Ticket]) -> None:
        """Every device this loop holds or waits for goes back to the ledger (the loop is ending)."""
        self.let_go()
        for ticket in in_flight:
            self.ledger.release(ticket.grant)

    def refresh_capacity(self, *, now: bool = False) -> None:
        """Re-read the backend's devices into the ledger (at most every CAPACITY_TTL_S, or ``now``:
        after a node-lost failure). A backend that cannot answer keeps the last figure."""
        if not now and time.monotonic() - self.ledger.read_at < CAPACITY_TTL_S:
            return
        try:
            capacity = int(self.backend.capacity())
        except Exception as exc:  # the trial launches then meet the same condition and say so
            log.warning("sweep %s: could not re-read the backend's capacity (%s)", self.ctx.sweep_id, exc)
            self.ledger.read_at = time.monotonic()
            return
        if capacity != self.ledger.seen:
            log.warning("sweep %s: the backend's capacity is now %d devices (was %d)", self.ctx.sweep_id,
                        capacity, self.ledger.seen)
        self.ledger.set_capacity(capacity)

    def cancel(self, in_flight: Iterable[Ticket], trial_id: Callable[[Ticket], str]) -> None:
        """The sweep was cancelled: a backend that can stop a trial (Ray: its gang's actors killed and
        placement groups removed) frees the devices now; each ticket told is marked ``cancelled``
        first (its result is not recorded, nor its launch retried), the rows become "interrupted"
        (``mark_cancelled``)."""
        cancel = getattr(self.backend, "cancel", None)
        if not callable(cancel):
            return  # the trials in flight finish and are recorded, as before
        for ticket in in_flight:
            if not ticket.cancelled:
                ticket.cancelled = True
                try:
                    cancel(trial_id(ticket))
                except Exception as exc:  # the trial then ends on its own; its result is still dropped
                    log.warning("sweep %s: could not stop trial %s (%s)", self.ctx.sweep_id, trial_id(ticket), exc)

    def mark_cancelled(self) -> None:
        ctx = self.ctx
        with store.session_scope(ctx.sessions) as s:
            if store.hold_sweep(s, sweep_id=ctx.sweep_id, runner_id=ctx.runner_id):
                store.mark_interrupted(s, sweep_id=ctx.sweep_id, cause="sweep cancelled: the trial was stopped")
                store.refresh_sweep_cache(s, sweep_id=ctx.sweep_id)
