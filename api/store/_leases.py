"""One device queue for every coordinator on this database, per cluster (``pool``: the cluster's
identity, api/engine/_shared.py).

Tables ``cluster_members`` (each coordinator, its beat and the devices it sees), ``device_waiters``
(every sweep waiting for devices) and ``device_leases`` (every grant, kept after release for audits).
Every change is one transaction (``tend``) serialising the cluster's coordinators and ending with
``_dispatch``: dead members' leases released, then free devices granted in ``queue_key`` order.

The protocol (locks, order, liveness, clocks): docs/store.md#device-queue-and-leases.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Float, Index, Integer, String
from sqlalchemy.orm import Mapped, Session, mapped_column

from api.store._models import SWEEP_PRIORITIES, Base, Sweep, Trial, utcnow
from api.store._sweeps import _runner_is_dead, queue_key
from api.store._types import UTCDateTime, as_utc

LEASE_TTL_S = 30.0  # a member not beaten for this long is dead (its coordinator crashed or hangs)
USAGE_WINDOW_S = 3600.0  # the device-time the queue's order weighs: an owner's over the last hour
_LOCK_CLASS = 0x6D657368  # "mesh": the advisory lock's first key; the second is the pool's crc32


class ClusterMember(Base):
    __tablename__ = "cluster_members"

    pool: Mapped[str] = mapped_column(String(200), primary_key=True)  # the cluster's identity
    holder: Mapped[str] = mapped_column(String(200), primary_key=True)  # the coordinator's runner id
    capacity: Mapped[int] = mapped_column(Integer)  # the devices this coordinator's backend sees there
    joined_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class DeviceWaiter(Base):
    __tablename__ = "device_waiters"

    pool: Mapped[str] = mapped_column(String(200), primary_key=True)
    sweep_id: Mapped[int] = mapped_column(Integer, primary_key=True)  # one request per sweep at a time
    holder: Mapped[str] = mapped_column(String(200))
    owner: Mapped[str | None] = mapped_column(String(200), nullable=True)
    priority: Mapped[str] = mapped_column(String(8))
    devices: Mapped[int] = mapped_column(Integer)
    owner_max: Mapped[float | None] = mapped_column(Float, nullable=True)  # its owner's device limit
    since: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)  # when it began to wait


class DeviceLease(Base):
    __tablename__ = "device_leases"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    pool: Mapped[str] = mapped_column(String(200))
    sweep_id: Mapped[int] = mapped_column(Integer)
    owner: Mapped[str | None] = mapped_column(String(200), nullable=True)
    devices: Mapped[int] = mapped_column(Integer)
    holder: Mapped[str] = mapped_column(String(200))
    granted_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    asked_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)  # its waiter's since
    released_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)  # None: held now
    release_cause: Mapped[str | None] = mapped_column(String(40), nullable=True)  # released | holder gone

    __table_args__ = (Index(None, "pool", "released_at"),)


@dataclass(frozen=True)
class Want:
    """A sweep's request for ``devices`` (what ``tend`` stores as its waiter)."""

    sweep_id: int
    owner: str | None
    priority: str
    devices: int
    owner_max: float | None = None


@dataclass(frozen=True)
class Held:
    lease_id: int
    sweep_id: int
    owner: str | None
    devices: int
    holder: str


@dataclass
class ClusterState:
    """The pool as one transaction (or read) saw it."""

    capacity: int = 0  # the least any live member sees (0: no live member)
    members: dict[str, int] = field(default_factory=dict)  # live holder -> the devices it sees
    leases: list[Held] = field(default_factory=list)  # the live leases
    order: list[DeviceWaiter] = field(default_factory=list)  # the waiters, next served first
    usage: dict[str | None, float] = field(default_factory=dict)  # owner -> device-seconds, last USAGE_WINDOW_S
    granted: list[Held] = field(default_factory=list)  # granted by this transaction
    gone: list[str] = field(default_factory=list)  # members found dead by this transaction
    joined: bool = True  # False: the caller's member row was gone (found dead by another) and is new
    timings: dict[str, float] = field(default_factory=dict)  # seconds: "lock" (waited for it), "decide" (read,
    # order and grant, under the lock)

    @property
    def held(self) -> int:
        return sum(h.devices for h in self.leases)

    def by_owner(self) -> dict[str | None, int]:
        out: dict[str | None, int] = {}
        for h in self.leases:
            out[h.owner] = out.get(h.owner, 0) + h.devices
        return out

    def mine(self, holder: str) -> list[Held]:
        return [h for h in self.leases if h.holder == holder]


