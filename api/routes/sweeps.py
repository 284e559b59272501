"""/api/sweeps: submit, list, read, rank and cancel sweeps (thin wrappers over api.services.sweeps)."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

from fastapi import APIRouter, Body, Query, Request, Response, status

from api._http import GuardedRoute
from api.deps import ReaderDep, SessionDep, SweepId, TrialId, WriterDep
from api.routes._cache import VersionedCache, sweep_version
from api.schemas import (
    BODY_RESPONSES,
    ERROR_RESPONSES,
    NOT_FOUND,
    ErrorOut,
    ParetoOut,
    RankingOut,
    SweepOut,
    SweepPage,
    TrialOut,
    TrialPage,
)
from api.services import sweeps as service
from api.spec import SweepSpec
from api.store import SWEEP_STATUSES, TRIAL_STATUSES

router = APIRouter(prefix="/api/sweeps", tags=["sweeps"], route_class=GuardedRoute)
_cache = VersionedCache()

READ = {k: ERROR_RESPONSES[k] for k in (401, 403, 422)}
READ_ONE = {**READ, **NOT_FOUND}

Limit = Annotated[int, Query(ge=1, le=service.MAX_PAGE, description="Page size.")]
Offset = Annotated[int, Query(ge=0, le=2**31 - 1, description="Items to skip.")]
SweepStatus = Literal[SWEEP_STATUSES]  # type: ignore[valid-type]
TrialStatus = Literal[TRIAL_STATUSES]  # type: ignore[valid-type]
Metric = Literal[service.RANKING_METRICS]  # type: ignore[valid-type]
CSV = "text/csv"


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=SweepOut,
    summary="Submit a sweep",
    responses={**{k: ERROR_RESPONSES[k] for k in (401, 403, 422)}, **BODY_RESPONSES},
)
def create_sweep(
    spec: Annotated[SweepSpec, Body(openapi_examples={
        "tiny-cpu": {"summary": "Real runs on CPU ranks", "value": SweepSpec.model_config["json_schema_extra"]["examples"][0]},
        "llama3-70b": {"summary": "Simulated 70B on 64 H100", "value": SweepSpec.model_config["json_schema_extra"]["examples"][1]},
    })],
    session: SessionDep,
    user: WriterDep,
) -> SweepOut:
    """Validate the spec, store it as a queued sweep owned by the token's name, and return it.
    The coordinator's engine starts it as soon as it is free."""
    return service.create_sweep(session, spec=spec, owner=user.name)


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
    """The sweep's spec, state, counters and best layout so far."""
    return service.get_sweep(session, sweep_id=sweep_id)


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


@router.get(
    "/{sweep_id}/ranking",
    response_model=RankingOut,
    summary="Ranked layouts (JSON or CSV)",
    responses={**READ_ONE, 200: {"content": {CSV: {}}, "description": "JSON, or CSV with ?format=csv or Accept: text/csv."}},
)
def ranking(
    request: Request,
    sweep_id: SweepId,
    session: SessionDep,
    _: ReaderDep,
    metric: Annotated[Metric, Query(description="Rank by tokens/s per device, or by useful tokens/s.")] = (
        "tokens_per_s_per_device"
    ),
    format: Annotated[Literal["json", "csv"] | None, Query(description="json or csv (default: by Accept).")] = None,
    limit: Annotated[int | None, Query(ge=1, le=1_000_000, description="Only this many rows (default: all).")] = None,
    offset: Offset = 0,
) -> Response:
    """Measured layouts ranked by the median of their measurements, with a 95% interval; layouts whose
    intervals overlap the best one's are marked tied. CSV has one row per layout. ``limit``/``offset``
    page through the rows (``total`` counts them all). Answers are cached per sweep until its next
    recorded trial (api/routes/_cache.py)."""
    wants_csv = format == "csv" or (format is None and CSV in request.headers.get("accept", ""))
    result, json_bytes, csv_text = _cached(
        session, sweep_id, ("ranking", metric), lambda: _ranking(session, sweep_id, metric)
    )
    if limit is not None or offset:  # a page: serialise the slice (the whole answer is cached as bytes)
        end = None if limit is None else offset + limit
        page = dataclasses.replace(result, rows=result.rows[offset:end])
        if wants_csv:
            csv_text = service.ranking_csv(page)
        else:
            json_bytes = _ranking_json(page, total=len(result.rows))
    if wants_csv:
        return Response(
            csv_text,
            media_type=CSV,
            headers={"Content-Disposition": f'attachment; filename="sweep-{sweep_id}-ranking.csv"'},
        )
    return Response(json_bytes, media_type="application/json")


def _ranking_json(result: service.Ranking, *, total: int) -> bytes:
    out = RankingOut.model_validate(result, from_attributes=True)
    return out.model_copy(update={"total": total}).model_dump_json().encode()


def _ranking(session: SessionDep, sweep_id: int, metric: str) -> tuple[service.Ranking, bytes, str]:
    result = service.ranking(session, sweep_id=sweep_id, metric=metric)
    return result, _ranking_json(result, total=len(result.rows)), service.ranking_csv(result)


def _cached(session: SessionDep, sweep_id: int, what: tuple, compute):  # noqa: ANN001, ANN202
    """``compute()`` for this sweep, reused until the sweep's next recorded trial (404 if unknown)."""
    version = sweep_version(service.get_sweep(session, sweep_id=sweep_id))
    key = (str(session.get_bind().url), sweep_id, *what)
    return _cache.get(key, version, compute)


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
def cancel_sweep(sweep_id: SweepId, session: SessionDep, _: WriterDep) -> SweepOut:
    """Stop a queued or running sweep: nothing new starts, running trials finish and are kept."""
    return service.cancel_sweep(session, sweep_id=sweep_id)
