"""Keyword-only store functions for the engine's device sharing (api/engine/_share.py)."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.orm import Session

from api.store._models import Trial, utcnow


def restart_trial_clock(session: Session, *, sweep_id: int, number: int, attempt: int) -> None:
    """A re-run found waiting for devices after a restart starts now: its row's ``started_at`` is when
    its devices were granted, so a stored interval never claims devices the trial did not hold."""
    session.execute(
        sa.update(Trial).where(Trial.sweep_id == sweep_id, Trial.number == number, Trial.attempt == attempt,
                               Trial.status == "running")
        .values(started_at=utcnow()).execution_options(synchronize_session=False)
    )
