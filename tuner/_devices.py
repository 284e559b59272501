"""Which device type to rent: the best predicted layout of each (device type, cluster size), with its
tokens/s, MFU, time to train the token budget and total cost, the fastest and the cheapest marked.

A comparison names its device types as a list of presets (``cluster_types``: ``h100-sxm,b200`` on
the command line, ``cluster.preset`` as a list in a spec or the API; the section's other fields apply
to every type), with a price per type (``device_prices``: ``h100-sxm=2.5,b200=5.0``, or one price for
all). Each type is planned at each node count by ``tuner._scaling.plan_sizes``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tuner._errors import SpecError
from tuner._presets import CLUSTER_PRESETS, cluster_spec
from tuner._problem import Problem
from tuner._realise import Capabilities
from tuner._scaling import SizePoint, check_node_counts, plan_sizes
from tuner._space import SearchSpace
from tuner._specs import ClusterSpec, ModelSpec, TrainingSpec
from tuner._timing import CalibrationFactors

MAX_DEVICE_TYPES = 8  # device types one comparison may name
# One colour per device type in both panels of the figure (plotly's default qualitative sequence).
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def _type_names(value: Any, field: str) -> list[str]:
    """The preset names of a list (or of ``a,b`` text), each checked; SpecError naming the entry."""
    items = [p.strip() for p in value.split(",")] if isinstance(value, str) else list(value)
    if not items:
        raise SpecError(f"{field} must name at least one device type, got {value!r}")
    for i, name in enumerate(items):
        if not isinstance(name, str):
            raise SpecError(f"{field}[{i}]={name!r}: a list of device types names cluster presets only; compare "
                            "an inline cluster mapping on its own (cluster: {...})")
        if name not in CLUSTER_PRESETS:
            raise SpecError(f"{field}[{i}]={name!r} is not a known preset (known: {', '.join(sorted(CLUSTER_PRESETS))})")
    dupes = sorted({n for n in items if items.count(n) > 1})
    if dupes:
        raise SpecError(f"{field}={','.join(items)}: {dupes[0]} is given twice")
    if len(items) > MAX_DEVICE_TYPES:
        raise SpecError(f"{field}={','.join(items)}: {len(items)} device types, above the limit of {MAX_DEVICE_TYPES}")
    return items


def cluster_types(value: Any, *, field: str = "cluster") -> list[ClusterSpec]:
    """The clusters a cluster section names: one (a preset name, a mapping, ``cluster_spec``'s forms)
    or several device types (a list of preset names, ``a,b`` text, or a mapping whose ``preset`` is
    such a list, its other fields applied to each type; ``price_per_device_hour`` may then be a
    mapping per type, ``device_prices``). SpecError naming the field and the value otherwise."""
    if isinstance(value, str) and "," in value:
        value = _type_names(value, field)
    if isinstance(value, (list, tuple)):
        return [cluster_spec(name) for name in _type_names(value, field)]
    if isinstance(value, Mapping) and isinstance(value.get("preset"), (list, tuple, str)) and (
            not isinstance(value.get("preset"), str) or "," in value["preset"]):
        names = _type_names(value["preset"], f"{field}.preset")
        if "name" in value:
            raise SpecError(f"{field}.name={value['name']!r} cannot name a list of device types (each keeps its "
                            "preset's name)")
        rest = {k: v for k, v in value.items() if k not in ("preset", "price_per_device_hour")}
        prices = device_prices(value.get("price_per_device_hour"), names, field=f"{field}.price_per_device_hour")
        return [cluster_spec({"preset": n, **rest, "price_per_device_hour": prices.get(n)}) for n in names]
    if isinstance(value, Mapping) and isinstance(value.get("price_per_device_hour"), (Mapping, str)):
        one = cluster_spec({k: v for k, v in value.items() if k != "price_per_device_hour"})
        prices = device_prices(value["price_per_device_hour"], [value.get("preset") or one.name],
                               field=f"{field}.price_per_device_hour")
        return [dataclasses.replace(one, price_per_device_hour=next(iter(prices.values()), None))]
    return [cluster_spec(value)]


def device_prices(value: Any, names: Sequence[str], *, field: str = "price_per_device_hour") -> dict[str, float]:
    """Price per device-hour of each device type in ``names`` that has one: from one number (every
    type), a mapping, or ``NAME=PRICE,...`` text; a price for a type not in ``names`` is refused
    (SpecError naming the field and the value)."""
    if value is None:
        return {}
    if isinstance(value, str):
        text = value.strip()
        try:
            value = float(text)
        except ValueError:
            pairs: dict[str, Any] = {}
            for part in text.split(","):
                name, sep, price = part.partition("=")
                if not sep:
                    raise SpecError(f"{field}={value}: {part.strip()!r} is not NAME=PRICE (or one price for every "
                                    "device type)") from None
                try:
                    pairs[name.strip()] = float(price)
                except ValueError:
                    raise SpecError(f"{field}={value}: {price.strip()!r} is not a price") from None
            value = pairs
    if isinstance(value, bool) or not isinstance(value, (int, float, Mapping)):
        raise SpecError(f"{field} must be a price or a mapping of device type to price, got {value!r}")
    prices = {n: value for n in names} if isinstance(value, (int, float)) else dict(value)
    for name, price in prices.items():
        if name not in names:
            raise SpecError(f"{field}: {name}={price!r} names a device type that is not compared "
                            f"(compared: {', '.join(names)})")
        if isinstance(price, bool) or not isinstance(price, (int, float)) or not 0 <= price < float("inf"):
            raise SpecError(f"{field}: {name}={price!r} is not a non-negative price")
    return {n: float(p) for n, p in prices.items()}


@dataclass(frozen=True)
class DevicePoint:
    """The best predicted layout of one device type at one size (``SizePoint``), and whether it is
    the fastest (most tokens/s, so the shortest time to train) or the cheapest (least total cost,
    else least cost per token) of the comparison."""

    device: str
    size: SizePoint
    fastest: bool = False
    cheapest: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, **self.size.to_dict(), "fastest": self.fastest, "cheapest": self.cheapest}


def compare_devices(
    *, model: ModelSpec, clusters: Sequence[ClusterSpec], training: TrainingSpec, nodes: Sequence[int] | None = None,
    space: SearchSpace | None = None, factors: CalibrationFactors | None = None, allow_tp_across_nodes: bool = False,
    scale_batch: bool = False, capabilities: Capabilities | None = None,
) -> list[DevicePoint]:
    """Every (device type, node count) planned (``nodes``: each type's own node count when None),
    in the order given, the fastest and the cheapest marked."""
    rows: list[tuple[str, SizePoint]] = []
    for c in clusters:
        counts = check_node_counts(list(nodes) if nodes is not None else [c.nodes], field="nodes")
        problem = Problem(model=model, cluster=c, training=training, space=space or SearchSpace(),
                          capabilities=capabilities)
        for p in plan_sizes(problem=problem, nodes=counts, factors=factors,
                            allow_tp_across_nodes=allow_tp_across_nodes, scale_batch=scale_batch):
            rows.append((c.name, p))
    ok = [i for i, (_, p) in enumerate(rows) if p.tokens_per_s]
    fastest = max(ok, key=lambda i: rows[i][1].tokens_per_s or 0.0, default=None)
    priced = [i for i in ok if rows[i][1].budget is not None and rows[i][1].budget.cost_per_token is not None]
    cheapest = min(priced, key=lambda i: _cost(rows[i][1]), default=None)
    return [DevicePoint(name, p, fastest=i == fastest, cheapest=i == cheapest) for i, (name, p) in enumerate(rows)]


def _cost(p: SizePoint) -> float:
    """What "cheapest" compares: the total cost of the token budget, or the cost per token without one
    (the same order: a fixed budget costs tokens x cost per token)."""
    assert p.budget is not None and p.budget.cost_per_token is not None
    return p.budget.cost if p.budget.cost is not None else p.budget.cost_per_token


def devices_figure(points: Sequence[DevicePoint], *, title: str) -> dict[str, Any]:
    """A plotly figure (``{"data", "layout"}``) of the comparison: tokens/s against devices, one line
    per device type; where priced, total cost (or cost per 1M tokens) against time to train (or
    tokens/s) beside it, one marker per (type, size); the fastest and the cheapest starred."""
    types = list(dict.fromkeys(p.device for p in points))
    ok = [p for p in points if p.size.tokens_per_s]
    data: list[dict[str, Any]] = []
    colour = {t: COLOURS[i % len(COLOURS)] for i, t in enumerate(types)}
    for t in types:
        mine = [p for p in ok if p.device == t]
        data.append({"type": "scatter", "mode": "lines+markers", "name": t, "legendgroup": t,
                     "line": {"color": colour[t]}, "marker": {"color": colour[t]},
                     "x": [p.size.devices for p in mine], "y": [p.size.tokens_per_s for p in mine],
                     "text": [f"{p.size.nodes} nodes: {p.size.layout_key}" for p in mine]})
    layout: dict[str, Any] = {
        "title": {"text": title},
        "xaxis": {"title": {"text": "devices"}, "type": "log", "domain": [0, 0.46]},
        "yaxis": {"title": {"text": "tokens/s (predicted)"}, "rangemode": "tozero"},
        "legend": {"orientation": "h", "y": -0.25},
    }
    priced = [p for p in ok if p.size.budget is not None and p.size.budget.cost_per_token is not None]
    if priced:
        budgeted = all(p.size.budget.cost is not None for p in priced)  # type: ignore[union-attr]
        for t in types:
            mine = [p for p in priced if p.device == t]
            if not mine:
                continue
            data.append({"type": "scatter", "mode": "markers", "name": f"{t} cost", "legendgroup": t,
                         "showlegend": False, "xaxis": "x2", "yaxis": "y2", "marker": {"color": colour[t], "size": 9},
                         "x": [_days(p) if budgeted else p.size.tokens_per_s for p in mine],
                         "y": [p.size.budget.cost if budgeted else p.size.budget.cost_per_token * 1e6  # type: ignore[union-attr]
                               for p in mine],
                         "text": [f"{t}, {p.size.nodes} nodes" for p in mine]})
        layout["xaxis2"] = {"title": {"text": "days to train the token budget" if budgeted else "tokens/s"},
                            "domain": [0.54, 1], "rangemode": "tozero"}
        layout["yaxis2"] = {"title": {"text": "total cost" if budgeted else "cost per 1M tokens"}, "anchor": "x2",
                            "rangemode": "tozero"}
    marks = [(p, label) for p in ok for label, on in (("fastest", p.fastest), ("cheapest", p.cheapest)) if on]
    if marks:
        widest = max(p.size.devices for p in ok)
        data.append({"type": "scatter", "mode": "markers+text", "name": "fastest / cheapest", "showlegend": False,
                     "x": [p.size.devices for p, _ in marks], "y": [p.size.tokens_per_s for p, _ in marks],
                     "text": [f"{label}: {p.device}" for p, label in marks],
                     "textposition": ["top left" if p.size.devices == widest else "top right" for p, _ in marks],
                     "marker": {"symbol": "star", "size": 14, "color": "black"}})
    return {"data": data, "layout": layout}


def _days(p: DevicePoint) -> float | None:
    b = p.size.budget
    return None if b is None or b.time_to_train_s is None else b.time_to_train_s / 86400.0
