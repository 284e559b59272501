"""The stored ranking, maintained as results land: one row per (sweep, metric, layout) with the
layout's aggregates and its place in the ranking, and one state row per sweep with its results
version. A ranking request reads a page of rows by rank instead of recomputing every trial.

``record_result`` calls ``fold_layout`` and bumps the results version in the result's transaction;
``rerank`` redoes the pooled intervals, order and tie groups from the rows' columns, bit for bit the
ranking recomputed from every trial.

How it stays exact: docs/store.md#stored-ranking.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import sqlalchemy as sa
from sqlalchemy import JSON, Boolean, Float, ForeignKey, Index, Integer, String
from sqlalchemy.orm import Mapped, Session, mapped_column

from api.store._models import Base, Sweep, Trial
from tuner import CONFIDENCE, PooledNoise, interval, median_of, t_quantile

RANKING_METRICS = ("tokens_per_s_per_device", "useful_tokens_per_s")  # what a ranking ranks by (the first: the default)


class RankedLayout(Base):
    __tablename__ = "ranked_layouts"

    sweep_id: Mapped[int] = mapped_column(ForeignKey("sweeps.id", ondelete="CASCADE"), primary_key=True)
    metric: Mapped[str] = mapped_column(String(32), primary_key=True)
    layout_key: Mapped[str] = mapped_column(String(200), primary_key=True)
    layout: Mapped[dict[str, Any]] = mapped_column(JSON)
    first_number: Mapped[int] = mapped_column(Integer)  # the order tuner.rank pools the groups in
    # Interval inputs (tuner._stats.interval on the finite values of the metric).
    n: Mapped[int] = mapped_column(Integer)
    median: Mapped[float] = mapped_column(Float)
    mean_log: Mapped[float | None] = mapped_column(Float, nullable=True)  # None: a value <= 0 (no pooling)
    own_low: Mapped[float | None] = mapped_column(Float, nullable=True)  # the interval without pooling
    own_high: Mapped[float | None] = mapped_column(Float, nullable=True)
    noise_ss: Mapped[float | None] = mapped_column(Float, nullable=True)  # variance * (n - 1) of log values
    noise_dof: Mapped[int] = mapped_column(Integer, default=0)
    # The ranking (rerank).
    rank: Mapped[int | None] = mapped_column(Integer, nullable=True)
    low: Mapped[float | None] = mapped_column(Float, nullable=True)
    high: Mapped[float | None] = mapped_column(Float, nullable=True)
    tie_group: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tied_with_best: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    # Medians over the same measurements, and what the row shows beside them.
    tokens_per_s_per_device: Mapped[float | None] = mapped_column(Float, nullable=True)
    useful_tokens_per_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    useful_tokens_per_s_per_device: Mapped[float | None] = mapped_column(Float, nullable=True)
    peak_memory_median: Mapped[float | None] = mapped_column(Float, nullable=True)  # bytes; the error reads the median
    # {calibration version: [predicted tokens/s per device, predicted bytes]} of the last trial
    # predicted under each version (api.ranking.service picks the sweep's current one).
    predictions: Mapped[dict[str, Any]] = mapped_column(JSON)
    simulated: Mapped[bool] = mapped_column(Boolean, default=False)
    trial_numbers: Mapped[list[Any]] = mapped_column(JSON)

    __table_args__ = (Index(None, "sweep_id", "metric", "rank"),)


class RankingState(Base):
    __tablename__ = "ranking_states"

    sweep_id: Mapped[int] = mapped_column(ForeignKey("sweeps.id", ondelete="CASCADE"), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, default=0)  # +1 per recorded result
    ranked_version: Mapped[int] = mapped_column(Integer, default=-1)  # the version the ranks reflect
    # {metric: {"total": rows, "simulated": any row simulated}}
    summary: Mapped[dict[str, Any]] = mapped_column(JSON)


_TRIAL_COLUMNS = (
    Trial.number, Trial.tokens_per_s_per_device, Trial.useful_tokens_per_s, Trial.peak_memory_bytes,
    Trial.predicted_tokens_per_s_per_device, Trial.predicted_memory_bytes, Trial.simulated, Trial.world_size,
    Trial.calibration_version,
)


def _aggregate(metric: str, ts: list[Any], layout: dict[str, Any]) -> dict[str, Any] | None:
    """One layout's row for ``metric`` from its completed trials in number order (None: none measured it)."""
    ts = [t for t in ts if getattr(t, metric) is not None]
    values = [float(getattr(t, metric)) for t in ts]
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return None
    own = interval(values)  # unpooled; the pooled one is rerank's
    positive = all(v > 0 for v in finite)
    logs = [math.log(v) for v in values if math.isfinite(v) and v > 0]  # tuner._stats.pooled_noise's filter
    predictions: dict[str, Any] = {}
    for t in ts:  # the last trial predicted under each version wins
        predictions[str(t.calibration_version or 0)] = [t.predicted_tokens_per_s_per_device, t.predicted_memory_bytes]
    return dict(
        metric=metric, layout=layout, first_number=ts[0].number, n=own.n, median=own.median,
        mean_log=statistics.fmean(math.log(v) for v in finite) if positive else None,
        own_low=own.low, own_high=own.high,
        noise_ss=statistics.variance(logs) * (len(logs) - 1) if len(logs) >= 2 else None,
        noise_dof=len(logs) - 1 if len(logs) >= 2 else 0,
        rank=None, low=None, high=None, tie_group=None, tied_with_best=None,
        tokens_per_s_per_device=median_of([t.tokens_per_s_per_device for t in ts]),
        useful_tokens_per_s=median_of([t.useful_tokens_per_s for t in ts]),
        useful_tokens_per_s_per_device=median_of([
            t.useful_tokens_per_s / t.world_size for t in ts if t.useful_tokens_per_s is not None and t.world_size
        ]),
        peak_memory_median=median_of([t.peak_memory_bytes for t in ts]), predictions=predictions,
        simulated=any(t.simulated for t in ts), trial_numbers=[t.number for t in ts],
    )