def _now(session: Session, pool: str, *, lock: bool) -> datetime:
    """The transaction's clock, after taking the pool's lock when ``lock`` (see the module docstring)."""
    if session.get_bind().dialect.name == "postgresql":
        key = zlib.crc32(pool.encode()) - 2**31  # int4
        sql = ("WITH l AS MATERIALIZED (SELECT pg_advisory_xact_lock(:a, :b)) SELECT clock_timestamp() FROM l"
               if lock else "SELECT clock_timestamp()")
        return as_utc(session.execute(sa.text(sql), {"a": _LOCK_CLASS, "b": key}).scalar_one())
    if lock:  # a write first: SQLite's one write lock is held from here to the commit
        session.execute(sa.update(ClusterMember).where(sa.false()).values(capacity=0)
                        .execution_options(synchronize_session=False))
    return utcnow()


@dataclass
class Waiting:
    """A ``device_waiters`` row, as the dispatch reads it."""

    sweep_id: int
    holder: str
    owner: str | None
    priority: str
    devices: int
    owner_max: float | None
    since: datetime


def _order(waiters: Iterable[Waiting], by_owner: dict[str | None, int],
           usage: dict[str | None, float]) -> list[Waiting]:
    return sorted(waiters, key=lambda w: queue_key(owner_devices=by_owner.get(w.owner, 0), priority=w.priority,
                                                   owner_usage=usage.get(w.owner, 0.0), since=w.since,
                                                   sweep_id=w.sweep_id))


def _usage(rows: Iterable[Any], now: datetime) -> dict[str | None, float]:
    """Owner -> device-seconds the lease ``rows`` held over the last ``USAGE_WINDOW_S``."""
    start = now - timedelta(seconds=USAGE_WINDOW_S)
    out: dict[str | None, float] = {}
    for r in rows:
        a, b = max(as_utc(r.granted_at), start), min(as_utc(r.released_at) if r.released_at else now, now)
        if b > a:
            out[r.owner] = out.get(r.owner, 0.0) + r.devices * (b - a).total_seconds()
    return out


def _recent(session: Session, now: datetime, pool: str | None = None) -> list[Any]:
    """The leases held now or released within ``USAGE_WINDOW_S`` (of ``pool``, or every pool's)."""
    query = sa.select(DeviceLease.id, DeviceLease.sweep_id, DeviceLease.owner, DeviceLease.devices,
                      DeviceLease.holder, DeviceLease.granted_at, DeviceLease.released_at).where(
        sa.or_(DeviceLease.released_at.is_(None), DeviceLease.released_at > now - timedelta(seconds=USAGE_WINDOW_S)))
    return list(session.execute(query if pool is None else query.where(DeviceLease.pool == pool)))


def _read(session: Session, pool: str, now: datetime, ttl_s: float) -> tuple[ClusterState, list[str], dict[int, Waiting]]:
    """(the pool's live state, the holders of members found dead, every waiter row by sweep); no grant
    is made. Three statements: members, leases (live and recent), waiters."""
    members = session.execute(sa.select(ClusterMember.holder, ClusterMember.capacity, ClusterMember.heartbeat_at)
                              .where(ClusterMember.pool == pool)).all()
    cutoff = now - timedelta(seconds=ttl_s)
    live = {m.holder: m.capacity for m in members if as_utc(m.heartbeat_at) >= cutoff and not _runner_is_dead(m.holder)}
    gone = [m.holder for m in members if m.holder not in live]
    recent = _recent(session, now, pool)
    leases = [Held(r.id, r.sweep_id, r.owner, r.devices, r.holder) for r in recent if r.released_at is None]
    waiters = {r.sweep_id: Waiting(r.sweep_id, r.holder, r.owner, r.priority, r.devices, r.owner_max, as_utc(r.since))
               for r in session.execute(sa.select(DeviceWaiter.sweep_id, DeviceWaiter.holder, DeviceWaiter.owner,
                                                  DeviceWaiter.priority, DeviceWaiter.devices, DeviceWaiter.owner_max,
                                                  DeviceWaiter.since).where(DeviceWaiter.pool == pool))}
    state = ClusterState(capacity=min(live.values(), default=0), members=live,
                         leases=[h for h in leases if h.holder in live], usage=_usage(recent, now))
    state.order = _order([w for w in waiters.values() if w.holder in live], state.by_owner(), state.usage)
    # Leases whose holder is no live member (dead, or never a member) are released by the next tend.
    return state, gone + sorted({h.holder for h in leases if h.holder not in live} - set(gone)), waiters


