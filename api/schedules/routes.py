"""/api/schedules (CRUD, run-now, fires), /api/alerts and /api/trends — thin wrappers over
api.schedules.service.

The router also carries the scheduler's lifespan: in a coordinator that runs the sweep engine
(``create_app(run_engine=True)``, i.e. ``meshtune serve`` without ``--no-engine``) and has
``MESHTUNE_SCHEDULER_ENABLED`` true (the default), a ``Scheduler`` thread ticks beside the engine.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Literal

from fastapi import APIRouter, Body, FastAPI, Query, Response, status

from api._http import GuardedRoute
from api.deps import Limit, Offset, ReaderDep, ScheduleId, SessionDep, WriterDep, query_id
from api.schedules import service
from api.schedules.models import ALERT_KINDS, DELIVERY_STATUSES, FIRE_STATUSES
from api.schedules.schemas import (
    AlertPage,
    FireOut,
    FirePage,
    ScheduleIn,
    ScheduleOut,
    SchedulePage,
    ScheduleUpdate,
    TrendsOut,
)
from api.schemas import BODY_RESPONSES, ERROR_RESPONSES, ErrorOut

log = logging.getLogger("meshtune.schedules")


@asynccontextmanager
async def scheduler_lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Run the scheduler thread while the app runs (only where the engine runs too)."""
    settings = app.state.settings
    scheduler = None
    engine_runs = getattr(app.state, "background", None) is not None  # set by api.main._start_background
    if settings.scheduler_enabled and engine_runs:
        from api.schedules import Scheduler

        scheduler = Scheduler(sessions=app.state.sessions, settings=settings)
        scheduler.start()
        log.info("scheduler started as replica %s", scheduler.replica_id)
    app.state.scheduler = scheduler
    try:
        yield
    finally:
        if scheduler is not None:
            scheduler.stop()


router = APIRouter(tags=["schedules"], lifespan=scheduler_lifespan, route_class=GuardedRoute)

READ = {k: ERROR_RESPONSES[k] for k in (401, 403, 422)}
NOT_FOUND = {404: {"model": ErrorOut, "description": "No schedule with this id."}}
READ_ONE = {**READ, **NOT_FOUND}
WRITE = {**READ, **BODY_RESPONSES}
WRITE_ONE = {**READ_ONE, **BODY_RESPONSES}
FireStatus = Literal[FIRE_STATUSES]  # type: ignore[valid-type]
AlertKind = Literal[ALERT_KINDS]  # type: ignore[valid-type]
DeliveryStatus = Literal[DELIVERY_STATUSES]  # type: ignore[valid-type]


@router.post("/api/schedules", status_code=status.HTTP_201_CREATED, response_model=ScheduleOut,
             summary="Create a schedule", responses=WRITE)
def create_schedule(
    data: Annotated[ScheduleIn, Body(openapi_examples={
        "remeasure": {"summary": "Re-measure the top 3 layouts of sweep 1 nightly",
                      "value": ScheduleIn.model_config["json_schema_extra"]["examples"][0]},
    })],
    session: SessionDep,
    user: WriterDep,
) -> ScheduleOut:
    """Store a schedule. Invalid cron, time zone, webhook URL or an unknown sweep id: 422 naming the field."""
    return service.describe(service.create_schedule(session, data=data, owner=user.name))


@router.get("/api/schedules", response_model=SchedulePage, summary="List schedules", responses=READ)
def list_schedules(
    session: SessionDep,
    _: ReaderDep,
    enabled: Annotated[bool | None, Query(description="Only enabled (true) or disabled (false) schedules.")] = None,
    limit: Limit = 100,
    offset: Offset = 0,
) -> SchedulePage:
    rows, total = service.list_schedules(session, enabled=enabled, limit=limit, offset=offset)
    return SchedulePage(items=[service.describe(r) for r in rows], total=total)


