"""``meshtune sweep SPEC`` (run a sweep end to end, or ``--resume ID``) and ``meshtune db
upgrade|downgrade|current``; ``meshtune sweeps`` and ``meshtune show ID`` are registered here too and
live in api/cli/show.py, with the rendering ``sweep`` prints at its end. All of them use the
configured store (MESHTUNE_DATABASE_URL, default a SQLite file under MESHTUNE_HOME), migrated to head
on first use.
"""

from __future__ import annotations

import argparse
import getpass
import json
import sys
from typing import Any

from api.cli import show
from api.cli._foreground import run_in_foreground
from api.cli._store import open_sessions, resume_hint
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

    show.register(sub)  # `sweeps` and `show`

    p = sub.add_parser("db", help="database schema: upgrade, downgrade, current",
                       description="Manage the store's schema with Alembic (MESHTUNE_DATABASE_URL or the "
                       "embedded SQLite file).")
    p.add_argument("action", choices=["upgrade", "downgrade", "current"])
    p.add_argument("--revision", help="target revision (default head for upgrade, base for downgrade)")
    p.set_defaults(func=db_cmd)


# --- helpers -----------------------------------------------------------------------------------


def load_spec(path: str, *, backend: str | None = None, max_trials: int | None = None,
              model: str | None = None) -> Any:
    """A validated SweepSpec from a file; errors are SpecError naming the file and the field."""
    from pydantic import ValidationError

    from api.spec import SweepSpec
    from tuner import read_spec_file

    data = read_spec_file(path)
    if backend:
        data["backend"] = backend
    if model is not None:
        from tuner import model_arg

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


# --- commands ----------------------------------------------------------------------------------


def run_sweep_cmd(args: argparse.Namespace) -> int:
    from rich.console import Console

    from api import store
    from api.engine import SweepRunner
    from api.ranking import service as rankings
    from api.spec import SweepSpec
    from api.sweeps import service as svc

    if args.resume is not None:
        if args.spec or args.backend or args.max_trials is not None:
            raise SpecError("--resume ID takes no SPEC, --backend nor --max-trials: a sweep resumes with its stored spec")
        settings, sessions = open_sessions()
        runner = SweepRunner(settings, sessions=sessions)
        with sessions() as s:
            sweep = svc.get_sweep(s, sweep_id=args.resume)  # NotFoundError: exit 2
            if sweep.status in store.FINISHED_SWEEP_STATUSES:
                raise ConflictError(f"--resume {args.resume}: sweep {args.resume} is already {sweep.status}; "
                                    "only queued or running sweeps can be resumed")
            spec = SweepSpec.model_validate(sweep.spec)
            # the sweep's counts: a node-lost trial beside its re-run is one trial (api/store/_sweeps.py)
            done = sweep.n_completed + sweep.n_pruned + sweep.n_failed
    elif not args.spec:
        raise SpecError("give a sweep spec file (meshtune sweep SPEC), or --resume ID")
    else:
        spec = load_spec(args.spec, backend=args.backend, max_trials=args.max_trials,
                         model=getattr(args, "model", None))
        settings, sessions = open_sessions()
        runner = SweepRunner(settings, sessions=sessions)
        with sessions() as s:
            try:  # inserted already running under this runner: `meshtune serve` cannot claim it first
                sweep = svc.create_sweep(s, spec=spec, owner=getpass.getuser(), runner_id=runner.runner_id)
            except SpecError as exc:
                raise SpecError(f"{args.spec}: {exc}") from None
        done = 0
    console = Console(stderr=args.json, width=None if sys.stdout.isatty() else show.PIPED_WIDTH)
    verb = "resuming" if args.resume is not None else "sweep"
    console.print(f"{verb} {sweep.id} '{spec.name}': {_problem_label(spec)}, sampler={spec.sampler_label}, "
                  f"backend={spec.backend}, up to {_planned_trials(spec)} trials{_trials_why(spec)}")
    final = run_in_foreground(runner, sweep.id, console, description="trials", total=_planned_trials(spec),
                              completed=done, counts=lambda event: event["event"] in ("finished", "pruned"))
    if final is None:
        return 130
    with sessions() as s:
        ranking = rankings.ranking(s, sweep_id=final.id)
        if args.json:
            json.dump({"sweep": show.jsonable(final), "ranking": show.jsonable(ranking)}, sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:  # the same lines as `meshtune show` (the host-noise warning included)
            show.print_report(console, final, ranking, svc.pareto(s, sweep_id=final.id), top=args.top)
    if final.status not in store.FINISHED_SWEEP_STATUSES:
        console.print(f"[yellow]stopped: {resume_hint(final.id)}[/yellow]")
        return 130
    return 0 if final.status == "completed" else 1


def _problem_label(spec: Any) -> str:
    """``llama3-70b on h100-sxm (8×8 cuda)``: the resolved model and cluster, whether the spec names a
    preset or a mapping of overrides (a mapping printed as it is read ``{'preset': ...}``)."""
    from api import format as fmt

    problem = spec.to_problem()
    model, cluster = problem.model, problem.cluster
    workload = show.workload_text(spec.workload).strip()
    return f"{model.name} on {fmt.cluster_label(cluster)}" + (f", {workload}" if workload else "")


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

