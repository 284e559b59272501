"""Keyword-only store functions for schedules, fires, alerts and webhook deliveries.

Every state change that two coordinator replicas could race on is a single statement whose effect
tells the caller whether it won: ``insert_fire`` (INSERT ... ON CONFLICT DO NOTHING on the unique
(schedule_id, fire_time)), ``finish_fire`` and ``lease_delivery`` (conditional UPDATEs).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from api.schedules.models import AlertDelivery, Schedule, ScheduleAlert, ScheduleFire
from api.store import SWEEP_PRIORITIES, Trial
from api.store._models import utcnow


def _insert_ignoring_conflict(session: Session, model: type, values: dict[str, Any], keys: list[str]) -> int | None:
    """INSERT ... ON CONFLICT (keys) DO NOTHING RETURNING id: the new id, or None if the row existed."""
    dialect = session.get_bind().dialect.name
    insert = {"postgresql": postgresql.insert, "sqlite": sqlite.insert}.get(dialect)
    assert insert is not None, f"schedules need PostgreSQL or SQLite (ON CONFLICT), not {dialect}"
    stmt = insert(model).values(**values).on_conflict_do_nothing(index_elements=keys).returning(model.id)
    return session.execute(stmt).scalar_one_or_none()


# --- schedules ---------------------------------------------------------------------------------------


def insert_schedule(session: Session, **values: Any) -> Schedule:
    assert values.get("priority", "normal") in SWEEP_PRIORITIES, values.get("priority")  # validated by ScheduleIn
    now = utcnow()
    row = Schedule(**values, active_since=now, created_at=now, updated_at=now)
    session.add(row)
    session.flush()
    return row


def get_schedule(session: Session, *, schedule_id: int) -> Schedule | None:
    return session.get(Schedule, schedule_id, populate_existing=True)


def list_schedules(
    session: Session, *, enabled: bool | None = None, limit: int | None = 100, offset: int = 0
) -> tuple[list[Schedule], int]:
    where = [] if enabled is None else [Schedule.enabled.is_(enabled)]
    total = session.scalar(sa.select(sa.func.count()).select_from(Schedule).where(*where)) or 0
    query = sa.select(Schedule).where(*where).order_by(Schedule.id).offset(offset)
    if limit is not None:
        query = query.limit(limit)
    return list(session.scalars(query).all()), int(total)


def update_schedule(session: Session, *, schedule_id: int, values: dict[str, Any]) -> bool:
    assert values.get("priority", "normal") in SWEEP_PRIORITIES, values.get("priority")  # validated by ScheduleUpdate
    values = {**values, "updated_at": utcnow()}
    if values.get("enabled") is True:  # re-enabled: its off-time is not owed as missed fires
        current = session.scalar(sa.select(Schedule.enabled).where(Schedule.id == schedule_id))
        if current is False:
            values["active_since"] = utcnow()
    result = session.execute(
        sa.update(Schedule).where(Schedule.id == schedule_id).values(**values)
        .execution_options(synchronize_session=False)
    )
    return bool(result.rowcount)


def delete_schedule(session: Session, *, schedule_id: int) -> bool:
    # Explicit child deletes: SQLite enforces ON DELETE CASCADE only with foreign_keys=ON.
    fire_ids = sa.select(ScheduleFire.id).where(ScheduleFire.schedule_id == schedule_id)
    session.execute(sa.delete(AlertDelivery).where(AlertDelivery.fire_id.in_(fire_ids)))
    session.execute(sa.delete(ScheduleAlert).where(ScheduleAlert.schedule_id == schedule_id))
    session.execute(sa.delete(ScheduleFire).where(ScheduleFire.schedule_id == schedule_id))
    return bool(session.execute(sa.delete(Schedule).where(Schedule.id == schedule_id)).rowcount)


# --- fires -------------------------------------------------------------------------------------------


def latest_cron_fire_time(session: Session, *, schedule_id: int) -> datetime | None:
    """The newest fire time recorded for the schedule's cron (manual runs do not count)."""
    return session.scalar(
        sa.select(sa.func.max(ScheduleFire.fire_time))
        .where(ScheduleFire.schedule_id == schedule_id, ScheduleFire.trigger == "cron")
    )