@router.get("/api/schedules/{schedule_id}", response_model=ScheduleOut, summary="One schedule", responses=READ_ONE)
def get_schedule(schedule_id: ScheduleId, session: SessionDep, _: ReaderDep) -> ScheduleOut:
    return service.describe(service.get_schedule(session, schedule_id=schedule_id))


@router.patch("/api/schedules/{schedule_id}", response_model=ScheduleOut, summary="Change a schedule",
              responses=WRITE_ONE)
def update_schedule(schedule_id: ScheduleId, data: ScheduleUpdate, session: SessionDep, user: WriterDep) -> ScheduleOut:
    """Change when it fires, whether it is enabled, its webhook or its alert policy (its owner or an admin)."""
    return service.describe(service.update_schedule(session, schedule_id=schedule_id, data=data, actor=user))


@router.delete("/api/schedules/{schedule_id}", status_code=status.HTTP_204_NO_CONTENT,
               summary="Delete a schedule", responses=WRITE_ONE)
def delete_schedule(schedule_id: ScheduleId, session: SessionDep, user: WriterDep) -> Response:
    """Delete the schedule, its fires and alerts; the sweeps it ran are kept (its owner or an admin)."""
    service.delete_schedule(session, schedule_id=schedule_id, actor=user)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post("/api/schedules/{schedule_id}/run-now", status_code=status.HTTP_201_CREATED, response_model=FireOut,
             summary="Fire a schedule now", responses=WRITE_ONE)
def run_now(schedule_id: ScheduleId, session: SessionDep, user: WriterDep) -> FireOut:
    """Queue the schedule's sweeps now (a manual fire); the result is checked like a cron fire's
    (its owner or an admin)."""
    return service.run_now(session, schedule_id=schedule_id, by=user.name, actor=user)


@router.get("/api/schedules/{schedule_id}/fires", response_model=FirePage, summary="Fires of a schedule",
            responses=READ_ONE)
def list_fires(
    schedule_id: ScheduleId,
    session: SessionDep,
    _: ReaderDep,
    status: Annotated[FireStatus | None, Query(description="Only fires in this state.")] = None,
    limit: Limit = 50,
    offset: Offset = 0,
) -> FirePage:
    """Every fire, newest first: runs, missed and coalesced fires (misfire policy), failures."""
    rows, total = service.list_fires(session, schedule_id=schedule_id, status=status, limit=limit, offset=offset)
    return FirePage(items=[FireOut.model_validate(r) for r in rows], total=total)


@router.get("/api/alerts", response_model=AlertPage, summary="Regression, improvement and failure alerts",
            responses=READ_ONE)
def list_alerts(
    session: SessionDep,
    _: ReaderDep,
    schedule_id: query_id("Only this schedule's alerts.", optional=True) = None,
    kind: Annotated[AlertKind | None, Query(description="regression, improvement or failure.")] = None,
    layout: Annotated[str | None, Query(max_length=200, description="Only this layout key.")] = None,
    delivery_status: Annotated[DeliveryStatus | None, Query(description="Webhook delivery state.")] = None,
    limit: Limit = 100,
    offset: Offset = 0,
) -> AlertPage:
    """Alerts newest first, with their webhook delivery state (failed deliveries are kept and shown)."""
    rows, total = service.list_alerts(session, schedule_id=schedule_id, kind=kind, layout=layout,
                                      delivery_status=delivery_status, limit=limit, offset=offset)
    return AlertPage.model_validate({"items": rows, "total": total}, from_attributes=True)


@router.get("/api/trends", response_model=TrendsOut, summary="Best tokens/s per run per layout", responses=READ_ONE)
def trends(
    session: SessionDep,
    _: ReaderDep,
    schedule_id: query_id("The schedule."),
    layout: Annotated[str | None, Query(max_length=200, description="Only this layout key.")] = None,
    runs: Annotated[int, Query(ge=1, le=1000, description="The last N completed runs.")] = 30,
) -> TrendsOut:
    """One point per (run, layout): best and median tokens/s, with the run's verdict and alert."""
    return TrendsOut.model_validate(service.trends(session, schedule_id=schedule_id, layout=layout, runs=runs))
