"""Dashboard pages, served by the coordinator (server-rendered Jinja2, Plotly served locally).

The sweeps list and submit form (``/``, ``/sweeps-table``, ``POST /sweeps``), a sweep's page, tables,
chart data and importance (``/sweeps/{id}...``), one trial, a ranked layout's export, ``/login`` and
the static assets. Reads follow the API's rule, a browser sending the token as an http-only cookie set
by ``/login``; submitting needs a token whenever tokens are configured.

The route table and the "check migration" control: docs/api.md#dashboard-routes.
"""

from __future__ import annotations

import gzip
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Form, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from jinja2 import pass_context
from starlette.concurrency import run_in_threadpool
from starlette.routing import NoMatchFound

from api import format as fmt
from api import redact
from api.auth import ANONYMOUS, match_token
from api.dashboard import data, form, memory_page, views
from api.dashboard.importance import param_importance
from api.deps import SessionDep, SettingsDep, SweepId, TrialId
from api.settings import Settings
from api.spec import SAMPLERS
from api.store import SWEEP_STATUSES
from api.sweeps import service
from tuner import CLUSTER_PRESETS, MODEL_PRESETS, ConflictError, NotFoundError

HERE = Path(__file__).resolve().parent
COOKIE = "meshtune_token"
RANK_PAGE = 50
TRIAL_PAGE = 100
REFRESH_MS = 5000

templates = Jinja2Templates(directory=str(HERE / "templates"))
router = APIRouter(include_in_schema=False)
router.mount("/dashboard/static", StaticFiles(directory=str(HERE / "static")), name="dashboard_static")


# --- template globals and filters (the filters are api.format's, shared with the CLI) -------------

@pass_context
def _path_for(context: dict[str, Any], name: str, /, **params: Any) -> str:
    """A root-relative URL: pages work behind a proxy whatever host and scheme it presents.
    Memoised per app: Starlette's url_for walks every route (~1 ms each on a loaded host, and a sweep
    page links a few hundred trials), while a route's path for given parameters never changes."""
    request = context["request"]
    try:
        return _route_path(request.app, request.scope.get("root_path", ""), name, tuple(sorted(params.items())))
    except TypeError:  # an unhashable parameter: no memo
        return request.url_for(name, **params).path


@lru_cache(maxsize=65536)
def _route_path(app: Any, root_path: str, name: str, params: tuple[tuple[str, Any], ...]) -> str:
    return root_path.rstrip("/") + app.url_path_for(name, **dict(params))


@pass_context
def _path_if_routed(context: dict[str, Any], name: str, /, **params: Any) -> str | None:
    """Like ``path_for``, None when the app has no such route (e.g. pages of optional features)."""
    try:
        return context["request"].url_for(name, **params).path
    except NoMatchFound:
        return None


templates.env.globals["path_for"] = _path_for
templates.env.globals["path_if_routed"] = _path_if_routed
templates.env.filters.update(fmt.jinja_filters())


@lru_cache(maxsize=1)
def _plotly_js() -> tuple[bytes, bytes, str]:
    """plotly.js as shipped inside the installed plotly package (raw, gzipped once, ETag)."""
    import plotly

    raw = (Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js").read_bytes()
    return raw, gzip.compress(raw, compresslevel=6), f'"plotly-{plotly.__version__}-{len(raw)}"'


@router.get("/dashboard/vendor/plotly.min.js", name="dashboard_plotly")
def plotly_js(request: Request) -> Response:
    """plotly.js served by the coordinator (no CDN): gzipped when the browser accepts it (4.8 MB ->
    ~1.4 MB for clusters reached over a slow link), cached for a day, revalidated by ETag."""
    raw, packed, etag = _plotly_js()
    headers = {"Cache-Control": "public, max-age=86400", "ETag": etag, "Vary": "Accept-Encoding"}
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers=headers)
    if "gzip" in request.headers.get("accept-encoding", ""):
        return Response(packed, media_type="text/javascript", headers=headers | {"Content-Encoding": "gzip"})
    return Response(raw, media_type="text/javascript", headers=headers)


# --- auth ------------------------------------------------------------------------------------------

def _can_read(request: Request, settings: Settings) -> bool:
    if not settings.api_tokens or not settings.read_requires_auth:
        return True
    token = request.cookies.get(COOKIE) or ""
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        token = header[7:]
    return bool(token) and match_token(token, settings.api_tokens) is not None


def _can_write(request: Request, settings: Settings) -> bool:
    """Whether to show actions (submit, check migration): hidden only when the signed-in token (the
    cookie, or a bearer header) is read-only; without one the forms ask for a token and the API
    decides (api/auth.py)."""
    token = request.cookies.get(COOKIE) or ""
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        token = header[7:]
    name = match_token(token, settings.api_tokens) if token and settings.api_tokens else None
    return name is None or settings.role_of(name) != "read-only"