def _allowed(w: Waiting, by_owner: dict[str | None, int]) -> bool:
    return w.owner_max is None or by_owner.get(w.owner, 0) + w.devices <= w.owner_max


def _dispatch(session: Session, pool: str, now: datetime, state: ClusterState, gone: list[str]) -> ClusterState:
    """Release the dead members' leases, drop their waiters, then grant in the queue's order (the
    grants in one INSERT, their waiters in one DELETE)."""
    if gone:
        session.execute(sa.update(DeviceLease).where(DeviceLease.pool == pool, DeviceLease.holder.in_(gone),
                                                     DeviceLease.released_at.is_(None))
                        .values(released_at=now, release_cause="holder gone").execution_options(synchronize_session=False))
        for table in (DeviceWaiter, ClusterMember):
            session.execute(sa.delete(table).where(table.pool == pool, table.holder.in_(gone))
                            .execution_options(synchronize_session=False))
        state.gone = gone
    by_owner, free = state.by_owner(), state.capacity - state.held
    waiting, granted = list(state.order), []
    while True:
        # A waiter its owner's limit keeps out does not hold back the others; one larger than the
        # whole cluster never fits (its coordinator lets it through to be refused by the backend).
        head = next((w for w in _order(waiting, by_owner, state.usage)
                     if _allowed(w, by_owner) and w.devices <= state.capacity), None)
        if head is None or head.devices > free:
            break
        granted.append(head)
        by_owner[head.owner] = by_owner.get(head.owner, 0) + head.devices
        free -= head.devices
        waiting.remove(head)
    if granted:
        ids = session.scalars(sa.insert(DeviceLease).returning(DeviceLease.id, sort_by_parameter_order=True), [
            {"pool": pool, "sweep_id": w.sweep_id, "owner": w.owner, "devices": w.devices, "holder": w.holder,
             "granted_at": now, "asked_at": w.since} for w in granted]).all()
        session.execute(sa.delete(DeviceWaiter).where(DeviceWaiter.pool == pool,
                                                      DeviceWaiter.sweep_id.in_([w.sweep_id for w in granted]))
                        .execution_options(synchronize_session=False))
        for lease_id, w in zip(ids, granted, strict=True):
            held = Held(lease_id, w.sweep_id, w.owner, w.devices, w.holder)
            state.leases.append(held)
            state.granted.append(held)
    state.order = _order(waiting, by_owner, state.usage)
    return state


def tend(
    session: Session, *, pool: str, holder: str, capacity: int, want: Collection[Want] = (),
    withdraw: Collection[int] = (), release: Collection[int] = (), keep: Collection[int] = (),
    ttl_s: float = LEASE_TTL_S,
) -> ClusterState:
    """One serialised transaction of a coordinator on ``pool``: it beats (its member row, seeing
    ``capacity`` devices; re-joined if another found it dead), releases its leases ``release``, stops
    the requests of ``withdraw`` (their waiters deleted, and any live lease of those sweeps not in
    ``keep`` released: granted after they stopped wanting), stores the requests ``want`` (a request
    already waiting keeps its place), then dispatches. Commit right after: the lock is the
    transaction's."""
    for w in want:
        if w.priority not in SWEEP_PRIORITIES:
            raise ValueError(f"priority={w.priority!r} is not one of {', '.join(SWEEP_PRIORITIES)}")
    t0 = time.perf_counter()
    now = _now(session, pool, lock=True)
    locked = time.perf_counter()
    beaten = session.execute(sa.update(ClusterMember).where(ClusterMember.pool == pool, ClusterMember.holder == holder)
                             .values(heartbeat_at=now, capacity=capacity)
                             .execution_options(synchronize_session=False)).rowcount
    if not beaten:
        session.execute(sa.insert(ClusterMember).values(pool=pool, holder=holder, capacity=capacity, joined_at=now,
                                                        heartbeat_at=now))
    if withdraw:
        session.execute(sa.delete(DeviceWaiter).where(DeviceWaiter.pool == pool, DeviceWaiter.holder == holder,
                                                      DeviceWaiter.sweep_id.in_(list(withdraw)))
                        .execution_options(synchronize_session=False))
        late = sa.update(DeviceLease).where(DeviceLease.pool == pool, DeviceLease.holder == holder,
                                            DeviceLease.released_at.is_(None), DeviceLease.sweep_id.in_(list(withdraw)))
        if keep:
            late = late.where(DeviceLease.id.not_in(list(keep)))
        session.execute(late.values(released_at=now, release_cause="released").execution_options(synchronize_session=False))
    if release:
        session.execute(sa.update(DeviceLease).where(DeviceLease.id.in_(list(release)), DeviceLease.released_at.is_(None))
                        .values(released_at=now, release_cause="released").execution_options(synchronize_session=False))
    t1 = time.perf_counter()  # the decision: read the queue, order it, grant
    state, gone, waiters = _read(session, pool, now, ttl_s)
    new, changed = [], []
    for w in want:  # a request already waiting keeps its place (its since); its sweep may have a new holder
        before = waiters.get(w.sweep_id)
        row = Waiting(w.sweep_id, holder, w.owner, w.priority, w.devices, w.owner_max, before.since if before else now)
        (new if before is None else changed).append(row)
        waiters[w.sweep_id] = row
    if new:
        session.execute(sa.insert(DeviceWaiter), [{"pool": pool, **vars(r)} for r in new])
    for r in changed:
        session.execute(sa.update(DeviceWaiter).where(DeviceWaiter.pool == pool, DeviceWaiter.sweep_id == r.sweep_id)
                        .values(holder=r.holder, owner=r.owner, priority=r.priority, devices=r.devices,
                                owner_max=r.owner_max).execution_options(synchronize_session=False))
    if new or changed:  # the caller is live: its requests are in the order now
        state.order = _order([w for w in waiters.values() if w.holder in state.members], state.by_owner(), state.usage)
    state = _dispatch(session, pool, now, state, gone)
    state.joined = bool(beaten)
    state.timings = {"lock": locked - t0, "decide": time.perf_counter() - t1}
    return state


