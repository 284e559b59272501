"""Sweep services: what the HTTP routes, the dashboard and the CLI call. Keyword-only; the session is
passed in and each mutating service commits its own write. Unknown ids raise NotFoundError, state
conflicts ConflictError, bad filters SpecError (all from tuner._errors), so routes stay thin.

Reads return ORM rows (``api.schemas`` reads them with ``from_attributes``) or small dataclasses.
"""

from __future__ import annotations

import csv
import io
import json
import threading
import zlib
from collections import OrderedDict, defaultdict
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy.orm import Session

from api import store
from api.auth import Principal, require_owner
from api.engine._model import check_runnable, predict_under
from api.settings import Settings
from api.spec import SweepSpec
from api.store import Sweep, Trial
from api.store._models import utcnow
from api.sweeps import budget
from tuner import ConflictError, Layout, NotFoundError, SpecError
from tuner._stats import pareto_front, rank, relative_error

RANKING_METRICS = ("tokens_per_s_per_device", "useful_tokens_per_s")
MAX_PAGE = 1000


@dataclass
class Page:
    items: list[Any]
    total: int
    limit: int
    offset: int


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
    budget: dict[str, Any] | None = None  # time and cost to train the token budget (api.sweeps.budget)


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


@dataclass
class ParetoPoint:
    layout_key: str
    layout: dict[str, Any]
    tokens_per_s_per_device: float
    peak_memory_bytes: int
    on_front: bool
    simulated: bool


@dataclass
class Counts:
    """What /metrics exports."""

    sweeps_by_status: dict[str, int]
    trials_by_status: dict[str, int]
    device_seconds: float


