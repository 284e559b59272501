"""/api/sweeps: submit, list, read and cancel sweeps, their trials and Pareto front (thin wrappers over
api.sweeps.service; the ranking's routes are api.ranking.routes)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Body, Query, Response, status

from api._http import GuardedRoute
from api._lru import LRU
from api.deps import (
    Limit,
    Offset,
    ReaderDep,
    SessionDep,
    SettingsDep,
    SweepId,
    TrialId,
    WriterDep,
)
from api.routes._cache import sweep_version
from api.schemas import BODY_RESPONSES, ERROR_RESPONSES, NOT_FOUND, ErrorOut
from api.spec import SweepSpec
from api.store import SWEEP_PRIORITIES, SWEEP_STATUSES, TRIAL_STATUSES
from api.sweeps import service
from api.sweeps.schemas import ParetoOut, SweepOut, SweepPage, TrialOut, TrialPage

router = APIRouter(prefix="/api/sweeps", tags=["sweeps"], route_class=GuardedRoute)
_cache: LRU = LRU(max_entries=256)  # Pareto answers, by version

READ = {k: ERROR_RESPONSES[k] for k in (401, 403, 422)}
READ_ONE = {**READ, **NOT_FOUND}

SweepStatus = Literal[SWEEP_STATUSES]  # type: ignore[valid-type]
Priority = Literal[SWEEP_PRIORITIES]  # type: ignore[valid-type]
TrialStatus = Literal[TRIAL_STATUSES]  # type: ignore[valid-type]


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=SweepOut,
    summary="Submit a sweep",
    responses={**{k: ERROR_RESPONSES[k] for k in (401, 403, 422)}, **BODY_RESPONSES,
               409: {"model": ErrorOut, "description": "The owner's device-hours of the last 24 h are spent."}},
)
def create_sweep(
    spec: Annotated[SweepSpec, Body(openapi_examples={
        "tiny-cpu": {"summary": "Real runs on CPU ranks", "value": SweepSpec.model_config["json_schema_extra"]["examples"][0]},
        "llama3-70b": {"summary": "Simulated 70B on 64 H100", "value": SweepSpec.model_config["json_schema_extra"]["examples"][1]},
    })],
    session: SessionDep,
    user: WriterDep,
    settings: SettingsDep,
    priority: Annotated[Priority, Query(description="Queue priority (after fair share between owners).")] = "normal",
) -> SweepOut:
    """Validate the spec, store it as a queued sweep owned by the token's name, and return it.
    The coordinator's engine starts it when the cluster's devices allow (fair share between owners,
    then priority, then age); a trial needing more devices than the owner may hold is 422, an owner
    whose device-hours of the day are spent 409."""
    sweep = service.create_sweep(session, spec=spec, owner=user.name, priority=priority, settings=settings)
    return service.describe_sweep(session, sweep_id=sweep.id)


@router.get("", response_model=SweepPage, summary="List sweeps", responses=READ)
def list_sweeps(
    session: SessionDep,
    _: ReaderDep,
    status: Annotated[SweepStatus | None, Query(description="Only sweeps in this state.")] = None,
    owner: Annotated[str | None, Query(max_length=200, description="Only sweeps submitted by this token name.")] = None,
    limit: Limit = 50,
    offset: Offset = 0,
) -> SweepPage:
    """Sweeps, newest first, filtered by state and owner, one page at a time."""
    page = service.list_sweeps(session, status=status, owner=owner, limit=limit, offset=offset)
    return SweepPage.model_validate(page, from_attributes=True)


@router.get("/{sweep_id}", response_model=SweepOut, summary="One sweep", responses=READ_ONE)
def get_sweep(sweep_id: SweepId, session: SessionDep, _: ReaderDep) -> SweepOut:
    """The sweep's spec, state, counters and best layout so far, its queue position and running trials."""
    return service.describe_sweep(session, sweep_id=sweep_id)


@router.get("/{sweep_id}/trials", response_model=TrialPage, summary="Trials of a sweep", responses=READ_ONE)
def list_trials(
    sweep_id: SweepId,
    session: SessionDep,
    _: ReaderDep,
    status: Annotated[TrialStatus | None, Query(description="Only trials with this outcome.")] = None,
    limit: Limit = 100,
    offset: Offset = 0,
) -> TrialPage:
    """Every trial attempt of the sweep in number order, measurements included."""
    page = service.list_trials(session, sweep_id=sweep_id, status=status, limit=limit, offset=offset)
    return TrialPage.model_validate(page, from_attributes=True)


@router.get("/{sweep_id}/trials/{trial_id}", response_model=TrialOut, summary="One trial", responses=READ_ONE)
def get_trial(sweep_id: SweepId, trial_id: TrialId, session: SessionDep, _: ReaderDep) -> TrialOut:
    return service.get_trial(session, sweep_id=sweep_id, trial_id=trial_id)


def _cached(session: SessionDep, sweep_id: int, what: tuple, compute):  # noqa: ANN001, ANN202
    """``compute()`` for this sweep, reused until the sweep's next recorded trial (404 if unknown)."""
    version = sweep_version(service.get_sweep(session, sweep_id=sweep_id))
    key = (str(session.get_bind().url), sweep_id, *what)
    return _cache.get_or_build(key, compute, version=version)


@router.get("/{sweep_id}/pareto", response_model=ParetoOut, summary="Throughput vs peak memory", responses=READ_ONE)
def pareto(sweep_id: SweepId, session: SessionDep, _: ReaderDep) -> Response:
    """Every measured layout with whether it is on the Pareto front (no layout is both faster and
    lighter), front first by ascending memory."""
    body = _cached(
        session, sweep_id, ("pareto",),
        lambda: ParetoOut(sweep_id=sweep_id, points=service.pareto(session, sweep_id=sweep_id)).model_dump_json(),
    )
    return Response(body, media_type="application/json")


@router.post(
    "/{sweep_id}/cancel",
    response_model=SweepOut,
    summary="Cancel a sweep",
    responses={
        **{k: ERROR_RESPONSES[k] for k in (401, 403, 422)},
        **NOT_FOUND,
        409: {"model": ErrorOut, "description": "The sweep already completed, failed or was cancelled."},
    },
)
def cancel_sweep(sweep_id: SweepId, session: SessionDep, user: WriterDep) -> SweepOut:
    """Stop a queued or running sweep: nothing new starts; its running trials are stopped and their
    devices freed within seconds (Ray backend). Only its owner or an admin may (403 otherwise)."""
    return service.cancel_sweep(session, sweep_id=sweep_id, actor=user)
