"""``meshtune run-trial``: run one layout of a model on a backend and print the measurement.

    meshtune run-trial --model tiny --cluster cpu-local --layout tp=2,dp=2 --global-batch 8 --json

``--layout`` is ``key=value`` pairs of ``tuner.Layout`` (tp, pp, dp, cp, ep, zero, mbs, ac, sp,
schedule, vpp); a bad key or value, a layout that does not fit the cluster, or an unknown backend
exits 2 with one line naming the field and value, before any process starts. So does a backend
that cannot run anything now (``BackendUnavailable``: e.g. a local Ray that did not start in time,
after the backend's own retries with back-off): one line saying what and why, never a traceback. A
trial that fails (oom, timeout, crash, nan) is a result: it is printed like any other and the exit
status is 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tuner import (
    Layout,
    LayoutError,
    SpecError,
    canonical_layout,
    check_layout,
    cluster_spec,
    model_spec,
    training_spec,
    twin_note,
)
from workers._contract import TrialRequest, TrialResult

INT_FIELDS = ("tp", "pp", "dp", "cp", "ep", "zero", "mbs", "vpp")
STR_FIELDS = ("ac", "schedule")
BOOL_FIELDS = ("sp",)
GiB = 2**30


def parse_layout(text: str) -> Layout:
    """``"tp=2,dp=2,ac=full,sp=true"`` -> Layout; LayoutError names the offending field and value."""
    known = INT_FIELDS + STR_FIELDS + BOOL_FIELDS
    values: dict[str, Any] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, raw = part.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or not raw:
            raise LayoutError(f"--layout entry {part!r} is not key=value")
        if key not in known:
            raise LayoutError(f"--layout field {key!r} is not known (known: {', '.join(known)})")
        if key in values:
            raise LayoutError(f"--layout field {key!r} is given twice")
        if key in INT_FIELDS:
            try:
                values[key] = int(raw)
            except ValueError:
                raise LayoutError(f"--layout {key}={raw!r} is not an integer") from None
        elif key in BOOL_FIELDS:
            if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise LayoutError(f"--layout {key}={raw!r} is not true or false")
            values[key] = raw.lower() in ("true", "1", "yes")
        else:
            values[key] = raw
    if not values:
        raise LayoutError(f"--layout {text!r} names no field")
    return Layout(**values)


def parse_options(items: list[str]) -> dict[str, Any]:
    """``--option KEY=VALUE`` (VALUE read as JSON when it parses, else kept as a string)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise SpecError(f"--option {item!r} is not KEY=VALUE")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run-trial",
        help="run one layout for a few real training steps and print the measurement",
        description="Run one layout of a model on a backend (ray: real ranks; simulate: the "
        "analytical model with noise, labelled simulated; or any module:attr) and print the result.",
    )
    p.add_argument("--model", default="tiny", metavar="PRESET", help="model preset (default tiny)")
    p.add_argument("--cluster", default="cpu-local", metavar="PRESET", help="cluster preset (default cpu-local)")
    p.add_argument("--layout", required=True, metavar="K=V,...", help="e.g. tp=2,dp=2,pp=1,zero=0,ac=none")
    p.add_argument("--global-batch", type=int, default=8, metavar="N", help="sequences per step (default 8)")
    p.add_argument("--backend", default=None, metavar="NAME", help="ray, simulate or module:attr (default: settings)")
    p.add_argument("--warmup", type=int, default=2, metavar="N", help="warm-up steps, discarded (default 2)")
    p.add_argument("--measure", type=int, default=3, metavar="N", help="measured steps (default 3)")
    p.add_argument("--step-timeout", type=float, default=120.0, metavar="S", help="per-step watchdog (default 120)")
    p.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="worker option, e.g. fail=crash or memory_cap_bytes=100000000 (repeatable)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def build_request(args: argparse.Namespace) -> TrialRequest:
    if args.warmup < 0:
        raise SpecError(f"--warmup must be a non-negative integer, got {args.warmup}")
    if args.measure < 1:
        raise SpecError(f"--measure must be a positive integer, got {args.measure}")
    if not args.step_timeout > 0:
        raise SpecError(f"--step-timeout must be a positive number, got {args.step_timeout}")
    model = model_spec(args.model)
    cluster = cluster_spec(args.cluster)
    training = training_spec({"global_batch": args.global_batch, "seed": args.seed}, seq_len=model.seq_len)
    given = parse_layout(args.layout)
    check_layout(given, model=model, cluster=cluster, training=training)
    # A twin runs (and is reported) as its canonical layout: one key per distinct program.
    layout = canonical_layout(given, training=training)
    note = twin_note(given, layout)
    if note:
        print(f"meshtune run-trial: note: {note}", file=sys.stderr)
    return TrialRequest(
        model=model,
        cluster=cluster,
        training=training,
        layout=layout,
        warmup_steps=args.warmup,
        measure_steps=args.measure,
        step_timeout_s=args.step_timeout,
        seed=args.seed,
        options=parse_options(args.option),
    )


