"""``meshtune sweep SPEC`` (run a sweep end to end), ``meshtune sweeps``, ``meshtune show ID`` and
``meshtune db upgrade|downgrade|current``. All of them use the configured store (MESHTUNE_DATABASE_URL,
default a SQLite file under MESHTUNE_HOME), migrated to head on first use.
"""

from __future__ import annotations

import argparse
import dataclasses
import getpass
import json
import signal
import sys
import threading
from datetime import datetime
from typing import Any

from tuner import ConflictError, SpecError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="run a sweep from a spec file and print the ranked layouts",
                       description="Run a sweep end to end on the configured store and backend (default: "
                       "SQLite under MESHTUNE_HOME, a local Ray, CPU ranks) and print the ranking.")
    p.add_argument("spec", nargs="?", help="sweep spec file (.yaml/.yml/.toml/.json)")
    p.add_argument("--resume", type=int, metavar="ID",
                   help="resume unfinished sweep ID in the foreground instead of starting one (trials that were "
                   "running are marked interrupted and re-run; none is lost or duplicated)")
    p.add_argument("--backend", help="override the spec's backend: ray, simulate or module:attr")
    p.add_argument("--max-trials", type=int, help="override search.max_trials")
    p.add_argument("--model", metavar="PRESET|hf:PATH",
                   help="override the spec's model: a preset, or hf:PATH of a Hugging Face config.json")
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


def load_spec(path: str, *, backend: str | None = None, max_trials: int | None = None,
              model: str | None = None) -> Any:
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
    if model is not None:
        from tuner._hf import model_arg

        data["model"] = model_arg(model)
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
        out = {c.name: _jsonable(getattr(obj, c.key)) for c in obj.__table__.columns}
        if hasattr(obj, "diagnostic"):
            out["diagnostic"] = obj.diagnostic
        return out
    return obj


def _fmt_bytes(n: float | None) -> str:
    from api import format as fmt

    return fmt.bytes_text(n, dash="-")


def _fmt(v: float | None) -> str:
    """Throughput as the dashboard shows it (api.format.num: 4 significant digits, whole numbers from
    10,000 up), so that a table fits a terminal and both read the same."""
    from api import format as fmt

    return fmt.num(v, dash="-")


# Piped or captured output is not squeezed into 80 columns (as `meshtune plan`): a ranking's widest
# rows (long layouts, ten numeric columns) fit in 200 without wrapping.
PIPED_WIDTH = 200

METRIC_LABELS = {
    "tokens_per_s_per_device": "tok/s/dev",
    "useful_tokens_per_s": "useful tok/s (job)",
}


