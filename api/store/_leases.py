"""Device leases: the devices every coordinator on this database holds now, one row per granted trial
(api/engine/_share.py keeps the in-process order of its own waiters; the counts are these rows).

A lease is live while its holder beats it (``beat_leases``) within ``ttl_s``, and its holder is not a
process of this host that is gone (``_runner_is_dead``, as for sweep claims): a crashed
coordinator's devices come back by themselves. ``take_lease`` is one transaction that serialises
every grant of every coordinator on the database: on PostgreSQL a transaction-scoped advisory lock;
on SQLite its first statement is a write (the DELETE of dead leases), which takes the database's one
write lock before the sums are read. Heartbeats use the coordinators' clocks, as sweep heartbeats do.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy import Index, Integer, String
from sqlalchemy.orm import Mapped, Session, mapped_column

from api.store._models import Base, utcnow
from api.store._sweeps import _runner_is_dead
from api.store._types import UTCDateTime

LEASE_TTL_S = 30.0  # a lease not beaten for this long is dead (its coordinator crashed or hangs)
# Any constant bigint, the same in every coordinator: the key of the grant's advisory lock.
_ADVISORY_KEY = 0x6D657368_6C656173  # "meshleas"


class DeviceLease(Base):
    __tablename__ = "device_leases"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    pool: Mapped[str] = mapped_column(String(200))  # whose devices: the backend's name (one ledger each)
    sweep_id: Mapped[int] = mapped_column(Integer)
    owner: Mapped[str | None] = mapped_column(String(200), nullable=True)
    devices: Mapped[int] = mapped_column(Integer)
    holder: Mapped[str] = mapped_column(String(200))  # the coordinator's runner id (host:pid:random)
    granted_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    __table_args__ = (Index(None, "pool", "heartbeat_at"),)


@dataclass
class Holdings:
    """What the live leases of a pool hold, but for the caller's own (``mine``)."""

    total: int = 0
    by_owner: dict[str | None, int] = field(default_factory=dict)


def _serialise(session: Session, *, pool: str, ttl_s: float) -> None:
    if session.get_bind().dialect.name == "postgresql":
        session.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _ADVISORY_KEY})
    # On SQLite this DELETE is the transaction's first statement: it takes the write lock.
    session.execute(sa.delete(DeviceLease).where(DeviceLease.pool == pool,
                                                 DeviceLease.heartbeat_at < utcnow() - timedelta(seconds=ttl_s))
                    .execution_options(synchronize_session=False))


def _live(session: Session, *, pool: str, mine: Collection[int]) -> tuple[Holdings, int, dict[str | None, int]]:
    """(others' holdings, every live lease's devices, every live lease's devices by owner); leases of
    a holder found dead on this host are deleted."""
    rows = session.execute(sa.select(DeviceLease.id, DeviceLease.owner, DeviceLease.devices, DeviceLease.holder)
                           .where(DeviceLease.pool == pool)).all()
    dead = {h for h in {r.holder for r in rows} if _runner_is_dead(h)}
    if dead:
        session.execute(sa.delete(DeviceLease).where(DeviceLease.pool == pool, DeviceLease.holder.in_(dead))
                        .execution_options(synchronize_session=False))
    others, total, by_owner = Holdings(), 0, {}
    for r in rows:
        if r.holder in dead:
            continue
        total += r.devices
        by_owner[r.owner] = by_owner.get(r.owner, 0) + r.devices
        if r.id not in mine:
            others.total += r.devices
            others.by_owner[r.owner] = others.by_owner.get(r.owner, 0) + r.devices
    return others, total, by_owner


def take_lease(
    session: Session, *, pool: str, sweep_id: int, owner: str | None, devices: int, holder: str,
    capacity: int, owner_max: float | None = None, mine: Collection[int] = (), ttl_s: float = LEASE_TTL_S,
) -> tuple[int | None, Holdings]:
    """A lease of ``devices`` for one trial, if they fit ``capacity`` and the owner's limit
    (``owner_max``) beside every live lease of ``pool``: (its id or None, what the others hold, ``mine``
    being the caller's own live leases). Commit right after: the lock is the transaction's."""
    _serialise(session, pool=pool, ttl_s=ttl_s)
    others, total, by_owner = _live(session, pool=pool, mine=mine)
    if total + devices > capacity or (owner_max is not None and by_owner.get(owner, 0) + devices > owner_max):
        return None, others
    lease = DeviceLease(pool=pool, sweep_id=sweep_id, owner=owner, devices=devices, holder=holder)
    session.add(lease)
    session.flush()
    return lease.id, others


def holdings(session: Session, *, pool: str, mine: Collection[int] = (), ttl_s: float = LEASE_TTL_S) -> Holdings:
    """What the live leases of ``pool`` other than ``mine`` hold (read only: no lock taken)."""
    rows = session.execute(
        sa.select(DeviceLease.id, DeviceLease.owner, DeviceLease.devices, DeviceLease.holder)
        .where(DeviceLease.pool == pool, DeviceLease.heartbeat_at >= utcnow() - timedelta(seconds=ttl_s))).all()
    out = Holdings()
    for r in rows:
        if r.id not in mine and not _runner_is_dead(r.holder):
            out.total += r.devices
            out.by_owner[r.owner] = out.by_owner.get(r.owner, 0) + r.devices
    return out


def beat_leases(session: Session, *, lease_ids: Collection[int]) -> int:
    """The holder still holds these leases; returns how many rows it still had (fewer: some were
    found dead by another coordinator and deleted)."""
    if not lease_ids:
        return 0
    return session.execute(sa.update(DeviceLease).where(DeviceLease.id.in_(list(lease_ids)))
                           .values(heartbeat_at=utcnow()).execution_options(synchronize_session=False)).rowcount


def drop_lease(session: Session, *, lease_id: int) -> None:
    session.execute(sa.delete(DeviceLease).where(DeviceLease.id == lease_id)
                    .execution_options(synchronize_session=False))
