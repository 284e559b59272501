"""Schedule services: what the HTTP routes, the dashboard and the CLI call. Keyword-only; the session
is passed in and each mutating service commits its own write. Unknown ids raise NotFoundError, bad
input SpecError naming the field (422 / exit 2).
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from api import store
from api.auth import Principal, require_owner
from api.engine._submission import check_runnable
from api.paging import MAX_ID, check_page
from api.schedules import _store
from api.schedules._cron import as_utc, next_fire
from api.schedules._launch import fire_schedule
from api.schedules.models import ALERT_KINDS, DELIVERY_STATUSES, FIRE_STATUSES, Schedule, ScheduleFire
from api.schedules.schemas import ScheduleIn, ScheduleOut, ScheduleUpdate
from api.store._models import utcnow
from api.sweeps.service import check_learn_from
from tuner import ConflictError, NotFoundError, SpecError


def describe(schedule: Schedule, *, now: datetime | None = None) -> ScheduleOut:
    """The schedule with its next cron fire (UTC) filled in."""
    out = ScheduleOut.model_validate(schedule)
    if schedule.enabled:
        out.next_fire_at = next_fire(schedule.cron, schedule.timezone, now or utcnow())
    return out


def create_schedule(session: Session, *, data: ScheduleIn, owner: str | None) -> Schedule:
    values: dict[str, Any] = dict(
        name=data.name, owner=owner, cron=data.cron, timezone=data.timezone, enabled=data.enabled,
        webhook_url=data.webhook_url, misfire_grace_s=data.misfire_grace_s, policy=data.regression.model_dump(),
        priority=data.priority,
    )
    if data.template is not None:
        try:
            check_runnable(data.template)  # no valid layout / unknown backend: 422 now, not a failed fire later
            check_learn_from(session, spec=data.template)  # search.learn_from: sweeps of this cluster
        except SpecError as exc:
            raise SpecError(f"template.{exc}") from None
        values.update(kind="template", template=data.template.model_dump(mode="json"),
                      repeats=data.template.search.repeats)
    else:
        assert data.remeasure is not None
        sweep_id = data.remeasure.sweep_id
        if store.get_sweep(session, sweep_id=sweep_id) is None:
            raise SpecError(f"remeasure.sweep_id={sweep_id}: no sweep with this id exists")
        values.update(kind="remeasure", source_sweep_id=sweep_id, top_k=data.remeasure.top_k,
                      repeats=data.remeasure.repeats)
    row = _store.insert_schedule(session, **values)
    session.commit()
    return row


def get_schedule(session: Session, *, schedule_id: int) -> Schedule:
    if isinstance(schedule_id, bool) or not isinstance(schedule_id, int) or not 1 <= schedule_id <= MAX_ID:
        raise NotFoundError(f"schedule {schedule_id!r} does not exist")
    row = _store.get_schedule(session, schedule_id=schedule_id)
    if row is None:
        raise NotFoundError(f"schedule {schedule_id} does not exist")
    return row


def list_schedules(session: Session, *, enabled: bool | None = None, limit: int = 100, offset: int = 0) -> tuple[list[Schedule], int]:
    check_page(limit, offset)
    return _store.list_schedules(session, enabled=enabled, limit=limit, offset=offset)


def update_schedule(session: Session, *, schedule_id: int, data: ScheduleUpdate, actor: Principal | None = None) -> Schedule:
    """``actor``: only the schedule's owner or an admin may (api.auth.require_owner); None: in process."""
    current = get_schedule(session, schedule_id=schedule_id)
    require_owner(actor, owner=current.owner, what=f"schedule {schedule_id}")
    values = data.model_dump(exclude_unset=True)
    if "regression" in values:
        values["policy"] = data.regression.model_dump() if data.regression else current.policy
        del values["regression"]
    if values.get("webhook_url") == "":
        values["webhook_url"] = None
    for key in ("name", "cron", "timezone", "enabled", "misfire_grace_s", "priority"):
        if key in values and values[key] is None:
            raise SpecError(f"{key} cannot be null")
    if values:
        _store.update_schedule(session, schedule_id=schedule_id, values=values)
        session.commit()
    return get_schedule(session, schedule_id=schedule_id)


def delete_schedule(session: Session, *, schedule_id: int, actor: Principal | None = None) -> None:
    """Delete a schedule with its fires and alerts (the sweeps it ran are kept); only by its owner or
    an admin."""
    current = get_schedule(session, schedule_id=schedule_id)
    require_owner(actor, owner=current.owner, what=f"schedule {schedule_id}")
    _store.delete_schedule(session, schedule_id=schedule_id)
    session.commit()