def _page_bounds(limit: int, offset: int) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
        raise SpecError(f"limit must be an integer between 1 and {MAX_PAGE}, got {limit!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise SpecError(f"offset must be a non-negative integer, got {offset!r}")


def create_sweep(
    session: Session, *, spec: SweepSpec, owner: str | None, runner_id: str | None = None, priority: str = "normal",
    settings: Settings | None = None,
) -> Sweep:
    """Store a validated spec as a queued sweep (the engine picks it up); with ``runner_id`` as a
    sweep already running under that runner (``meshtune sweep`` runs it in the foreground).
    ``priority`` orders the queue after fair share; with ``settings`` the owner's limits are checked
    (``check_owner_limits``)."""
    import tuner

    if priority not in store.SWEEP_PRIORITIES:
        raise SpecError(f"priority={priority!r} is not a priority (one of {', '.join(store.SWEEP_PRIORITIES)})")

    known = getattr(tuner, "REFERENCE_LAYOUTS", {})
    model, cluster, training = spec.to_problem()
    for i, name in enumerate(spec.search.reference_layouts):
        if name not in known:
            raise SpecError(
                f"search.reference_layouts[{i}]={name!r} is not a known reference layout"
                f" (known: {', '.join(sorted(known))})"
            )
        layout = getattr(known[name], "layout", known[name])
        try:
            tuner.check_layout(layout, model=model, cluster=cluster, training=training)
        except tuner.LayoutError as exc:
            raise SpecError(f"search.reference_layouts[{i}]={name!r} does not fit this sweep: {exc}") from None
    check_runnable(spec)  # a space with no valid layout, an unknown backend: 422 now, not a failed sweep later
    if settings is not None:
        check_owner_limits(session, settings=settings, owner=owner, devices=cluster.devices)
    sweep = store.insert_sweep(
        session, name=spec.name, owner=owner, spec=spec.model_dump(mode="json"), backend=spec.backend,
        sampler=spec.sampler_label, runner_id=runner_id, priority=priority,
    )
    session.commit()
    return sweep


def check_owner_limits(session: Session, *, settings: Settings, owner: str | None, devices: int) -> None:
    """Refuse, on submission, a sweep its owner's limits could never run or may not start now: one
    trial needing more devices than the owner may hold at once (SpecError naming ``cluster``, 422), or
    an owner whose device-hours of the last 24 h are spent (ConflictError, 409). At launch the engine
    waits on the same limits instead of failing (api/engine/_share.py)."""
    cap = settings.owner_limit(settings.owner_max_devices, owner)
    if cap is not None and devices > cap:
        raise SpecError(
            f"cluster: a trial of this sweep needs {devices} devices but owner {owner!r} may hold at most"
            f" {cap:g} at once (MESHTUNE_OWNER_MAX_DEVICES)")
    hours = settings.owner_limit(settings.owner_device_hours_per_day, owner)
    if hours is not None:
        used = store.owner_device_seconds(session, owner=owner, since=utcnow() - timedelta(days=1)) / 3600
        if used >= hours:
            raise ConflictError(
                f"owner {owner!r} has used {used:.2f} of its {hours:g} device-hours in the last 24 h"
                " (MESHTUNE_OWNER_DEVICE_HOURS_PER_DAY); submit again when some of them are older than a day")


def _with_queue(session: Session, sweeps: list[Sweep]) -> list[Sweep]:
    """Fill in each sweep's queue position and running trials (not stored: derived now)."""
    if not sweeps:
        return sweeps
    positions = store.queue_positions(session) if any(sw.status == "queued" for sw in sweeps) else {}
    running = store.running_by_sweep(session, sweep_ids=[sw.id for sw in sweeps])
    for sw in sweeps:
        sw.queue_position = positions.get(sw.id)
        sw.running_trials = running.get(sw.id, (0, 0))[0]
    return sweeps


def list_sweeps(
    session: Session, *, status: str | None = None, owner: str | None = None, limit: int = 50, offset: int = 0
) -> Page:
    if status is not None and status not in store.SWEEP_STATUSES:
        raise SpecError(f"status={status!r} is not a sweep status (one of {', '.join(store.SWEEP_STATUSES)})")
    _page_bounds(limit, offset)
    rows, total = store.list_sweeps(session, status=status, owner=owner, limit=limit, offset=offset)
    return Page(_with_queue(session, rows), total, limit, offset)


def get_sweep(session: Session, *, sweep_id: int) -> Sweep:
    sweep = store.get_sweep(session, sweep_id=sweep_id)
    if sweep is None:
        raise NotFoundError(f"sweep {sweep_id} does not exist")
    return sweep


def describe_sweep(session: Session, *, sweep_id: int) -> Sweep:
    """``get_sweep`` with its queue position and running trials filled in (the API's sweep JSON)."""
    return _with_queue(session, [get_sweep(session, sweep_id=sweep_id)])[0]


def list_trials(
    session: Session, *, sweep_id: int, status: str | None = None, limit: int = 100, offset: int = 0
) -> Page:
    get_sweep(session, sweep_id=sweep_id)
    if status is not None and status not in store.TRIAL_STATUSES:
        raise SpecError(f"status={status!r} is not a trial status (one of {', '.join(store.TRIAL_STATUSES)})")
    _page_bounds(limit, offset)
    rows, total = store.list_trials(session, sweep_id=sweep_id, status=status, limit=limit, offset=offset)
    return Page(rows, total, limit, offset)


def get_trial(session: Session, *, sweep_id: int, trial_id: int) -> Trial:
    get_sweep(session, sweep_id=sweep_id)
    trial = store.get_trial(session, sweep_id=sweep_id, trial_id=trial_id)
    if trial is None:
        raise NotFoundError(f"trial {trial_id} does not exist in sweep {sweep_id}")
    return trial


def _median(values: list[float]) -> float | None:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


_CACHE_LOCK = threading.Lock()
_CACHE: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
_CACHE_SIZE = 64


def _cached(session: Session, sweep: Sweep, what: str, build: Any) -> Any:
    """Memoise a derived view of a sweep until any of its counters changes (each recorded trial
    changes them; a finished sweep never changes): ranking 10,000 trials is then a dict lookup.
    The cached objects are shared: callers read them and never mutate them."""
    key = (
        str(session.get_bind().url), sweep.id, what, sweep.status, sweep.n_trials, sweep.n_completed,
        sweep.n_failed, sweep.n_pruned, sweep.device_seconds, sweep.best_tokens_per_s_per_device,
        repr(sweep.calibration),
    )
    with _CACHE_LOCK:
        if key in _CACHE:
            _CACHE.move_to_end(key)
            return _CACHE[key]
    value = build()
    with _CACHE_LOCK:
        _CACHE[key] = value
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return value


def ranking(session: Session, *, sweep_id: int, metric: str = "tokens_per_s_per_device",
            limit: int | None = None, offset: int = 0) -> Ranking:
    """Measured layouts ranked by ``metric`` (median over re-measurements, 95% interval, ties): the
    stored ranking that results keep up to date (api/store/_ranking.py), ``limit`` rows from
    ``offset`` (all: None). ``Ranking.total`` counts every ranked layout."""
    if metric not in RANKING_METRICS:
        raise SpecError(f"metric={metric!r} is not a ranking metric (one of {', '.join(RANKING_METRICS)})")
    sweep = get_sweep(session, sweep_id=sweep_id)
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
    return Ranking(sweep.id, metric, rows, sweep.calibration, bool(summary.get("simulated")), sweep.diagnostic,
                   total=int(summary.get("total", 0)), budget=budget.attach(sweep, rows))


def ranking_tag(session: Session, *, sweep_id: int, metric: str = "tokens_per_s_per_device") -> str:
    """What a ranking answer of the sweep is a function of: its results version and calibration
    (one primary-key read). The routes' ETag and response cache key on it. Unknown sweep: NotFoundError."""
    if metric not in RANKING_METRICS:
        raise SpecError(f"metric={metric!r} is not a ranking metric (one of {', '.join(RANKING_METRICS)})")
    state = _ranked_state(session, sweep_id=sweep_id)
    calibration = json.dumps(state.calibration, sort_keys=True, default=str).encode()
    return f"{sweep_id}.{state.version}.{zlib.crc32(calibration):08x}.{metric}"


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


_RERANK_LOCK = threading.Lock()


def ranking_from_trials(session: Session, *, sweep_id: int, metric: str = "tokens_per_s_per_device") -> Ranking:
    """The ranking recomputed from every trial (what each request did before the stored ranking):
    the reference the stored one is tested against (tests/test_ranking_incremental.py)."""
    if metric not in RANKING_METRICS:
        raise SpecError(f"metric={metric!r} is not a ranking metric (one of {', '.join(RANKING_METRICS)})")
    sweep = get_sweep(session, sweep_id=sweep_id)
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
        tps = _median([t.tokens_per_s_per_device for t in ts])
        peak = _median([t.peak_memory_bytes for t in ts])
        pred_tps, pred_mem = predicted.get(r.key, (None, None))
        rows.append(RankingRow(
            rank=r.rank, layout_key=r.key, layout=layouts.get(r.key, {}), n=r.interval.n, median=r.interval.median,
            low=r.interval.low, high=r.interval.high, tie_group=r.tie_group, tied_with_best=r.tied_with_best,
            tokens_per_s_per_device=tps, useful_tokens_per_s=_median([t.useful_tokens_per_s for t in ts]),
            useful_tokens_per_s_per_device=_median([
                t.useful_tokens_per_s / t.world_size for t in ts if t.useful_tokens_per_s is not None and t.world_size
            ]),
            peak_memory_bytes=None if peak is None else int(peak),
            predicted_tokens_per_s_per_device=pred_tps, prediction_error=relative_error(pred_tps, tps),
            predicted_memory_bytes=pred_mem, memory_prediction_error=relative_error(pred_mem, peak),
            simulated=any(t.simulated for t in ts), trial_numbers=[t.number for t in ts],
        ))
    return Ranking(sweep.id, metric, rows, sweep.calibration, any(r.simulated for r in rows), sweep.diagnostic,
                   budget=budget.attach(sweep, rows))


def _predicted_stored(sweep: Sweep, rows: list[Any]) -> dict[str, tuple[float | None, int | None]]:
    """``_predicted`` on stored rows (each keeps the last prediction made under each calibration
    version): a row predicted under the current version keeps it, the others are re-predicted."""
    version = str(int((sweep.calibration or {}).get("version", 0)))
    out: dict[str, tuple[float | None, int | None]] = {}
    stale: dict[str, Layout] = {}
    for r in rows:
        same = (r.predictions or {}).get(version)
        if same is not None:
            out[r.layout_key] = (same[0], same[1])
        elif r.layout:
            stale[r.layout_key] = Layout(**r.layout)
    if stale:
        try:
            model, cluster, training = SweepSpec.model_validate(sweep.spec).to_problem()
        except ValueError:
            return out
        out.update(predict_under(sweep.calibration, stale, model=model, cluster=cluster, training=training))
    return out


def _predicted(sweep: Sweep, by_key: dict[str, list[Any]],
               layouts: dict[str, dict[str, Any]]) -> dict[str, tuple[float | None, int | None]]:
    """Each ranked layout's predicted (tokens/s per device, peak bytes) under ONE calibration: the
    sweep's calibration now (``Ranking.calibration``, its "version"). Each trial stores the
    prediction made under the version in force when it started (trials.calibration_version;
    None on rows from before that column: a sweep never calibrated made them under the prior, 0);
    comparing rows predicted under different versions would mix calibrations (an early row judged
    against the prior, a late one against a fit that saw it). So a layout keeps a stored prediction
    made under the current version, and every other layout is re-predicted under it
    (api.engine._model.predict_under). Errors of calibrated rows are then in-sample (the fit saw
    them); the held-out figure is the calibration's leave-one-out Spearman (``calibration["time"]``)."""
    version = int((sweep.calibration or {}).get("version", 0))
    out: dict[str, tuple[float | None, int | None]] = {}
    stale: dict[str, Layout] = {}
    for key, ts in by_key.items():
        same = [t for t in ts if (t.calibration_version or 0) == version]
        if same:
            out[key] = (same[-1].predicted_tokens_per_s_per_device, same[-1].predicted_memory_bytes)
        elif key in layouts:
            stale[key] = Layout(**layouts[key])
    if stale:
        try:
            model, cluster, training = SweepSpec.model_validate(sweep.spec).to_problem()
        except ValueError:  # a stored spec this version no longer reads: no error rather than a mixed one
            return out
        out.update(predict_under(sweep.calibration, stale, model=model, cluster=cluster, training=training))
    return out


CSV_COLUMNS = (
    "rank", "layout_key", "n", "median", "low", "high", "tie_group", "tied_with_best", "tokens_per_s_per_device",
    "useful_tokens_per_s", "useful_tokens_per_s_per_device", "peak_memory_bytes", "predicted_tokens_per_s_per_device", "prediction_error",
    "predicted_memory_bytes", "memory_prediction_error", "simulated",
)
# One column per layout field after layout_key (the key stays: it is the layout's identity), so a
# spreadsheet can filter and pivot on tp, pp, ... without parsing the key.
CSV_LAYOUT_COLUMNS = tuple(Layout.__dataclass_fields__)
# Last: the time and cost to train training.train_tokens at the row's median (api.sweeps.budget).
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
        budget = row.budget or {}
        spend = ["" if budget.get(k) is None else budget[k] for k in ("time_to_train_s", "cost")]
        writer.writerow([*cells[:2], *layout, *cells[2:], *spend])
    return buf.getvalue()


def pareto(session: Session, *, sweep_id: int) -> list[ParetoPoint]:
    """Every measured layout (medians) with whether it is on the throughput-vs-peak-memory front."""
    sweep = get_sweep(session, sweep_id=sweep_id)
    return _cached(session, sweep, "pareto", lambda: _pareto(session, sweep))


def _pareto(session: Session, sweep: Sweep) -> list[ParetoPoint]:
    by_key: dict[str, list[Any]] = defaultdict(list)
    for t in store.measured_trials(session, sweep_id=sweep.id):
        if t.peak_memory_bytes is not None:
            by_key[t.layout_key].append(t)
    points = [
        (k, _median([t.tokens_per_s_per_device for t in ts]), _median([t.peak_memory_bytes for t in ts]))
        for k, ts in by_key.items()
    ]
    front = set(pareto_front(points))
    layouts = store.layouts_of(session, sweep_id=sweep.id, keys=list(by_key))
    out = [
        ParetoPoint(k, layouts.get(k, {}), thr, int(mem), k in front, any(t.simulated for t in by_key[k]))
        for k, thr, mem in points
    ]
    return sorted(out, key=lambda p: (not p.on_front, p.peak_memory_bytes, -p.tokens_per_s_per_device))


def cancel_sweep(session: Session, *, sweep_id: int, actor: Principal | None = None) -> Sweep:
    """Cancel a queued or running sweep: nothing new starts; on a backend that can stop a trial
    (Ray) the running ones are stopped within seconds and their devices freed (their rows become
    "interrupted", cause "sweep cancelled"), elsewhere they finish and are kept. ``actor``: only the
    sweep's owner or an admin may (api.auth.require_owner); None is an in-process caller (the CLI)."""
    sweep = get_sweep(session, sweep_id=sweep_id)
    require_owner(actor, owner=_acting_owner(session, sweep.owner), what=f"sweep {sweep_id}")
    if not store.set_sweep_status(session, sweep_id=sweep_id, status="cancelled", only_from=("queued", "running")):
        session.rollback()
        sweep = get_sweep(session, sweep_id=sweep_id)
        raise ConflictError(f"sweep {sweep_id} is already {sweep.status}; only queued or running sweeps can be cancelled")
    session.commit()
    return describe_sweep(session, sweep_id=sweep.id)


def _acting_owner(session: Session, owner: str | None) -> str | None:
    """Who may act on a sweep owned by ``owner``: a scheduled sweep ("schedule:ID", recorded by
    api/schedules/_launch.py) belongs to its schedule's owner."""
    if owner and owner.startswith("schedule:") and owner[9:].isdigit():
        from api.schedules import _store as schedules

        schedule = schedules.get_schedule(session, schedule_id=int(owner[9:]))
        return schedule.owner if schedule is not None else owner
    return owner


def counts(session: Session) -> Counts:
    return Counts(
        sweeps_by_status=store.count_sweeps_by_status(session),
        trials_by_status=store.count_trials_by_status(session),
        device_seconds=store.total_device_seconds(session),
    )
