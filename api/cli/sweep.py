"""``meshtune sweep SPEC`` (run a sweep end to end), ``meshtune sweeps``, ``meshtune show ID`` and
``meshtune db upgrade|downgrade|current``. All of them use the configured store (MESHTUNE_DATABASE_URL,
default a SQLite file under MESHTUNE_HOME), migrated to head on first use.
"""

from __future__ import annotations

import argparse
import dataclasses
import getpass
import json
import sys
from datetime import datetime
from typing import Any

from tuner import SpecError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="run a sweep from a spec file and print the ranked layouts",
                       description="Run a sweep end to end on the configured store and backend (default: "
                       "SQLite under MESHTUNE_HOME, a local Ray, CPU ranks) and print the ranking.")
    p.add_argument("spec", help="sweep spec file (.yaml/.yml/.toml/.json)")
    p.add_argument("--backend", help="override the spec's backend: ray, simulate or module:attr")
    p.add_argument("--max-trials", type=int, help="override search.max_trials")
    p.add_argument("--json", action="store_true", help="print the final sweep and ranking as JSON")
    p.add_argument("--top", type=int, default=20, help="rows of the ranking to print (default 20)")
    p.set_defaults(func=run_sweep_cmd)

    p = sub.add_parser("sweeps", help="list stored sweeps", description="List stored sweeps, newest first.")
    p.add_argument("--status", help="only sweeps in this state (queued, running, completed, cancelled, failed)")
    p.add_argument("--owner", help="only sweeps submitted by this owner")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=list_cmd)

    p = sub.add_parser("show", help="show one sweep: status, ranking, Pareto front",
                       description="Show a stored sweep: its state, the ranking and its trials.")
    p.add_argument("id", type=int, help="sweep id")
    p.add_argument("--metric", default="tokens_per_s_per_device",
                   choices=["tokens_per_s_per_device", "useful_tokens_per_s"])
    p.add_argument("--trials", action="store_true", help="also list every trial")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=show_cmd)

    p = sub.add_parser("db", help="database schema: upgrade, downgrade, current",
                       description="Manage the store's schema with Alembic (MESHTUNE_DATABASE_URL or the "
                       "embedded SQLite file).")
    p.add_argument("action", choices=["upgrade", "downgrade", "current"])
    p.add_argument("--revision", help="target revision (default head for upgrade, base for downgrade)")
    p.set_defaults(func=db_cmd)


# --- helpers -----------------------------------------------------------------------------------


def _sessions() -> Any:
    from api import store
    from api.settings import Settings

    settings = Settings()
    _, sessions = store.open_store(settings.resolved_database_url)
    return settings, sessions


def load_spec(path: str, *, backend: str | None = None, max_trials: int | None = None) -> Any:
    """A validated SweepSpec from a file; errors are SpecError naming the file and the field."""
    from pydantic import ValidationError

    import tuner
    from api.spec import SweepSpec

    read = getattr(tuner, "read_spec_file", None)
    if read is None:
        from tuner._specfile import read_spec_file as read
    data = read(path)
    if backend:
        data["backend"] = backend
    if max_trials is not None:
        data.setdefault("search", {})
        if isinstance(data["search"], dict):
            data["search"]["max_trials"] = max_trials
    try:
        return SweepSpec.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(x) for x in err["loc"]) or "spec"
        msg = err["msg"].removeprefix("Value error, ")
        value = err.get("input")
        shown = "" if err["type"] == "missing" or isinstance(value, dict) else f" (got {value!r})"
        raise SpecError(f"{path}: {field}: {msg}{shown}") from None


