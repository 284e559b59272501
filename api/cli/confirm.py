"""``meshtune confirm SWEEP [--top K] [--steps N]``: run a completed sweep's top K layouts for N
measured steps each (default 10x the sweep's), in the foreground, and print the report of short
runs against long runs (``meshtune show`` prints it too). The same as POST /api/sweeps/{id}/confirm
and the dashboard's "confirm" action, run here instead of by a coordinator."""

from __future__ import annotations

import argparse
import getpass
import json
import sys

from api.cli import show
from api.cli._foreground import run_in_foreground
from api.cli._store import open_sessions, resume_hint

NAMES = {"top_k": "--top", "steps": "--steps"}  # a refused value is named as the user typed it
DEFAULT_TOP = 5


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("confirm", help="run a sweep's top layouts longer and compare with the short runs",
                       description="Re-run the top K layouts of a completed sweep for N measured steps each, as "
                       "their own phase (not in the ranking), and report the short-run order against the long-run "
                       "order: Spearman with a bootstrap interval, whether the winner was kept, and each long run's "
                       "drift (last tenth of its steps against the first).")
    p.add_argument("id", type=int, help="sweep id (a completed sweep)")
    p.add_argument("--top", type=int, default=None,
                   help=f"how many of the ranking's leading layouts (default {DEFAULT_TOP}, or every ranked one if fewer)")
    p.add_argument("--steps", type=int, default=None, help="measured steps per long run (default 10x the sweep's)")
    p.add_argument("--json", action="store_true", help="print the sweep and the report as JSON")
    p.set_defaults(func=confirm_cmd)


def confirm_cmd(args: argparse.Namespace) -> int:
    from rich.console import Console

    from api import store
    from api.confirm import service as confirm
    from api.engine import SweepRunner

    settings, sessions = open_sessions()
    runner = SweepRunner(settings, sessions=sessions)
    with sessions() as s:
        top = args.top
        if top is None:  # every ranked layout when fewer than the default are
            sweep = confirm._sweep(s, args.id)  # NotFoundError: exit 2
            store.ensure_ranked(s, sweep_id=sweep.id)
            state = store.ranking_state(s, sweep_id=sweep.id)
            ranked = int(((state.summary or {}).get("tokens_per_s_per_device") or {}).get("total", 0))
            top = max(1, min(DEFAULT_TOP, ranked))
        sweep = confirm.request_confirm(s, sweep_id=args.id, top_k=top, steps=args.steps, runner_id=runner.runner_id,
                                        names=NAMES, requested_by=getpass.getuser())
        asked = dict(sweep.confirm)
    console = Console(stderr=args.json, width=None if sys.stdout.isatty() else show.PIPED_WIDTH)
    console.print(f"confirm {sweep.id} '{sweep.name}': the top {len(asked['keys'])} layouts, {asked['steps']} measured "
                  f"steps each (round {asked['round']})")
    final = run_in_foreground(runner, sweep.id, console, description="long runs", total=len(asked["keys"]),
                              counts=lambda event: event["event"] == "finished" and event["trial"].phase == "confirm")
    if final is None:
        return 130
    with sessions() as s:
        report = confirm.confirm_report(s, sweep_id=final.id)
    if args.json:
        json.dump({"sweep": show.jsonable(final), "confirm": show.jsonable(report)}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        show.print_confirm(console, report)
    if final.status not in store.FINISHED_SWEEP_STATUSES:
        console.print(f"[yellow]stopped: {resume_hint(final.id)}[/yellow]")
        return 130
    return 0 if final.status == "completed" else 1
