"""The sweep page, its tables fragment and its chart data, and the cache that answers their repeats.

    GET  /sweeps/{id}                        sweep page: ranking, charts, migration checks, trials
    GET  /sweeps/{id}/tables                 ranking + migration checks + trials (HTML fragment)
    GET  /sweeps/{id}/data.json              chart data for the live refresh (Plotly.react)

Each answer is a pure function of the sweep's state (data.sweep_state's "version"), its migration
checks, the query and what the viewer may do: rendered once per version, gzipped once, sent with a
weak ETag, and registered with api/_answers.py so an unchanged repeat is answered before routing.
The templates, the read rule and the rest of the dashboard's pages: api/dashboard/router.py.
"""

from __future__ import annotations

import functools
import gzip
import zlib
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from api._answers import remember
from api._lru import LRU
from api.dashboard import confirm_page, data, views
from api.dashboard.router import (
    RANK_PAGE,
    REFRESH_MS,
    TRIAL_PAGE,
    _can_read,
    _can_write,
    _json_guard,
    _login,
    _not_found,
    templates,
)
from api.deps import SessionDep, SettingsDep, SweepId
from api.routes._cache import etag_matches
from api.settings import Settings
from tuner import NotFoundError

router = APIRouter(include_in_schema=False)


def _tables_ctx(request: Request, state: dict[str, Any], *, checks: list[dict[str, Any]], rank_page: int,
                trial_page: int, trial_status: str) -> dict[str, Any]:
    sweep_id = state["sweep"]["id"]
    trial_status = trial_status if trial_status in views.OUTCOMES else ""
    trials = [t for t in state["trials"] if not trial_status or t["status"] == trial_status]
    ranking = state["ranking"]
    rank_pages = max(1, -(-len(ranking) // RANK_PAGE))
    trial_pages = max(1, -(-len(trials) // TRIAL_PAGE))
    rank_page, trial_page = min(rank_page, rank_pages), min(trial_page, trial_pages)
    base = request.url_for("dashboard_sweep", sweep_id=sweep_id).path
    q = {"rank_page": rank_page, "trial_page": trial_page, "trial_status": trial_status}

    def url(**changes: Any) -> str:
        return base + "?" + urlencode(q | changes)

    return {
        "sweep": state["sweep"],
        "ranking": ranking[(rank_page - 1) * RANK_PAGE: rank_page * RANK_PAGE],
        "rank_page": rank_page, "rank_pages": rank_pages, "rank_page_url": lambda p: url(rank_page=p),
        "trials": trials[(trial_page - 1) * TRIAL_PAGE: trial_page * TRIAL_PAGE],
        "trial_page": trial_page, "trial_pages": trial_pages, "trial_page_url": lambda p: url(trial_page=p),
        "trial_status": trial_status, "trial_filters": ("", *views.OUTCOMES),
        "trial_filter_url": lambda s: url(trial_status=s, trial_page=1),
        "counts": state["bundle"]["summary"]["counts"],
        # Migration (reshard) checks: the past ones, and the layouts a "check migration" may target.
        "checks": checks,
        "migration_targets": data.migration_targets(ranking),
    }


Page = Annotated[int, Query(ge=1, le=1_000_000)]

# Rendered sweep pages and tables fragments: a pure function of the sweep's state (data.sweep_state's
# "version", unchanged while the sweep's counters and calibration are; on a running sweep while its
# incremental refresh, at most every LIVE_TTL_S, finds nothing new), its migration checks, the query
# and what the viewer may do (a
# read-only token sees no actions). A repeat load is then a dict lookup (a 10,000-trial page costs
# ~55 ms of CPU to render), and its ETag (a digest of the bytes) answers If-None-Match with a 304.
_rendered: LRU = LRU(max_entries=64)


def _checks_version(checks: list[dict[str, Any]]) -> tuple:
    return tuple((c["id"], c["verdict"], c["error"], c["wall_s"], c["corrupt"]) for c in checks)


def _cached_html(request: Request, session: Any, settings: Settings, sweep_id: int, template: str, *,
                 rank_page: int, trial_page: int, trial_status: str, extra: dict[str, Any]) -> Response:
    if not _can_read(request, settings):
        return _login(request)
    try:
        state = data.sweep_state(session, sweep_id=sweep_id)
    except NotFoundError as exc:
        return _not_found(request, str(exc))
    checks = data.migration_checks(session, sweep_id=sweep_id)
    can_write = _can_write(request, settings)
    key = (template, sweep_id, rank_page, trial_page, trial_status, can_write, bool(settings.api_tokens),
           request.scope.get("root_path", ""), tuple(sorted(extra.items())))

    def render() -> tuple[bytes, str]:
        ctx = _tables_ctx(request, state, checks=checks, rank_page=rank_page, trial_page=trial_page,
                          trial_status=trial_status)
        ctx.update(extra, request=request, can_write=can_write, auth_on=bool(settings.api_tokens),
                   confirm=confirm_page.card(session, sweep=state["sweep"]))
        if template == "sweep.html":
            ctx.update(bundle=state["bundle"], live=state["bundle"]["live"])
        body = templates.get_template(template).render(ctx).encode()
        return body, f'"dash-{sweep_id}-{zlib.crc32(body):08x}-{len(body)}"'

    version = (state["version"], _checks_version(checks))
    entry = _rendered.get_or_build(key, lambda: _packed(*render()), version=version)
    _remember(request, sweep_id, version)
    return _send(request, entry, "text/html; charset=utf-8")


def _page_version(sessions: Any, sweep_id: int) -> tuple:
    """What a sweep's pages and chart data are a function of, read again (api/_answers.py's probe)."""
    with sessions() as session:
        state = data.sweep_state(session, sweep_id=sweep_id)
        return state["version"], _checks_version(data.migration_checks(session, sweep_id=sweep_id))


def _remember(request: Request, sweep_id: int, version: tuple) -> None:
    remember(request, probe_key=("sweep-page", sweep_id), version=version,
             probe=functools.partial(_page_version, request.app.state.sessions, sweep_id))


def _packed(body: bytes, etag: str) -> tuple[bytes, bytes, str]:
    """The bytes, gzipped once (a browser then gets ~10x fewer: 160 kB of tables, 0.7 MB of chart
    data at 10,000 trials), and the ETag."""
    return body, gzip.compress(body, compresslevel=5), etag


def _send(request: Request, entry: tuple[bytes, bytes, str], media_type: str) -> Response:
    raw, packed, etag = entry
    # Weak (RFC 9110 section 8.8.1): the gzipped and the plain bytes are one representation's two encodings.
    headers = {"ETag": "W/" + etag, "Cache-Control": "no-cache", "Vary": "Accept-Encoding"}  # revalidated on each use
    if etag_matches(request.headers.get("if-none-match"), etag):
        return Response(status_code=304, headers=headers)
    if "gzip" in request.headers.get("accept-encoding", ""):
        return Response(packed, media_type=media_type, headers=headers | {"Content-Encoding": "gzip"})
    return Response(raw, media_type=media_type, headers=headers)


@router.get("/sweeps/{sweep_id}", name="dashboard_sweep")
def sweep_page(
    request: Request, sweep_id: SweepId, session: SessionDep, settings: SettingsDep,
    rank_page: Page = 1, trial_page: Page = 1, trial_status: str = "",
    refresh_ms: Annotated[int, Query(ge=500, le=600_000)] = REFRESH_MS,
) -> Response:
    """The sweep page: one page of the ranking and of the trials; the charts' data comes from
    data.json (fetched by dashboard.js), so the page stays small whatever the sweep's size."""
    return _cached_html(request, session, settings, sweep_id, "sweep.html", rank_page=rank_page,
                        trial_page=trial_page, trial_status=trial_status, extra={"refresh_ms": refresh_ms})


@router.get("/sweeps/{sweep_id}/tables", name="dashboard_sweep_tables")
def sweep_tables(
    request: Request, sweep_id: SweepId, session: SessionDep, settings: SettingsDep,
    rank_page: Page = 1, trial_page: Page = 1, trial_status: str = "",
) -> Response:
    return _cached_html(request, session, settings, sweep_id, "_tables.html", rank_page=rank_page,
                        trial_page=trial_page, trial_status=trial_status, extra={})


@router.get("/sweeps/{sweep_id}/data.json", name="dashboard_sweep_data")
def sweep_data(request: Request, sweep_id: SweepId, session: SessionDep, settings: SettingsDep) -> Response:
    if (denied := _json_guard(request, settings)) is not None:
        return denied
    try:
        state = data.sweep_state(session, sweep_id=sweep_id)
    except NotFoundError as exc:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    def render() -> tuple[bytes, str]:  # ~1 MB at 10,000 trials: serialised once per state
        body = JSONResponse(state["bundle"] | {"status": state["sweep"]["status"]}).body
        return body, f'"data-{sweep_id}-{zlib.crc32(body):08x}-{len(body)}"'

    entry = _rendered.get_or_build(("data.json", sweep_id), lambda: _packed(*render()), version=state["version"])
    _remember(request, sweep_id, (state["version"], _checks_version(data.migration_checks(session, sweep_id=sweep_id))))
    return _send(request, entry, "application/json")
