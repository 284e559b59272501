"""``meshtune run-trial``: run one layout of a model on a backend and print the measurement.

    meshtune run-trial --model tiny --cluster cpu-local --layout tp=2,dp=2 --global-batch 8 --json

``--nodes`` and ``--devices-per-node`` size any cluster preset (the layout's world is their product).
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

from workers import TrialRequest, TrialResult
from workers.cli_request import build_request

__all__ = ["register", "run"]
GiB = 2**30


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run-trial",
        help="run one layout for a few real training steps and print the measurement",
        description="Run one layout of a model on a backend (ray: real ranks; simulate: the "
        "analytical model with noise, labelled simulated; or any module:attr) and print the result.",
    )
    p.add_argument("--model", default="tiny", metavar="PRESET|hf:PATH",
                   help="model preset, or hf:PATH of a Hugging Face config.json (default tiny)")
    p.add_argument("--cluster", default="cpu-local", metavar="PRESET", help="cluster preset (default cpu-local)")
    p.add_argument("--nodes", metavar="N", help="nodes of the cluster (default: the preset's), e.g. to re-run a "
                   "sweep's 16-GPU winner: --cluster h100-sxm --nodes 2")
    p.add_argument("--devices-per-node", metavar="N", help="devices per node (default: the preset's)")
    p.add_argument("--layout", required=True, metavar="K=V,...", help="e.g. tp=2,dp=2,pp=1,zero=0,ac=none")
    p.add_argument("--global-batch", type=int, default=8, metavar="N", help="sequences per step (default 8)")
    p.add_argument("--backend", default=None, metavar="NAME", help="ray, simulate or module:attr (default: settings)")
    p.add_argument("--workload", default="builtin", metavar="NAME",
                   help="model code to train: builtin, hf (the transformers model of --model hf:PATH) or module:attr")
    p.add_argument("--warmup", type=int, default=2, metavar="N", help="warm-up steps, discarded (default 2)")
    p.add_argument("--measure", type=int, default=3, metavar="N", help="measured steps (default 3)")
    p.add_argument("--step-timeout", type=float, default=120.0, metavar="S", help="per-step watchdog (default 120)")
    p.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="worker option, e.g. fail=crash or memory_cap_bytes=100000000 (repeatable)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


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
        f"[bold]{request.model.name}[/] on [bold]{request.cluster.name}[/] ({request.cluster.nodes} x "
        f"{request.cluster.devices_per_node}), layout [bold]{request.layout.key}[/]"
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