def _login(request: Request, *, error: str | None = None, status_code: int = 401) -> HTMLResponse:
    return templates.TemplateResponse(
        request, "login.html", {"next": request.url.path, "error": error}, status_code=status_code
    )


def _not_found(request: Request, message: str) -> HTMLResponse:
    return templates.TemplateResponse(request, "error.html", {"message": message}, status_code=404)


@router.get("/login", name="dashboard_login_page")
def login_page(request: Request) -> HTMLResponse:
    return _login(request, status_code=200)


@router.post("/login", name="dashboard_login")
def login(
    request: Request, settings: SettingsDep, token: Annotated[str, Form()] = "", next: Annotated[str, Form()] = "/"
) -> Response:
    if match_token(token, settings.api_tokens) is None:
        return _login(request, error="token: not a valid token", status_code=403)
    target = next if next.startswith("/") and not next.startswith("//") else "/"
    resp = RedirectResponse(target, status_code=303)
    resp.set_cookie(COOKIE, token, httponly=True, samesite="strict", secure=request.url.scheme == "https")
    return resp


# --- sweeps list and submit form -------------------------------------------------------------------

def _list_ctx(request: Request, session: Any, *, status: str | None, page: int, refresh_ms: int) -> dict[str, Any]:
    status = status or None
    if status is not None and status not in SWEEP_STATUSES:
        status = None
    listing = data.sweeps_page(session, status=status, page=page)
    query = {"status": status or "", "page": page}

    def page_url(p: int) -> str:
        return request.url_for("dashboard_sweeps").path + "?" + urlencode(query | {"page": p})

    return {
        **listing, "status": status, "page": page, "page_url": page_url, "sweep_statuses": SWEEP_STATUSES,
        "live": data.live_sweeps(session) > 0, "refresh_ms": refresh_ms,
        "table_url": request.url_for("dashboard_sweeps_table").path + "?" + urlencode(query | {"refresh_ms": refresh_ms}),
    }


def _sweeps_page(
    request: Request, session: Any, settings: Settings, *, status: str | None, page: int,
    state: form.FormState | None = None, status_code: int = 200, refresh_ms: int = REFRESH_MS,
) -> HTMLResponse:
    if state is None:
        state = form.FormState()
        state.values["backend"] = settings.backend
    elif state.errors:  # an error answer shows no secret, in its messages nor in the fields it refills (the
        # form has no field that takes a URL or a token but the token's, which is never refilled)
        state.errors = [redact.redact_text(e) for e in state.errors]
        state.values = redact.redact(state.values)
    ctx = {
        **_list_ctx(request, session, status=status, page=page, refresh_ms=refresh_ms),
        "form": state, "model_presets": sorted(MODEL_PRESETS), "cluster_presets": sorted(CLUSTER_PRESETS),
        "samplers": SAMPLERS, "auth_on": bool(settings.api_tokens), "can_write": _can_write(request, settings),
    }
    return templates.TemplateResponse(request, "sweeps.html", ctx, status_code=status_code)


ListPage = Annotated[int, Query(ge=1, le=100_000)]
RefreshMs = Annotated[int, Query(ge=500, le=600_000)]


@router.get("/", name="dashboard_sweeps")
def sweeps_list(
    request: Request, session: SessionDep, settings: SettingsDep,
    status: str = "", page: ListPage = 1, refresh_ms: RefreshMs = REFRESH_MS,
) -> HTMLResponse:
    if not _can_read(request, settings):
        return _login(request)
    return _sweeps_page(request, session, settings, status=status, page=page, refresh_ms=refresh_ms)


@router.get("/sweeps-table", name="dashboard_sweeps_table")
def sweeps_table(
    request: Request, session: SessionDep, settings: SettingsDep,
    status: str = "", page: ListPage = 1, refresh_ms: RefreshMs = REFRESH_MS,
) -> HTMLResponse:
    """The list's table alone, for the list page's refresh (it says whether to keep refreshing)."""
    if not _can_read(request, settings):
        return _login(request)
    ctx = _list_ctx(request, session, status=status, page=page, refresh_ms=refresh_ms)
    return templates.TemplateResponse(request, "_sweeps_table.html", ctx, headers={"Cache-Control": "no-store"})


@router.post("/sweeps", name="dashboard_submit")
async def submit(request: Request, session: SessionDep, settings: SettingsDep) -> Response:
    raw = {k: str(v) for k, v in (await request.form()).items()}
    # The store is synchronous: validate, write and render off the event loop.
    return await run_in_threadpool(_submit, request, session, settings, raw)


