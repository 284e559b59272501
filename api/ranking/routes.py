"""/api/sweeps/{id}/ranking and /transfer: a sweep's ranked layouts (JSON or CSV, paged, with an ETag
of its results version) and the ranking re-ranked for another training stack (thin wrappers over
api.ranking.service and api.ranking.transfer). The answers are cached by the ranking's tag
(api/routes/_cache.py) and replayed while it stands (api/_answers.py)."""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request, Response, status

from api._answers import remember
from api._http import GuardedRoute
from api._lru import LRU
from api.deps import Offset, RankingLimit, ReaderDep, SessionDep, SweepId
from api.ranking import service as rankings
from api.ranking.schemas import RankingOut, TransferOut
from api.ranking.transfer import transfer as transfer_of
from api.routes._cache import etag_matches
from api.schemas import ERROR_RESPONSES, NOT_FOUND, ErrorOut
from api.store import RANKING_METRICS

router = APIRouter(prefix="/api/sweeps", tags=["sweeps"], route_class=GuardedRoute)
_cache: LRU = LRU(max_entries=256)  # ranking pages and transfers, by the ranking's tag

READ_ONE = {**{k: ERROR_RESPONSES[k] for k in (401, 403, 422)}, **NOT_FOUND}
Metric = Literal[RANKING_METRICS]  # type: ignore[valid-type]
CSV = "text/csv"


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
