"""``meshtune optuna-export SWEEP``: the sweep's trials as an Optuna study (api/export/optuna.py),
for ``optuna-dashboard`` and Optuna's own tools. Exporting again adds only what finished since."""

from __future__ import annotations

import argparse

from api.settings import Settings
from tuner import SpecError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "optuna-export",
        help="export a sweep's trials as an Optuna study (for optuna-dashboard)",
        description="Write the sweep's finished trials into an Optuna storage of its own (never meshtune's "
        "database) as the study '<id>-<name>': params are the layout's knobs, the value is tokens/s per "
        "device (maximize), failures are FAIL trials with their status and error. Incremental: running it "
        "again adds only the trials finished since. Then: optuna-dashboard <storage URL>.",
    )
    p.add_argument("sweep_id", type=int, metavar="SWEEP", help="the sweep's id")
    p.add_argument("--storage", default=None,
                   help="Optuna storage URL (default: sqlite:///... next to meshtune's SQLite store, "
                        "else $MESHTUNE_HOME/optuna.db)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from api import store
    from api.export.optuna import default_storage, export_sweep

    if not 1 <= args.sweep_id <= 2**31 - 1:
        raise SpecError(f"SWEEP={args.sweep_id} is not a sweep id (1..2147483647)")
    settings = Settings()
    url = settings.resolved_database_url
    storage = args.storage or default_storage(url, settings.home)
    if storage.startswith("sqlite") and (problem := store.url_problem(storage)):
        raise SpecError(f"--storage={store.safe_url(storage)!r}: {problem}")
    engine, sessions = store.open_store(url)
    try:
        with sessions() as session:
            done = export_sweep(session, sweep_id=args.sweep_id, storage=storage)
    finally:
        engine.dispose()
    print(f"study {done.study_name!r} in {done.storage}: {done.added} trials added, {done.total} in all")
    print(f"open it with: optuna-dashboard {done.storage}")
    return 0