def _submit(request: Request, session: Any, settings: Settings, raw: dict[str, str]) -> Response:
    values = {k: raw.get(k, form.DEFAULTS[k]) for k in form.FIELDS}
    owner: str | None = ANONYMOUS  # as POST /api/sweeps records a sweep when auth is off
    if settings.api_tokens:  # the same rule as POST /api/sweeps: a valid token, its name is the owner
        token = raw.get("token", "")
        owner = match_token(token, settings.api_tokens) if token else None
        if owner is None:  # refused before the spec is parsed or validated: that work is for callers only
            state = form.FormState(values=values, fields={"token"}, errors=[
                "token: missing — this coordinator needs a token to submit" if not token else "token: not a valid token"])
            return _sweeps_page(request, session, settings, status=None, page=1, state=state,
                                status_code=401 if not token else 403)
        if settings.role_of(owner) == "read-only":  # as POST /api/sweeps answers a read-only token
            state = form.FormState(values=values, fields={"token"}, errors=[
                f"token: {owner!r} is read-only — it may read, not submit"])
            return _sweeps_page(request, session, settings, status=None, page=1, state=state, status_code=403)
    spec, state = form.validate(values)
    code = 422
    if spec is not None and not state.errors:
        try:
            sweep = service.create_sweep(session, spec=spec, owner=owner, settings=settings)
        except (ValueError, ConflictError) as exc:  # an unknown reference layout, an owner's limit: named by the service
            state.errors.append(str(exc))
        else:
            return RedirectResponse(request.url_for("dashboard_sweep", sweep_id=sweep.id).path, status_code=303)
    return _sweeps_page(request, session, settings, status=None, page=1, state=state, status_code=code)


# --- the sweep's other pages (the sweep page, its tables and chart data: api/dashboard/sweep_pages.py) ---

def _json_guard(request: Request, settings: Settings) -> JSONResponse | None:
    if not _can_read(request, settings):
        return JSONResponse({"detail": "this coordinator needs a token to read"}, status_code=401)
    return None


@router.get("/sweeps/{sweep_id}/importance.json", name="dashboard_sweep_importance")
def sweep_importance(request: Request, sweep_id: SweepId, session: SessionDep, settings: SettingsDep) -> JSONResponse:
    if (denied := _json_guard(request, settings)) is not None:
        return denied
    try:
        sweep = service.get_sweep(session, sweep_id=sweep_id)
    except NotFoundError as exc:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    def load() -> list[dict[str, Any]]:
        return data.sweep_state(session, sweep_id=sweep_id)["trials"]

    # The listing counters change with every recorded result, so they key the cache.
    key = (sweep_id, sweep.n_trials, sweep.n_completed, sweep.best_tokens_per_s_per_device)
    return JSONResponse(param_importance(load, cache_key=key))


@router.get("/sweeps/{sweep_id}/export", name="dashboard_export")
def export_file(request: Request, sweep_id: SweepId, session: SessionDep, settings: SettingsDep,
                  format: Annotated[str, Query(max_length=50)],
                  layout: Annotated[str | None, Query(max_length=300)] = None) -> Response:
    """The ranking row's export links: GET /api/sweeps/{id}/export's file, read with the cookie."""
    from api.export import service as export_service

    if not _can_read(request, settings):
        return _login(request)
    try:
        out = export_service.export_sweep(session, sweep_id=sweep_id, format=format, layout=layout)
    except (NotFoundError, ConflictError, ValueError) as exc:
        code = 404 if isinstance(exc, NotFoundError) else 409 if isinstance(exc, ConflictError) else 422
        return Response(f"{exc}\n", status_code=code, media_type="text/plain; charset=utf-8")
    return Response(out.export.text, media_type=out.media_type,
                    headers={"Content-Disposition": f'attachment; filename="{out.filename}"'})


@router.get("/sweeps/{sweep_id}/trials/{trial_id}", name="dashboard_trial")
def trial_page(request: Request, sweep_id: SweepId, trial_id: TrialId, session: SessionDep,
               settings: SettingsDep) -> HTMLResponse:
    if not _can_read(request, settings):
        return _login(request)
    try:
        sweep = service.get_sweep(session, sweep_id=sweep_id)
        trial = service.get_trial(session, sweep_id=sweep_id, trial_id=trial_id)
    except NotFoundError as exc:
        return _not_found(request, str(exc))
    prob = data.problem(sweep)
    t = data.trial_row(trial, training=prob["training"], device_memory=prob["device_memory"])
    series = {
        "step_times_ms": [views.sig(s * 1000) for s in t["step_times_s"]],
        "losses": [views.sig(v, 6) if v is not None else None for v in t["losses"]],
        # losses cover warm-up + measured steps; step times the measured ones (the last of them)
        "first_measured_step": max(len(t["losses"]) - len(t["step_times_s"]), 0),
    }
    ctx = {"sweep": data.sweep_header(sweep, prob), "t": t, "label": views.layout_label(t["layout"]), "series": series,
           "memory": memory_page.view(session, sweep_id=sweep_id, trial_id=trial_id)}  # its memory card
    return templates.TemplateResponse(request, "trial.html", ctx)
