"""Keyword-only store functions of confirm runs (api/engine/_confirm.py): the request kept on the
sweep (``sweeps.confirm``), a completed sweep reopened for it, and the rows the report reads."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from api.store._models import Sweep, Trial, utcnow


def set_confirm(session: Session, *, sweep_id: int, confirm: dict[str, Any]) -> None:
    session.execute(sa.update(Sweep).where(Sweep.id == sweep_id).values(confirm=confirm)
                    .execution_options(synchronize_session=False))


def reopen_for_confirm(session: Session, *, sweep_id: int, confirm: dict[str, Any], runner_id: str | None = None) -> bool:
    """A completed sweep takes a confirm request and runs again: queued for a coordinator, or (with
    ``runner_id``) already running under that runner (``meshtune confirm`` runs it in the foreground,
    as ``meshtune sweep`` does, so no coordinator claims it first). A conditional UPDATE: False (and
    nothing changed) when the sweep is no longer completed, e.g. a concurrent request won."""
    values: dict[str, Any] = {"status": "queued", "confirm": confirm, "error": None}
    if runner_id is not None:
        values.update(status="running", runner_id=runner_id, heartbeat_at=utcnow())
    result = session.execute(sa.update(Sweep).where(Sweep.id == sweep_id, Sweep.status == "completed")
                             .values(**values).execution_options(synchronize_session=False))
    return bool(result.rowcount)


def short_run_trials(session: Session, *, sweep_id: int, keys: list[str]) -> list[Any]:
    """The completed short-run measurements (search and re-measurement) of these layouts, light rows."""
    return list(session.execute(
        sa.select(Trial.layout_key, Trial.number, Trial.step_time_s, Trial.step_times_s, Trial.tokens_per_s_per_device)
        .where(Trial.sweep_id == sweep_id, Trial.layout_key.in_(keys), Trial.phase != "confirm",
               Trial.status == "completed", Trial.tokens_per_s_per_device.is_not(None))
        .order_by(Trial.number)
    ).all())


def confirm_trials(session: Session, *, sweep_id: int, round: int) -> list[Trial]:
    """The live rows (not interrupted) of confirm round ``round``, by number."""
    return list(session.scalars(
        sa.select(Trial).where(Trial.sweep_id == sweep_id, Trial.phase == "confirm", Trial.repeat == round,
                               Trial.status != "interrupted").order_by(Trial.number)
        .execution_options(populate_existing=True)
    ).all())
