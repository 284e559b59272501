"""``meshtune plan``: rank every valid layout of a problem by the analytical model, no device time.

The problem comes from a spec file (YAML/TOML/JSON with model, cluster, training and optional space
sections) and/or flags; flags override the file. Without either it plans the tiny CPU preset.
``--nodes 4,8,16`` (or ``--plot FILE``) compares cluster sizes instead: the best layout at each, its
tokens/s, MFU, useful tokens/s, and the time and cost to train the token budget (tuner._scaling);
``--cluster h100-sxm,b200`` compares device types at each size, priced per type
(``--price-per-device-hour h100-sxm=2.5,b200=5.0``), the fastest and the cheapest marked
(tuner._devices). ``--stack megatron`` predicts for the stack the model is trained with (tuner/_stack.py).
Each answer ends with a line naming its figures: a stored probe's (a plan's of its node count, else,
as a comparison's, the newest of its hardware at another; api/plan/service.py ``plan_probe``,
``comparison_probe``, ``comparison_figures``) or the datasheet's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from api import format as fmt
from tuner import (
    DEFAULT_STACK,
    MEMORY_HEADROOM,
    PRECISIONS,
    REFERENCE_LAYOUTS,
    STACKS,
    DevicePoint,
    LayoutError,
    Plan,
    Problem,
    SearchSpace,
    SizePoint,
    SpecError,
    check_node_counts,
    check_stack,
    cluster_types,
    compare_devices,
    devices_figure,
    enumerate_layouts,
    model_arg,
    model_spec,
    parse_token_count,
    plan,
    plan_sizes,
    read_spec_file,
    sizes_figure,
    stack_of,
    to_dict,
    training_budget,
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
    p.add_argument("--reference", metavar="NAME", help="plan the problem of a published run (tuner.REFERENCE_LAYOUTS: "
                   f"{', '.join(sorted(REFERENCE_LAYOUTS))}) and say how its published layout compares")
    p.add_argument("--model", metavar="PRESET|hf:PATH",
                   help=f"model preset, or hf:PATH of a Hugging Face config.json (default {DEFAULT_MODEL})")
    p.add_argument("--cluster", metavar="PRESET[,PRESET...]",
                   help=f"cluster preset (default {DEFAULT_CLUSTER}); a list (h100-sxm,h200,b200,mi300x) compares "
                   "device types")
    p.add_argument("--nodes", type=_node_list, metavar="N[,N...]",
                   help="number of nodes of the cluster; a list (4,8,16) compares cluster sizes")
    p.add_argument("--plot", metavar="FILE", help="write the cluster-size comparison as a plotly HTML page")
    p.add_argument("--scale-batch", action="store_true",
                   help="with a list of sizes, grow the global batch with the devices from the first size's")
    p.add_argument("--price-per-device-hour", metavar="PRICE|TYPE=PRICE,...",
                   help="price of one device-hour (cluster.price_per_device_hour), for costs; per device type "
                   "when comparing types: h100-sxm=2.5,b200=5.0")
    p.add_argument("--stack", metavar="STACK",
                   help=f"the stack you train with (training.stack): {', '.join(STACKS)} (default meshtune, "
                   "meshtune's own workers)")
    p.add_argument("--train-tokens", type=_train_tokens, metavar="N",
                   help="token budget of the training run (training.train_tokens), e.g. 15e12 or 15T")
    batch = p.add_mutually_exclusive_group()
    batch.add_argument("--global-batch", type=int, metavar="N", help="sequences per optimiser step")
    batch.add_argument("--global-batch-tokens", type=int, metavar="N", help="tokens per optimiser step")
    p.add_argument("--precision", choices=PRECISIONS, help="training precision")
    p.add_argument("--critical-batch-tokens", type=int, metavar="N",
                   help="critical batch in tokens (training.critical_batch_tokens): useful tokens/s level off past it")
    p.add_argument("--top", type=int, default=10, metavar="N", help="layouts to show (default 10)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (memory in bytes)")
    p.add_argument("--allow-tp-across-nodes", action="store_true", help="let TP groups span nodes")
    p.add_argument("--datasheet", action="store_true",
                   help="model the cluster from its datasheet even where a probe of it is stored (`meshtune probe`)")
    p.set_defaults(func=run)


def _node_list(text: str) -> list[int]:
    """``8`` or ``4,8,16``: the integers (their values are checked where they are used)."""
    out = []
    for part in text.split(","):
        try:
            out.append(int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part.strip()!r} is not a whole number of nodes") from None
    return out


def _train_tokens(text: str) -> float:
    """``15e12`` or ``15T`` (the form the tool prints budgets in)."""
    try:
        return parse_token_count("--train-tokens", text)  # its value is checked with the spec's other fields
    except SpecError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--train-tokens=")) from None


def _problem(args: argparse.Namespace) -> tuple[Problem, list[Any]]:
    """The problem of the spec file and the flags (on the first cluster), and every device type
    compared (``--cluster a,b``: one cluster each)."""
    data: dict[str, Any] = read_spec_file(args.spec_file) if args.spec_file else {}
    prefix = f"{args.spec_file}: " if args.spec_file else ""
    if args.reference is not None:  # the published run's problem: flags still override it
        if args.spec_file:
            raise SpecError(f"--reference={args.reference} and a spec file ({args.spec_file}): give one of them")
        ref = _reference(args.reference)
        data = {"model": to_dict(ref.model), "cluster": to_dict(ref.cluster), "training": to_dict(ref.training)}
        data["model"].pop("hf_config", None)
    try:
        model_data = model_arg(args.model) if args.model is not None else data.get("model", DEFAULT_MODEL)
        cluster_data = args.cluster if args.cluster is not None else data.get("cluster", DEFAULT_CLUSTER)
        if isinstance(cluster_data, (list, tuple)) or (isinstance(cluster_data, str) and "," in cluster_data):
            cluster_data = {"preset": cluster_data}  # several device types (tuner._devices.cluster_types)
        if args.nodes is not None or args.price_per_device_hour is not None:
            cluster_data = {"preset": cluster_data} if isinstance(cluster_data, str) else dict(cluster_data or {})
        if args.nodes is not None:
            cluster_data["nodes"] = args.nodes[0]
        if args.price_per_device_hour is not None:
            cluster_data["price_per_device_hour"] = _price(args.price_per_device_hour)
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
        if args.train_tokens is not None:
            training_data["train_tokens"] = args.train_tokens
        if args.critical_batch_tokens is not None:
            training_data.pop("critical_batch", None)
            training_data["critical_batch_tokens"] = args.critical_batch_tokens
        if args.stack is not None:
            training_data["stack"] = check_stack(args.stack, field="--stack")
        model = model_spec(model_data)
        clusters = cluster_types(cluster_data)
        training = training_spec(training_data, seq_len=model.seq_len)
        space = SearchSpace.from_mapping(data.get("space"))
        workload, caps = data.get("workload", "builtin"), None
        if not isinstance(workload, str):
            raise SpecError(f"workload must be 'builtin', 'hf' or 'module:attr', got {workload!r}")
        if workload != "builtin":  # plan only what the spec's workload realises (valid means runnable)
            from tuner import within_capabilities
            from workers.workload_registry import check_workload

            caps = check_workload(workload, model, training)
            space = within_capabilities(space, caps)
    except SpecError as exc:
        raise type(exc)(f"{prefix}{exc}") from None
    return Problem(model=model, cluster=clusters[0], training=training, space=space,
                   capabilities=caps), clusters


def _price(text: str) -> float | str:
    """``2.5`` (every device type) or ``h100-sxm=2.5,b200=5.0`` (checked with the device types)."""
    try:
        return float(text)
    except ValueError:
        return text


def _reference(name: str) -> Any:
    if name not in REFERENCE_LAYOUTS:
        raise SpecError(f"--reference={name!r} is not a published run meshtune knows (known: "
                        f"{', '.join(sorted(REFERENCE_LAYOUTS))})")
    return REFERENCE_LAYOUTS[name]


def run(args: argparse.Namespace) -> int:
    if args.top < 1:
        raise SpecError(f"--top must be a positive integer, got {args.top}")
    problem, clusters = _problem(args)
    if len(clusters) > 1:
        return _run_devices(args, problem, clusters)
    if (args.nodes is not None and len(args.nodes) > 1) or args.plot:
        return _run_sizes(args, problem)
    model, cluster, training = problem.model, problem.cluster, problem.training
    enum = enumerate_layouts(problem=problem, allow_tp_across_nodes=args.allow_tp_across_nodes)
    if not enum.count:  # nothing to rank: the problem (or the space) admits no layout at all
        reasons = ", ".join(f"{r} ({n:,})" for r, n in sorted(enum.rejected.items(), key=lambda kv: -kv[1])[:3])
        raise LayoutError(
            f"no valid layout of model {model.name} on {cluster.devices} devices with "
            f"training.global_batch={training.global_batch}: {reasons or 'the space is empty'}"
        )
    cluster, figures = _figures(args, model, cluster, training, enum)
    result = plan(problem=dataclasses.replace(problem, cluster=cluster),
                  allow_tp_across_nodes=args.allow_tp_across_nodes, enumeration=enum)
    published = _published(result, _reference(args.reference)) if args.reference is not None else None
    if args.json:
        json.dump({**result.to_dict(top=args.top), "figures": figures,
                   **({"published": published} if published else {})}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print(result, args.top)
        if published:
            _print_published(published)
        _console().print(figures["text"], highlight=False)
    return 0


DATASHEET = {"source": "datasheet", "probe_id": None, "text": "cluster figures: datasheet (--datasheet)",
             "probe_nodes": None, "datasheet_links": []}
SHOW = "; `meshtune probe --show` lists them, --datasheet ignores them"


def _figures(args: argparse.Namespace, model: Any, cluster: Any, training: Any, enum: Any) -> tuple[Any, dict]:
    """The cluster with the stored probe's figures (api/probes), and what the plan says of them."""
    from api.plan import service as plan_service

    if args.datasheet:
        return cluster, dict(DATASHEET)
    row, note = _stored(args, model, cluster, training, exact_first=True)
    cluster, figures = plan_service.plan_figures(row=row, note=note, cluster=cluster, training=training, layouts=enum.valid)
    if row is not None:
        figures["text"] += SHOW
    return cluster, figures


