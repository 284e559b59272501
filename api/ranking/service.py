"""Sweep rankings: measured layouts ranked by a metric (median over re-measurements, 95% interval,
tie groups), each row with its prediction under the sweep's calibration now, as dataclasses, a tag
and CSV. What the routes, dashboard, CLI, exports and schedules read. Keyword-only like the other
services; an unknown sweep raises NotFoundError and an unknown metric SpecError (tuner._errors).

``ranking`` reads the stored ranking that each recorded result keeps up to date
(api/store/_ranking.py); ``ranking_from_trials`` recomputes it from every trial, the reference the
stored one is tested against.
"""

from __future__ import annotations

import csv
import io
import json
import threading
import zlib
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy.orm import Session

from api import store
from api.engine import predict_under
from api.paging import MAX_RANKING_PAGE, check_page
from api.ranking import budget
from api.spec import SweepSpec
from api.store import RANKING_METRICS, Sweep
from tuner import Layout, NotFoundError, SpecError, median_of, rank, relative_error

Predictions = dict[str, tuple[float | None, int | None]]  # layout key -> (tokens/s per device, peak bytes)


@dataclass
class RankingRow:
    rank: int
    layout_key: str
    layout: dict[str, Any]
    n: int  # measurements of this layout (1 + re-measurements)
    median: float
    low: float | None  # 95% interval (on log values); None when n < 2 (unknown: never "not tied")
    high: float | None
    tie_group: int
    tied_with_best: bool
    tokens_per_s_per_device: float  # median over measurements
    useful_tokens_per_s: float | None  # median, whole job (all devices)
    useful_tokens_per_s_per_device: float | None  # median, per device (comparable with tokens_per_s_per_device)
    peak_memory_bytes: int | None
    predicted_tokens_per_s_per_device: float | None
    prediction_error: float | None  # (predicted - measured) / measured, on tokens/s per device
    predicted_memory_bytes: int | None
    memory_prediction_error: float | None
    simulated: bool
    trial_numbers: list[int] = field(default_factory=list)
    budget: dict[str, Any] | None = None  # time and cost to train the token budget (api.ranking.budget)


@dataclass
class Ranking:
    sweep_id: int
    metric: str
    rows: list[RankingRow]
    calibration: dict[str, Any] | None
    simulated: bool  # any row comes from the simulate backend
    diagnostic: bool = False  # trial.options injected failures/sleeps/memory caps: not real measurements
    total: int = 0  # ranked layouts in the whole ranking (rows may be one page of them)
    budget: dict[str, Any] | None = None  # token budget, price, and what the search spent

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_metric(metric: str) -> None:
    if metric not in RANKING_METRICS:
        raise SpecError(f"metric={metric!r} is not a ranking metric (one of {', '.join(RANKING_METRICS)})")


def _known_sweep(session: Session, sweep_id: int) -> Sweep:
    sweep = store.get_sweep(session, sweep_id=sweep_id)
    if sweep is None:
        raise NotFoundError(f"sweep {sweep_id} does not exist")
    return sweep


def ranking(session: Session, *, sweep_id: int, metric: str = "tokens_per_s_per_device",
            limit: int | None = None, offset: int = 0) -> Ranking:
    """Measured layouts ranked by ``metric`` (median over re-measurements, 95% interval, ties): the
    stored ranking that results keep up to date (api/store/_ranking.py), ``limit`` rows from
    ``offset`` (all: None). ``Ranking.total`` counts every ranked layout."""
    _check_metric(metric)
    check_page(limit, offset, max_limit=MAX_RANKING_PAGE, optional=True)
    sweep = _known_sweep(session, sweep_id)
    state = _ranked_state(session, sweep_id=sweep_id)
    stored = store.ranked_rows(session, sweep_id=sweep_id, metric=metric, limit=limit, offset=offset)
    predicted = _predicted_stored(sweep, stored)
    rows = []
    for r in stored:
        peak = r.peak_memory_median
        pred_tps, pred_mem = predicted.get(r.layout_key, (None, None))
        rows.append(RankingRow(
            rank=r.rank, layout_key=r.layout_key, layout=r.layout, n=r.n, median=r.median, low=r.low, high=r.high,
            tie_group=r.tie_group, tied_with_best=r.tied_with_best, tokens_per_s_per_device=r.tokens_per_s_per_device,
            useful_tokens_per_s=r.useful_tokens_per_s, useful_tokens_per_s_per_device=r.useful_tokens_per_s_per_device,
            peak_memory_bytes=None if peak is None else int(peak),
            predicted_tokens_per_s_per_device=pred_tps, prediction_error=relative_error(pred_tps, r.tokens_per_s_per_device),
            predicted_memory_bytes=pred_mem, memory_prediction_error=relative_error(pred_mem, peak),
            simulated=r.simulated, trial_numbers=list(r.trial_numbers),
        ))
    summary = (state.summary or {}).get(metric) or {}
    # a simulate sweep's ranking is simulated with no row to say so (every trial pruned)
    simulated = sweep.simulated or bool(summary.get("simulated"))
    return Ranking(sweep.id, metric, rows, sweep.calibration, simulated, sweep.diagnostic,
                   total=int(summary.get("total", 0)), budget=budget.attach(sweep, rows))