def _jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _jsonable(dataclasses.asdict(obj))
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, datetime):
        return obj.isoformat()
    if hasattr(obj, "__table__"):  # an ORM row
        return {c.name: _jsonable(getattr(obj, c.key)) for c in obj.__table__.columns}
    return obj


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def print_ranking(console: Any, ranking: Any, *, top: int = 20) -> None:
    from rich.table import Table

    label = " (SIMULATED: analytical model + noise, not measurements)" if ranking.simulated else ""
    table = Table(title=f"sweep {ranking.sweep_id}: ranked by {ranking.metric}{label}")
    for col in ("#", "layout", "n", "median", "95% interval", "tie", "useful tok/s", "peak mem",
                "pred err", "mem err"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for row in ranking.rows[:top]:
        table.add_row(
            str(row.rank), row.layout_key, str(row.n), _fmt(row.median), f"{_fmt(row.low)} - {_fmt(row.high)}",
            f"={row.tie_group}" + ("*" if row.tied_with_best else ""), _fmt(row.useful_tokens_per_s),
            _fmt_bytes(row.peak_memory_bytes),
            "-" if row.prediction_error is None else f"{row.prediction_error:+.0%}",
            "-" if row.memory_prediction_error is None else f"{row.memory_prediction_error:+.0%}",
        )
    console.print(table)
    if ranking.rows:
        tied = [r.layout_key for r in ranking.rows if r.tied_with_best]
        if len(tied) > 1:
            console.print(f"{len(tied)} layouts are tied with the best (95% intervals overlap; marked *).")
    else:
        console.print("no layout was measured successfully")


def _print_sweep(console: Any, sweep: Any) -> None:
    console.print(
        f"sweep {sweep.id} [bold]{sweep.name}[/bold]: {sweep.status}  sampler={sweep.sampler} backend={sweep.backend} "
        f"trials={sweep.n_trials} (completed {sweep.n_completed}, pruned {sweep.n_pruned}, failed {sweep.n_failed}) "
        f"device-seconds={sweep.device_seconds:.1f}"
    )
    if sweep.error:
        console.print(f"[red]error:[/red] {sweep.error}")


# --- commands ----------------------------------------------------------------------------------


def run_sweep_cmd(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from api.engine import SweepRunner
    from api.services import sweeps as svc

    spec = load_spec(args.spec, backend=args.backend, max_trials=args.max_trials)
    settings, sessions = _sessions()
    with sessions() as s:
        sweep = svc.create_sweep(s, spec=spec, owner=getpass.getuser())
    console = Console(stderr=args.json, width=None if sys.stdout.isatty() else 160)
    console.print(f"sweep {sweep.id} '{spec.name}': {spec.model} on {spec.cluster}, sampler={spec.search.sampler}, "
                  f"backend={spec.backend}, up to {spec.search.max_trials} trials")
    total = spec.search.max_trials + max(0, spec.search.remeasure_top_k * (spec.search.repeats - 1))
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[last]}"), console=console, transient=False) as progress:
        task = progress.add_task("trials", total=total, last="")

        def on_progress(event: dict[str, Any]) -> None:
            row = event.get("trial")
            if event["event"] in ("finished", "pruned") and row is not None:
                what = row.status if row.status != "completed" else f"{_fmt(row.tokens_per_s_per_device)} tok/s/dev"
                progress.update(task, advance=1, last=f"#{row.number} {row.layout_key}: {what}")

        final = SweepRunner(settings, sessions=sessions).run_sweep(sweep.id, on_progress=on_progress)
        progress.update(task, total=progress.tasks[0].completed)
    with sessions() as s:
        ranking = svc.ranking(s, sweep_id=final.id)
        if args.json:
            json.dump({"sweep": _jsonable(final), "ranking": _jsonable(ranking)}, sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            _print_sweep(console, final)
            print_ranking(console, ranking, top=args.top)
    return 0 if final.status == "completed" else 1


def list_cmd(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from api.services import sweeps as svc

    _, sessions = _sessions()
    with sessions() as s:
        page = svc.list_sweeps(s, status=args.status, owner=args.owner, limit=args.limit, offset=args.offset)
    if args.json:
        json.dump({"items": _jsonable(page.items), "total": page.total, "limit": page.limit,
                   "offset": page.offset}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    table = Table(title=f"sweeps ({page.total} in all)")
    for col in ("id", "name", "status", "owner", "sampler", "backend", "trials", "best layout", "best tok/s/dev",
                "created"):
        table.add_column(col)
    for sw in page.items:
        table.add_row(str(sw.id), sw.name, sw.status, sw.owner or "-", sw.sampler, sw.backend, str(sw.n_trials),
                      sw.best_layout_key or "-", _fmt(sw.best_tokens_per_s_per_device),
                      sw.created_at.strftime("%Y-%m-%d %H:%M"))
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    return 0


def show_cmd(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from api.services import sweeps as svc

    _, sessions = _sessions()
    with sessions() as s:
        sweep = svc.get_sweep(s, sweep_id=args.id)
        ranking = svc.ranking(s, sweep_id=args.id, metric=args.metric)
        front = svc.pareto(s, sweep_id=args.id)
        trials = svc.list_trials(s, sweep_id=args.id, limit=1000).items if (args.trials or args.json) else []
    if args.json:
        json.dump({"sweep": _jsonable(sweep), "ranking": _jsonable(ranking), "pareto": _jsonable(front),
                   "trials": _jsonable(trials)}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    console = Console(width=None if sys.stdout.isatty() else 160)
    _print_sweep(console, sweep)
    print_ranking(console, ranking)
    on_front = [p for p in front if p.on_front]
    if on_front:
        console.print("Pareto front (tokens/s per device vs peak memory): " + ", ".join(
            f"{p.layout_key} ({_fmt(p.tokens_per_s_per_device)}, {_fmt_bytes(p.peak_memory_bytes)})" for p in on_front))
    if sweep.calibration:
        cal = sweep.calibration
        console.print(f"calibration from {cal.get('n_time_samples')} measurements: rms log error "
                      f"{cal.get('rms_log_error_before', float('nan')):.3f} -> {cal.get('rms_log_error_after', float('nan')):.3f}; "
                      + ", ".join(f"{k}={cal['factors'][k]:.3f}" for k in cal.get("fitted", [])))
    if args.trials:
        table = Table(title="trials")
        for col in ("#", "att", "phase", "layout", "status", "tok/s/dev", "pred", "peak mem", "pred mem", "cause"):
            table.add_column(col)
        for t in trials:
            table.add_row(str(t.number), str(t.attempt), t.phase, t.layout_key, t.status, _fmt(t.tokens_per_s_per_device),
                          _fmt(t.predicted_tokens_per_s_per_device), _fmt_bytes(t.peak_memory_bytes),
                          _fmt_bytes(t.predicted_memory_bytes), (t.cause or "")[:60])
        console.print(table)
    return 0


def db_cmd(args: argparse.Namespace) -> int:
    from api import store
    from api.settings import Settings

    url = Settings().resolved_database_url
    if args.action == "upgrade":
        store.upgrade(url, args.revision or "head")
    elif args.action == "downgrade":
        store.downgrade(url, args.revision or "base")
    print(f"{store.safe_url(url)}: schema revision {store.current_revision(url) or 'base (empty)'}")
    return 0