def _stored(args: argparse.Namespace, model: Any, cluster: Any, training: Any, *, exact_first: bool) -> tuple[Any, str]:
    """The stored probe a plan (``exact_first``, api/plan/service.py ``plan_probe``) or a comparison
    (``comparison_probe``) of this cluster and model uses on the configured backend, and a note when none."""
    from api.probes import service as probes
    from api.settings import get_settings

    if training.stack != DEFAULT_STACK:
        return None, ""
    workload = read_spec_file(args.spec_file).get("workload", "builtin") if args.spec_file else "builtin"
    return probes.stored(model=model, cluster=cluster, training=training, backend=get_settings().backend,
                         workload=workload, any_nodes=True, exact_first=exact_first)


def _compared(args: argparse.Namespace, model: Any, clusters: list[Any], training: Any) -> list[tuple[Any, Any]]:
    """Each compared cluster with the newest stored probe of its hardware at any node count applied
    (none under --datasheet), and that probe's row (None without one) with its note."""
    from api.plan import service as plan_service

    out = []
    for c in clusters:
        row, note = (None, "") if args.datasheet else _stored(args, model, c, training, exact_first=False)
        out.append((plan_service.probed_cluster(row=row, cluster=c, training=training), (row, note)))
    return out


def _comparison_figures(args: argparse.Namespace, found: tuple[Any, str], cluster: Any, training: Any,
                        counts: Any, points: list[SizePoint]) -> dict[str, Any]:
    """What a comparison of ``cluster`` at ``counts`` says of its figures (api/plan/service.py)."""
    from api.plan import service as plan_service

    if args.datasheet:
        return dict(DATASHEET)
    row, note = found
    figures = plan_service.comparison_figures(row=row, note=note, cluster=cluster, training=training, counts=counts,
                                              points=points)
    if row is not None:
        figures["text"] += SHOW
    return figures