def ranking_tag(session: Session, *, sweep_id: int, metric: str = "tokens_per_s_per_device") -> str:
    """What a ranking answer of the sweep is a function of: its results version and calibration
    (one primary-key read). The routes' ETag and response cache key on it. Unknown sweep: NotFoundError."""
    _check_metric(metric)
    state = _ranked_state(session, sweep_id=sweep_id)
    calibration = json.dumps(state.calibration, sort_keys=True, default=str).encode()
    return f"{sweep_id}.{state.version}.{zlib.crc32(calibration):08x}.{metric}"


# Requests that find a stale ranking re-rank it one at a time (in this process), not side by side.
_RERANK_LOCK = threading.Lock()


def _ranked_state(session: Session, *, sweep_id: int) -> Any:
    state = store.ranking_state(session, sweep_id=sweep_id)
    if state is None:
        raise NotFoundError(f"sweep {sweep_id} does not exist")
    if state.version is None or state.version != state.ranked_version:
        # Results stored without the engine's refresh (or a sweep never ranked): rank it now, once.
        with _RERANK_LOCK:
            store.ensure_ranked(session, sweep_id=sweep_id)
            session.commit()
        state = store.ranking_state(session, sweep_id=sweep_id)
    return state


def ranking_from_trials(session: Session, *, sweep_id: int, metric: str = "tokens_per_s_per_device") -> Ranking:
    """The ranking recomputed from every trial (what each request did before the stored ranking):
    the reference the stored one is tested against (tests/api/sweeps/test_ranking_incremental.py)."""
    _check_metric(metric)
    sweep = _known_sweep(session, sweep_id)
    result = _ranking(session, sweep, metric)
    result.total = len(result.rows)
    return result


def _ranking(session: Session, sweep: Sweep, metric: str) -> Ranking:
    by_key: dict[str, list[Any]] = defaultdict(list)
    for t in store.measured_trials(session, sweep_id=sweep.id):
        if getattr(t, metric) is not None:
            by_key[t.layout_key].append(t)
    ranked = rank({k: [getattr(t, metric) for t in ts] for k, ts in by_key.items()})
    layouts = store.layouts_of(session, sweep_id=sweep.id, keys=list(by_key))
    predicted = _predicted(sweep, by_key, layouts)
    rows = []
    for r in ranked:
        ts = by_key[r.key]
        tps = median_of([t.tokens_per_s_per_device for t in ts])
        peak = median_of([t.peak_memory_bytes for t in ts])
        pred_tps, pred_mem = predicted.get(r.key, (None, None))
        rows.append(RankingRow(
            rank=r.rank, layout_key=r.key, layout=layouts.get(r.key, {}), n=r.interval.n, median=r.interval.median,
            low=r.interval.low, high=r.interval.high, tie_group=r.tie_group, tied_with_best=r.tied_with_best,
            tokens_per_s_per_device=tps, useful_tokens_per_s=median_of([t.useful_tokens_per_s for t in ts]),
            useful_tokens_per_s_per_device=median_of([
                t.useful_tokens_per_s / t.world_size for t in ts if t.useful_tokens_per_s is not None and t.world_size
            ]),
            peak_memory_bytes=None if peak is None else int(peak),
            predicted_tokens_per_s_per_device=pred_tps, prediction_error=relative_error(pred_tps, tps),
            predicted_memory_bytes=pred_mem, memory_prediction_error=relative_error(pred_mem, peak),
            simulated=any(t.simulated for t in ts), trial_numbers=[t.number for t in ts],
        ))
    return Ranking(sweep.id, metric, rows, sweep.calibration, sweep.simulated or any(r.simulated for r in rows),
                   sweep.diagnostic, budget=budget.attach(sweep, rows))


