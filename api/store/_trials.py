"""Keyword-only store functions for trials. Reporting a result is idempotent: a trial row accepts one
result (only while it is "running"); a duplicate report of the same (sweep, number, attempt) changes
nothing and returns False. Inserting an existing (sweep, number, attempt) is a no-op too."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from api.store import _ranking, _timeline
from api.store._models import SIMULATE_BACKEND, Sweep, Trial, utcnow
from workers import TrialResult


def env_fingerprint(env: dict[str, Any] | None) -> str | None:
    """A short stable hash of the measurement environment (versions, devices, hosts)."""
    if not env:
        return None
    return hashlib.sha256(json.dumps(env, sort_keys=True, default=str).encode()).hexdigest()[:16]


def insert_trial(
    session: Session,
    *,
    sweep_id: int,
    number: int,
    layout: dict[str, Any],
    layout_key: str,
    world_size: int,
    attempt: int = 0,
    phase: str = "search",
    source: str = "sampler",
    repeat: int = 0,
    status: str = "running",
    cause: str | None = None,
    predicted_memory_bytes: int | None = None,
    predicted_step_time_s: float | None = None,
    predicted_tokens_per_s_per_device: float | None = None,
    useful_fraction: float | None = None,
    backend: str | None = None,
    calibration_version: int | None = None,
) -> bool:
    """Insert one trial row (ON CONFLICT DO NOTHING); returns whether it was inserted."""
    now = utcnow()
    values = dict(
        sweep_id=sweep_id, number=number, attempt=attempt, phase=phase, source=source, repeat=repeat,
        layout=layout, layout_key=layout_key, world_size=world_size, status=status, cause=cause,
        predicted_memory_bytes=predicted_memory_bytes, predicted_step_time_s=predicted_step_time_s,
        predicted_tokens_per_s_per_device=predicted_tokens_per_s_per_device, useful_fraction=useful_fraction,
        calibration_version=calibration_version, backend=backend, device_seconds=0.0, created_at=now,
        # a row with no result yet (pruned, or running) is simulated when its backend is: labelled as its sweep
        simulated=backend == SIMULATE_BACKEND,
        started_at=now if status == "running" else None, finished_at=None if status == "running" else now,
    )
    dialect = session.get_bind().dialect.name
    insert = {"postgresql": postgresql.insert, "sqlite": sqlite.insert}.get(dialect)
    if insert is None:  # another database: a plain guarded insert
        exists = session.scalar(sa.select(Trial.id).where(
            Trial.sweep_id == sweep_id, Trial.number == number, Trial.attempt == attempt))
        if exists is not None:
            return False
        session.execute(sa.insert(Trial).values(**values))
        return True
    stmt = (
        insert(Trial).values(**values)
        .on_conflict_do_nothing(index_elements=["sweep_id", "number", "attempt"])
        .returning(Trial.id)  # rowcount is -1 under RETURNING (PostgreSQL): test the row instead
    )
    return session.execute(stmt).first() is not None


def record_result(
    session: Session,
    *,
    sweep_id: int,
    number: int,
    attempt: int,
    result: TrialResult,
    useful_fraction: float | None = None,
    layout_key: str | None = None,
    runner_id: str | None = None,
) -> bool:
    """Store a backend's result on a running trial. Returns False (and changes nothing) when the trial
    already has a result or does not exist — a duplicate report is idempotent. With ``layout_key`` the
    row must hold that layout (a measurement never lands on another layout's row); with ``runner_id``
    that runner must still own the sweep (a coordinator whose sweep was taken over records nothing)."""
    err = result.error
    tokens = result.tokens_per_s
    useful = tokens * useful_fraction if (tokens is not None and useful_fraction is not None) else None
    values: dict[str, Any] = dict(
        status=result.status,
        cause=(f"{err.kind}: {err.message}" if err else None),
        error=(result.to_dict()["error"] if err else None),
        step_time_s=result.step_time_s,
        tokens_per_s=tokens,
        tokens_per_s_per_device=result.tokens_per_s_per_device,
        useful_tokens_per_s=useful,
        mfu=result.mfu,
        peak_memory_bytes=result.peak_memory_bytes,
        peak_reserved_bytes=result.peak_reserved_bytes,
        memory_measure=result.memory_measure,
        step_times_s=list(result.step_times_s),
        losses=[float(x) if x == x else None for x in result.losses],  # NaN is not JSON
        stage_times_s=list(result.stage_times_s),
        stage_imbalance=result.stage_imbalance,
        env=result.env or None,
        env_fingerprint=env_fingerprint(result.env),
        rank_nodes=list(result.rank_nodes) or None,
        backend=result.backend,
        simulated=bool(result.simulated),
        wall_s=result.wall_s,
        device_seconds=float(result.device_seconds or 0.0),
        finished_at=utcnow(),
    )
    stmt = (
        sa.update(Trial)
        .where(Trial.sweep_id == sweep_id, Trial.number == number, Trial.attempt == attempt,
               Trial.status == "running")
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if layout_key is not None:
        stmt = stmt.where(Trial.layout_key == layout_key)
    if runner_id is not None:
        owned = sa.select(Sweep.id).where(Sweep.id == sweep_id, Sweep.runner_id == runner_id).scalar_subquery()
        stmt = stmt.where(Trial.sweep_id == owned)
    if not session.execute(stmt).rowcount:
        return False
    if layout_key is None:
        layout_key = session.scalar(sa.select(Trial.layout_key).where(
            Trial.sweep_id == sweep_id, Trial.number == number, Trial.attempt == attempt))
    if result.memory_timeline:  # its own table: the ranking and the dashboard read trials in bulk
        trial_id = session.scalar(sa.select(Trial.id).where(
            Trial.sweep_id == sweep_id, Trial.number == number, Trial.attempt == attempt))
        _timeline.store_timeline(session, trial_id=trial_id, ranks=result.memory_timeline)
    # The stored ranking follows in the same transaction (api/store/_ranking.py).
    _ranking.note_result(session, sweep_id=sweep_id, layout_key=layout_key,
                         completed=result.status == "completed" and result.tokens_per_s_per_device is not None)
    return True


RESTART_CAUSE = "coordinator stopped while the trial ran; re-run as attempt+1"


def mark_interrupted(session: Session, *, sweep_id: int, cause: str = RESTART_CAUSE) -> list[Trial]:
    """Mark every "running" row of the sweep "interrupted" with ``cause`` and return them. On a
    restart (the default cause) the caller re-runs each under the same number with ``attempt + 1``;
    when the sweep fails, the cause says why and nothing re-runs them."""
    rows = list(session.scalars(
        sa.select(Trial).where(Trial.sweep_id == sweep_id, Trial.status == "running").order_by(Trial.number)
        .execution_options(populate_existing=True)
    ).all())
    if rows:
        session.execute(
            sa.update(Trial)
            .where(Trial.id.in_([r.id for r in rows]), Trial.status == "running")
            .values(status="interrupted", cause=cause, finished_at=utcnow())
            .execution_options(synchronize_session=False)
        )
    return rows


def get_trial(session: Session, *, sweep_id: int, trial_id: int) -> Trial | None:
    trial = session.get(Trial, trial_id, populate_existing=True)
    return trial if trial is not None and trial.sweep_id == sweep_id else None


def get_trial_by_number(session: Session, *, sweep_id: int, number: int, attempt: int | None = None) -> Trial | None:
    query = sa.select(Trial).where(Trial.sweep_id == sweep_id, Trial.number == number)
    if attempt is not None:
        query = query.where(Trial.attempt == attempt)
    return session.scalars(
        query.order_by(Trial.attempt.desc()).limit(1).execution_options(populate_existing=True)
    ).first()


def list_trials(
    session: Session,
    *,
    sweep_id: int,
    status: str | None = None,
    phase: str | None = None,
    limit: int | None = 100,
    offset: int = 0,
) -> tuple[list[Trial], int]:
    """Trials of a sweep in number/attempt order, with the filtered total."""
    where = [Trial.sweep_id == sweep_id]
    if status is not None:
        where.append(Trial.status == status)
    if phase is not None:
        where.append(Trial.phase == phase)
    total = session.scalar(sa.select(sa.func.count()).select_from(Trial).where(*where)) or 0
    query = sa.select(Trial).where(*where).order_by(Trial.number, Trial.attempt).offset(offset)
    if limit is not None:
        query = query.limit(limit)
    return list(session.scalars(query.execution_options(populate_existing=True)).all()), int(total)


def all_trials(session: Session, *, sweep_id: int) -> list[Trial]:
    return list_trials(session, sweep_id=sweep_id, limit=None)[0]


RANKING_COLUMNS = (
    Trial.number, Trial.layout_key, Trial.tokens_per_s_per_device, Trial.useful_tokens_per_s,
    Trial.peak_memory_bytes, Trial.predicted_tokens_per_s_per_device, Trial.predicted_memory_bytes,
    Trial.step_time_s, Trial.simulated, Trial.world_size, Trial.calibration_version,
)


def measured_trials(session: Session, *, sweep_id: int) -> list[Any]:
    """Completed measurements of a sweep (search and re-measurement; confirm runs are not short-run
    measurements) as light rows (Core, not ORM: only the columns ranking needs, so 10,000 trials stay
    fast). ``layouts_of`` gives the layouts."""
    return list(session.execute(
        sa.select(*RANKING_COLUMNS).where(Trial.sweep_id == sweep_id, Trial.status == "completed",
                                          Trial.tokens_per_s_per_device.is_not(None), Trial.phase != "confirm")
        .order_by(Trial.number)
    ).all())


def layouts_of(session: Session, *, sweep_id: int, keys: list[str]) -> dict[str, dict[str, Any]]:
    """Layout dicts of the given layout keys in a sweep (from their first search trial)."""
    out: dict[str, dict[str, Any]] = {}
    for i in range(0, len(keys), 500):
        chunk = keys[i:i + 500]
        for key, layout in session.execute(
            sa.select(Trial.layout_key, Trial.layout)
            .where(Trial.sweep_id == sweep_id, Trial.layout_key.in_(chunk), Trial.repeat == 0)
            .order_by(Trial.number)
        ):
            out.setdefault(key, layout)
    return out


def next_number(session: Session, *, sweep_id: int) -> int:
    current = session.scalar(sa.select(sa.func.max(Trial.number)).where(Trial.sweep_id == sweep_id))
    return 0 if current is None else int(current) + 1
