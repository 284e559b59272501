"""/api/plan, /api/plan/sizes and /api/plan/devices: the analytical answers (valid layouts that fit,
fastest predicted first; the best layout per cluster size and per device type), no device time (thin
wrappers over api.plan.service, which caches them and bounds a new answer's work).

A new answer (a cache miss: any changed parameter, e.g. the batch) for an anonymous caller is charged
to that client's budget of candidate layouts (``api.plan.service.ClientBudget``, refilled at its
``rate`` per second); an empty budget is a 429 with Retry-After. Clients are told apart by their
address (api._http.client_address): behind a proxy named in ``MESHTUNE_TRUSTED_PROXIES`` the one it
forwards for, behind any other proxy the proxy's.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Query, Request

from api._http import GuardedRoute, client_address
from api.deps import ReaderDep, SessionDep, SettingsDep
from api.plan import service
from api.plan.schemas import PlanDevicesOut, PlanOut, PlanSizesOut
from api.schemas import BODY_RESPONSES, ERROR_RESPONSES, ErrorOut
from api.spec import PlanDevicesRequest, PlanRequest
from tuner import STACKS, check_node_counts, cluster_types

# GuardedRoute: POST /api/plan's body gets the rules every body gets (1 MiB, UTF-8, depth; auth first).
router = APIRouter(tags=["plan"], route_class=GuardedRoute)

MAX_TOP = 200


ModelName = Annotated[str, Query(max_length=100, description="Model preset name (see /api/presets).")]
ClusterName = Annotated[str, Query(max_length=100, description="Cluster preset name (see /api/presets).")]
DevicesPerNode = Annotated[int | None, Query(ge=1, le=1024, description="Override the preset's devices per node.")]
GlobalBatch = Annotated[int | None, Query(ge=1, le=2**31 - 1, description="Sequences per optimiser step.")]
GlobalBatchTokens = Annotated[
    int | None, Query(ge=1, le=2**40, description="Tokens per step (a multiple of the model's seq_len).")
]
CriticalBatchTokens = Annotated[
    int | None, Query(ge=1, le=2**40, description="Critical batch in tokens (useful tokens/s level off past it).")
]
Precision = Annotated[Literal["bf16", "fp32"], Query(description="Training precision.")]
TrainTokens = Annotated[float | None, Query(gt=0, le=1e18, description="Token budget of the training run "
                                             "(training.train_tokens): time and cost to train it.")]
Price = Annotated[float | None, Query(ge=0, le=1e6, description="Price of one device-hour "
                                      "(cluster.price_per_device_hour), any currency.")]
Stack = Annotated[str, Query(max_length=50, description="The stack the model is trained with (training.stack): "
                             f"{', '.join(STACKS)}; meshtune (default) is meshtune's own workers.")]


@router.get(
    "/api/plan",
    response_model=PlanOut,
    summary="Analytical plan (instant, no device time)",
    responses={**{k: ERROR_RESPONSES[k] for k in (401, 403, 422)}, 429: {
        "model": ErrorOut, "description": "An anonymous client's planning budget is spent (new answers only; "
        "cached ones are free): wait Retry-After seconds, or send a bearer token."}},
)
def get_plan(
    request: Request,
    caller: ReaderDep,
    session: SessionDep,
    settings: SettingsDep,
    model: ModelName,
    cluster: ClusterName,
    nodes: Annotated[int | None, Query(ge=1, le=100_000, description="Override the preset's node count.")] = None,
    devices_per_node: DevicesPerNode = None,
    global_batch: GlobalBatch = None,
    global_batch_tokens: GlobalBatchTokens = None,
    critical_batch_tokens: CriticalBatchTokens = None,
    precision: Precision = "bf16",
    top: Annotated[int, Query(ge=1, le=MAX_TOP, description="How many of the fastest layouts to return.")] = 10,
    train_tokens: TrainTokens = None,
    price_per_device_hour: Price = None,
    stack: Stack = "meshtune",
) -> PlanOut:
    """Enumerate every valid layout of the model on the cluster, drop those predicted not to fit,
    and return the fastest predicted ones with their memory and time breakdowns (and, given
    train_tokens / price_per_device_hour, each one's time and cost to train the budget), predicted
    for the stack it is trained with (``stack``)."""
    problem = service.preset_problem(
        model=model, cluster=cluster, nodes=nodes, devices_per_node=devices_per_node, global_batch=global_batch,
        global_batch_tokens=global_batch_tokens, critical_batch_tokens=critical_batch_tokens, precision=precision,
        train_tokens=train_tokens, price_per_device_hour=price_per_device_hour, stack=stack)
    return PlanOut(**service.plan_answer(session, problem=problem, backend=settings.backend, top=top,
                                         charge=_charger(request, caller)))


@router.post(
    "/api/plan",
    response_model=PlanOut,
    summary="Analytical plan of a model given as a mapping (e.g. a Hugging Face config object)",
    responses={**{k: ERROR_RESPONSES[k] for k in (401, 403, 422)}, **BODY_RESPONSES, 429: {
        "model": ErrorOut, "description": "An anonymous client's planning budget is spent: wait Retry-After seconds."}},
)
def post_plan(request: Request, caller: ReaderDep, session: SessionDep, settings: SettingsDep,
              body: PlanRequest) -> PlanOut:
    """As ``GET /api/plan``, for a model, cluster and training given as mappings (the same rules as a
    sweep's: ``model: {"hf_config": {...}}`` takes the config object itself, never a path)."""
    problem = body.to_problem()
    service.check_devices(problem.cluster)
    return PlanOut(**service.plan_answer(session, problem=problem, backend=settings.backend,
                                         top=body.top, charge=_charger(request, caller)))


def _charger(request: Request, caller: Any) -> service.Charge:
    """What a new answer costs an anonymous caller: its planning budget is charged (429 with Retry-After
    when it is spent); a token holder is not charged."""
    def charge(cost: int) -> None:
        if caller.authenticated:
            return
        client = client_address(request)
        wait = request.app.state.plan_budget.charge(client, cost)
        if wait:
            raise HTTPException(429, headers={"Retry-After": str(math.ceil(wait))}, detail=(
                f"planning budget of anonymous client {client} is spent: this plan considers up to "
                f"{cost:,} candidate layouts; retry in {math.ceil(wait)} s, or send a bearer token"))

    return charge


@router.get(
    "/api/plan/sizes",
    response_model=PlanSizesOut,
    summary="How many devices: the best layout at each cluster size (analytical, no device time)",
    responses={**{k: ERROR_RESPONSES[k] for k in (401, 403, 422)}, 429: {
        "model": ErrorOut, "description": "An anonymous client's planning budget is spent: wait Retry-After seconds."}},
)
def get_plan_sizes(
    request: Request,
    caller: ReaderDep,
    session: SessionDep,
    settings: SettingsDep,
    model: ModelName,
    cluster: ClusterName,
    nodes: Annotated[str, Query(max_length=400, description="Node counts to compare, comma-separated: 4,8,16,32,64.")],
    devices_per_node: DevicesPerNode = None,
    global_batch: GlobalBatch = None,
    global_batch_tokens: GlobalBatchTokens = None,
    critical_batch_tokens: CriticalBatchTokens = None,
    precision: Precision = "bf16",
    scale_batch: Annotated[bool, Query(description="Grow the global batch with the devices from the first size's.")] = False,
    train_tokens: TrainTokens = None,
    price_per_device_hour: Price = None,
    stack: Stack = "meshtune",
) -> PlanSizesOut:
    """The best predicted layout at each node count, with tokens/s, MFU, useful tokens/s (critical
    batch), time to train the token budget and its cost, and the comparison as a plotly figure;
    modelled on the newest stored probe of the cluster's hardware at any node count (``figures``
    says which, and which links keep the datasheet's figures at which size)."""
    counts = check_node_counts(nodes, field="nodes")
    problem = service.preset_problem(
        model=model, cluster=cluster, nodes=counts[0], devices_per_node=devices_per_node, global_batch=global_batch,
        global_batch_tokens=global_batch_tokens, critical_batch_tokens=critical_batch_tokens, precision=precision,
        train_tokens=train_tokens, price_per_device_hour=price_per_device_hour, stack=stack)
    return PlanSizesOut(**service.sizes_answer(session, problem=problem, counts=counts, scale_batch=scale_batch,
                                               backend=settings.backend, charge=_charger(request, caller)))


DevicesResponses = {**{k: ERROR_RESPONSES[k] for k in (401, 403, 422)}, 429: {
    "model": ErrorOut, "description": "An anonymous client's planning budget is spent: wait Retry-After seconds."}}


@router.get("/api/plan/devices", response_model=PlanDevicesOut, responses=DevicesResponses,
            summary="Which device type: the best layout per (device type, cluster size), time and cost, compared")
def get_plan_devices(
    request: Request,
    caller: ReaderDep,
    session: SessionDep,
    settings: SettingsDep,
    model: ModelName,
    cluster: Annotated[str, Query(max_length=400, description="Cluster presets to compare, comma-separated: "
                                  "h100-sxm,h200,b200,mi300x.")],
    nodes: Annotated[str, Query(max_length=400, description="Node counts to compare, comma-separated: 8,16,32.")],
    global_batch: GlobalBatch = None,
    global_batch_tokens: GlobalBatchTokens = None,
    critical_batch_tokens: CriticalBatchTokens = None,
    precision: Precision = "bf16",
    scale_batch: Annotated[bool, Query(description="Grow the global batch with the devices from the first size's.")] = False,
    train_tokens: TrainTokens = None,
    price_per_device_hour: Annotated[str | None, Query(max_length=400, description="Price of one device-hour per "
                                     "device type, TYPE=PRICE,... (h100-sxm=2.5,b200=5.0), or one price for all.")] = None,
    stack: Stack = "meshtune",
) -> PlanDevicesOut:
    """Every device type at every node count: the best predicted layout, tokens/s, MFU, time to train
    the token budget and its total cost, the fastest and the cheapest marked, as a table and a plotly
    figure (analytical, no device time); each type modelled on the newest stored probe of its own
    hardware (``figures``: one line per type)."""
    counts = check_node_counts(nodes, field="nodes")
    clusters = cluster_types({"preset": cluster, "price_per_device_hour": price_per_device_hour}
                             if price_per_device_hour is not None else {"preset": cluster})
    m, t = service.preset_model_training(
        model=model, global_batch=global_batch, global_batch_tokens=global_batch_tokens,
        critical_batch_tokens=critical_batch_tokens, precision=precision, train_tokens=train_tokens, stack=stack)
    return PlanDevicesOut(**service.devices_answer(session, model=m, clusters=clusters, training=t, counts=counts,
                                                   scale_batch=scale_batch, backend=settings.backend,
                                                   charge=_charger(request, caller)))


@router.post("/api/plan/devices", response_model=PlanDevicesOut, responses={**DevicesResponses, **BODY_RESPONSES},
             summary="Which device type, for a problem given as mappings (cluster.preset as a list)")
def post_plan_devices(request: Request, caller: ReaderDep, session: SessionDep, settings: SettingsDep,
                      body: PlanDevicesRequest) -> PlanDevicesOut:
    """As ``GET /api/plan/devices``, for ``cluster: {"preset": [...], "price_per_device_hour": {type: price}}``
    (the section's other fields apply to every type) and a model and training given as mappings."""
    m, clusters, t = body.to_comparison()
    counts = check_node_counts(body.nodes, field="nodes") if body.nodes is not None else None
    return PlanDevicesOut(**service.devices_answer(session, model=m, clusters=clusters, training=t, counts=counts,
                                                   scale_batch=body.scale_batch, backend=settings.backend,
                                                   charge=_charger(request, caller)))
