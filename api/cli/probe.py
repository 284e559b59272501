"""``meshtune probe``: measure the cluster (compute at the model's shapes, each collective at each
tier of links, real layers and steps, the allocator) on the trials' own rank processes, store it,
and print each figure beside the datasheet's; ``--show`` prints the stored probe without running.

    meshtune probe                                    # tiny on cpu-local: what the quick start uses
    meshtune probe examples/tiny-cpu.yaml --show      # a spec's model, cluster, training and space

A later sweep of the same cluster, model and environment uses the stored probe instead of probing
(api/probes/service.py). Bad input, a cluster that cannot start the probe's gangs, a probe that
fails or times out: one line naming the cause, exit 2; nothing half-measured is stored.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("probe", help="measure the cluster's compute, links and overheads for the models",
                       description="Measure the cluster on the trials' own rank processes and store the figures "
                       "that plan, sweeps and the dashboard then use in place of the datasheet's.")
    p.add_argument("spec", nargs="?", help="a sweep spec file: its model, cluster, training, space and backend")
    p.add_argument("--model", default=None, metavar="PRESET|hf:PATH", help="model preset or hf:PATH (default tiny)")
    p.add_argument("--cluster", default=None, metavar="PRESET", help="cluster preset (default cpu-local)")
    p.add_argument("--global-batch", type=int, default=None, metavar="N", help="sequences per step (default 8)")
    p.add_argument("--backend", default=None, metavar="NAME", help="ray or module:attr (default: the spec's, else settings)")
    p.add_argument("--budget-s", type=float, default=None, metavar="S",
                   help="the probe's own time budget on the ranks (default 60; phases past it are skipped)")
    p.add_argument("--show", action="store_true", help="print the stored probe of this cluster and model; run nothing")
    p.add_argument("--json", action="store_true", help="print the probe as JSON")
    p.set_defaults(func=probe_cmd)


def _problem(args: argparse.Namespace) -> tuple[Any, ...]:
    """(model, cluster, training, layouts, backend name, workload) of the spec or the flags."""
    import tuner
    from api.settings import get_settings

    if args.spec:
        from api.cli.sweep import load_spec
        from api.engine._submission import enumerate_space

        spec = load_spec(args.spec, backend=args.backend, model=args.model)
        problem = spec.to_problem()
        layouts = spec.listed_layouts()
        if layouts is None:
            layouts = enumerate_space(problem, space_fields=spec.space).valid
        return problem.model, problem.cluster, problem.training, layouts, spec.backend, spec.workload
    from tuner import model_arg

    model = tuner.model_spec(model_arg(args.model or "tiny"))
    cluster = tuner.cluster_spec(args.cluster or "cpu-local")
    training = tuner.training_spec({"global_batch": args.global_batch or 8}, seq_len=model.seq_len)
    layouts = tuner.enumerate_layouts(problem=tuner.Problem(model=model, cluster=cluster,
                                                            training=training)).valid
    return model, cluster, training, layouts, args.backend or get_settings().backend, "builtin"


def _backend(name: str, cluster: Any) -> Any:
    from api.settings import get_settings
    from workers.backends import get_backend

    kwargs = {"address": get_settings().ray_address, "num_cpus": cluster.devices} if name == "ray" else {}
    return get_backend(name, **kwargs)


def probe_cmd(args: argparse.Namespace) -> int:
    from api.cli._store import open_sessions
    from api.probes import service as probes
    from tuner import NotFoundError

    model, cluster, training, layouts, backend_name, workload = _problem(args)
    _, sessions = open_sessions()
    key = probes.probe_key(cluster=cluster, model=model, training=training, backend=backend_name, workload=workload)
    if args.show:
        with sessions() as s:
            row = probes.latest(s, key=key)
            if row is None:
                raise NotFoundError(f"no probe of cluster {cluster.name!r} for model {model.name!r} on backend "
                                    f"{backend_name!r} is stored; `meshtune probe` measures one")
            s.expunge(row)
        outcome = probes.ProbeOutcome(row, reused=True)
    else:
        if backend_name == "simulate":
            from tuner import SpecError

            raise SpecError("backend='simulate' runs no probe: it measures nothing (the analytical model with noise)")
        backend = _backend(backend_name, cluster)
        try:
            outcome = probes.ensure(sessions, backend, model=model, cluster=cluster, training=training,
                                    layouts=layouts, workload=workload, force=True, budget_s=args.budget_s)
        finally:
            backend.close()
    print_probe(outcome, cluster, model, as_json=args.json)
    return 0


def print_probe(outcome: Any, cluster: Any, model: Any, *, as_json: bool = False) -> None:
    from rich.console import Console
    from rich.table import Table

    from api import format as fmt
    from api.probes import display
    from api.probes import service as probes
    from tuner import figure_rows, summary

    row = outcome.row
    figures = probes.figures_of(row)
    hw = probes.hardware(cluster)
    if as_json:
        json.dump({"id": row.id, "key": row.key, "env_fingerprint": row.env_fingerprint, "backend": row.backend,
                   "created_at": row.created_at.isoformat() if row.created_at else None, "wall_s": row.wall_s,
                   "dtype": row.dtype, "env": row.env, "figures": row.figures, "summary": summary(hw, figures),
                   "rows": [r.to_dict() for r in figure_rows(hw, figures)]}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    console = Console(width=None if sys.stdout.isatty() else 160)
    env = row.env or {}
    console.print(f"probe #{row.id} of {cluster.name} ({cluster.nodes}x{cluster.devices_per_node} {cluster.device_kind}) "
                  f"for {model.name} in {row.dtype}, {fmt.when(row.created_at)}, "
                  f"{'stored' if outcome.reused else 'measured and stored'}; took {row.wall_s:.1f} s "
                  f"(on the ranks {(row.raw or {}).get('wall_s', 0):.1f} s)"
                  + (f"; host load average {row.raw['host_load'][0]:.1f}" if (row.raw or {}).get("host_load") else ""))
    console.print(f"environment: {env.get('device_name')}, torch {env.get('torch')}"
                  + (f", CUDA {env.get('cuda')}, NCCL {env.get('nccl')}, driver {env.get('driver')}" if env.get("cuda") else ""))
    table = Table(title=f"probed vs datasheet: {summary(hw, figures)}")
    for col in ("figure", "datasheet", "probed", "ratio", "models use"):
        table.add_column(col, justify="left" if col == "figure" else "right")
    for r in display.rows(hw, figures):
        table.add_row(r["name"], r["datasheet"], r["probed"], r["ratio"], r["used"])
    console.print(table)
    for note in figures.notes:
        console.print(f"note: {note}", style="yellow")