def _published(result: Plan, ref: Any) -> dict[str, Any]:
    """How a published run compares with the plan of its problem: the model's prediction for the
    published layout itself, the plan's best layout on the published mesh, and where that ranks."""
    from tuner import estimate_memory, estimate_time, layout_violation, place

    def util(t: Any) -> float:
        return t.hfu if ref.mfu_kind == "hardware" else t.mfu

    kw = dict(model=result.model, cluster=result.cluster, training=result.training)
    mesh = (ref.layout.tp, ref.layout.cp, ref.layout.ep, ref.layout.dp, ref.layout.pp)
    at = next((i for i, e in enumerate(result.entries)
               if (e.layout.tp, e.layout.cp, e.layout.ep, e.layout.dp, e.layout.pp) == mesh), None)
    out: dict[str, Any] = {
        "name": ref.name, "source": ref.source, "notes": ref.notes, "layout": ref.layout.key,
        "mfu_kind": ref.mfu_kind, "reported": ref.reported_mfu, "predicted": None, "predicted_fits": None,
        "predicted_memory_bytes": None, "refused": None,
        "feasible": len(result.entries), "mesh_rank": None, "mesh_best": None, "mesh_best_predicted": None,
    }
    # The published layout may not run on the stack planned for (e.g. an embedding-only pipeline stage
    # on meshtune's workers): said, and the plan's best on the mesh still compared.
    bad = layout_violation(ref.layout, **kw)
    if bad is not None:
        out["refused"] = f"{bad[1]} (stack {result.training.stack})"
    else:
        exact_t = estimate_time(ref.layout, placement=place(ref.layout, result.cluster), **kw)
        exact_m = estimate_memory(ref.layout, **kw)
        out.update(predicted=util(exact_t), predicted_fits=exact_m.fits, predicted_memory_bytes=exact_m.total)
    if at is not None:
        out.update(mesh_rank=at + 1, mesh_best=result.entries[at].layout.key,
                   mesh_best_predicted=util(result.entries[at].time))
    return out