def print_ranking(console: Any, ranking: Any, *, top: int = 20) -> None:
    """The ranking as a table. Per-device columns say "/dev"; "useful tok/s/dev" is the API's
    ``useful_tokens_per_s_per_device`` (so it is <= tok/s/dev); the metric's median and interval are
    labelled with the metric's unit. Layouts are shown in their short form (``Layout.short``; the
    JSON keeps the full key), never cut: two layouts never read the same."""
    from rich.table import Table

    from api import format as fmt

    label = " (SIMULATED: analytical model + noise, not measurements)" if ranking.simulated else ""
    if getattr(ranking, "diagnostic", False):
        label += " (DIAGNOSTIC: trial.options inject failures/sleeps/memory caps; not real measurements)"
    unit = METRIC_LABELS.get(ranking.metric, ranking.metric)
    table = Table(title=f"sweep {ranking.sweep_id}: ranked by {ranking.metric}{label}")
    columns = ["#", "layout", "n", f"median {unit}", "95% interval", "vs best"]
    if ranking.metric != "tokens_per_s_per_device":
        columns.append("tok/s/dev")
    columns += ["useful tok/s/dev", "peak mem", "pred err", "mem err"]
    spend = getattr(ranking, "budget", None) or {}
    priced = spend.get("train_tokens") is not None or spend.get("price_per_device_hour") is not None
    if priced:  # time and cost to train training.train_tokens at each layout's measured tokens/s
        columns += ["time to train", "cost"]
    for col in columns:
        if col == "layout":
            table.add_column(col, justify="left", overflow="fold", min_width=12)
        elif col == "vs best":
            table.add_column(col, justify="left", max_width=16)
        else:
            table.add_column(col, justify="right")
    best_known = bool(ranking.rows) and fmt.interval_known(ranking.rows[0])
    verdicts = fmt.versus_rows(ranking.rows)
    for row, versus in list(zip(ranking.rows, verdicts, strict=True))[:top]:
        spread = "none (n=1)" if not fmt.interval_known(row) else f"{_fmt(row.low)} - {_fmt(row.high)}"
        cells = [str(row.rank), fmt.layout_text(row.layout, dash=row.layout_key) if row.layout else row.layout_key,
                 str(row.n), _fmt(row.median), spread,
                 fmt.versus_text(versus, row_known=fmt.interval_known(row), best_known=best_known)]
        if ranking.metric != "tokens_per_s_per_device":
            cells.append(_fmt(row.tokens_per_s_per_device))
        cells += [
            _fmt(row.useful_tokens_per_s_per_device), _fmt_bytes(row.peak_memory_bytes),
            fmt.error_markup(row.prediction_error), fmt.error_markup(row.memory_prediction_error),
        ]
        if priced:
            b = fmt.budget_cells(row.budget, simulated=bool(row.budget and row.budget.get("simulated")))
            cells += [b["time"], b["cost"]]
        table.add_row(*cells)
    console.print(table)
    if ranking.rows:
        tied = sum(v == fmt.TIED for v in verdicts)
        console.print(fmt.tied_sentence(tied, best_known=best_known))
        console.print(f"vs best — {fmt.VERSUS_LEGEND}. pred err / mem err: (model - measured) / measured, "
                      "coloured by size (green within 15%, yellow within 50%, red beyond).", style="dim")
    else:
        console.print("no layout was measured successfully")


def _device_seconds_text(sweep: Any) -> str:
    """The sweep's device-seconds, said to be simulated on the simulate backend: there they are the
    time the modelled runs would take, and no device spent them."""
    if sweep.backend == "simulate":
        return f"simulated device-seconds={sweep.device_seconds:,.1f} (no real device time)"
    return f"device-seconds={sweep.device_seconds:,.1f}"


def _print_sweep(console: Any, sweep: Any) -> None:
    console.print(
        f"sweep {sweep.id} [bold]{sweep.name}[/bold]: {sweep.status}  sampler={sweep.sampler} backend={sweep.backend} "
        f"{_workload_text((getattr(sweep, 'spec', None) or {}).get('workload'))}"
        f"trials={sweep.n_trials} (completed {sweep.n_completed}, pruned {sweep.n_pruned}, failed {sweep.n_failed}) "
        f"{_device_seconds_text(sweep)}"
    )
    from api import format as fmt
    from api.sweeps import budget

    prob = budget.problem(sweep)
    if prob is not None:
        cluster, training = prob
        line = "search spent: " + fmt.search_spent(sweep.device_seconds or 0.0, simulated=sweep.backend == "simulate",
                                                  price_per_device_hour=cluster.price_per_device_hour)
        if training.train_tokens is not None:
            line += f"; token budget to train: {fmt.tokens_text(training.train_tokens)}"
        console.print(line)
    if sweep.diagnostic:
        console.print("[yellow]diagnostic sweep: trial.options inject failures, sleeps or memory caps; its numbers "
                      "are not real measurements[/yellow]")
    if sweep.error:
        console.print(f"[red]error:[/red] {sweep.error}")


# --- commands ----------------------------------------------------------------------------------


def _resume_hint(sweep_id: int) -> str:
    return (f"sweep {sweep_id} is unfinished; resume it with `meshtune sweep --resume {sweep_id}` "
            "(a coordinator, `meshtune serve`, on the same database resumes it too)")


