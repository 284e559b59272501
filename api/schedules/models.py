"""SQLAlchemy models of scheduled sweeps, on the store's declarative ``Base`` (one Alembic history).

- ``Schedule``: a cron expression in an IANA time zone, what to run (a sweep template, or a
  re-measurement of the top-k layouts of an earlier sweep), an enabled flag and a webhook.
- ``ScheduleFire``: one row per (schedule, fire time). The unique constraint on that pair is the
  single-fire guarantee: every coordinator replica inserts the row with ON CONFLICT DO NOTHING and
  only the replica whose insert took effect launches the run.
- ``ScheduleAlert``: one row per layout found regressed or improved (or per failed run), written
  before any webhook is tried, so a failing webhook never loses a finding.
- ``AlertDelivery``: one row per webhook attempt (status code or error), the delivery log.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from api.store._models import Base, utcnow
from api.store._types import UTCDateTime

SCHEDULE_KINDS = ("template", "remeasure")
# running: claimed and its sweeps created (one transaction); completed: sweeps finished and checked for
# regressions; failed: could not be launched, or its sweeps failed; missed: not run (misfire policy);
# coalesced: folded into a later fire of the same catch-up.
FIRE_STATUSES = ("running", "completed", "failed", "missed", "coalesced")
FINAL_FIRE_STATUSES = ("completed", "failed", "missed", "coalesced")
ALERT_KINDS = ("regression", "improvement", "failure")
DELIVERY_STATUSES = ("pending", "delivered", "failed", "no_target")


class Schedule(Base):
    __tablename__ = "schedules"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200))
    owner: Mapped[str | None] = mapped_column(String(200), nullable=True)
    cron: Mapped[str] = mapped_column(String(200))
    timezone: Mapped[str] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(16))
    template: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)  # a SweepSpec dict
    source_sweep_id: Mapped[int | None] = mapped_column(
        ForeignKey("sweeps.id", ondelete="SET NULL"), nullable=True
    )
    top_k: Mapped[int | None] = mapped_column(Integer, nullable=True)
    repeats: Mapped[int] = mapped_column(Integer, default=3)
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    webhook_url: Mapped[str | None] = mapped_column(Text, nullable=True)
    misfire_grace_s: Mapped[float] = mapped_column(Float, default=7200.0)
    policy: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)  # tuner RegressionPolicy fields
    # The queue priority of the sweeps it fires (store.SWEEP_PRIORITIES; api/engine/_share.py).
    priority: Mapped[str] = mapped_column(String(8), default="normal", server_default="normal")
    # Fires before this instant are never owed (set on creation and whenever the schedule is enabled),
    # so a schedule that was off does not report its off-time as missed.
    active_since: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    __table_args__ = (Index(None, "enabled"),)


class ScheduleFire(Base):
    __tablename__ = "schedule_fires"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    schedule_id: Mapped[int] = mapped_column(ForeignKey("schedules.id", ondelete="CASCADE"))
    fire_time: Mapped[datetime] = mapped_column(UTCDateTime())  # UTC, whole seconds for cron
    trigger: Mapped[str] = mapped_column(String(16), default="cron")  # cron | manual
    status: Mapped[str] = mapped_column(String(16))
    claimed_by: Mapped[str | None] = mapped_column(String(200), nullable=True)
    # The sweeps this fire created: one for a template; one per layout for a re-measurement (each
    # pinned to its layout, see api/schedules/_launch.py). Empty for missed/coalesced fires.
    sweep_ids: Mapped[list[Any]] = mapped_column(JSON, default=list)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    env: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)  # the run's fingerprint
    env_changes: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)  # vs the previous run
    comparisons: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)  # every layout's verdict
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)

    __table_args__ = (
        UniqueConstraint("schedule_id", "fire_time"),
        Index(None, "status"),
    )


class ScheduleAlert(Base):
    __tablename__ = "schedule_alerts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    schedule_id: Mapped[int] = mapped_column(ForeignKey("schedules.id", ondelete="CASCADE"))
    fire_id: Mapped[int] = mapped_column(ForeignKey("schedule_fires.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(16))
    layout_key: Mapped[str | None] = mapped_column(String(200), nullable=True)
    ratio: Mapped[float | None] = mapped_column(Float, nullable=True)
    ratio_low: Mapped[float | None] = mapped_column(Float, nullable=True)
    ratio_high: Mapped[float | None] = mapped_column(Float, nullable=True)
    p_value: Mapped[float | None] = mapped_column(Float, nullable=True)
    message: Mapped[str] = mapped_column(Text)
    detail: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    delivery_status: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    next_attempt_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    delivered_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    __table_args__ = (
        UniqueConstraint("fire_id", "kind", "layout_key"),
        Index(None, "schedule_id", "created_at"),
        Index(None, "delivery_status"),
    )


class AlertDelivery(Base):
    __tablename__ = "schedule_alert_deliveries"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    fire_id: Mapped[int] = mapped_column(ForeignKey("schedule_fires.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    url: Mapped[str] = mapped_column(Text)
    ok: Mapped[bool] = mapped_column(Boolean)
    status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    alert_ids: Mapped[list[Any]] = mapped_column(JSON)
    at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    __table_args__ = (Index(None, "fire_id"),)