def run_now(session: Session, *, schedule_id: int, by: str | None = None, actor: Principal | None = None) -> ScheduleFire:
    """Fire the schedule now (manual trigger, whether enabled or not); its sweeps are queued at once.
    Manual fires never count as the cron's fires (they do not move the misfire anchor). Only by its
    owner or an admin."""
    schedule = get_schedule(session, schedule_id=schedule_id)
    require_owner(actor, owner=schedule.owner, what=f"schedule {schedule_id}")
    fire_id = fire_schedule(session, schedule=schedule, fire_time=utcnow(), claimed_by=f"run-now:{by or '-'}",
                            trigger="manual")
    if fire_id is None:  # another run-now of this schedule in the same microsecond
        session.rollback()
        raise ConflictError(f"schedule {schedule_id} was fired by someone else at this very instant; retry")
    session.commit()
    return _store.get_fire(session, fire_id=fire_id)


def list_fires(session: Session, *, schedule_id: int, status: str | None = None, limit: int = 50,
               offset: int = 0) -> tuple[list[ScheduleFire], int]:
    get_schedule(session, schedule_id=schedule_id)
    if status is not None and status not in FIRE_STATUSES:
        raise SpecError(f"status={status!r} is not a fire status (one of {', '.join(FIRE_STATUSES)})")
    check_page(limit, offset)
    return _store.list_fires(session, schedule_id=schedule_id, status=status, limit=limit, offset=offset)


def list_alerts(
    session: Session,
    *,
    schedule_id: int | None = None,
    kind: str | None = None,
    layout: str | None = None,
    delivery_status: str | None = None,
    limit: int = 100,
    offset: int = 0,
) -> tuple[list[Any], int]:
    if schedule_id is not None:
        get_schedule(session, schedule_id=schedule_id)
    if kind is not None and kind not in ALERT_KINDS:
        raise SpecError(f"kind={kind!r} is not an alert kind (one of {', '.join(ALERT_KINDS)})")
    if delivery_status is not None and delivery_status not in DELIVERY_STATUSES:
        raise SpecError(f"delivery_status={delivery_status!r} is not one of {', '.join(DELIVERY_STATUSES)}")
    check_page(limit, offset)
    return _store.list_alerts(session, schedule_id=schedule_id, kind=kind, layout_key=layout,
                              delivery_status=delivery_status, limit=limit, offset=offset)


def trends(session: Session, *, schedule_id: int, layout: str | None = None, runs: int = 30) -> dict[str, Any]:
    """Best and median tokens/s per run per layout over the last ``runs`` completed runs (oldest
    first), each point marked with its verdict and alert."""
    if isinstance(runs, bool) or not isinstance(runs, int) or not 1 <= runs <= 1000:
        raise SpecError(f"runs must be an integer between 1 and 1000, got {runs!r}")
    get_schedule(session, schedule_id=schedule_id)
    fires, _ = _store.list_fires(session, schedule_id=schedule_id, status="completed", limit=runs)
    fires = sorted(fires, key=lambda f: as_utc(f.fire_time))
    alerts, _ = _store.list_alerts(session, schedule_id=schedule_id, limit=None)
    alert_of = {(a.fire_id, a.layout_key): a.id for a in alerts if a.layout_key}
    points: list[dict[str, Any]] = []
    latest_best: dict[str, float] = {}
    for fire in fires:
        verdicts = {c["layout"]: c["verdict"] for c in (fire.comparisons or [])}
        by_layout: dict[str, list[Any]] = defaultdict(list)
        for t in _store.fire_measurements(session, sweep_ids=list(fire.sweep_ids or [])):
            if layout is None or t.layout_key == layout:
                by_layout[t.layout_key].append(t)
        for key, ts in sorted(by_layout.items()):
            values = sorted(float(t.tokens_per_s) for t in ts)
            mid = len(values) // 2
            median = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
            points.append(dict(
                fire_id=fire.id, fire_time=as_utc(fire.fire_time), layout_key=key, best_tokens_per_s=values[-1],
                median_tokens_per_s=median, n=len(values), simulated=any(t.simulated for t in ts),
                verdict=verdicts.get(key), alert_id=alert_of.get((fire.id, key)),
            ))
            latest_best[key] = values[-1]
    layouts = sorted(latest_best, key=lambda k: -latest_best[k])
    return {"schedule_id": schedule_id, "layouts": layouts, "points": points}