def _stop_on_ctrl_c(stop: threading.Event, console: Any) -> Any:
    """First Ctrl-C: start no new trial, record the ones in flight, then return (resumable).
    Second Ctrl-C: KeyboardInterrupt at once (trials in flight are re-run on resume).
    Returns the previous SIGINT handler, or None off the main thread (no handler installed)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        console.print("[yellow]stopping: no new trials; waiting for the trials in flight to be recorded "
                      "(Ctrl-C again to leave them now)[/yellow]")

    return signal.signal(signal.SIGINT, handler)


def run_sweep_cmd(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from api import format as fmt
    from api import store
    from api.engine import SweepRunner
    from api.spec import SweepSpec
    from api.sweeps import service as svc

    if args.resume is not None:
        if args.spec or args.backend or args.max_trials is not None:
            raise SpecError("--resume ID takes no SPEC, --backend nor --max-trials: a sweep resumes with its stored spec")
        settings, sessions = _sessions()
        runner = SweepRunner(settings, sessions=sessions)
        with sessions() as s:
            sweep = svc.get_sweep(s, sweep_id=args.resume)  # NotFoundError: exit 2
            if sweep.status in store.FINISHED_SWEEP_STATUSES:
                raise ConflictError(f"--resume {args.resume}: sweep {args.resume} is already {sweep.status}; "
                                    "only queued or running sweeps can be resumed")
            spec = SweepSpec.model_validate(sweep.spec)
            done = sum(1 for t in store.all_trials(s, sweep_id=sweep.id)
                       if t.status in store.TERMINAL_TRIAL_STATUSES)
    elif not args.spec:
        raise SpecError("give a sweep spec file (meshtune sweep SPEC), or --resume ID")
    else:
        spec = load_spec(args.spec, backend=args.backend, max_trials=args.max_trials,
                         model=getattr(args, "model", None))
        settings, sessions = _sessions()
        runner = SweepRunner(settings, sessions=sessions)
        with sessions() as s:
            try:  # inserted already running under this runner: `meshtune serve` cannot claim it first
                sweep = svc.create_sweep(s, spec=spec, owner=getpass.getuser(), runner_id=runner.runner_id)
            except SpecError as exc:
                raise SpecError(f"{args.spec}: {exc}") from None
        done = 0
    console = Console(stderr=args.json, width=None if sys.stdout.isatty() else PIPED_WIDTH)
    verb = "resuming" if args.resume is not None else "sweep"
    console.print(f"{verb} {sweep.id} '{spec.name}': {_problem_label(spec)}, sampler={spec.sampler_label}, "
                  f"backend={spec.backend}, up to {_planned_trials(spec)} trials{_trials_why(spec)}")
    stop = threading.Event()
    previous = _stop_on_ctrl_c(stop, console)
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      TextColumn("{task.fields[last]}"), console=console, transient=False) as progress:
            task = progress.add_task("trials", total=max(_planned_trials(spec), done), completed=done, last="")

            def on_progress(event: dict[str, Any]) -> None:
                row = event.get("trial")
                if event["event"] in ("finished", "pruned") and row is not None:
                    what = row.status if row.status != "completed" else f"{_fmt(row.tokens_per_s_per_device)} tok/s/dev"
                    progress.update(task, advance=1, last=f"#{row.number} {fmt.layout_text(row.layout)}: {what}")

            final = runner.run_sweep(sweep.id, stop_event=stop, on_progress=on_progress)
            progress.update(task, total=progress.tasks[0].completed)
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted: {_resume_hint(sweep.id)}[/yellow]")
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    with sessions() as s:
        ranking = svc.ranking(s, sweep_id=final.id)
        if args.json:
            json.dump({"sweep": _jsonable(final), "ranking": _jsonable(ranking)}, sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            _print_sweep(console, final)
            print_ranking(console, ranking, top=args.top)
    if final.status not in store.FINISHED_SWEEP_STATUSES:
        console.print(f"[yellow]stopped: {_resume_hint(final.id)}[/yellow]")
        return 130
    return 0 if final.status == "completed" else 1


def _problem_label(spec: Any) -> str:
    """``llama3-70b on h100-sxm (8×8 cuda)``: the resolved model and cluster, whether the spec names a
    preset or a mapping of overrides (a mapping printed as it is read ``{'preset': ...}``)."""
    from api import format as fmt

    model, cluster, _ = spec.to_problem()
    workload = _workload_text(spec.workload).strip()
    return f"{model.name} on {fmt.cluster_label(cluster)}" + (f", {workload}" if workload else "")


def _workload_text(workload: str | None) -> str:
    """`` workload=hf `` where the model code trained is not the built-in model (which trained is what
    the numbers measure), else nothing."""
    return f"workload={workload} " if workload and workload != "builtin" else ""


def _planned_trials(spec: Any) -> int:
    """Trial numbers the sweep plans (search + re-measurements); the progress bar's total."""
    search = spec.search
    if search.layouts is not None:
        return len(search.layouts) * search.repeats
    return search.max_trials + max(0, search.remeasure_top_k * (search.repeats - 1))


