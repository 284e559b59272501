"""SQLAlchemy 2 models of the store: one row per sweep, one row per trial attempt.

The schema is owned by Alembic (``migrations/``); ``Base.metadata.create_all`` is for nothing but
comparing the models against the migrations in tests.

Trial identity: ``(sweep_id, number, attempt)`` is unique. ``number`` is the sweep-wide trial number
(search trials and re-measurements alike); ``attempt`` grows only when a coordinator restart finds the
trial "running" (the stale row is marked ``interrupted`` and the trial re-runs as ``attempt + 1``).
So every number has exactly one row that is not ``interrupted``.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from api.store._types import UTCDateTime
from workers import DIAGNOSTIC_OPTIONS

SWEEP_STATUSES = ("queued", "running", "completed", "cancelled", "failed")
FINISHED_SWEEP_STATUSES = ("completed", "cancelled", "failed")
SWEEP_PRIORITIES = ("high", "normal", "low")  # the queue's order after fair share (api/engine/_share.py)
# "pruned": rejected by the memory model before running (no device time).
# "interrupted": a stale attempt found running after a coordinator restart (re-run as attempt+1).
TRIAL_STATUSES = ("running", "pruned", "completed", "oom", "timeout", "crash", "nan", "interrupted")
INFEASIBLE_TRIAL_STATUSES = ("pruned", "oom", "timeout")  # told to the sampler as constraint violations
FAILED_TRIAL_STATUSES = ("crash", "nan")
TERMINAL_TRIAL_STATUSES = ("pruned", "completed", "oom", "timeout", "crash", "nan")
# "confirm": a longer run of a leading layout (api/engine/_confirm.py), never in the short-run ranking.
PHASES = ("search", "remeasure", "confirm")

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


# The backend whose results are the analytical model with noise: its sweeps, and every row of them
# (pruned ones, which no backend answered, included), are labelled simulated.
SIMULATE_BACKEND = "simulate"

class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class Sweep(Base):
    __tablename__ = "sweeps"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200))
    owner: Mapped[str | None] = mapped_column(String(200), nullable=True)
    status: Mapped[str] = mapped_column(String(16), default="queued")
    # The queue's priority (SWEEP_PRIORITIES); fair share between owners comes first (api/engine/_share.py).
    priority: Mapped[str] = mapped_column(String(8), default="normal", server_default="normal")
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    backend: Mapped[str] = mapped_column(String(200))
    sampler: Mapped[str] = mapped_column(String(16))
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    # Why it ended, one line (api/engine/_budget.py: max_trials, device budget, patience, every layout
    # tried, nothing left predicted to fit; cancelled; failed with its cause); null while it runs.
    stop_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    # Fitted tuner.CalibrationFactors (as a dict) and the fit's quality; used for later predictions.
    calibration: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # The cluster fingerprint of its measurements (device, torch, NCCL from the trials' env): a later
    # sweep on the same fingerprint starts from what this one learned (api.engine._learned).
    fingerprint: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # Which coordinator runs it (host:pid:uuid) and when it last said so; lets a restart take over.
    runner_id: Mapped[str | None] = mapped_column(String(200), nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # Cache for fast listing (kept up to date by the engine when a trial is recorded).
    n_trials: Mapped[int] = mapped_column(Integer, default=0)
    n_completed: Mapped[int] = mapped_column(Integer, default=0)
    n_pruned: Mapped[int] = mapped_column(Integer, default=0)
    n_failed: Mapped[int] = mapped_column(Integer, default=0)
    device_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    best_layout_key: Mapped[str | None] = mapped_column(String(200), nullable=True)
    best_tokens_per_s_per_device: Mapped[float | None] = mapped_column(Float, nullable=True)
    best_useful_tokens_per_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    best_peak_memory_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # The latest confirm run asked of the sweep (api/engine/_confirm.py): {round, top_k, steps, keys, ...}.
    confirm: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)

    # Filled in by the services for the API (not stored): the sweep's place among the queued ones
    # (1 = next to start; None once it runs) and its trials running now.
    queue_position = None
    running_trials = 0

    @property
    def diagnostic(self) -> bool:
        """trial.options inject failures, slowness or a memory cap (workers.DIAGNOSTIC_OPTIONS): the
        sweep's numbers are diagnostics, not real measurements of its layouts. Derived from the spec."""
        options = ((self.spec or {}).get("trial") or {}).get("options") or {}
        return any(options.get(k) is not None for k in DIAGNOSTIC_OPTIONS)

    @property
    def simulated(self) -> bool:
        """Every trial of a sweep on the ``simulate`` backend is the analytical model with noise: its
        device time and throughput are simulated, never counted as measured."""
        return self.backend == SIMULATE_BACKEND

    __table_args__ = (
        Index(None, "status", "created_at"),
        Index(None, "owner", "created_at"),
        Index(None, "created_at"),
        Index(None, "fingerprint", "status"),
    )


class Trial(Base):
    __tablename__ = "trials"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    sweep_id: Mapped[int] = mapped_column(ForeignKey("sweeps.id", ondelete="CASCADE"))
    number: Mapped[int] = mapped_column(Integer)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    phase: Mapped[str] = mapped_column(String(16), default="search")
    source: Mapped[str] = mapped_column(String(32), default="sampler")  # warm_start/reference/sampler/...
    repeat: Mapped[int] = mapped_column(Integer, default=0)  # 0 = first measurement of the layout
    layout: Mapped[dict[str, Any]] = mapped_column(JSON)
    layout_key: Mapped[str] = mapped_column(String(200))  # also the measurement group of re-measurements
    world_size: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16), default="running")
    cause: Mapped[str | None] = mapped_column(Text, nullable=True)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # The analytical model's predictions at proposal time (calibrated when the sweep had a fit).
    predicted_memory_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    predicted_step_time_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    predicted_tokens_per_s_per_device: Mapped[float | None] = mapped_column(Float, nullable=True)
    useful_fraction: Mapped[float | None] = mapped_column(Float, nullable=True)
    # The sweep's calibration version the predictions above were made under (0: the analytical prior).
    calibration_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Measurements.
    step_time_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    tokens_per_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    tokens_per_s_per_device: Mapped[float | None] = mapped_column(Float, nullable=True)
    useful_tokens_per_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    mfu: Mapped[float | None] = mapped_column(Float, nullable=True)
    peak_memory_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    peak_reserved_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    memory_measure: Mapped[str | None] = mapped_column(String(64), nullable=True)
    step_times_s: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)
    losses: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)
    stage_times_s: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)
    stage_imbalance: Mapped[float | None] = mapped_column(Float, nullable=True)
    env: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    env_fingerprint: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # rank -> the node id its process ran on (TrialResult.rank_nodes): where the placement landed.
    rank_nodes: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)
    backend: Mapped[str | None] = mapped_column(String(200), nullable=True)
    simulated: Mapped[bool] = mapped_column(Boolean, default=False)
    wall_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    device_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)

    __table_args__ = (
        UniqueConstraint("sweep_id", "number", "attempt"),
        Index(None, "sweep_id", "status"),
        Index(None, "sweep_id", "tokens_per_s_per_device"),
        Index(None, "sweep_id", "layout_key"),
        Index(None, "status"),
    )