def _bump(session: Session, *, sweep_id: int) -> bool:
    """+1 on the sweep's results version, taking its state row's lock; False: the sweep has none yet."""
    return bool(session.execute(
        sa.update(RankingState).where(RankingState.sweep_id == sweep_id)
        .values(version=RankingState.version + 1).execution_options(synchronize_session=False)
    ).rowcount)


def fold_layout(session: Session, *, sweep_id: int, layout_key: str) -> None:
    """A result of ``layout_key`` landed: recompute that layout's rows from its trials and mark the
    sweep's ranking out of date (``rerank`` puts it back in order). Three statements and a write."""
    if not _bump(session, sweep_id=sweep_id):  # the sweep's first result (or one from before the table)
        rebuild(session, sweep_id=sweep_id)
        return
    every = session.execute(
        sa.select(Trial.status, Trial.repeat, Trial.phase, Trial.layout, *_TRIAL_COLUMNS)
        .where(Trial.sweep_id == sweep_id, Trial.layout_key == layout_key).order_by(Trial.number)
    ).all()
    ts = [t for t in every if t.status == "completed" and t.tokens_per_s_per_device is not None
          and t.phase != "confirm"]  # a confirm run is a longer run: its own report, not a repeat
    layout = next((t.layout for t in every if t.repeat == 0), None) or {}  # as store.layouts_of picks it
    session.execute(sa.delete(RankedLayout).where(RankedLayout.sweep_id == sweep_id,
                                                  RankedLayout.layout_key == layout_key))
    rows = [r for m in RANKING_METRICS if (r := _aggregate(m, ts, layout)) is not None] if ts else []
    if rows:
        session.execute(sa.insert(RankedLayout), [r | {"sweep_id": sweep_id, "layout_key": layout_key} for r in rows])


def note_result(session: Session, *, sweep_id: int, layout_key: str | None, completed: bool) -> None:
    """What ``record_result`` calls: a completed measurement is folded in; any other result only
    moves the results version (the ETag), since it changes no ranked row."""
    if completed and layout_key is not None:
        fold_layout(session, sweep_id=sweep_id, layout_key=layout_key)
    elif not _bump(session, sweep_id=sweep_id):
        rebuild(session, sweep_id=sweep_id)