def _trials_why(spec: Any) -> str:
    """What the planned count is made of: a spec that says max_trials: 4 and reads "up to 10" is a puzzle."""
    search = spec.search
    if search.layouts is not None:
        return f" ({len(search.layouts)} layouts x {search.repeats} repeats)" if search.repeats > 1 else ""
    extra = max(0, search.remeasure_top_k * (search.repeats - 1))
    return f" ({search.max_trials} searched + {extra} re-measurements of the top {search.remeasure_top_k})" if extra else ""


def list_cmd(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from api import format as fmt
    from api.sweeps import service as svc

    _, sessions = _sessions()
    with sessions() as s:
        page = svc.list_sweeps(s, status=args.status, owner=args.owner, limit=args.limit, offset=args.offset)
    if args.json:
        json.dump({"items": _jsonable(page.items), "total": page.total, "limit": page.limit,
                   "offset": page.offset}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    table = Table(title=f"sweeps ({page.total} in all)")
    for col in ("id", "name", "status", "owner", "sampler", "backend", "trials", "best layout",
                "best tok/s/dev (median)", "created"):
        table.add_column(col, overflow="fold")
    with sessions() as s:
        for sw in page.items:  # the ranking's #1, as `show` and the dashboard name it (not the fastest run)
            ranked = svc.ranking(s, sweep_id=sw.id).rows if sw.n_completed else []
            best = ranked[0] if ranked else None
            table.add_row(str(sw.id), sw.name, sw.status, sw.owner or "-", sw.sampler, sw.backend, str(sw.n_trials),
                          fmt.layout_text(best.layout) if best else "-", _fmt(best.median if best else None),
                          sw.created_at.strftime("%Y-%m-%d %H:%M"))
    Console(width=None if sys.stdout.isatty() else PIPED_WIDTH).print(table)
    return 0


def calibration_lines(calibration: dict | None) -> list[str]:
    """What the sweep's calibration says (one text for `meshtune show` and the dashboard)."""
    from api.engine._calibrate import describe

    return describe(calibration)


def show_cmd(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from api import format as fmt
    from api.sweeps import service as svc

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
    console = Console(width=None if sys.stdout.isatty() else PIPED_WIDTH)
    _print_sweep(console, sweep)
    print_ranking(console, ranking)
    on_front = [p for p in front if p.on_front]
    if on_front:
        console.print("Pareto front (tokens/s per device vs peak memory): " + ", ".join(
            f"{fmt.layout_text(p.layout)} ({_fmt(p.tokens_per_s_per_device)}, {_fmt_bytes(p.peak_memory_bytes)})"
            for p in on_front))
    for line in calibration_lines(sweep.calibration):
        console.print(line)
    if args.trials:
        table = Table(title="trials")
        for col in ("#", "att", "phase", "layout", "status", "tok/s/dev", "pred", "peak mem", "pred mem", "cause"):
            table.add_column(col, overflow="fold")
        for t in trials:
            table.add_row(str(t.number), str(t.attempt), t.phase, fmt.layout_text(t.layout), t.status,
                          _fmt(t.tokens_per_s_per_device), _fmt(t.predicted_tokens_per_s_per_device),
                          _fmt_bytes(t.peak_memory_bytes), _fmt_bytes(t.predicted_memory_bytes), fmt.cause_text(t.cause))
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