def run(args: argparse.Namespace) -> int:
    from api.settings import get_settings
    from workers.backends import get_backend

    request = build_request(args)
    backend = get_backend(args.backend or get_settings().backend)
    try:
        result = backend.run(request)
    finally:
        backend.close()
    if args.json:
        json.dump(result.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_summary(request, result)
    return 0 if result.ok else 1


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def print_summary(request: TrialRequest, result: TrialResult) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:  # piped or captured: do not wrap the summary at 80 columns
        console = Console(width=160)
    label = " [yellow](SIMULATED: analytical model, not a measurement)[/]" if result.simulated else ""
    colour = "green" if result.ok else "red"
    console.print(
        f"[bold]{request.model.name}[/] on [bold]{request.cluster.name}[/], layout [bold]{request.layout.key}[/]"
        f" via {result.backend}: [{colour}]{result.status}[/]{label}"
    )
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("step time (median)", _fmt(result.step_time_s, ".4f", " s"))
    table.add_row("tokens/s", _fmt(result.tokens_per_s, ",.0f"))
    table.add_row("tokens/s per device", _fmt(result.tokens_per_s_per_device, ",.0f"))
    table.add_row("MFU", _fmt(result.mfu * 100 if result.mfu is not None else None, ".1f", " %"))
    peak = result.peak_memory_bytes / GiB if result.peak_memory_bytes is not None else None
    table.add_row("peak memory (max rank)", _fmt(peak, ".3f", f" GiB ({result.memory_measure})"))
    if result.peak_memory_per_rank:
        table.add_row("peak memory per rank", ", ".join(f"{p / GiB:.3f}" for p in result.peak_memory_per_rank) + " GiB")
    if result.losses:
        table.add_row("losses", ", ".join(f"{x:.4f}" for x in result.losses))
    if result.stage_times_s:
        stages = ", ".join(f"{s:.4f}" for s in result.stage_times_s)
        table.add_row("stage compute (s)", f"{stages}  imbalance {_fmt(result.stage_imbalance, '.3f')}")
    table.add_row("wall / device-seconds", f"{_fmt(result.wall_s, '.2f', ' s')} / {_fmt(result.device_seconds, '.1f')}")
    if result.error is not None:
        err = result.error
        where = f" on rank {err.rank}" if err.rank is not None else ""
        table.add_row("error", f"{err.kind}{where}: {err.message}")
        if err.bytes_requested is not None:
            table.add_row("bytes requested", f"{err.bytes_requested:,}")
        if err.exception_type:
            table.add_row("exception", err.exception_type)
    env = result.env
    if env.get("torch"):
        table.add_row("environment", f"torch {env.get('torch')}, {env.get('device_name')}, hosts {env.get('hosts')}")
    console.print(table)
    if result.error is not None and result.error.traceback_tail:
        console.print(result.error.traceback_tail, style="dim", markup=False, highlight=False)