def _print_published(p: dict[str, Any]) -> None:
    console = Console(width=200) if not sys.stdout.isatty() else Console()
    kind = "HFU (Megatron's count, recompute included)" if p["mfu_kind"] == "hardware" else "MFU (PaLM's count)"
    console.print(f"[bold]published[/]: {p['source']}: {p['layout']}, reported {kind} {p['reported']:.0%}")
    if p["refused"] is not None:
        console.print(f"  the published layout does not run here: {p['refused']}")
    else:
        fits = "" if p["predicted_fits"] else f" (predicted {fmt.bytes_text(p['predicted_memory_bytes'])}: does not fit)"
        console.print(f"  the published layout, predicted: {p['predicted']:.1%} "
                      f"({p['predicted'] / p['reported'] - 1:+.1%}){fits}")
    if p["mesh_rank"] is None:
        console.print("  no feasible layout of the published mesh in this plan")
    else:
        console.print(f"  the plan's best on the published mesh: {p['mesh_best']}, {p['mesh_best_predicted']:.1%} "
                      f"({p['mesh_best_predicted'] / p['reported'] - 1:+.1%}), ranked #{p['mesh_rank']:,} of "
                      f"{p['feasible']:,} ({p['mesh_rank'] / p['feasible']:.2%})")
    console.print(f"  what the paper states and what is assumed: {p['notes']}", style="dim")


def _count(n: float) -> str:
    n = float(f"{n:.3g}")  # round first: 999.9M is "1B", not "1e+03M"
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
        f"global batch {t.global_batch} x {m.seq_len} tokens, {t.precision}; {stack_line(t)}"
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
        (f"{unit} p/g/o/buf/act", "right"), (f"{unit} total", "right"), ("step s", "right"), ("tok/s/dev", "right"),
        ("MFU", "right"),
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    priced = t.train_tokens is not None or c.price_per_device_hour is not None
    if priced:
        table.add_column("time to train", justify="right")
        table.add_column("cost", justify="right")
    for i, e in enumerate(shown, 1):
        lay, mem, tm = e.layout, e.memory, e.time
        sched = "-" if lay.pp == 1 else (f"interleaved v{lay.vpp}" if lay.schedule == "interleaved" else lay.schedule)
        table.add_row(
            str(i), "·".join(str(getattr(lay, a)) for a in ("tp", "cp", "ep", "dp", "pp")), str(lay.zero),
            str(lay.mbs), str(e.microbatches), lay.ac, "y" if lay.sp else "n", sched, e.placement.summary,
            "/".join(f"{x / size:.1f}" for x in (mem.params, mem.grads, mem.optimizer, mem.buffers,
                                                    mem.activations)),
            f"{mem.total / size:.1f}" + (" tight" if mem.tight else ""), f"{tm.step_time_s:.3g}", f"{tm.tokens_per_s_per_device:,.0f}", f"{tm.mfu:.1%}",
            *(budget_columns(e, c, t) if priced else ()),
        )
    if shown:
        console.print(table)
        console.print(f"p/g/o/buf/act: params, grads, optimizer, buffers (FSDP's gathered weights, gradients held "
                      f"between micro-batches), activations; totals add a framework allowance of "
                      f"{shown[0].memory.overhead / size:.1f} {unit} per device")
        tight = sum(e.memory.tight for e in result.entries)
        if tight:
            console.print(f"tight: {tight:,} layout{'s' * (tight > 1)} fit but leave under "
                          f"{MEMORY_HEADROOM:.0%} of the device free (a measured peak moves by about that between "
                          "runs): ranked after every layout with room, and a sweep launches them last too")
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


