"""/api/sweeps: submit, list, read, rank and cancel sweeps (thin wrappers over api.sweeps.service)."""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Query, Request, Response, status

from api._answers import remember
from api._http import GuardedRoute
from api._lru import LRU
from api.deps import (
    Limit,
    Offset,
    RankingLimit,
    ReaderDep,
    SessionDep,
    SettingsDep,
    SweepId,
    TrialId,
    WriterDep,
)
from api.ranking import service as rankings
from api.routes._cache import etag_matches, sweep_version
from api.schemas import BODY_RESPONSES, ERROR_RESPONSES, NOT_FOUND, ErrorOut
from api.spec import SweepSpec
from api.store import SWEEP_PRIORITIES, SWEEP_STATUSES, TRIAL_STATUSES
from api.sweeps import service
from api.sweeps.schemas import ParetoOut, RankingOut, SweepOut, SweepPage, TransferOut, TrialOut, TrialPage

router = APIRouter(prefix="/api/sweeps", tags=["sweeps"], route_class=GuardedRoute)
_cache: LRU = LRU(max_entries=256)  # ranking pages and Pareto answers, by version

READ = {k: ERROR_RESPONSES[k] for k in (401, 403, 422)}
READ_ONE = {**READ, **NOT_FOUND}

SweepStatus = Literal[SWEEP_STATUSES]  # type: ignore[valid-type]
Priority = Literal[SWEEP_PRIORITIES]  # type: ignore[valid-type]
TrialStatus = Literal[TRIAL_STATUSES]  # type: ignore[valid-type]
Metric = Literal[rankings.RANKING_METRICS]  # type: ignore[valid-type]
CSV = "text/csv"


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


@router.get(
    "/{sweep_id}/ranking",
    response_model=RankingOut,
    summary="Ranked layouts (JSON or CSV)",
    responses={**READ_ONE, 200: {"content": {CSV: {}}, "description": "JSON, or CSV with ?format=csv or Accept: text/csv."},
               304: {"description": "Unchanged since the ETag given in If-None-Match (no result landed since)."}},
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
    limit: RankingLimit = None,
    offset: Offset = 0,
) -> Response:
    """Measured layouts ranked by the median of their measurements, with a 95% interval; layouts whose
    intervals overlap the best one's are marked tied. CSV has one row per layout. ``limit``/``offset``
    page through the rows (``total`` counts them all). The ranking is stored and kept up to date as
    results land (api/store/_ranking.py); each answer has an ETag of the sweep's results version, so
    ``If-None-Match`` gets 304 until the next result (api/routes/_cache.py)."""
    wants_csv = format == "csv" or (format is None and CSV in request.headers.get("accept", ""))
    tag = rankings.ranking_tag(session, sweep_id=sweep_id, metric=metric)
    kind = "csv" if wants_csv else "json"
    etag = f'"{tag}.{kind}.{offset}.{limit or 0}"'
    headers = {"ETag": etag, "Cache-Control": "no-cache", "Vary": "Accept"}
    if etag_matches(request.headers.get("if-none-match"), etag):
        return Response(status_code=status.HTTP_304_NOT_MODIFIED, headers=headers)
    key = (str(session.get_bind().url), sweep_id, metric, kind, offset, limit)
    body = _cache.get_or_build(key, lambda: _ranking_body(session, sweep_id, metric, wants_csv, limit, offset),
                               version=tag)
    if wants_csv:
        headers["Content-Disposition"] = f'attachment; filename="sweep-{sweep_id}-ranking.csv"'
    remember(request, probe_key=("ranking", sweep_id, metric), version=tag,
             probe=functools.partial(_ranking_tag, request.app.state.sessions, sweep_id, metric))
    return Response(body, media_type=CSV if wants_csv else "application/json", headers=headers)


@router.get("/{sweep_id}/transfer", response_model=TransferOut, responses={**READ_ONE, 409: {
    "model": ErrorOut, "description": "The sweep has no completed trial yet."}},
    summary="Ranking transfer: the measured layouts re-ranked for another training stack")
def transfer(
    sweep_id: SweepId,
    session: SessionDep,
    _: ReaderDep,
    stack: Annotated[str, Query(max_length=50, description="The stack trained with: torchtitan, megatron (or meshtune).")],
) -> Response:
    """The measured layouts re-ranked by the target stack's prediction corrected with the sweep's
    calibration (api/ranking/transfer.py), each row with its measured rank and how far it moved."""
    from api.ranking.transfer import transfer as transfer_of

    tag = rankings.ranking_tag(session, sweep_id=sweep_id)
    key = (str(session.get_bind().url), sweep_id, "transfer", stack)
    body = _cache.get_or_build(key, lambda: TransferOut.model_validate(
        transfer_of(session, sweep_id=sweep_id, stack=stack).to_dict()).model_dump_json().encode(), version=tag)
    return Response(body, media_type="application/json")


def _ranking_tag(sessions: Any, sweep_id: int, metric: str) -> str:
    """The ranking's current tag, in a session of its own (the probe api/_answers.py replays by)."""
    with sessions() as session:
        return rankings.ranking_tag(session, sweep_id=sweep_id, metric=metric)


def _ranking_body(session: SessionDep, sweep_id: int, metric: str, wants_csv: bool, limit: int | None,
                  offset: int) -> bytes:
    """One answer (a page, or the whole ranking) serialised from the stored ranking's rows."""
    result = rankings.ranking(session, sweep_id=sweep_id, metric=metric, limit=limit, offset=offset)
    if wants_csv:
        return rankings.ranking_csv(result).encode()
    return RankingOut.model_validate(result, from_attributes=True).model_dump_json().encode()


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