def cluster_state(session: Session, *, pool: str, ttl_s: float = LEASE_TTL_S) -> ClusterState:
    """The pool's live members, leases and waiters in the order they will be served (a read: no lock
    taken, nothing granted or released)."""
    return _read(session, pool, _now(session, pool, lock=False), ttl_s)[0]


def my_leases(session: Session, *, pool: str, holder: str) -> list[Held]:
    """The live leases of ``holder`` on ``pool`` (how a coordinator learns of a grant another made)."""
    return [Held(r.id, r.sweep_id, r.owner, r.devices, r.holder) for r in session.execute(
        sa.select(DeviceLease.id, DeviceLease.sweep_id, DeviceLease.owner, DeviceLease.devices, DeviceLease.holder)
        .where(DeviceLease.pool == pool, DeviceLease.holder == holder, DeviceLease.released_at.is_(None)))]


def lease_intervals(session: Session, *, pool: str) -> list[DeviceLease]:
    """Every lease of ``pool`` ever granted, oldest first (``released_at`` None: held now)."""
    return list(session.scalars(sa.select(DeviceLease).where(DeviceLease.pool == pool)
                                .order_by(DeviceLease.granted_at, DeviceLease.id)))


def peak_held(leases: Iterable[DeviceLease], *, until: datetime | None = None) -> tuple[int, datetime | None]:
    """The most devices ``leases`` held at one instant of their [granted_at, released_at) intervals,
    and when (a release at the same instant as a grant comes first: the intervals are half-open)."""
    end = until or utcnow()
    events: list[tuple[datetime, int]] = []
    for x in leases:
        events += [(as_utc(x.granted_at), x.devices), (as_utc(x.released_at) if x.released_at else end, -x.devices)]
    peak, at, now = 0, None, 0
    for t, d in sorted(events):  # at one instant, -devices sorts before +devices
        now += d
        if now > peak:
            peak, at = now, t
    return peak, at


def queue_positions(session: Session) -> dict[int, int]:
    """Queued sweep id -> its place in the queue (1 = the next to start), in ``queue_key`` order with
    each owner's devices in use counted from the trials running now and its device-time from the
    leases of the last ``USAGE_WINDOW_S`` (every cluster's)."""
    queued = session.execute(
        sa.select(Sweep.id, Sweep.owner, Sweep.priority, Sweep.created_at).where(Sweep.status == "queued")
    ).all()
    if not queued:
        return {}
    held: dict[str | None, int] = {}
    for owner, devices in session.execute(
        sa.select(Sweep.owner, sa.func.coalesce(sa.func.sum(Trial.world_size), 0))
        .join(Trial, Trial.sweep_id == Sweep.id).where(Trial.status == "running").group_by(Sweep.owner)
    ):
        held[owner] = int(devices)
    now = utcnow()
    usage = _usage(_recent(session, now), now)
    order = sorted(queued, key=lambda r: queue_key(owner_devices=held.get(r.owner, 0), priority=r.priority,
                                                   owner_usage=usage.get(r.owner, 0.0), since=r.created_at,
                                                   sweep_id=r.id))
    return {r.id: i for i, r in enumerate(order, start=1)}