def _run_sizes(args: argparse.Namespace, problem: Problem) -> int:
    model, cluster, training = problem.model, problem.cluster, problem.training
    counts = check_node_counts(args.nodes if args.nodes is not None else [cluster.nodes], field="--nodes")
    [(probed, found)] = _compared(args, model, [cluster], training)
    points = plan_sizes(problem=dataclasses.replace(problem, cluster=probed), nodes=counts,
                        allow_tp_across_nodes=args.allow_tp_across_nodes, scale_batch=args.scale_batch)
    figures = _comparison_figures(args, found, cluster, training, counts, points)
    figure = sizes_figure(points, title=_sizes_title(model, cluster, training))
    if args.plot:
        _write_plot(args.plot, figure)
    if args.json:
        json.dump({"model": to_dict(model), "cluster": to_dict(probed), "training": to_dict(training),
                   "scale_batch": args.scale_batch, "simulated": False, "predicted": True,
                   "sizes": [p.to_dict() for p in points], "figure": figure, "figures": figures}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print_sizes(points, model, cluster, training, plot=args.plot)
        _console().print(figures["text"], highlight=False)
    return 0


def _console() -> Console:
    return Console(width=None if sys.stdout.isatty() else 200)


def _sizes_title(model: Any, cluster: Any, training: Any) -> str:
    batch = f"global batch {training.global_batch} x {model.seq_len} tokens"
    return f"{model.name} on {cluster.name}: best predicted layout per cluster size ({batch})"


def _print_sizes(points: list[SizePoint], model: Any, cluster: Any, training: Any, *, plot: str | None) -> None:
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    budget = (f"; token budget {fmt.tokens_text(training.train_tokens)}" if training.train_tokens
              else "; no token budget (--train-tokens)")
    price = (f"; {fmt.money(cluster.price_per_device_hour)} per device-hour" if cluster.price_per_device_hour is not None
             else "; no price (--price-per-device-hour)")
    console.print(f"[bold]{model.name}[/] ({_count(model.params)} params) on [bold]{cluster.name}[/] "
                  f"({cluster.devices_per_node} per node){budget}{price}; {stack_line(training)}")
    table = Table(box=box.SIMPLE_HEAD, title="Best predicted layout per cluster size (analytical model, not measured)")
    for col in ("nodes", "devices", "batch", "best layout", "placement", "tok/s", "tok/s/dev", "MFU",
                "useful tok/s", "time to train", "cost / 1M tok", "total cost"):
        table.add_column(col, justify="left" if col in ("best layout", "placement") else "right")
    for p in points:
        if p.layout is None:
            table.add_row(str(p.nodes), str(p.devices), str(p.global_batch), p.why or "-", "", *[fmt.DASH] * 7)
            continue
        cells = fmt.budget_cells(p.budget)
        table.add_row(str(p.nodes), f"{p.devices:,}", f"{p.global_batch:,}", fmt.layout_text(p.layout),
                      p.placement or "", fmt.num(p.tokens_per_s), fmt.num(p.tokens_per_s_per_device), fmt.pct(p.mfu),
                      fmt.num(p.useful_tokens_per_s), cells["time"], cells["per_mtok"], cells["cost"])
    console.print(table)
    if training.critical_batch is None:
        console.print("useful tok/s equals tok/s: no critical batch given (training.critical_batch_tokens)",
                      style="dim")
    else:
        console.print(f"useful tok/s: tokens/s x 1/(1 + B/B_crit), B_crit = {training.critical_batch:,} sequences "
                      "(McCandlish et al. 2018): beyond the critical batch more tokens per step buy little progress",
                      style="dim")
    if plot:
        console.print(f"plot written to {plot}")


def budget_columns(entry: Any, cluster: Any, training: Any) -> tuple[str, str]:
    """(time to train, cost) of one planned layout's predicted tokens/s."""
    b = training_budget(entry.time.tokens_per_s, devices=cluster.devices, train_tokens=training.train_tokens,
                        price_per_device_hour=cluster.price_per_device_hour)
    cells = fmt.budget_cells(b)
    return cells["time"], cells["cost"]


def stack_line(training: Any) -> str:
    """Which stack the figures are predicted for (``training.stack``)."""
    st = stack_of(training)
    return f"predicted for stack {st.name} ({st.description})"


def _run_devices(args: argparse.Namespace, problem: Problem, clusters: list[Any]) -> int:
    """``--cluster a,b,...``: every device type at every size (``--nodes``, else each type's own)."""
    model, training = problem.model, problem.training
    counts = check_node_counts(args.nodes, field="--nodes") if args.nodes is not None else None
    compared = _compared(args, model, clusters, training)  # a probe applies to its own device type only
    points = compare_devices(model=model, clusters=[c for c, _ in compared], training=training, nodes=counts,
                             space=problem.space, allow_tp_across_nodes=args.allow_tp_across_nodes,
                             scale_batch=args.scale_batch, capabilities=problem.capabilities)
    figures = [{"device": c.name, **_comparison_figures(args, found, c, training, counts or (c.nodes,),
                                                         [p.size for p in points if p.device == c.name])}
               for c, (_, found) in zip(clusters, compared, strict=True)]
    title = devices_title(model, clusters, training)
    figure = devices_figure(points, title=title)
    if args.plot:
        _write_plot(args.plot, figure)
    if args.json:
        json.dump({"model": to_dict(model), "clusters": [to_dict(c) for c, _ in compared],
                   "training": to_dict(training), "stack": stack_of(training).to_dict(),
                   "scale_batch": args.scale_batch, "simulated": False, "predicted": True,
                   "devices": [p.to_dict() for p in points], "figure": figure, "figures": figures},
                  sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_devices(points, model, training, plot=args.plot)
        for f in figures:
            _console().print(f"{f['device']}: {f['text']}", highlight=False)
    return 0


def devices_title(model: Any, clusters: list[Any], training: Any) -> str:
    return (f"{model.name}: best predicted layout per device type and size ({', '.join(c.name for c in clusters)}; "
            f"global batch {training.global_batch} x {model.seq_len} tokens; stack {training.stack})")


def _write_plot(path: str, figure: dict[str, Any]) -> None:
    import plotly.graph_objects as go

    try:  # self-contained: plotly.js inlined, the page opens with no network
        Path(path).write_text(go.Figure(figure).to_html(include_plotlyjs=True, full_html=True))
    except OSError as exc:
        raise SpecError(f"--plot={path!r}: cannot write it ({exc.strerror or exc})") from None


def print_devices(points: list[DevicePoint], model: Any, training: Any, *, plot: str | None) -> None:
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    budget = (f"token budget {fmt.tokens_text(training.train_tokens)}" if training.train_tokens
              else "no token budget (--train-tokens)")
    console.print(f"[bold]{model.name}[/] ({_count(model.params)} params); {budget}; {stack_line(training)}")
    table = Table(box=box.SIMPLE_HEAD, title="Best predicted layout per device type and cluster size "
                  "(analytical model, not measured)")
    for col in ("device", "nodes", "devices", "best layout", "tok/s", "tok/s/dev", "MFU", "time to train",
                "price/dev-h", "total cost", ""):
        table.add_column(col, justify="left" if col in ("device", "best layout", "") else "right")
    for p in points:
        s = p.size
        price = fmt.money(s.budget.price_per_device_hour) if s.budget is not None else fmt.DASH
        if s.layout is None:
            table.add_row(p.device, str(s.nodes), f"{s.devices:,}", s.why or "-", *[fmt.DASH] * 6, "")
            continue
        cells = fmt.budget_cells(s.budget)
        marks = ", ".join(m for m, on in (("fastest", p.fastest), ("cheapest", p.cheapest)) if on)
        table.add_row(p.device, str(s.nodes), f"{s.devices:,}", fmt.layout_text(s.layout), fmt.num(s.tokens_per_s),
                      fmt.num(s.tokens_per_s_per_device), fmt.pct(s.mfu), cells["time"], price, cells["cost"],
                      f"[bold]{marks}[/]" if marks else "")
    console.print(table)
    if not any(p.cheapest for p in points):
        console.print("cheapest: no device type has a price (--price-per-device-hour TYPE=PRICE,...)", style="dim")
    if plot:
        console.print(f"plot written to {plot}")
