"""How many devices: the best layout's throughput, MFU, useful tokens/s (critical batch), time and
cost to train a token budget, at each of several cluster sizes. Pure functions of the frozen specs
and the planner (tuner/_plan.py); a throughput's budget is tuner/_budget.py's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tuner._budget import TrainingBudget, training_budget
from tuner._errors import SpecError
from tuner._formulas import useful_tokens_per_s
from tuner._plan import plan
from tuner._problem import Problem
from tuner._timing import CalibrationFactors

MAX_SIZES = 32  # cluster sizes one request may compare


def check_node_counts(nodes: Any, *, field: str = "nodes") -> tuple[int, ...]:
    """The node counts of a size comparison: distinct positive integers (given as a list or as the
    text ``4,8,16``), at most ``MAX_SIZES``; else SpecError naming ``field`` and the value."""
    items: list[Any]
    if isinstance(nodes, str):
        items = [p.strip() for p in nodes.split(",")]
        parsed = []
        for p in items:
            if not (p.isascii() and p.isdigit()):
                raise SpecError(f"{field}={nodes}: {p!r} is not a positive integer")
            parsed.append(int(p))
        items = parsed
    elif isinstance(nodes, (list, tuple)):
        items = list(nodes)
    else:
        raise SpecError(f"{field} must be a list of node counts, got {nodes!r}")
    if not items:
        raise SpecError(f"{field} must name at least one node count, got {nodes!r}")
    shown = nodes if isinstance(nodes, str) else ",".join(str(n) for n in items)
    for n in items:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise SpecError(f"{field}={shown}: {n!r} is not a positive integer")
    dupes = sorted({n for n in items if items.count(n) > 1})
    if dupes:
        raise SpecError(f"{field}={shown}: {dupes[0]} is given twice")
    if len(items) > MAX_SIZES:
        raise SpecError(f"{field}={shown}: {len(items)} node counts, above the limit of {MAX_SIZES}")
    return tuple(items)


@dataclass(frozen=True)
class SizePoint:
    """The best predicted layout at one cluster size (``layout`` None: nothing fits; ``why`` says why)."""

    nodes: int
    devices: int
    global_batch: int
    layout: dict[str, Any] | None
    layout_key: str | None
    placement: str | None
    step_time_s: float | None
    tokens_per_s: float | None
    tokens_per_s_per_device: float | None
    mfu: float | None
    useful_tokens_per_s: float | None
    budget: TrainingBudget | None
    feasible: int
    why: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["budget"] = None if self.budget is None else self.budget.to_dict()
        return d


def plan_sizes(
    *, problem: Problem, nodes: Sequence[int], factors: CalibrationFactors | None = None,
    allow_tp_across_nodes: bool = False, scale_batch: bool = False,
) -> list[SizePoint]:
    """The best layout of ``problem`` at each node count in ``nodes`` (the cluster otherwise
    unchanged), among what its workload runs (``problem.capabilities``; see ``enumerate_layouts``).

    With a fixed global batch (the default) bigger clusters split the same batch finer (strong
    scaling), and the data-parallel degree is bounded by it. ``scale_batch`` grows the batch with
    the device count from the first size's (weak scaling): tokens/s keep growing, useful tokens/s
    level off once the batch passes the critical batch (McCandlish et al. 2018)."""
    counts = check_node_counts(list(nodes))
    cluster, training = problem.cluster, problem.training
    base = counts[0] * cluster.devices_per_node
    out = []
    for n in counts:
        c = dataclasses.replace(cluster, nodes=n)
        t = training
        if scale_batch:
            t = dataclasses.replace(training, global_batch=max(1, training.global_batch * c.devices // base))
        result = plan(problem=dataclasses.replace(problem, cluster=c, training=t), factors=factors,
                      allow_tp_across_nodes=allow_tp_across_nodes)
        best = result.best
        if best is None:
            top = sorted(result.rejected.items(), key=lambda kv: (-kv[1], kv[0]))[:2]
            why = "no layout fits: " + (", ".join(f"{r} ({k:,})" for r, k in top) or "the space is empty")
            out.append(SizePoint(n, c.devices, t.global_batch, None, None, None, None, None, None, None, None, None,
                                 0, why))
            continue
        tm = best.time
        useful = useful_tokens_per_s(tm.tokens_per_s, t.global_batch, t.critical_batch)
        out.append(SizePoint(
            nodes=n, devices=c.devices, global_batch=t.global_batch, layout=dataclasses.asdict(best.layout),
            layout_key=best.layout.key, placement=best.placement.summary, step_time_s=tm.step_time_s,
            tokens_per_s=tm.tokens_per_s, tokens_per_s_per_device=tm.tokens_per_s_per_device, mfu=tm.mfu,
            useful_tokens_per_s=useful,
            budget=training_budget(tm.tokens_per_s, devices=c.devices, train_tokens=t.train_tokens,
                                   price_per_device_hour=c.price_per_device_hour),
            feasible=len(result.entries),
        ))
    return out


def sizes_figure(points: Sequence[SizePoint], *, title: str) -> dict[str, Any]:
    """A plotly figure (plain JSON: ``{"data", "layout"}``) of the size comparison: tokens/s and
    useful tokens/s against devices, MFU on a second axis, and cost per million tokens where priced.
    The dashboard and the API hand it to plotly.js; ``meshtune plan --plot`` writes it to HTML."""
    ok = [p for p in points if p.tokens_per_s is not None]
    x = [p.devices for p in ok]
    data: list[dict[str, Any]] = [
        {"type": "scatter", "mode": "lines+markers", "name": "tokens/s", "x": x, "y": [p.tokens_per_s for p in ok]},
        {"type": "scatter", "mode": "lines+markers", "name": "useful tokens/s (critical batch)", "x": x,
         "y": [p.useful_tokens_per_s for p in ok]},
        {"type": "scatter", "mode": "lines+markers", "name": "MFU", "x": x, "y": [p.mfu for p in ok], "yaxis": "y2",
         "line": {"dash": "dot"}},
    ]
    layout: dict[str, Any] = {
        "title": {"text": title},
        "xaxis": {"title": {"text": "devices"}, "type": "log", "tickvals": x, "ticktext": [str(v) for v in x]},
        "yaxis": {"title": {"text": "tokens/s (predicted)"}, "rangemode": "tozero"},
        "yaxis2": {"title": {"text": "MFU"}, "overlaying": "y", "side": "right", "tickformat": ".0%",
                   "rangemode": "tozero"},
        "legend": {"orientation": "h", "y": -0.2},
    }
    priced = [p for p in ok if p.budget is not None and p.budget.cost_per_token is not None]
    if priced:
        data.append({"type": "scatter", "mode": "lines+markers", "name": "cost per 1M tokens",
                     "x": [p.devices for p in priced], "y": [p.budget.cost_per_token * 1e6 for p in priced],  # type: ignore[union-attr]
                     "xaxis": "x", "yaxis": "y3", "line": {"dash": "dash"}})
        layout["yaxis3"] = {"title": {"text": "cost per 1M tokens"}, "overlaying": "y", "side": "right",
                            "anchor": "free", "position": 1.0, "rangemode": "tozero", "showgrid": False}
        layout["xaxis"]["domain"] = [0, 0.88]
        layout["yaxis2"]["anchor"] = "x"
    return {"data": data, "layout": layout}

