"""Sweep services: what the HTTP routes, the dashboard and the CLI call. Keyword-only; the session is
passed in and each mutating service commits its own write. Unknown ids raise NotFoundError, state
conflicts ConflictError, bad filters SpecError (all from tuner._errors), so routes stay thin.

Reads return ORM rows (``api.schemas`` reads them with ``from_attributes``) or small dataclasses.
The ranking of a sweep's measured layouts is its own feature, ``api.ranking``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy.orm import Session

from api import store
from api._lru import LRU
from api.auth import Principal, require_owner
from api.engine._submission import check_runnable
from api.paging import check_page
from api.settings import Settings
from api.spec import SweepSpec
from api.store import Sweep, Trial
from api.store._models import utcnow
from tuner import ConflictError, NotFoundError, SpecError, median_of, pareto_front


@dataclass
class Page:
    items: list[Any]
    total: int
    limit: int
    offset: int


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
    """What /metrics exports: trials and device time kept apart by ``simulated`` (True: the simulate
    backend's model of a run, no device spent it)."""

    sweeps_by_status: dict[str, int]
    trials_by_status: dict[tuple[str, bool], int]
    device_seconds: dict[bool, float]


def create_sweep(
    session: Session, *, spec: SweepSpec, owner: str | None, runner_id: str | None = None, priority: str = "normal",
    settings: Settings | None = None, commit: bool = True,
) -> Sweep:
    """Store a validated spec as a queued sweep (the engine picks it up); with ``runner_id`` as a
    sweep already running under that runner (``meshtune sweep`` runs it in the foreground).
    ``priority`` orders the queue after fair share; with ``settings`` the owner's limits are checked
    (``check_owner_limits``). ``commit=False``: in the caller's transaction (a schedule's fire claims
    its time and creates its sweeps in one)."""
    check_submission(session, spec=spec, owner=owner, priority=priority, settings=settings)
    sweep = store.insert_sweep(
        session, name=spec.name, owner=owner, spec=spec.model_dump(mode="json"), backend=spec.backend,
        sampler=spec.sampler_label, runner_id=runner_id, priority=priority,
    )
    if commit:
        session.commit()
    return sweep


def check_submission(session: Session, *, spec: SweepSpec, owner: str | None, priority: str = "normal",
                     settings: Settings | None = None) -> None:
    """Everything a sweep is refused for before it is stored, one line naming the field and value
    (SpecError: 422 / exit 2; ConflictError: 409): its priority, reference layouts, a space with no
    valid layout or an unknown backend, ``search.learn_from``, and with ``settings`` the owner's limits."""
    import tuner

    if priority not in store.SWEEP_PRIORITIES:
        raise SpecError(f"priority={priority!r} is not a priority (one of {', '.join(store.SWEEP_PRIORITIES)})")

    known = tuner.REFERENCE_LAYOUTS
    problem = spec.to_problem()
    model, cluster, training = problem.model, problem.cluster, problem.training
    for i, name in enumerate(spec.search.reference_layouts):
        if name not in known:
            raise SpecError(
                f"search.reference_layouts[{i}]={name!r} is not a known reference layout"
                f" (known: {', '.join(sorted(known))})"
            )
        layout = known[name].layout
        try:
            tuner.check_layout(layout, model=model, cluster=cluster, training=training)
        except tuner.LayoutError as exc:
            raise SpecError(f"search.reference_layouts[{i}]={name!r} does not fit this sweep: {exc}") from None
    check_runnable(spec)  # a space with no valid layout, an unknown backend: 422 now, not a failed sweep later
    check_learn_from(session, spec=spec)
    if settings is not None:
        check_owner_limits(session, settings=settings, owner=owner, devices=cluster.devices)


def check_learn_from(session: Session, *, spec: SweepSpec) -> None:
    """``search.learn_from`` as sweep ids: each must exist and have measured this sweep's cluster (the
    same backend and hardware, and one cluster fingerprint among them); else SpecError naming the
    field and the value (422, exit 2), before anything is stored."""
    from api.engine._learning import hardware

    ids = spec.search.learn_from
    if not isinstance(ids, list):
        return
    mine = hardware(spec.model_dump(mode="json")["cluster"])
    seen: dict[str, int] = {}
    for i, sweep_id in enumerate(ids):
        field = f"search.learn_from[{i}]={sweep_id}"
        sw = store.get_sweep(session, sweep_id=sweep_id)
        if sw is None:
            raise SpecError(f"{field}: sweep {sweep_id} does not exist")
        if sw.backend != spec.backend:
            raise SpecError(f"{field}: sweep {sweep_id} ran on backend {sw.backend!r}, not this sweep's "
                            f"{spec.backend!r}: another cluster")
        if hardware((sw.spec or {}).get("cluster")) != mine:
            raise SpecError(f"{field}: sweep {sweep_id} measured another cluster ({sw.spec.get('cluster')!r}) than "
                            f"this sweep's")
        if sw.fingerprint is None:
            raise SpecError(f"{field}: sweep {sweep_id} has measured nothing yet (no cluster fingerprint): "
                            "nothing to learn from")
        other = next((j for fp, j in seen.items() if fp != sw.fingerprint), None)
        if other is not None:
            raise SpecError(f"{field}: sweep {sweep_id} measured another cluster fingerprint ({sw.fingerprint}) "
                            f"than sweep {other}")
        seen.setdefault(sw.fingerprint, sweep_id)


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


def confirm_runs(session: Session, *, sweep_ids: list[int]) -> dict[int, int]:
    """Finished confirm runs per sweep (those of its trial counts that ``max_trials`` does not budget)."""
    return store.count_confirm_runs(session, sweep_ids=sweep_ids)


def list_sweeps(
    session: Session, *, status: str | None = None, owner: str | None = None, limit: int = 50, offset: int = 0
) -> Page:
    if status is not None and status not in store.SWEEP_STATUSES:
        raise SpecError(f"status={status!r} is not a sweep status (one of {', '.join(store.SWEEP_STATUSES)})")
    check_page(limit, offset)
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
    check_page(limit, offset)
    rows, total = store.list_trials(session, sweep_id=sweep_id, status=status, limit=limit, offset=offset)
    return Page(rows, total, limit, offset)


def get_trial(session: Session, *, sweep_id: int, trial_id: int) -> Trial:
    get_sweep(session, sweep_id=sweep_id)
    trial = store.get_trial(session, sweep_id=sweep_id, trial_id=trial_id)
    if trial is None:
        raise NotFoundError(f"trial {trial_id} does not exist in sweep {sweep_id}")
    return trial


_VIEWS: LRU[Any] = LRU(max_entries=64)


def _cached(session: Session, sweep: Sweep, what: str, build: Any) -> Any:
    """Memoise a derived view of a sweep until any of its counters changes (each recorded trial
    changes them; a finished sweep never changes): the Pareto front of 10,000 trials is then a lookup.
    The cached objects are shared: callers read them and never mutate them."""
    key = (
        str(session.get_bind().url), sweep.id, what, sweep.status, sweep.n_trials, sweep.n_completed,
        sweep.n_failed, sweep.n_pruned, sweep.device_seconds, sweep.best_tokens_per_s_per_device,
        repr(sweep.calibration),
    )
    return _VIEWS.get_or_build(key, build)


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
        (k, median_of([t.tokens_per_s_per_device for t in ts]), median_of([t.peak_memory_bytes for t in ts]))
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
    who = f" by {actor.name}" if actor is not None else ""
    if not store.set_sweep_status(session, sweep_id=sweep_id, status="cancelled", only_from=("queued", "running"),
                                  stop_reason=f"cancelled{who} after {sweep.n_trials} trials"):
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
        device_seconds=store.device_seconds_by_simulated(session),
    )
