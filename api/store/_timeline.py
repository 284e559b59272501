"""Memory timelines of real trials: one row per trial attempt whose ranks recorded one (the workers'
``TrialResult.memory_timeline``: per rank a few hundred points of one measured step, its phases and
where its peak falls; workers/_memory_timeline.py). Kept out of the ``trials`` table, which the
ranking and the dashboard read in bulk: only a trial's own page and API answer read this one.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy import JSON, ForeignKey
from sqlalchemy.orm import Mapped, Session, mapped_column

from api.store._models import Base


class TrialMemory(Base):
    __tablename__ = "trial_memory"

    trial_id: Mapped[int] = mapped_column(ForeignKey("trials.id", ondelete="CASCADE"), primary_key=True)
    ranks: Mapped[list[Any]] = mapped_column(JSON)  # per rank, rank order (workers/_memory_timeline.py)


def store_timeline(session: Session, *, trial_id: int, ranks: list[dict[str, Any]]) -> None:
    """Keep a trial attempt's timeline (a result lands once: record_result's guard)."""
    session.execute(sa.insert(TrialMemory).values(trial_id=trial_id, ranks=ranks))


def trial_timeline(session: Session, *, trial_id: int) -> list[dict[str, Any]] | None:
    """The trial attempt's per-rank memory timelines; None when it recorded none (simulated, failed,
    or from before timelines)."""
    return session.scalar(sa.select(TrialMemory.ranks).where(TrialMemory.trial_id == trial_id))
