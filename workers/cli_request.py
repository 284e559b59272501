"""A ``TrialRequest`` from command-line arguments: the layout and option syntax of ``meshtune run-trial``.

It lives in workers (not api) so that the plain-``torchrun`` entry point (workers/torchrun_main.py)
builds exactly the request ``run-trial`` builds without importing the coordinator: workers never
imports api (the layering rules, README "Layout of the code"). ``meshtune run-trial`` (api/cli/run_trial.py) calls it.
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
    model_arg,
    model_spec,
    training_spec,
    twin_note,
)
from workers._contract import TrialRequest

INT_FIELDS = ("tp", "pp", "dp", "cp", "ep", "zero", "mbs", "vpp")
STR_FIELDS = ("ac", "schedule")
BOOL_FIELDS = ("sp",)


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


def cluster_arg(args: argparse.Namespace) -> Any:
    """``--cluster`` with ``--nodes``/``--devices-per-node`` over the preset's (one line naming the
    option and the value for anything but a positive integer)."""
    sizes = {}
    for option, field in (("nodes", "nodes"), ("devices_per_node", "devices_per_node")):
        raw = getattr(args, option, None)
        if raw is None:
            continue
        try:
            value = int(str(raw), 10)
        except ValueError:
            value = 0
        if value < 1:
            raise SpecError(f"--{option.replace('_', '-')} must be a positive integer, got {raw!r}")
        sizes[field] = value
    return {"preset": args.cluster, **sizes} if sizes else args.cluster


def build_request(args: argparse.Namespace) -> TrialRequest:
    if args.warmup < 0:
        raise SpecError(f"--warmup must be a non-negative integer, got {args.warmup}")
    if args.measure < 1:
        raise SpecError(f"--measure must be a positive integer, got {args.measure}")
    if not args.step_timeout > 0:
        raise SpecError(f"--step-timeout must be a positive number, got {args.step_timeout}")
    model = model_spec(model_arg(args.model))  # a preset, or hf:PATH (tuner._hf.model_arg)
    cluster = cluster_spec(cluster_arg(args))
    training = training_spec({"global_batch": args.global_batch, "seed": args.seed}, seq_len=model.seq_len)
    given = parse_layout(args.layout)
    options = parse_options(args.option)
    check_layout(given, model=model, cluster=cluster, training=training,
                 allow_tp_across_nodes=options.get("allow_tp_across_nodes") is True)
    # A twin runs (and is reported) as its canonical layout: one key per distinct program.
    layout = canonical_layout(given, training=training)
    workload = getattr(args, "workload", None) or "builtin"
    # The model code the ranks train (workers/workload.py) must run this layout: refused here, not
    # in a trial (the built-in model's own limits: tuner._realise.builtin_refusal).
    from tuner import check_supported

    if workload != "builtin":
        from workers.workload_registry import check_workload

        check_supported(layout, model, check_workload(workload, model, training))
    else:
        check_supported(layout, model)
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
        options=options,
        workload=workload,
    )
