"""``meshtune reshard-check``: verify moving a run from one layout to another through a DCP checkpoint.

    meshtune reshard-check --model tiny --cluster cpu-local --from tp=2,dp=2 --to dp=4 --global-batch 8 --json
    meshtune reshard-check --sweep 12 --from tp=2,dp=2 --to dp=4,zero=3     # the sweep's problem; stored

Trains ``--steps-before`` real steps under ``--from`` (Ray ranks, like trials), saves model and
optimizer with torch.distributed.checkpoint, loads under ``--to``, checks every tensor bit for bit and
the next ``--steps-after`` losses against an uninterrupted run. Exit 0: ok; 1: corrupted, diverged
or failed; 2: bad input (one line naming the field and value, before any process starts), or Ray
could not be started or reached after the backend's retries (one line, no traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any

from tuner import LayoutError, SpecError, cluster_spec, model_spec, training_spec
from workers.reshard import CORRUPTIONS, ReshardJob, ReshardReport


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "reshard-check",
        help="verify a checkpoint saved under one layout loads bit-exactly under another and trains on",
        description="Train under --from, save (DCP), load under --to, compare every parameter and optimizer "
        "tensor bit for bit and the continued losses against an uninterrupted run.",
    )
    p.add_argument("--from", dest="from_layout", required=True, metavar="K=V,...", help="layout A, e.g. tp=2,dp=2")
    p.add_argument("--to", dest="to_layout", required=True, metavar="K=V,...", help="layout B, e.g. dp=4,zero=3")
    p.add_argument("--sweep", type=int, default=None, metavar="ID",
                   help="use this sweep's model, cluster and training, and store the verdict with it")
    p.add_argument("--model", default=None, metavar="PRESET", help="model preset (default tiny; not with --sweep)")
    p.add_argument("--cluster", default=None, metavar="PRESET", help="cluster preset (default cpu-local; not with --sweep)")
    p.add_argument("--global-batch", type=int, default=None, metavar="N", help="sequences per step (default 8; not with --sweep)")
    p.add_argument("--seed", type=int, default=None, help="training seed (default 0; not with --sweep)")
    p.add_argument("--steps-before", type=int, default=2, metavar="N", help="steps under --from before the save (default 2)")
    p.add_argument("--steps-after", type=int, default=2, metavar="M", help="steps compared after the save (default 2)")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="keep the checkpoint here (must be new or empty; shared storage on a multi-node cluster); "
                   "default: a temporary directory, removed")
    p.add_argument("--inject-corruption", default=None, choices=CORRUPTIONS,
                   help="self-test: load wrongly on purpose, the verdict must be 'corrupted' (swap-layers: two "
                   "layers' tensors swapped; permute-shards: every sharded tensor loaded with a rotated shard mapping)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def _layout(flag: str, text: str) -> Any:
    from workers.cli_request import parse_layout

    try:
        return parse_layout(text)
    except (LayoutError, SpecError, TypeError) as exc:
        raise LayoutError(f"{flag} {text!r}: {str(exc).replace('--layout ', '')}") from None


def build_job(args: argparse.Namespace) -> ReshardJob:
    """The job from flags alone (no --sweep); raises SpecError/LayoutError naming the flag."""
    model = model_spec(args.model or "tiny")
    cluster = cluster_spec(args.cluster or "cpu-local")
    training = training_spec({"global_batch": args.global_batch or 8, "seed": args.seed or 0}, seq_len=model.seq_len)
    for flag in ("steps_before", "steps_after"):
        if getattr(args, flag) < 1:
            raise SpecError(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be a positive integer")
    job = ReshardJob(model=model, cluster=cluster, training=training,
                     from_layout=_layout("--from", args.from_layout), to_layout=_layout("--to", args.to_layout),
                     checkpoint_dir=args.checkpoint_dir or "<temporary>", steps_before=args.steps_before,
                     steps_after=args.steps_after, corrupt=args.inject_corruption)
    try:
        job.validate()
    except LayoutError as exc:
        raise LayoutError(str(exc).replace("from_layout", "--from").replace("to_layout", "--to")) from None
    return job


def _check_dir(path: str | None) -> None:
    import os

    if path and os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise SpecError(f"--checkpoint-dir={path!r} exists and is not an empty directory")


def _runner(args: argparse.Namespace):
    def run_job(job: ReshardJob) -> ReshardReport:
        from workers.ray_backend import RayBackend
        from workers.reshard_launch import run_reshard_check, run_with_temp_checkpoint

        if args.checkpoint_dir:
            return run_reshard_check(replace(job, checkpoint_dir=args.checkpoint_dir), backend=RayBackend())
        return run_with_temp_checkpoint(job, backend=RayBackend())

    return run_job


def run(args: argparse.Namespace) -> int:
    _check_dir(args.checkpoint_dir)
    if args.sweep is not None:
        given = [f"--{f.replace('_', '-')}" for f in ("model", "cluster", "global_batch", "seed") if getattr(args, f) is not None]
        if given:
            raise SpecError(f"{given[0]} cannot be combined with --sweep (the sweep's problem is used)")
        report = _run_for_sweep(args)
    else:
        report = _runner(args)(build_job(args))
    if args.json:
        json.dump(report.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_summary(report)
    return 0 if report.verdict == "ok" else 1


def _run_for_sweep(args: argparse.Namespace) -> ReshardReport:
    from api.cli._store import open_sessions
    from api.reshard import service

    _, sessions = open_sessions()
    captured: list[ReshardReport] = []

    def runner(job: ReshardJob) -> ReshardReport:
        captured.append(_runner(args)(job))
        return captured[-1]

    with sessions() as session:
        try:
            row = service.run_check(session, sweep_id=args.sweep, from_layout=_layout("--from", args.from_layout).__dict__,
                                    to_layout=_layout("--to", args.to_layout).__dict__, steps_before=args.steps_before,
                                    steps_after=args.steps_after, owner="cli", corrupt=args.inject_corruption,
                                    runner=runner)
        except LayoutError as exc:
            raise LayoutError(str(exc).replace("from_layout", "--from").replace("to_layout", "--to")) from None
        print(f"stored as reshard check {row.id} of sweep {args.sweep}", file=sys.stderr)
    return captured[-1]


def print_summary(report: ReshardReport) -> None:
    from rich.console import Console
    from rich.table import Table

    from tuner import Layout

    console = Console()
    colour = {"ok": "green", "diverged": "yellow"}.get(report.verdict, "red")
    a, b = Layout(**report.from_layout).key, Layout(**report.to_layout).key
    injected = f" [yellow](corruption injected: {report.corrupt})[/]" if report.corrupt else ""
    console.print(f"reshard [bold]{a}[/] -> [bold]{b}[/] via {report.backend}: [{colour}]{report.verdict}[/]{injected}")
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("tensors compared", f"{report.tensors_checked} (parameters + optimizer state, gathered to full)")
    table.add_row("not bit-identical", str(report.mismatch_count))
    table.add_row("max abs diff", "-" if report.max_abs_diff is None else f"{report.max_abs_diff:.3g}")
    for m in report.mismatches[:10]:
        diff = "-" if m.max_abs_diff is None else f"{m.max_abs_diff:.3g}"
        table.add_row("  mismatch", f"{m.key}: {m.detail} (max abs diff {diff})")
    if report.mismatch_count > 10:
        table.add_row("", f"... and {report.mismatch_count - 10} more (--json lists up to 200)")
    table.add_row("losses before save", ", ".join(f"{x:.6f}" for x in report.losses_before))
    table.add_row("A uninterrupted", ", ".join(f"{x:.6f}" for x in report.losses_a))
    table.add_row("B after load", ", ".join(f"{x:.6f}" for x in report.losses_b))
    rel = "-" if report.max_rel_loss_diff is None else f"{report.max_rel_loss_diff:.2e}"
    table.add_row("max rel loss diff", f"{rel} (tolerance {report.tolerance:.0e})")
    if report.wall_s is not None:
        table.add_row("save / load / wall", f"{report.save_s or 0:.2f} s / {report.load_s or 0:.2f} s / {report.wall_s:.1f} s")
    if report.error:
        table.add_row("error", report.error.splitlines()[0])
    console.print(table)