def insert_fire(
    session: Session,
    *,
    schedule_id: int,
    fire_time: datetime,
    status: str,
    claimed_by: str,
    trigger: str = "cron",
    error: str | None = None,
) -> int | None:
    """Record a fire; returns its id if THIS call inserted it, None if any replica already had.

    This is the single-fire guarantee: the unique (schedule_id, fire_time) makes the database pick
    exactly one inserter, and only the inserter launches the run.
    """
    now = utcnow()
    values = dict(
        schedule_id=schedule_id, fire_time=fire_time, trigger=trigger, status=status, claimed_by=claimed_by,
        sweep_ids=[], error=error, created_at=now, finished_at=None if status == "running" else now,
    )
    return _insert_ignoring_conflict(session, ScheduleFire, values, ["schedule_id", "fire_time"])


def get_fire(session: Session, *, fire_id: int) -> ScheduleFire | None:
    return session.get(ScheduleFire, fire_id, populate_existing=True)


def set_fire_sweeps(session: Session, *, fire_id: int, sweep_ids: list[int]) -> None:
    session.execute(
        sa.update(ScheduleFire).where(ScheduleFire.id == fire_id).values(sweep_ids=list(sweep_ids))
        .execution_options(synchronize_session=False)
    )


def finish_fire(session: Session, *, fire_id: int, status: str, **values: Any) -> bool:
    """running -> ``status`` (completed/failed) with ``values``; False if another replica did it first."""
    result = session.execute(
        sa.update(ScheduleFire)
        .where(ScheduleFire.id == fire_id, ScheduleFire.status == "running")
        .values(status=status, finished_at=utcnow(), **values)
        .execution_options(synchronize_session=False)
    )
    return bool(result.rowcount)


def running_fires(session: Session) -> list[ScheduleFire]:
    return list(session.scalars(
        sa.select(ScheduleFire).where(ScheduleFire.status == "running").order_by(ScheduleFire.fire_time)
    ).all())


def list_fires(
    session: Session,
    *,
    schedule_id: int,
    status: str | None = None,
    before: datetime | None = None,
    limit: int | None = 100,
    offset: int = 0,
) -> tuple[list[ScheduleFire], int]:
    """Fires of a schedule, newest fire time first."""
    where = [ScheduleFire.schedule_id == schedule_id]
    if status is not None:
        where.append(ScheduleFire.status == status)
    if before is not None:
        where.append(ScheduleFire.fire_time < before)
    total = session.scalar(sa.select(sa.func.count()).select_from(ScheduleFire).where(*where)) or 0
    query = sa.select(ScheduleFire).where(*where).order_by(ScheduleFire.fire_time.desc()).offset(offset)
    if limit is not None:
        query = query.limit(limit)
    return list(session.scalars(query).all()), int(total)


def fire_measurements(session: Session, *, sweep_ids: list[int]) -> list[Trial]:
    """Completed measurements (tokens/s) of the given sweeps."""
    if not sweep_ids:
        return []
    return list(session.scalars(
        sa.select(Trial)
        .where(Trial.sweep_id.in_(sweep_ids), Trial.status == "completed", Trial.tokens_per_s.is_not(None))
        .order_by(Trial.sweep_id, Trial.number)
    ).all())


# --- alerts and deliveries -----------------------------------------------------------------------


def insert_alert(session: Session, *, fire_id: int, schedule_id: int, kind: str, layout_key: str | None,
                 message: str, detail: dict[str, Any], deliver: bool, ratio: float | None = None,
                 ratio_low: float | None = None, ratio_high: float | None = None,
                 p_value: float | None = None) -> ScheduleAlert:
    now = utcnow()
    row = ScheduleAlert(
        fire_id=fire_id, schedule_id=schedule_id, kind=kind, layout_key=layout_key, message=message,
        detail=detail, ratio=ratio, ratio_low=ratio_low, ratio_high=ratio_high, p_value=p_value,
        delivery_status="pending" if deliver else "no_target", attempts=0,
        next_attempt_at=now if deliver else None, created_at=now,
    )
    session.add(row)
    session.flush()
    return row


