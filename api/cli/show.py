"""``meshtune sweeps`` (the stored sweeps) and ``meshtune show ID`` (one sweep: its state, ranking,
Pareto front, calibration and trials), and the rendering ``meshtune sweep`` prints at its end too:
the sweep line and the ranking table, the numbers as the dashboard shows them (api/format.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from datetime import datetime
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    """The read commands; ``api.cli.sweep.register`` calls it, so ``--help`` lists them after ``sweep``."""
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
    p.add_argument("--stack", metavar="STACK", help="also re-rank the measured layouts by what this training "
                   "stack (torchtitan, megatron) is predicted to make of them, corrected with the sweep's "
                   "calibration, marking where the order differs from the measured one")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=show_cmd)


# Piped or captured output is not squeezed into 80 columns (as `meshtune plan`): a ranking's widest
# rows (long layouts, ten numeric columns) fit in 200 without wrapping.
PIPED_WIDTH = 200

METRIC_LABELS = {
    "tokens_per_s_per_device": "tok/s/dev",
    "useful_tokens_per_s": "useful tok/s (job)",
}


def jsonable(obj: Any) -> Any:
    """Dataclasses, ORM rows (with a sweep's derived ``diagnostic``) and datetimes as JSON values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return jsonable(dataclasses.asdict(obj))
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, datetime):
        return obj.isoformat()
    if hasattr(obj, "__table__"):  # an ORM row
        out = {c.name: jsonable(getattr(obj, c.key)) for c in obj.__table__.columns}
        if hasattr(obj, "diagnostic"):
            out["diagnostic"] = obj.diagnostic
        return out
    return obj


def bytes_cell(n: float | None) -> str:
    """Bytes as the dashboard shows them (api.format.bytes_text), "-" for none."""
    from api import format as fmt

    return fmt.bytes_text(n, dash="-")


