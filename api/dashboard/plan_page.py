"""Dashboard page "how many GPUs": the cluster-size comparison of ``meshtune plan --nodes 4,8,16``.

    GET /plan      a form (model, cluster, node counts, batch, critical batch, token budget, price);
                   with node counts, the best predicted layout per size as a table and the plotly
                   figure (tuner._scaling.sizes_figure, the one ``--plot`` and /api/plan/sizes give)

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
from api.routes.plan import MAX_CANDIDATES, MAX_DEVICES
from tuner import CLUSTER_PRESETS, MODEL_PRESETS, SpecError, cluster_spec, model_spec, to_dict, training_spec
from tuner._plan import check_planning_work
from tuner._scaling import check_node_counts, plan_sizes, sizes_figure

router = APIRouter(include_in_schema=False)

FIELDS = ("model", "cluster", "nodes", "global_batch_tokens", "critical_batch_tokens", "train_tokens",
          "price_per_device_hour", "scale_batch")
DEFAULTS = {"model": "llama3-70b", "cluster": "h100-sxm", "nodes": "4,8,16,32,64", "global_batch_tokens": "4194304",
            "critical_batch_tokens": "", "train_tokens": "15e12", "price_per_device_hour": "", "scale_batch": ""}


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
    cluster: dict[str, Any] = {"preset": values["cluster"], "nodes": counts[0]}
    price = _number(values, "price_per_device_hour", float)
    if price is not None:
        cluster["price_per_device_hour"] = price
    c = cluster_spec(cluster)
    training: dict[str, Any] = {"global_batch_tokens": _number(values, "global_batch_tokens", int)}
    if training["global_batch_tokens"] is None:
        raise SpecError("global_batch_tokens: give the tokens per optimiser step")
    for name, kind in (("critical_batch_tokens", int), ("train_tokens", float)):
        v = _number(values, name, kind)
        if v is not None:
            training[name] = v
    t = training_spec(training, seq_len=model.seq_len)
    cost = 0
    for n in counts:
        size = cluster_spec({**to_dict(c), "nodes": n})
        if size.devices > MAX_DEVICES:
            raise SpecError(f"nodes={n}: {size.devices} devices exceeds this page's limit of {MAX_DEVICES}; "
                            "use `meshtune plan`")
        cost += check_planning_work(model=model, cluster=size, limit=MAX_CANDIDATES, where="plan request",
                                    remedy="plan it with `meshtune plan`, which has no such limit")
    if charge is not None:
        charge(cost)
    points = plan_sizes(model=model, cluster=c, training=t, nodes=counts, scale_batch=bool(values["scale_batch"]))
    title = f"{model.name} on {c.name}: best predicted layout per cluster size"
    rows = []
    for p in points:
        cells = fmt.budget_cells(p.budget)
        rows.append({"nodes": p.nodes, "devices": p.devices, "batch": p.global_batch, "why": p.why,
                     "layout": fmt.layout_text(p.layout) if p.layout else None, "placement": p.placement,
                     "tokens_per_s": fmt.num(p.tokens_per_s), "per_device": fmt.num(p.tokens_per_s_per_device),
                     "mfu": fmt.pct(p.mfu), "useful": fmt.num(p.useful_tokens_per_s), **cells})
    return {"rows": rows, "figure": sizes_figure(points, title=title), "model": model, "cluster": c, "training": t}


@router.get("/plan", name="dashboard_plan")
def plan_page(request: Request, settings: SettingsDep) -> HTMLResponse:
    if not _can_read(request, settings):
        return _login(request)
    given = {k: request.query_params.get(k) for k in FIELDS}
    asked = given["nodes"] is not None
    values = {k: (v if v is not None else ("" if asked and k == "scale_batch" else DEFAULTS[k]))
              for k, v in given.items()}
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
    ctx = {"values": values, "result": result, "error": error,
           "model_presets": sorted(MODEL_PRESETS), "cluster_presets": sorted(CLUSTER_PRESETS)}
    return templates.TemplateResponse(request, "plan.html", ctx, status_code=status)
