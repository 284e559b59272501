"""The coordinator's FastAPI app: wires the routers, the lifespan and the exception handlers.

``create_app(settings)`` builds an app on any settings (tests); ``app`` is the process default, for
``uvicorn api.main:app``. ``meshtune serve`` migrates the database first, then runs this app.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from api import dashboard, errors, store
from api.dashboard import trends
from api.routes import health, metrics, plan, presets, reshard, schedules, sweeps
from api.settings import Settings, get_settings

log = logging.getLogger("meshtune.api")

DESCRIPTION = """\
Submit parallelism-layout sweeps, follow their trials, and read the measured ranking.

**Auth**: mutating endpoints need `Authorization: Bearer <token>` with one of the tokens configured in
`MESHTUNE_API_TOKENS` (`name:token,...`); the token's name is recorded as the sweep's owner. Reads need
a token only when `MESHTUNE_READ_REQUIRES_AUTH=true`. No header: 401; unknown token: 403.

**Errors**: invalid input is 422 naming the field and the value; unknown ids 404; cancelling a
finished sweep 409.
"""


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
    )
    app.state.settings = settings
    errors.install(app)
    # API routers first, then the dashboard's pages (the dashboard owns "/").
    for module in (sweeps, plan, presets, health, metrics, schedules, reshard, dashboard, trends):
        app.include_router(module.router)
    return app