def list_alerts(
    session: Session,
    *,
    schedule_id: int | None = None,
    kind: str | None = None,
    layout_key: str | None = None,
    delivery_status: str | None = None,
    limit: int | None = 100,
    offset: int = 0,
) -> tuple[list[ScheduleAlert], int]:
    """Alerts, newest first, with the filtered total."""
    where = []
    if schedule_id is not None:
        where.append(ScheduleAlert.schedule_id == schedule_id)
    if kind is not None:
        where.append(ScheduleAlert.kind == kind)
    if layout_key is not None:
        where.append(ScheduleAlert.layout_key == layout_key)
    if delivery_status is not None:
        where.append(ScheduleAlert.delivery_status == delivery_status)
    total = session.scalar(sa.select(sa.func.count()).select_from(ScheduleAlert).where(*where)) or 0
    query = sa.select(ScheduleAlert).where(*where).order_by(ScheduleAlert.id.desc()).offset(offset)
    if limit is not None:
        query = query.limit(limit)
    return list(session.scalars(query).all()), int(total)


def due_delivery_fires(session: Session, *, now: datetime) -> list[int]:
    """Fires with alerts whose next webhook attempt is due."""
    return list(session.scalars(
        sa.select(ScheduleAlert.fire_id)
        .where(ScheduleAlert.delivery_status == "pending", ScheduleAlert.next_attempt_at <= now)
        .group_by(ScheduleAlert.fire_id).order_by(ScheduleAlert.fire_id)
    ).all())


def lease_delivery(session: Session, *, fire_id: int, now: datetime, lease_s: float) -> list[ScheduleAlert]:
    """Take the fire's due pending alerts for one webhook attempt (pushing their next attempt
    ``lease_s`` ahead, so another replica does not post them meanwhile). Empty if none were due."""
    due = [
        ScheduleAlert.fire_id == fire_id, ScheduleAlert.delivery_status == "pending",
        ScheduleAlert.next_attempt_at <= now,
    ]
    ids = list(session.scalars(sa.select(ScheduleAlert.id).where(*due)).all())
    if not ids:
        return []
    leased = session.execute(
        sa.update(ScheduleAlert).where(ScheduleAlert.id.in_(ids), *due)
        .values(next_attempt_at=now + timedelta(seconds=lease_s), attempts=ScheduleAlert.attempts + 1)
        .execution_options(synchronize_session=False)
    ).rowcount
    if leased != len(ids):  # another replica leased some of them in between: leave them all to it
        session.rollback()
        return []
    return list(session.scalars(
        sa.select(ScheduleAlert).where(ScheduleAlert.id.in_(ids)).order_by(ScheduleAlert.id)
        .execution_options(populate_existing=True)
    ).all())


def record_delivery(
    session: Session,
    *,
    fire_id: int,
    alert_ids: list[int],
    attempt: int,
    url: str,
    ok: bool,
    status_code: int | None,
    error: str | None,
    next_attempt_at: datetime | None,
    give_up: bool,
) -> None:
    """Log one webhook attempt and move its alerts to delivered / failed / pending (retry later)."""
    now = utcnow()
    session.add(AlertDelivery(fire_id=fire_id, attempt=attempt, url=url, ok=ok, status_code=status_code,
                              error=error, alert_ids=list(alert_ids), at=now))
    if ok:
        values: dict[str, Any] = dict(delivery_status="delivered", delivered_at=now, next_attempt_at=None,
                                      last_error=None)
    elif give_up:
        values = dict(delivery_status="failed", next_attempt_at=None, last_error=error)
    else:
        values = dict(next_attempt_at=next_attempt_at, last_error=error)
    session.execute(
        sa.update(ScheduleAlert).where(ScheduleAlert.id.in_(alert_ids)).values(**values)
        .execution_options(synchronize_session=False)
    )


def list_deliveries(session: Session, *, fire_id: int | None = None, limit: int = 100) -> list[AlertDelivery]:
    query = sa.select(AlertDelivery).order_by(AlertDelivery.id.desc()).limit(limit)
    if fire_id is not None:
        query = query.where(AlertDelivery.fire_id == fire_id)
    return list(session.scalars(query).all())
