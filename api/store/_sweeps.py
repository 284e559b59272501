"""Keyword-only store functions for sweeps: insert, read, list, state changes, claims, counters."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session, aliased

from api.store import _ranking
from api.store._models import FINISHED_SWEEP_STATUSES, SWEEP_PRIORITIES, Sweep, Trial, utcnow


def insert_sweep(
    session: Session, *, name: str, owner: str | None, spec: dict[str, Any], backend: str, sampler: str,
    runner_id: str | None = None, priority: str = "normal",
) -> Sweep:
    """A queued sweep; with ``runner_id`` it is inserted already running under that runner (the CLI's
    foreground sweep: no coordinator on the same database can claim it between insert and claim)."""
    sweep = Sweep(name=name, owner=owner, spec=spec, backend=backend, sampler=sampler, status="queued",
                  priority=priority)
    if runner_id is not None:
        now = utcnow()
        sweep.status, sweep.runner_id, sweep.heartbeat_at, sweep.started_at = "running", runner_id, now, now
    session.add(sweep)
    session.flush()
    return sweep


def get_sweep(session: Session, *, sweep_id: int) -> Sweep | None:
    return session.get(Sweep, sweep_id, populate_existing=True)


def list_sweeps(
    session: Session,
    *,
    status: str | None = None,
    owner: str | None = None,
    limit: int = 50,
    offset: int = 0,
) -> tuple[list[Sweep], int]:
    """Newest first, with the total count of the filtered set (for pagination)."""
    where = []
    if status is not None:
        where.append(Sweep.status == status)
    if owner is not None:
        where.append(Sweep.owner == owner)
    total = session.scalar(sa.select(sa.func.count()).select_from(Sweep).where(*where)) or 0
    rows = session.scalars(
        sa.select(Sweep).where(*where).order_by(Sweep.created_at.desc(), Sweep.id.desc()).limit(limit).offset(offset)
        .execution_options(populate_existing=True)
    ).all()
    return list(rows), int(total)


def set_sweep_status(
    session: Session,
    *,
    sweep_id: int,
    status: str,
    error: str | None = None,
    only_from: tuple[str, ...] | None = None,
    runner_id: str | None = None,
    stop_reason: str | None = None,
) -> bool:
    """Set the status (and finished_at for final states); with ``only_from`` only from those states,
    with ``runner_id`` only while that runner owns the sweep (a coordinator whose sweep was taken over
    must not end it for the new owner). Returns whether a row changed (a conditional UPDATE, so
    concurrent writers cannot both win). ``stop_reason``: why it ended (one line), kept unless given."""
    values: dict[str, Any] = {"status": status}
    now = utcnow()
    if status in FINISHED_SWEEP_STATUSES:
        values["finished_at"] = now
    if status == "running":
        values["started_at"] = sa.func.coalesce(Sweep.started_at, now)
    if error is not None:
        values["error"] = error
    if stop_reason is not None:
        values["stop_reason"] = stop_reason[:2000]
    stmt = sa.update(Sweep).where(Sweep.id == sweep_id)
    if only_from is not None:
        stmt = stmt.where(Sweep.status.in_(only_from))
    if runner_id is not None:
        stmt = stmt.where(Sweep.runner_id == runner_id)
    result = session.execute(stmt.values(**values).execution_options(synchronize_session=False))
    return bool(result.rowcount)


def new_runner_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{os.urandom(4).hex()}"


def _runner_is_dead(runner_id: str | None) -> bool:
    """A runner on this host whose process is gone (so its sweeps can be taken over at once)."""
    if not runner_id:
        return True
    host, _, rest = runner_id.partition(":")
    pid_text = rest.partition(":")[0]
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def claim_sweep(
    session: Session, *, runner_id: str, stale_after_s: float = 60.0, sweep_id: int | None = None
) -> Sweep | None:
    """Take the oldest sweep that is queued, or running under a runner that is dead or silent for
    ``stale_after_s``; mark it running under ``runner_id``. None when there is nothing to take."""
    stale_before: datetime = utcnow() - timedelta(seconds=stale_after_s)
    query = sa.select(Sweep).where(Sweep.status.in_(("queued", "running"))).order_by(Sweep.created_at, Sweep.id)
    if sweep_id is not None:
        query = query.where(Sweep.id == sweep_id)
    for sweep in session.scalars(query.execution_options(populate_existing=True)).all():
        hb = sweep.heartbeat_at  # aware UTC on every backend (api/store/_types.py)
        takeable = (
            sweep.status == "queued"
            or sweep.runner_id == runner_id
            or _runner_is_dead(sweep.runner_id)
            or hb is None
            or hb < stale_before
        )
        if not takeable:
            continue
        stmt = (
            sa.update(Sweep)
            .where(Sweep.id == sweep.id, Sweep.status == sweep.status)
            .where(Sweep.runner_id.is_(None) if sweep.runner_id is None else Sweep.runner_id == sweep.runner_id)
            .values(
                status="running",
                runner_id=runner_id,
                heartbeat_at=utcnow(),
                started_at=sa.func.coalesce(Sweep.started_at, utcnow()),
            )
            .execution_options(synchronize_session=False)
        )
        if session.execute(stmt).rowcount:
            session.flush()
            return get_sweep(session, sweep_id=sweep.id)
    return None


def release_sweep(session: Session, *, sweep_id: int, runner_id: str) -> bool:
    """``runner_id`` stops running an unfinished sweep (e.g. Ctrl-C on ``meshtune sweep``): it stays
    "running" with no runner, so a resume or any coordinator can take it over at once."""
    result = session.execute(
        sa.update(Sweep)
        .where(Sweep.id == sweep_id, Sweep.runner_id == runner_id, Sweep.status == "running")
        .values(runner_id=None, heartbeat_at=None)
        .execution_options(synchronize_session=False)
    )
    return bool(result.rowcount)


def heartbeat(session: Session, *, sweep_id: int, runner_id: str) -> str | None:
    """Record that ``runner_id`` still runs the sweep; returns the sweep's current status (the engine
    stops when it is no longer "running", e.g. cancelled), or None if another runner took it over."""
    session.execute(
        sa.update(Sweep)
        .where(Sweep.id == sweep_id, Sweep.runner_id == runner_id)
        .values(heartbeat_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    row = session.execute(sa.select(Sweep.status, Sweep.runner_id).where(Sweep.id == sweep_id)).first()
    if row is None or row.runner_id != runner_id:
        return None
    return str(row.status)


def hold_sweep(session: Session, *, sweep_id: int, runner_id: str, statuses: tuple[str, ...] | None = None) -> bool:
    """Heartbeat that also asserts ownership: True when ``runner_id`` still owns the sweep (and it is
    in one of ``statuses``). The engine calls it first in every transaction that adds trial rows: the
    UPDATE takes the sweep's row lock (PostgreSQL; SQLite locks the whole file), so a concurrent
    ``claim_sweep`` waits for this transaction and then sees its trials (no number is taken twice)."""
    stmt = sa.update(Sweep).where(Sweep.id == sweep_id, Sweep.runner_id == runner_id)
    if statuses is not None:
        stmt = stmt.where(Sweep.status.in_(statuses))
    result = session.execute(stmt.values(heartbeat_at=utcnow()).execution_options(synchronize_session=False))
    return bool(result.rowcount)


def set_calibration(session: Session, *, sweep_id: int, calibration: dict[str, Any] | None) -> None:
    session.execute(
        sa.update(Sweep).where(Sweep.id == sweep_id).values(calibration=calibration)
        .execution_options(synchronize_session=False)
    )


def set_fingerprint(session: Session, *, sweep_id: int, fingerprint: str) -> None:
    session.execute(
        sa.update(Sweep).where(Sweep.id == sweep_id).values(fingerprint=fingerprint)
        .execution_options(synchronize_session=False)
    )


def sweeps_on_fingerprint(session: Session, *, fingerprint: str, before_id: int, limit: int = 5) -> list[Sweep]:
    """Finished sweeps (completed or cancelled) measured on ``fingerprint`` with a calibration,
    created before sweep ``before_id``, newest first (what a new sweep on that cluster learns from)."""
    return list(session.scalars(
        sa.select(Sweep).where(Sweep.fingerprint == fingerprint, Sweep.status.in_(("completed", "cancelled")),
                               Sweep.id < before_id, Sweep.calibration.is_not(None))
        .order_by(Sweep.id.desc()).limit(limit)
    ))


def latest_fingerprint(session: Session, *, backend: str, same_cluster: Callable[[Any], bool],
                       before_id: int) -> str | None:
    """The fingerprint of the newest earlier sweep on the same backend whose spec's cluster section
    ``same_cluster`` accepts (a new sweep's provisional fingerprint until its own first measurement says)."""
    rows = session.execute(
        sa.select(Sweep.spec, Sweep.fingerprint).where(Sweep.backend == backend, Sweep.fingerprint.is_not(None),
                                                      Sweep.id < before_id).order_by(Sweep.id.desc()).limit(50)
    ).all()
    for spec, fp in rows:
        if same_cluster((spec or {}).get("cluster")):
            return fp
    return None


def refresh_sweep_cache(session: Session, *, sweep_id: int) -> None:
    """Recompute the listing cache (counts, device-seconds, best layout) from the trials table."""
    live = sa.and_(Trial.sweep_id == sweep_id, Trial.status != "interrupted")
    counts = dict(
        session.execute(
            sa.select(Trial.status, sa.func.count()).where(live).group_by(Trial.status)
        ).all()
    )
    for status, n in session.execute(  # a node-lost row beside its re-run: the re-run is the trial
        sa.select(Trial.status, sa.func.count()).where(live, _lost_and_rerun()).group_by(Trial.status)
    ):
        counts[status] -= n
    spent = session.scalar(sa.select(sa.func.coalesce(sa.func.sum(Trial.device_seconds), 0.0)).where(
        Trial.sweep_id == sweep_id)) or 0.0
    values: dict[str, Any] = {
        "n_trials": sum(counts.values()),
        "n_completed": counts.get("completed", 0),
        "n_pruned": counts.get("pruned", 0),
        "n_failed": sum(counts.get(s, 0) for s in ("oom", "timeout", "crash", "nan")),
        "device_seconds": float(spent),
    }
    values.update(_ranked_best(session, sweep_id=sweep_id))
    session.execute(
        sa.update(Sweep).where(Sweep.id == sweep_id).values(**values).execution_options(synchronize_session=False)
    )


def _lost_and_rerun() -> sa.ColumnElement[bool]:
    """A trial a node died under (``infra="node_lost"``) whose layout ran again as a later live trial
    of the same phase and repeat: the engine re-queues it once so (api/engine/_lost.py). The lost
    row stays listed, but the sweep's counts hold its re-run alone, not the layout twice."""
    later = aliased(Trial)
    # "later" as a difference, not later.number > number: SQLite would then walk the (sweep_id, number)
    # index over every later trial of the sweep instead of the layout's few rows (at 10,000 trials, 200 of
    # them lost: 39 ms against 2.3 ms).
    return sa.and_(Trial.error["infra"].as_string() == "node_lost", sa.exists().where(
        later.sweep_id == Trial.sweep_id, later.layout_key == Trial.layout_key, later.phase == Trial.phase,
        later.repeat == Trial.repeat, later.number - Trial.number > 0, later.status != "interrupted"))


def _ranked_best(session: Session, *, sweep_id: int) -> dict[str, Any]:
    """The ``best_*`` columns from the ranking's first row (best median tokens/s per device over a
    layout's measurements, ``tuner.rank``'s order), not the single fastest trial: a lucky run of a
    noisy layout must not make the sweeps list name another layout than the ranking does. The
    stored ranking is put in order first (api/store/_ranking.py), so this reads one row."""
    _ranking.ensure_ranked(session, sweep_id=sweep_id)
    first = _ranking.best_row(session, sweep_id=sweep_id)
    if first is None:
        return {}
    return {"best_layout_key": first.layout_key, "best_tokens_per_s_per_device": first.median,
            "best_useful_tokens_per_s": first.useful_tokens_per_s,
            "best_peak_memory_bytes": None if first.peak_memory_median is None else int(first.peak_memory_median)}


def count_confirm_runs(session: Session, *, sweep_ids: list[int]) -> dict[int, int]:
    """Finished confirm runs per sweep, counted as ``refresh_sweep_cache`` counts the sweep's trials
    (interrupted attempts and a node-lost row beside its re-run left out): what of its counts is not
    a budgeted short run."""
    if not sweep_ids:
        return {}
    finished = ("completed", "pruned", "oom", "timeout", "crash", "nan")
    q = (sa.select(Trial.sweep_id, sa.func.count())
         .where(Trial.sweep_id.in_(sweep_ids), Trial.phase == "confirm", Trial.status.in_(finished),
                sa.not_(_lost_and_rerun()))
         .group_by(Trial.sweep_id))
    return {int(sid): int(n) for sid, n in session.execute(q)}


def count_sweeps_by_status(session: Session) -> dict[str, int]:
    return {s: int(n) for s, n in session.execute(sa.select(Sweep.status, sa.func.count()).group_by(Sweep.status))}


def count_trials_by_status(session: Session) -> dict[tuple[str, bool], int]:
    """Trial attempts by (status, simulated): a simulated outcome is never counted as a real one."""
    q = sa.select(Trial.status, Trial.simulated, sa.func.count()).group_by(Trial.status, Trial.simulated)
    out: dict[tuple[str, bool], int] = {}
    for status, simulated, n in session.execute(q):
        out[(status, bool(simulated))] = out.get((status, bool(simulated)), 0) + int(n)
    return out


def device_seconds_by_simulated(session: Session) -> dict[bool, float]:
    """Device-seconds of every trial, real (False) apart from simulated (True): the simulate backend
    reports the device time of the run it models, which no device spent."""
    q = sa.select(Trial.simulated, sa.func.coalesce(sa.func.sum(Trial.device_seconds), 0.0)).group_by(Trial.simulated)
    out = {False: 0.0, True: 0.0}
    for simulated, seconds in session.execute(q):
        out[bool(simulated)] += float(seconds or 0.0)
    return out


# --- sharing one cluster (api/engine/_share.py) ------------------------------------------------------


def owner_device_seconds(session: Session, *, owner: str | None, since: datetime) -> float:
    """Device-seconds the owner's trials held since ``since``: finished trials by their recorded
    device time, trials still running by the time they have held their devices so far."""
    base = sa.select(Trial).join(Sweep, Sweep.id == Trial.sweep_id).where(
        Sweep.owner.is_(None) if owner is None else Sweep.owner == owner)
    done = session.scalar(
        sa.select(sa.func.coalesce(sa.func.sum(Trial.device_seconds), 0.0)).join(Sweep, Sweep.id == Trial.sweep_id)
        .where(Sweep.owner.is_(None) if owner is None else Sweep.owner == owner, Trial.finished_at >= since)
    ) or 0.0
    now = utcnow()
    running = 0.0
    for t in session.scalars(base.where(Trial.status == "running")):
        if t.started_at is not None:
            running += max(0.0, (now - max(t.started_at, since)).total_seconds()) * t.world_size
    return float(done) + running


def running_by_sweep(session: Session, *, sweep_ids: list[int] | None = None) -> dict[int, tuple[int, int]]:
    """Sweep id -> (trials running, devices they hold) for the sweeps with trials running now."""
    query = sa.select(Trial.sweep_id, sa.func.count(), sa.func.coalesce(sa.func.sum(Trial.world_size), 0)).where(
        Trial.status == "running").group_by(Trial.sweep_id)
    if sweep_ids is not None:
        query = query.where(Trial.sweep_id.in_(sweep_ids))
    return {int(sid): (int(n), int(devices)) for sid, n, devices in session.execute(query)}


def queue_key(*, owner_devices: int, priority: str, owner_usage: float = 0.0, since: datetime, sweep_id: int) -> tuple:
    """The fair-share order of the queue, lowest first: the owner holding the fewest devices now,
    then the priority (high before normal before low), then the owner that has held the least
    device-time lately (``owner_usage``, device-seconds over ``store.USAGE_WINDOW_S``: owners holding
    alike take turns by what they used, so an owner whose trials run longer does not win every tie),
    then the request that has waited longest (``since``: a queued sweep's submission, a running sweep's
    request for its next trial's devices), then the sweep id (api/store/_leases.py, api/engine/_share.py)."""
    prio = SWEEP_PRIORITIES.index(priority) if priority in SWEEP_PRIORITIES else 1
    return (owner_devices, prio, round(owner_usage, 3), since, sweep_id)