def rebuild(session: Session, *, sweep_id: int) -> None:
    """Every row of the sweep from its trials (the backfill, and the first result of a sweep)."""
    ts_by_key: dict[str, list[Any]] = {}
    for t in session.execute(
        sa.select(Trial.layout_key, *_TRIAL_COLUMNS).where(
            Trial.sweep_id == sweep_id, Trial.status == "completed", Trial.tokens_per_s_per_device.is_not(None),
            Trial.phase != "confirm")
        .order_by(Trial.number)
    ):
        ts_by_key.setdefault(t.layout_key, []).append(t)
    layouts: dict[str, dict[str, Any]] = {}
    keys = list(ts_by_key)
    for i in range(0, len(keys), 500):
        for key, layout in session.execute(
            sa.select(Trial.layout_key, Trial.layout)
            .where(Trial.sweep_id == sweep_id, Trial.layout_key.in_(keys[i:i + 500]), Trial.repeat == 0)
            .order_by(Trial.number)
        ):
            layouts.setdefault(key, layout)
    session.execute(sa.delete(RankedLayout).where(RankedLayout.sweep_id == sweep_id))
    rows = [
        r | {"sweep_id": sweep_id, "layout_key": key}
        for key, ts in ts_by_key.items() for m in RANKING_METRICS
        if (r := _aggregate(m, ts, layouts.get(key, {}))) is not None
    ]
    for i in range(0, len(rows), 1000):
        session.execute(sa.insert(RankedLayout), rows[i:i + 1000])
    state = session.get(RankingState, sweep_id, populate_existing=True)
    if state is None:
        session.add(RankingState(sweep_id=sweep_id, version=0, ranked_version=-1, summary={}))
    else:
        state.version += 1
    session.flush()
    rerank(session, sweep_id=sweep_id)


_RANK_COLUMNS = (
    RankedLayout.metric, RankedLayout.layout_key, RankedLayout.first_number, RankedLayout.n, RankedLayout.median,
    RankedLayout.mean_log, RankedLayout.own_low, RankedLayout.own_high, RankedLayout.noise_ss,
    RankedLayout.noise_dof, RankedLayout.rank, RankedLayout.low, RankedLayout.high, RankedLayout.tie_group,
    RankedLayout.tied_with_best, RankedLayout.simulated,
)


def _ranks(rows: list[Any]) -> dict[str, tuple[int, float | None, float | None, int, bool]]:
    """key -> (rank, low, high, tie group, tied with best): tuner._stats.rank on the stored inputs."""
    rows = sorted(rows, key=lambda r: r.first_number)  # the dict order rank() pools and rates in
    ss, dof, used = 0.0, 0, 0
    for r in rows:
        if r.noise_dof:
            ss += r.noise_ss
            dof += r.noise_dof
            used += 1
    noise = PooledNoise(math.sqrt(ss / dof), dof, used) if dof else None
    t = t_quantile(0.5 + CONFIDENCE / 2, noise.dof) if noise is not None else None
    bounds: dict[str, tuple[float, float | None, float | None]] = {}
    for r in rows:
        if noise is not None and r.mean_log is not None:
            half = t * noise.sigma / math.sqrt(r.n)
            bounds[r.layout_key] = (r.median, min(math.exp(r.mean_log - half), r.median),
                                    max(math.exp(r.mean_log + half), r.median))
        else:
            bounds[r.layout_key] = (r.median, r.own_low, r.own_high)
    order = sorted(bounds, key=lambda k: (-bounds[k][0], k))

    def overlaps(a: str, b: str) -> bool:
        _, lo_a, hi_a = bounds[a]
        _, lo_b, hi_b = bounds[b]
        if lo_a is None or hi_a is None or lo_b is None or hi_b is None:
            return True
        return lo_a <= hi_b and lo_b <= hi_a

    out = {}
    group, leader = 0, None
    for i, key in enumerate(order):
        if leader is None or not overlaps(key, leader):
            group, leader = group + 1, key
        out[key] = (i + 1, bounds[key][1], bounds[key][2], group, overlaps(key, order[0]))
    return out