def num_cell(v: float | None) -> str:
    """Throughput as the dashboard shows it (api.format.num: 4 significant digits, whole numbers from
    10,000 up), so that a table fits a terminal and both read the same."""
    from api import format as fmt

    return fmt.num(v, dash="-")


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
        spread = "none (n=1)" if not fmt.interval_known(row) else f"{num_cell(row.low)} - {num_cell(row.high)}"
        cells = [str(row.rank), fmt.layout_text(row.layout, dash=row.layout_key) if row.layout else row.layout_key,
                 str(row.n), num_cell(row.median), spread,
                 fmt.versus_text(versus, row_known=fmt.interval_known(row), best_known=best_known)]
        if ranking.metric != "tokens_per_s_per_device":
            cells.append(num_cell(row.tokens_per_s_per_device))
        cells += [
            num_cell(row.useful_tokens_per_s_per_device), bytes_cell(row.peak_memory_bytes),
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


def print_sweep(console: Any, sweep: Any) -> None:
    console.print(
        f"sweep {sweep.id} [bold]{sweep.name}[/bold]: {sweep.status}  sampler={sweep.sampler} backend={sweep.backend} "
        f"{workload_text((getattr(sweep, 'spec', None) or {}).get('workload'))}"
        f"trials={sweep.n_trials} (completed {sweep.n_completed}, pruned {sweep.n_pruned}, failed {sweep.n_failed}) "
        f"{_device_seconds_text(sweep)}"
    )
    from api import format as fmt
    from api.ranking import budget

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
    elif getattr(sweep, "stop_reason", None):  # a failed sweep's reason is its error, said above
        console.print(f"stopped: {sweep.stop_reason}")


def workload_text(workload: str | None) -> str:
    """`` workload=hf `` where the model code trained is not the built-in model (which trained is what
    the numbers measure), else nothing."""
    return f"workload={workload} " if workload and workload != "builtin" else ""


def list_cmd(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from api import format as fmt
    from api.cli._store import open_sessions
    from api.ranking import service as rankings
    from api.sweeps import service as svc

    _, sessions = open_sessions()
    with sessions() as s:
        page = svc.list_sweeps(s, status=args.status, owner=args.owner, limit=args.limit, offset=args.offset)
    if args.json:
        json.dump({"items": jsonable(page.items), "total": page.total, "limit": page.limit,
                   "offset": page.offset}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    table = Table(title=f"sweeps ({page.total} in all)")
    for col in ("id", "name", "status", "owner", "sampler", "backend", "trials", "best layout",
                "best tok/s/dev (median)", "created"):
        table.add_column(col, overflow="fold")
    with sessions() as s:
        for sw in page.items:  # the ranking's #1, as `show` and the dashboard name it (not the fastest run)
            ranked = rankings.ranking(s, sweep_id=sw.id).rows if sw.n_completed else []
            best = ranked[0] if ranked else None
            table.add_row(str(sw.id), sw.name, sw.status, sw.owner or "-", sw.sampler, sw.backend, str(sw.n_trials),
                          fmt.layout_text(best.layout) if best else "-", num_cell(best.median if best else None),
                          sw.created_at.strftime("%Y-%m-%d %H:%M"))
    Console(width=None if sys.stdout.isatty() else PIPED_WIDTH).print(table)
    return 0


def node_lost(trial: Any) -> bool:
    """Whether a node died under the trial (``infra="node_lost"``): it runs once more as a new trial,
    which the sweep's counts count in its place (api/engine/_lost.py, api/store/_sweeps.py)."""
    from api.engine._lost import NODE_LOST, infra_of

    return infra_of(trial) == NODE_LOST


def trial_status_text(trial: Any) -> str:
    """The trial's status, ``crash (node lost)`` for a trial a node died under (listed beside its re-run)."""
    return f"{trial.status} (node lost)" if node_lost(trial) else trial.status


def calibration_lines(calibration: dict | None) -> list[str]:
    """What the sweep's calibration says (one text for `meshtune show` and the dashboard)."""
    from api.engine._calibrate import describe

    return describe(calibration)


def model_lines(sweep: Any, ranking: Any) -> list[str]:
    """Which figures the sweep modelled its cluster with, and how far its step times were predicted."""
    from api.probes.service import probe_line
    from api.ranking import accuracy

    line = probe_line(sweep.calibration, sweep.backend)
    return ([line] if line else []) + accuracy.lines(sweep, ranking)


def print_report(console: Any, sweep: Any, ranking: Any, front: list[Any], *, top: int = 20) -> None:
    """What ``meshtune show`` and the end of ``meshtune sweep`` print alike: the sweep line, the
    ranking, the Pareto front, then the calibration, memory-model and host-noise lines (a noise too
    high to trust the ranking is said here, not only by ``show``), and which figures modelled the
    cluster (probed or datasheet) with how far its step times were predicted."""
    from api import format as fmt

    print_sweep(console, sweep)
    print_ranking(console, ranking, top=top)
    on_front = [p for p in front if p.on_front]
    if on_front:
        console.print("Pareto front (tokens/s per device vs peak memory): " + ", ".join(
            f"{fmt.layout_text(p.layout)} ({num_cell(p.tokens_per_s_per_device)}, {bytes_cell(p.peak_memory_bytes)})"
            for p in on_front))
    for line in calibration_lines(sweep.calibration):
        console.print(line)
    for line in model_lines(sweep, ranking):
        console.print(line)


def show_cmd(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from api import format as fmt
    from api.cli._store import open_sessions
    from api.ranking import service as rankings
    from api.sweeps import service as svc

    _, sessions = open_sessions()
    from api.confirm import service as confirm

    with sessions() as s:
        sweep = svc.get_sweep(s, sweep_id=args.id)
        ranking = rankings.ranking(s, sweep_id=args.id, metric=args.metric)
        front = svc.pareto(s, sweep_id=args.id)
        trials = svc.list_trials(s, sweep_id=args.id, limit=1000).items if (args.trials or args.json) else []
        report = confirm.confirm_report(s, sweep_id=args.id)  # the latest confirm round, if any
        moved = None
        if args.stack is not None:
            from api.ranking.transfer import transfer

            moved = transfer(s, sweep_id=args.id, stack=args.stack)
    if args.json:
        json.dump({"sweep": jsonable(sweep), "ranking": jsonable(ranking), "pareto": jsonable(front),
                   "trials": jsonable(trials), "confirm": jsonable(report),
                   **({"transfer": moved.to_dict()} if moved is not None else {})}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    console = Console(width=None if sys.stdout.isatty() else PIPED_WIDTH)
    print_report(console, sweep, ranking, front)
    print_confirm(console, report)
    if moved is not None:
        print_transfer(console, moved)
    if args.trials:
        table = Table(title="trials")
        for col in ("#", "att", "phase", "layout", "status", "tok/s/dev", "pred", "peak mem", "pred mem", "cause"):
            table.add_column(col, overflow="fold")
        for t in trials:
            table.add_row(str(t.number), str(t.attempt), t.phase, fmt.layout_text(t.layout), trial_status_text(t),
                          num_cell(t.tokens_per_s_per_device), num_cell(t.predicted_tokens_per_s_per_device),
                          bytes_cell(t.peak_memory_bytes), bytes_cell(t.predicted_memory_bytes), fmt.cause_text(t.cause))
        console.print(table)
    return 0


def print_transfer(console: Any, moved: Any, *, top: int = 20) -> None:
    """The measured layouts re-ranked for another stack (api.ranking.transfer), each row's move marked."""
    from rich.table import Table

    from api import format as fmt

    stack = moved.stack["name"]
    corrected = "corrected with the sweep's calibration" if moved.calibrated else "the model alone (no calibration kept)"
    label = " (SIMULATED measurements)" if moved.simulated else ""
    table = Table(title=f"sweep {moved.sweep_id} re-ranked for stack {stack}: predicted, {corrected}{label}")
    for col in ("#", "measured #", "move", "layout", "measured tok/s/dev", f"{stack} tok/s/dev", f"{stack} MFU",
                f"{stack} peak mem"):
        table.add_column(col, justify="left" if col == "layout" else "right", overflow="fold")
    for row in moved.rows[:top]:
        move = "=" if row.moved == 0 else (f"[green]up {row.moved}[/]" if row.moved > 0 else f"[red]down {-row.moved}[/]")
        mem = bytes_cell(row.target_memory_bytes) + ("" if row.target_fits else " [red]does not fit[/]")
        table.add_row(str(row.target_rank), str(row.measured_rank), move, fmt.layout_text(row.layout, dash=row.layout_key),
                      num_cell(row.measured_tokens_per_s_per_device), num_cell(row.target_tokens_per_s_per_device),
                      fmt.pct(row.target_mfu), mem)
    console.print(table)
    first = moved.rows[0]
    winner = next(r for r in moved.rows if r.measured_rank == 1)
    if moved.same_winner:
        console.print(f"the measured winner {fmt.layout_text(winner.layout)} is also the predicted winner on {stack}; "
                      f"{moved.reordered} of {len(moved.rows)} layouts change place")
    else:
        console.print(f"[yellow]the order differs[/]: on {stack} the predicted winner is {fmt.layout_text(first.layout)} "
                      f"(measured #{first.measured_rank}); the measured winner {fmt.layout_text(winner.layout)} is "
                      f"predicted #{winner.target_rank}; {moved.reordered} of {len(moved.rows)} layouts change place")
    console.print(f"{stack}: {moved.stack['description']}. The prediction is not a measurement on {stack}.", style="dim")


def _confirm_interval(median: float | None, low: float | None, high: float | None) -> str:
    if median is None:
        return "-"
    if low is None or high is None:
        return f"{num_cell(median)} (n=1)"
    return f"{num_cell(median)} [{num_cell(low)}, {num_cell(high)}]"


def print_confirm(console: Any, report: Any) -> None:
    """The confirm report: one row per confirmed layout in short-run order, then the verdict line."""
    from rich.table import Table

    from api import format as fmt

    if report is None:
        return
    label = " (SIMULATED)" if report.simulated else ""
    table = Table(title=f"sweep {report.sweep_id}: confirm round {report.round}, top {len(report.rows)} x "
                  f"{report.steps} measured steps{label}")
    for col in ("short #", "layout", "short tok/s/dev [95%]", "long tok/s/dev [95%]", "change", "long #",
                "drift, last vs first tenth [95%]", "long run"):
        table.add_column(col, justify="left" if col in ("layout", "long run") else "right",
                         overflow="fold")
    for r in report.rows:
        d = r.drift
        if d is None:
            drift_text = "-"
        elif d.get("low") is None:
            drift_text = f"{fmt.signed_pct(d['change'])} (no interval: {d['steps']} step per tenth)"
        else:
            mark = " drifted" if d.get("drifted") else ""
            drift_text = f"{fmt.signed_pct(d['change'])} [{fmt.signed_pct(d['low'])}, {fmt.signed_pct(d['high'])}]{mark}"
        status = r.status if r.trial_number is None else f"#{r.trial_number} {r.status}"
        table.add_row(str(r.short_rank), fmt.layout_text(r.layout), _confirm_interval(r.short_median, r.short_low, r.short_high),
                      _confirm_interval(r.long_median, r.long_low, r.long_high), fmt.signed_pct(r.change),
                      "-" if r.long_rank is None else str(r.long_rank), drift_text, status)
    console.print(table)
    console.print(report.verdict)
