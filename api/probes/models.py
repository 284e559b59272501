"""SQLAlchemy model of cluster probes, on the store's declarative ``Base`` (one Alembic history).

``ClusterProbe``: one row per finished probe. ``key`` names what it measured (the cluster's hardware,
the model's shapes, the compute dtype, the backend and workload: api/probes/service.py ``probe_key``);
``env_fingerprint`` the software and devices it ran on (device, driver, torch, CUDA, NCCL, backend:
api/engine/_learned.py). A probe is used by a sweep of the same key and fingerprint whose
``version`` is the probe code's (tuner/_probe.py ``PROBE_VERSION``); anything else is re-probed. A
row is written once, complete, at the probe's end: an interrupted probe leaves none.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Float, Index, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from api.store._models import Base, utcnow
from api.store._types import UTCDateTime


class ClusterProbe(Base):
    __tablename__ = "cluster_probes"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    key: Mapped[str] = mapped_column(String(64))
    env_fingerprint: Mapped[str] = mapped_column(String(64))
    version: Mapped[int] = mapped_column(Integer)
    backend: Mapped[str] = mapped_column(String(200))
    cluster: Mapped[dict[str, Any]] = mapped_column(JSON)  # the hardware probed (ClusterSpec, no price)
    model: Mapped[dict[str, Any]] = mapped_column(JSON)  # whose shapes the compute was measured at
    dtype: Mapped[str] = mapped_column(String(32))
    figures: Mapped[dict[str, Any]] = mapped_column(JSON)  # tuner.ProbedFigures.to_dict()
    raw: Mapped[dict[str, Any]] = mapped_column(JSON)  # the rank program's timings (workers/probe.py)
    env: Mapped[dict[str, Any]] = mapped_column(JSON)
    wall_s: Mapped[float] = mapped_column(Float)  # the whole probe, gang start included
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    __table_args__ = (Index(None, "key", "env_fingerprint", "created_at"),)