def rerank(session: Session, *, sweep_id: int) -> None:
    """Put the sweep's rows in order after results were folded in (a no-op when they are)."""
    state = session.scalars(
        sa.select(RankingState).where(RankingState.sweep_id == sweep_id).with_for_update()
        .execution_options(populate_existing=True)
    ).first()
    if state is None:
        rebuild(session, sweep_id=sweep_id)
        return
    if state.ranked_version == state.version:
        return
    by_metric: dict[str, list[Any]] = {m: [] for m in RANKING_METRICS}
    for r in session.execute(sa.select(*_RANK_COLUMNS).where(RankedLayout.sweep_id == sweep_id)):
        by_metric[r.metric].append(r)
    summary = {}
    for metric, rows in by_metric.items():
        ranks = _ranks(rows)
        changed = [
            {"sweep_id": sweep_id, "metric": metric, "layout_key": r.layout_key, "rank": new[0], "low": new[1],
             "high": new[2], "tie_group": new[3], "tied_with_best": new[4]}
            for r in rows if (new := ranks[r.layout_key]) != (r.rank, r.low, r.high, r.tie_group, r.tied_with_best)
        ]
        if changed:  # ORM bulk UPDATE by primary key (one executemany)
            session.execute(sa.update(RankedLayout), changed)
        summary[metric] = {"total": len(rows), "simulated": any(r.simulated for r in rows)}
    state.ranked_version, state.summary = state.version, summary
    session.flush()


def best_row(session: Session, *, sweep_id: int) -> RankedLayout | None:
    """The first row of the tokens/s-per-device ranking (what the sweeps list calls "best")."""
    return session.scalars(sa.select(RankedLayout).where(
        RankedLayout.sweep_id == sweep_id, RankedLayout.metric == RANKING_METRICS[0], RankedLayout.rank == 1)).first()


def ranking_state(session: Session, *, sweep_id: int) -> Any | None:
    """(calibration, version, ranked_version, summary) of a sweep in one round trip; None: no such sweep.
    version is None when the sweep has no state row yet (a sweep from before the table, never ranked)."""
    return session.execute(
        sa.select(Sweep.calibration, RankingState.version, RankingState.ranked_version, RankingState.summary)
        .select_from(Sweep).outerjoin(RankingState, RankingState.sweep_id == Sweep.id).where(Sweep.id == sweep_id)
    ).first()


def ensure_ranked(session: Session, *, sweep_id: int) -> None:
    """Bring a stale or missing stored ranking up to date (results stored without a refresh)."""
    if session.get(RankingState, sweep_id, populate_existing=True) is None:
        rebuild(session, sweep_id=sweep_id)
    else:
        rerank(session, sweep_id=sweep_id)


def ranked_rows(session: Session, *, sweep_id: int, metric: str, limit: int | None = None,
                offset: int = 0) -> list[Any]:
    """Rows of the stored ranking in rank order, ``limit`` of them from ``offset`` (all: None), as
    light rows (Core, not ORM: the whole ranking of 4,000 layouts is read without building objects)."""
    table = RankedLayout.__table__
    query = sa.select(table).where(table.c.sweep_id == sweep_id, table.c.metric == metric)
    if offset:  # by the rank index: a page starts at a rank, not after sorting what comes before it
        query = query.where(table.c.rank > offset)
    query = query.order_by(table.c.rank)
    if limit is not None:  # a LIMIT, not rank <= offset + limit: that sum overflows PostgreSQL's INTEGER
        query = query.limit(limit)
    return list(session.execute(query).all())


def results_versions(session: Session) -> dict[int, int]:
    """Every ranked sweep's results version (what a mirror of the results compares to its last pass)."""
    return {int(sid): int(v) for sid, v in session.execute(sa.select(RankingState.sweep_id, RankingState.version))}
