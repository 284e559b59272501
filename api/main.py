"""The coordinator's FastAPI app: wires the routers, the lifespan and the exception handlers.

``create_app(settings)`` builds an app on any settings (tests); ``app`` is the process default, for
``uvicorn api.main:app``. ``meshtune serve`` migrates the database first, then runs this app.
"""

from __future__ import annotations

import importlib.resources
import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from api import _answers, _http, dashboard, errors, redact, store
from api.confirm import routes as confirm_routes
from api.dashboard import confirm_page, plan_page, sweep_pages, trends
from api.export import routes as export_routes
from api.memory import routes as memory_routes
from api.plan import routes as plan
from api.plan import service as plan_service
from api.probes import routes as probes
from api.ranking import routes as ranking
from api.reshard import routes as reshard
from api.routes import health, metrics, presets
from api.schedules import routes as schedules
from api.settings import Settings, get_settings
from api.sweeps import routes as sweeps

log = logging.getLogger("meshtune.api")

DESCRIPTION = """\
Submit parallelism-layout sweeps, follow their trials, and read the measured ranking.

**Auth**: mutating endpoints need `Authorization: Bearer <token>` with one of the tokens configured in
`MESHTUNE_API_TOKENS` (`name:token,...`); the token's name is recorded as the sweep's owner. Reads need
a token only when `MESHTUNE_READ_REQUIRES_AUTH=true`. No header: 401; unknown token: 403. Roles
(`MESHTUNE_API_ROLES`): a read-only token may not write, a member acts only on its own sweeps and
schedules (403 otherwise), an admin on all.

**Errors**: invalid input is 422 naming the field and the value (a body that is not UTF-8 JSON:
field `body`); unknown ids 404; cancelling a finished sweep 409; a body over 1 MiB 413; an
anonymous client that spent its planning budget 429 with `Retry-After`.
"""

DOCS_ASSETS = "/docs/assets"


def _docs_assets() -> Path:
    """Swagger UI 5 and ReDoc 2 (MIT), as shipped inside the installed ``fastapi-offline`` package:
    the pages work on a cluster with no route to a CDN."""
    return Path(str(importlib.resources.files("fastapi_offline"))) / "static"


def _add_docs(app: FastAPI) -> None:
    """/docs and /redoc with every asset served by this app (FastAPI's own pages load them from
    public CDNs; see its "Custom Docs UI Static Assets" how-to)."""
    app.mount(DOCS_ASSETS, StaticFiles(directory=str(_docs_assets())), name="docs_assets")
    redirect = app.swagger_ui_oauth2_redirect_url

    @app.get("/docs", include_in_schema=False)
    def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - API docs",
            oauth2_redirect_url=f"{root}{redirect}", swagger_js_url=f"{root}{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{DOCS_ASSETS}/swagger-ui.css", swagger_favicon_url=f"{root}{DOCS_ASSETS}/favicon.png",
        )

    @app.get(redirect, include_in_schema=False)
    def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(
            openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - API reference",
            redoc_js_url=f"{root}{DOCS_ASSETS}/redoc.standalone.js", redoc_favicon_url=f"{root}{DOCS_ASSETS}/favicon.png",
            with_google_fonts=False,
        )


STOP_TIMEOUT_S = 30.0


def _start_background(app: FastAPI, settings: Settings) -> None:
    """Start the sweep engine's loop (queued sweeps, and unfinished ones whose runner is gone) on a
    daemon thread of this process."""
    from api.engine import SweepRunner

    runner = SweepRunner(settings, sessions=app.state.sessions)
    stop = threading.Event()
    thread = threading.Thread(target=runner.run_pending, args=(stop,), name="meshtune-engine", daemon=True)
    thread.start()
    app.state.background = (stop, thread)


def _stop_background(app: FastAPI) -> None:
    """Ask the engine to stop; trials still running are picked up again by the next coordinator
    (marked interrupted and re-run under the same number)."""
    background = getattr(app.state, "background", None)
    if background is not None:
        stop, thread = background
        stop.set()
        thread.join(STOP_TIMEOUT_S)


def create_app(settings: Settings | None = None, *, run_engine: bool = True) -> FastAPI:
    """The coordinator app. ``run_engine=False`` serves the API only (tests, read replicas)."""
    settings = settings or get_settings()
    redact.add_secrets(*settings.api_tokens.values(), *settings.secret_values())  # never in an error answer or log

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.engine = store.create_engine(settings.resolved_database_url)
        app.state.sessions = store.make_sessionmaker(app.state.engine)
        if not settings.api_tokens:
            log.warning("MESHTUNE_API_TOKENS is empty: auth is off and every request acts as 'anonymous'")
        if run_engine:
            _start_background(app, settings)
        try:
            yield
        finally:
            _stop_background(app)
            app.state.engine.dispose()

    app = FastAPI(
        title="meshtune coordinator",
        version="0.1.0",
        description=DESCRIPTION,
        lifespan=lifespan,
        docs_url=None,  # served by _add_docs from installed files, not from a CDN
        redoc_url=None,
        dependencies=[Depends(_http.storable_params)],  # every route, the dashboard's included
    )
    app.state.settings = settings
    app.state.plan_budget = plan_service.ClientBudget()  # per app: a test's clients do not share one
    errors.install(app)
    _add_docs(app)
    # API routers first, then the dashboard's pages (the dashboard owns "/"; its sweep pages follow it).
    for module in (sweeps, ranking, confirm_routes, memory_routes, export_routes, plan, presets, health, metrics, schedules,
                   reshard, probes, dashboard, sweep_pages, confirm_page, trends, plan_page):
        app.include_router(module.router)
    # Outermost last: the body limit applies before anything, even routing, reads the body.
    app.add_middleware(_http.AllowedMethods)
    app.add_middleware(_http.BodyLimit)
    app.add_middleware(_answers.AnswerReplay)  # unchanged read answers, before routing (api/_answers.py)
    return app
