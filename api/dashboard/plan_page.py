"""Dashboard page "how many GPUs": the cluster-size comparison of ``meshtune plan --nodes 4,8,16``,
and of several device types side by side (``meshtune plan --cluster h100-sxm,b200``).

    GET /plan      a form (model, device types, node counts, batch, critical batch, token budget, price
                   per device type, the stack trained with); with node counts, the best predicted
                   layout per size (and device type) as a table and the plotly figure
                   (tuner._scaling.sizes_figure / tuner._devices.devices_figure, the ones ``--plot``,
                   /api/plan/sizes and /api/plan/devices give)

Analytical only, no device time. Reads follow the dashboard's rule; the planning work is bounded as
``GET /api/plan/sizes`` bounds it (devices, candidate layouts, the anonymous client's budget).
"""

from __future__ import annotations

import math
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from api import format as fmt
from api._http import client_address
from api.dashboard.router import _can_read, _login, templates
from api.deps import SettingsDep
from api.plan.service import MAX_CANDIDATES, MAX_DEVICES
from tuner import (
    CLUSTER_PRESETS,
    MODEL_PRESETS,
    STACKS,
    Problem,
    SpecError,
    check_node_counts,
    check_planning_work,
    cluster_spec,
    cluster_types,
    compare_devices,
    devices_figure,
    model_spec,
    plan_sizes,
    sizes_figure,
    to_dict,
    training_spec,
)

router = APIRouter(include_in_schema=False)

FIELDS = ("model", "nodes", "global_batch_tokens", "critical_batch_tokens", "train_tokens",
          "price_per_device_hour", "scale_batch", "stack")
DEFAULTS = {"model": "llama3-70b", "cluster": ["h100-sxm"], "nodes": "4,8,16,32,64", "global_batch_tokens": "4194304",
            "critical_batch_tokens": "", "train_tokens": "15e12", "price_per_device_hour": "", "scale_batch": "",
            "stack": "meshtune"}


def _number(values: dict[str, str], name: str, kind: type) -> Any:
    text = values[name].strip()
    if not text:
        return None
    try:
        v = float(text)
    except ValueError:
        raise SpecError(f"{name}={text!r} is not a number") from None
    if not math.isfinite(v):
        raise SpecError(f"{name}={text!r} is not a finite number")
    if kind is int:
        if v != int(v):
            raise SpecError(f"{name}={text!r} is not an integer")
        return int(v)
    return v


def compare(values: dict[str, str], *, charge: Any = None) -> dict[str, Any]:
    """The comparison the form asks for (SpecError naming field and value when it cannot be made)."""
    counts = check_node_counts(values["nodes"], field="nodes")
    model = model_spec(values["model"])
    types = values["cluster"]
    if not types:
        raise SpecError("cluster: choose at least one device type")
    price = values["price_per_device_hour"].strip() or None
    if price is not None and "=" not in price:
        price = _number(values, "price_per_device_hour", float)
    clusters = cluster_types({"preset": types if len(types) > 1 else types[0], "nodes": counts[0],
                              **({"price_per_device_hour": price} if price is not None else {})})
    c = clusters[0]
    training: dict[str, Any] = {"global_batch_tokens": _number(values, "global_batch_tokens", int),
                                "stack": values["stack"]}
    if training["global_batch_tokens"] is None:
        raise SpecError("global_batch_tokens: give the tokens per optimiser step")
    for name, kind in (("critical_batch_tokens", int), ("train_tokens", float)):
        v = _number(values, name, kind)
        if v is not None:
            training[name] = v
    t = training_spec(training, seq_len=model.seq_len)
    cost = 0
    for one in clusters:
        for n in counts:
            size = cluster_spec({**to_dict(one), "nodes": n})
            if size.devices > MAX_DEVICES:
                raise SpecError(f"nodes={n}: {size.devices} devices exceeds this page's limit of {MAX_DEVICES}; "
                                "use `meshtune plan`")
            cost += check_planning_work(model=model, cluster=size, limit=MAX_CANDIDATES, where="plan request",
                                        remedy="plan it with `meshtune plan`, which has no such limit", training=t)
    if charge is not None:
        charge(cost)
    if len(clusters) > 1:
        return _devices(model, clusters, t, counts, bool(values["scale_batch"]))
    points = plan_sizes(problem=Problem(model=model, cluster=c, training=t), nodes=counts,
                        scale_batch=bool(values["scale_batch"]))
    title = f"{model.name} on {c.name}: best predicted layout per cluster size"
    rows = []
    for p in points:
        cells = fmt.budget_cells(p.budget)
        rows.append({"nodes": p.nodes, "devices": p.devices, "batch": p.global_batch, "why": p.why,
                     "layout": fmt.layout_text(p.layout) if p.layout else None, "placement": p.placement,
                     "tokens_per_s": fmt.num(p.tokens_per_s), "per_device": fmt.num(p.tokens_per_s_per_device),
                     "mfu": fmt.pct(p.mfu), "useful": fmt.num(p.useful_tokens_per_s), **cells})
    return {"rows": rows, "figure": sizes_figure(points, title=title), "model": model, "cluster": c, "training": t,
            "devices": None}


def _devices(model: Any, clusters: list[Any], t: Any, counts: tuple[int, ...], scale_batch: bool) -> dict[str, Any]:
    """Several device types: one row per (type, size), the fastest and the cheapest marked."""
    points = compare_devices(model=model, clusters=clusters, training=t, nodes=counts, scale_batch=scale_batch)
    rows = []
    for p in points:
        s = p.size
        cells = fmt.budget_cells(s.budget)
        rows.append({"device": p.device, "nodes": s.nodes, "devices": s.devices, "why": s.why,
                     "layout": fmt.layout_text(s.layout) if s.layout else None, "tokens_per_s": fmt.num(s.tokens_per_s),
                     "per_device": fmt.num(s.tokens_per_s_per_device), "mfu": fmt.pct(s.mfu),
                     "price": fmt.money(s.budget.price_per_device_hour if s.budget else None), **cells,
                     "fastest": p.fastest, "cheapest": p.cheapest})
    title = f"{model.name}: best predicted layout per device type and size (stack {t.stack})"
    return {"rows": rows, "figure": devices_figure(points, title=title), "model": model, "cluster": clusters[0],
            "training": t, "devices": [c.name for c in clusters], "priced": any(p.cheapest for p in points)}


@router.get("/plan", name="dashboard_plan")
def plan_page(request: Request, settings: SettingsDep) -> HTMLResponse:
    if not _can_read(request, settings):
        return _login(request)
    given: dict[str, Any] = {k: request.query_params.get(k) for k in FIELDS}
    asked = given["nodes"] is not None
    values = {k: (v if v is not None else ("" if asked and k == "scale_batch" else DEFAULTS[k]))
              for k, v in given.items()}
    values["cluster"] = request.query_params.getlist("cluster") or ([] if asked else DEFAULTS["cluster"])
    result, error, status = None, None, 200
    if asked:
        client = client_address(request)

        def charge(cost: int) -> None:
            wait = request.app.state.plan_budget.charge(client, cost)
            if wait:
                raise SpecError(f"planning budget of client {client} is spent; retry in {math.ceil(wait)} s")

        try:
            result = compare(values, charge=charge)
        except ValueError as exc:  # SpecError and friends: one line naming field and value
            error, status = str(exc), 422
    ctx = {"values": values, "result": result, "error": error, "stacks": STACKS,
           "model_presets": sorted(MODEL_PRESETS), "cluster_presets": sorted(CLUSTER_PRESETS)}
    return templates.TemplateResponse(request, "plan.html", ctx, status_code=status)
