"""``meshtune plan``: rank every valid layout of a problem by the analytical model, no device time.

The problem comes from a spec file (YAML/TOML/JSON with model, cluster, training and optional space
sections) and/or flags; flags override the file. Without either it plans the tiny CPU preset.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from api import format as fmt
from tuner import (
    PRECISIONS,
    LayoutError,
    Plan,
    SearchSpace,
    SpecError,
    cluster_spec,
    enumerate_layouts,
    model_arg,
    model_spec,
    plan,
    read_spec_file,
    training_spec,
)

DEFAULT_MODEL = "tiny"
DEFAULT_CLUSTER = "cpu-local"
DEFAULT_GLOBAL_BATCH = 16
GiB = 2**30


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="rank the valid layouts of a model on a cluster with the analytical model",
        description="Enumerate every valid layout, drop those whose predicted memory does not fit, "
        "and rank the rest by predicted tokens/s per device.",
    )
    p.add_argument("spec_file", nargs="?", metavar="SPEC_FILE", help="YAML/TOML/JSON spec (model, cluster, training, space)")
    p.add_argument("--model", metavar="PRESET|hf:PATH",
                   help=f"model preset, or hf:PATH of a Hugging Face config.json (default {DEFAULT_MODEL})")
    p.add_argument("--cluster", metavar="PRESET", help=f"cluster preset (default {DEFAULT_CLUSTER})")
    p.add_argument("--nodes", type=int, metavar="N", help="number of nodes of the cluster")
    batch = p.add_mutually_exclusive_group()
    batch.add_argument("--global-batch", type=int, metavar="N", help="sequences per optimiser step")
    batch.add_argument("--global-batch-tokens", type=int, metavar="N", help="tokens per optimiser step")
    p.add_argument("--precision", choices=PRECISIONS, help="training precision")
    p.add_argument("--top", type=int, default=10, metavar="N", help="layouts to show (default 10)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (memory in bytes)")
    p.add_argument("--allow-tp-across-nodes", action="store_true", help="let TP groups span nodes")
    p.set_defaults(func=run)


def _problem(args: argparse.Namespace) -> tuple[Any, Any, Any, SearchSpace]:
    data: dict[str, Any] = read_spec_file(args.spec_file) if args.spec_file else {}
    prefix = f"{args.spec_file}: " if args.spec_file else ""
    try:
        model_data = model_arg(args.model) if args.model is not None else data.get("model", DEFAULT_MODEL)
        cluster_data = args.cluster if args.cluster is not None else data.get("cluster", DEFAULT_CLUSTER)
        if args.nodes is not None:
            cluster_data = {"preset": cluster_data} if isinstance(cluster_data, str) else dict(cluster_data or {})
            cluster_data["nodes"] = args.nodes
        training_data = data.get("training")
        if training_data is None:
            training_data = {}
        if not isinstance(training_data, dict):
            raise SpecError(f"training must be a mapping, got {training_data!r}")
        training_data = dict(training_data)
        if args.global_batch is not None or args.global_batch_tokens is not None:
            training_data.pop("global_batch", None)
            training_data.pop("global_batch_tokens", None)
            if args.global_batch is not None:
                training_data["global_batch"] = args.global_batch
            else:
                training_data["global_batch_tokens"] = args.global_batch_tokens
        elif "global_batch" not in training_data and "global_batch_tokens" not in training_data:
            training_data["global_batch"] = DEFAULT_GLOBAL_BATCH
        if args.precision is not None:
            training_data["precision"] = args.precision
        model = model_spec(model_data)
        cluster = cluster_spec(cluster_data)
        training = training_spec(training_data, seq_len=model.seq_len)
        space = SearchSpace.from_mapping(data.get("space"))
    except SpecError as exc:
        raise type(exc)(f"{prefix}{exc}") from None
    return model, cluster, training, space


def run(args: argparse.Namespace) -> int:
    if args.top < 1:
        raise SpecError(f"--top must be a positive integer, got {args.top}")
    model, cluster, training, space = _problem(args)
    enum = enumerate_layouts(model=model, cluster=cluster, training=training, space=space,
                             allow_tp_across_nodes=args.allow_tp_across_nodes)
    if not enum.valid:  # nothing to rank: the problem (or the space) admits no layout at all
        reasons = ", ".join(f"{r} ({n:,})" for r, n in sorted(enum.rejected.items(), key=lambda kv: -kv[1])[:3])
        raise LayoutError(
            f"no valid layout of model {model.name} on {cluster.devices} devices with "
            f"training.global_batch={training.global_batch}: {reasons or 'the space is empty'}"
        )
    result = plan(model=model, cluster=cluster, training=training, space=space,
                  allow_tp_across_nodes=args.allow_tp_across_nodes, enumeration=enum)
    if args.json:
        json.dump(result.to_dict(top=args.top), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print(result, args.top)
    return 0


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


def _print(result: Plan, top: int) -> None:
    console = Console()
    if not console.is_terminal:  # piped or captured: do not squeeze the table into 80 columns
        console = Console(width=200)
    m, c, t = result.model, result.cluster, result.training
    console.print(
        f"[bold]{m.name}[/] ({_count(m.params)} params) on [bold]{c.name}[/] "
        f"{c.nodes}x{c.devices_per_node} ({c.devices} devices, {fmt.bytes_text(c.device_memory)} each); "
        f"global batch {t.global_batch} x {m.seq_len} tokens, {t.precision}"
    )
    shown = result.entries[:top]
    # One memory unit per table: GiB for real devices, MiB when everything is small (CPU models).
    unit, size = ("GiB", GiB) if any(e.memory.total >= GiB for e in shown) else ("MiB", 2**20)
    # Every entry is a distinct program (twins folded into one canonical layout, tuner._space).
    twins = f"; {result.twins:,} twin combinations folded" if result.twins else ""
    table = Table(box=box.SIMPLE_HEAD, title=f"Top {len(shown)} of {len(result.entries):,} feasible layouts "
                  f"({len(result.entries):,} distinct runs{twins})")
    for col, justify in (
        ("#", "right"), ("tp·cp·ep·dp·pp", "left"), ("zero", "right"), ("mbs", "right"), ("m", "right"),
        ("ac", "left"), ("sp", "left"), ("schedule", "left"), ("placement", "left"),
        (f"{unit} p/g/o/act", "right"), (f"{unit} total", "right"), ("step s", "right"), ("tok/s/dev", "right"),
        ("MFU", "right"),
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for i, e in enumerate(shown, 1):
        lay, mem, tm = e.layout, e.memory, e.time
        sched = "-" if lay.pp == 1 else (f"interleaved v{lay.vpp}" if lay.schedule == "interleaved" else lay.schedule)
        table.add_row(
            str(i), "·".join(str(getattr(lay, a)) for a in ("tp", "cp", "ep", "dp", "pp")), str(lay.zero),
            str(lay.mbs), str(e.microbatches), lay.ac, "y" if lay.sp else "n", sched, e.placement.summary,
            "/".join(f"{x / size:.1f}" for x in (mem.params, mem.grads, mem.optimizer, mem.activations)),
            f"{mem.total / size:.1f}", f"{tm.step_time_s:.3g}", f"{tm.tokens_per_s_per_device:,.0f}", f"{tm.mfu:.1%}",
        )
    if shown:
        console.print(table)
        console.print(f"totals include a framework allowance of {shown[0].memory.overhead / size:.1f} {unit} per device")
    considered = len(result.entries) + sum(result.rejected.values())
    if result.rejected:
        rej = Table(box=box.SIMPLE_HEAD, title=f"Rejected: {sum(result.rejected.values()):,} of {considered:,} layouts")
        rej.add_column("reason")
        rej.add_column("count", justify="right")
        for reason, n in sorted(result.rejected.items(), key=lambda kv: (-kv[1], kv[0])):
            rej.add_row(reason, f"{n:,}")
        console.print(rej)
    if not result.entries:
        console.print("[bold red]No layout fits in device memory[/]: see the rejected reasons above.")
