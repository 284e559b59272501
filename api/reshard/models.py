"""SQLAlchemy model of reshard checks, on the store's declarative ``Base`` (one Alembic history).

``ReshardCheck``: one row per ``reshard-check`` run against a sweep's problem (model, cluster,
training): the two layouts, the step counts, the verdict ("ok", "corrupted", "diverged", "failed")
and the numbers behind it (tensors compared, mismatching tensors, max abs diff, A's uninterrupted
and B's continued losses, the tolerance they were held to). Deleted with its sweep.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Float, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from api.store._models import Base, utcnow
from api.store._types import UTCDateTime

RESHARD_VERDICTS = ("ok", "corrupted", "diverged", "failed")


class ReshardCheck(Base):
    __tablename__ = "reshard_checks"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    sweep_id: Mapped[int] = mapped_column(ForeignKey("sweeps.id", ondelete="CASCADE"))
    owner: Mapped[str | None] = mapped_column(String(200), nullable=True)
    from_layout: Mapped[dict[str, Any]] = mapped_column(JSON)
    to_layout: Mapped[dict[str, Any]] = mapped_column(JSON)
    from_key: Mapped[str] = mapped_column(String(200))
    to_key: Mapped[str] = mapped_column(String(200))
    steps_before: Mapped[int] = mapped_column(Integer)
    steps_after: Mapped[int] = mapped_column(Integer)
    verdict: Mapped[str] = mapped_column(String(16))
    tensors_checked: Mapped[int] = mapped_column(Integer, default=0)
    mismatch_count: Mapped[int] = mapped_column(Integer, default=0)
    mismatches: Mapped[list[Any]] = mapped_column(JSON)  # [{key, max_abs_diff, detail}], at most 200
    max_abs_diff: Mapped[float | None] = mapped_column(Float, nullable=True)
    losses_before: Mapped[list[Any]] = mapped_column(JSON)
    losses_a: Mapped[list[Any]] = mapped_column(JSON)  # A continued without interruption
    losses_b: Mapped[list[Any]] = mapped_column(JSON)  # B after the load, same steps
    max_rel_loss_diff: Mapped[float | None] = mapped_column(Float, nullable=True)
    tolerance: Mapped[float] = mapped_column(Float)
    corrupt: Mapped[str | None] = mapped_column(String(32), nullable=True)
    backend: Mapped[str] = mapped_column(String(200))
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    save_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    load_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    wall_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    __table_args__ = (Index(None, "sweep_id", "created_at"),)
