"""``meshtune serve``: run the coordinator (API, sweep engine loop, dashboard, scheduler) with uvicorn.

Start-up migrates the configured database to the newest schema first (idempotent: a database
already at head is left alone), so a fresh SQLite file or PostgreSQL database just works. Every log
handler (the root's, uvicorn's error and access logs) masks URLs' secrets and the configured tokens
(api.redact). uvicorn's own X-Forwarded-For handling is off: the app decides which proxies to believe
(``MESHTUNE_TRUSTED_PROXIES``, api._http.client_address), so a local client cannot pass for another.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import logging
from typing import Any

from api import redact
from api._gc import serve_quietly
from api.settings import Settings
from tuner import SpecError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="run the coordinator web API and the sweep engine",
        description="Run the coordinator: HTTP API, the sweep engine's execution loop and the scheduler. "
        "Configuration comes from MESHTUNE_* environment variables (database URL, API tokens, ...).",
    )
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    p.add_argument("--no-engine", action="store_true", help="serve the API only; run no sweeps in this process")
    p.add_argument("--no-migrate", action="store_true", help="do not upgrade the database schema on start")
    p.add_argument(
        "--migrate-only", action="store_true", help="upgrade the database schema and exit (one-shot deploy step)"
    )
    p.add_argument("--no-access-log", action="store_true", help="do not log one line per request")
    p.add_argument("--optuna-storage", default=None, metavar="URL",
                   help="keep an Optuna storage (e.g. sqlite:///optuna.db, never meshtune's own database) in step "
                        "with every sweep's trials as results land, for optuna-dashboard (api/export/optuna.py)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from api import store
    from api.main import create_app

    if not 0 <= args.port <= 65535:
        raise SpecError(f"--port={args.port} is not a TCP port (0-65535)")
    settings = Settings()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    redact.add_secrets(*settings.secret_values())
    redact.install_log_filter(logging.getLogger())
    # Alembic >= 1.16 logs every built-in plugin it sets up at INFO (alembic/runtime/plugins.py), seven
    # lines on each start that say nothing about this database; its migration lines still show.
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
    url = settings.resolved_database_url
    if not args.no_migrate or args.migrate_only:
        store.upgrade(url)  # raises StoreUnavailableError naming the URL (password hidden)
    logging.getLogger("meshtune.serve").info("database %s at schema head", store.safe_url(url))
    if args.migrate_only:
        return 0
    app = create_app(settings, run_engine=not args.no_engine)
    # uvloop and httptools (dependencies) when importable: ~3x the API's throughput of asyncio + h11
    # under 50 concurrent readers (benchmarks/bench_api_latency.py). One process: the sweep engine,
    # the scheduler and the response caches live in it.
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    logging.getLogger("meshtune.serve").info("serving on %s:%s (%s event loop, %s HTTP parser)",
                                             args.host, args.port, loop, http)
    mirror = _optuna_mirror(args.optuna_storage, url)
    serve_quietly()  # full garbage collections kept off the request path (api/_gc.py)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, log_config=log_config(),
                    access_log=not args.no_access_log, loop=loop, http=http, proxy_headers=False)
    finally:
        if mirror is not None:
            mirror.stop()
    return 0


def log_config() -> dict[str, Any]:
    """uvicorn's logging configuration with ``api.redact.RedactFilter`` on each of its handlers."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["redact"] = {"()": "api.redact.RedactFilter"}
    for handler in config["handlers"].values():
        handler["filters"] = [*handler.get("filters", []), "redact"]
    return config


def _optuna_mirror(storage: str | None, url: str):  # -> OptunaMirror | None
    """With ``--optuna-storage``: the thread that exports each sweep whose results moved."""
    if storage is None:
        return None
    from api import store
    from api.export.optuna import OptunaMirror

    if storage == url:
        raise SpecError("--optuna-storage must not be meshtune's own database (both have a 'trials' table)")
    if storage.startswith("sqlite") and (problem := store.url_problem(storage)):
        raise SpecError(f"--optuna-storage={store.safe_url(storage)!r}: {problem}")
    mirror = OptunaMirror(store.make_sessionmaker(store.create_engine(url)), storage=storage)
    mirror.start()
    logging.getLogger("meshtune.serve").info("mirroring every sweep into the Optuna storage %s", store.safe_url(storage))
    return mirror