def _predicted(sweep: Sweep, by_key: dict[str, list[Any]], layouts: dict[str, dict[str, Any]]) -> Predictions:
    """Each ranked layout's predicted (tokens/s per device, peak bytes) under ONE calibration: the
    sweep's calibration now (``Ranking.calibration``, its "version"). Each trial stores the
    prediction made under the version in force when it started (trials.calibration_version;
    None on rows from before that column: a sweep never calibrated made them under the prior, 0);
    comparing rows predicted under different versions would mix calibrations (an early row judged
    against the prior, a late one against a fit that saw it). So a layout keeps a stored prediction
    made under the current version, and every other layout is re-predicted under it
    (``_repredicted``). Errors of calibrated rows are then in-sample (the fit saw them); the
    held-out figure is the calibration's leave-one-out Spearman (``calibration["time"]``)."""
    version = _calibration_version(sweep)
    kept: Predictions = {}
    stale: dict[str, Layout] = {}
    for key, ts in by_key.items():
        same = [t for t in ts if (t.calibration_version or 0) == version]
        if same:
            kept[key] = (same[-1].predicted_tokens_per_s_per_device, same[-1].predicted_memory_bytes)
        elif key in layouts:
            stale[key] = Layout(**layouts[key])
    return _repredicted(sweep, kept, stale)


def _calibration_version(sweep: Sweep) -> int:
    """The version of the sweep's calibration now (0: never calibrated, the prior)."""
    return int((sweep.calibration or {}).get("version", 0))


def _repredicted(sweep: Sweep, kept: Predictions, stale: dict[str, Layout]) -> Predictions:
    """``kept`` plus each ``stale`` layout predicted under the sweep's calibration now
    (api.engine._model.predict_under); the tail ``_predicted`` and ``_predicted_stored`` share."""
    if not stale:
        return kept
    try:
        problem = SweepSpec.model_validate(sweep.spec).to_problem()
        model, cluster, training = problem.model, problem.cluster, problem.training
    except ValueError:  # a stored spec this version no longer reads: no error rather than a mixed one
        return kept
    return {**kept, **predict_under(sweep.calibration, stale, model=model, cluster=cluster, training=training)}


def _predicted_stored(sweep: Sweep, rows: list[Any]) -> Predictions:
    """``_predicted`` on stored rows (each keeps the last prediction made under each calibration
    version, keyed by the version's text): a row predicted under the current version keeps it, the
    others are re-predicted."""
    version = str(_calibration_version(sweep))
    kept: Predictions = {}
    stale: dict[str, Layout] = {}
    for r in rows:
        same = (r.predictions or {}).get(version)
        if same is not None:
            kept[r.layout_key] = (same[0], same[1])
        elif r.layout:
            stale[r.layout_key] = Layout(**r.layout)
    return _repredicted(sweep, kept, stale)


CSV_COLUMNS = (
    "rank", "layout_key", "n", "median", "low", "high", "tie_group", "tied_with_best", "tokens_per_s_per_device",
    "useful_tokens_per_s", "useful_tokens_per_s_per_device", "peak_memory_bytes", "predicted_tokens_per_s_per_device", "prediction_error",
    "predicted_memory_bytes", "memory_prediction_error", "simulated",
)
# One column per layout field after layout_key (the key stays: it is the layout's identity), so a
# spreadsheet can filter and pivot on tp, pp, ... without parsing the key.
CSV_LAYOUT_COLUMNS = tuple(Layout.__dataclass_fields__)
# Last: the time and cost to train training.train_tokens at the row's median (api.ranking.budget).
CSV_BUDGET_COLUMNS = ("time_to_train_s", "cost_to_train")


def ranking_csv(result: Ranking) -> str:
    """The ranking as CSV (one row per layout; ``median/low/high`` are of ``result.metric``)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow((*CSV_COLUMNS[:2], *CSV_LAYOUT_COLUMNS, *CSV_COLUMNS[2:], *CSV_BUDGET_COLUMNS))
    defaults = Layout().__dict__
    for row in result.rows:
        d = asdict(row)
        layout = [row.layout.get(f, defaults[f]) for f in CSV_LAYOUT_COLUMNS]
        cells = ["" if d[c] is None else d[c] for c in CSV_COLUMNS]
        to_train = row.budget or {}
        spend = ["" if to_train.get(k) is None else to_train[k] for k in ("time_to_train_s", "cost")]
        writer.writerow([*cells[:2], *layout, *cells[2:], *spend])
    return buf.getvalue()
