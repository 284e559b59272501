"""GET /api/plan: the analytical answer (valid layouts that fit, fastest predicted first), no device time.

The tuner's plan is a pure function of frozen specs, so answers are memoised per (model, cluster,
training): the first call for a 64-GPU 70B problem enumerates ~10^4 layouts, repeats are instant.

What one request may cost is bounded before any planning starts: the candidate layouts are counted
from the divisors of the device count (tuner._plan.candidate_layouts) and a count above
``MAX_CANDIDATES`` is a 422 saying so. A new answer (a cache miss: any changed parameter, e.g. the
batch) for an anonymous caller is also charged to that client's budget of candidate layouts, which
refills at ``ClientBudget.rate`` per second; an empty budget is a 429 with Retry-After. Clients are
told apart by their address (api._http.client_address): behind a proxy named in
``MESHTUNE_TRUSTED_PROXIES`` the one it forwards for, behind any other proxy the proxy's.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Query, Request

from api._http import GuardedRoute, client_address
from api._lru import LRU
from api.deps import ReaderDep, SessionDep, SettingsDep
from api.probes import service as probes
from api.schemas import BODY_RESPONSES, ERROR_RESPONSES, ErrorOut, PlanDevicesOut, PlanOut, PlanSizesOut
from api.spec import PlanDevicesRequest, PlanRequest
from tuner import (
    DEFAULT_STACK,
    STACKS,
    ClusterSpec,
    ModelSpec,
    Problem,
    SpecError,
    TrainingSpec,
    check_node_counts,
    check_planning_work,
    cluster_spec,
    cluster_types,
    compare_devices,
    devices_figure,
    model_spec,
    plan,
    plan_sizes,
    sizes_figure,
    stack_of,
    to_dict,
    training_spec,
)

# GuardedRoute: POST /api/plan's body gets the rules every body gets (1 MiB, UTF-8, depth; auth first).
router = APIRouter(tags=["plan"], route_class=GuardedRoute)

MAX_TOP = 200
MAX_DEVICES = 65_536  # bounds the divisor enumeration (16,384 devices plan in ~0.5 s; see benchmarks/bench_plan.py)
# ~1-3 s of one core at most (65,536 devices: 3.7 x 10^5 candidates, ~1 s; 24,576: 8.6 x 10^5, ~0.4 s).
MAX_CANDIDATES = 1_000_000


class ClientBudget:
    """A token bucket of candidate layouts per client address: ``capacity`` at most (by default room
    for two of the largest plans allowed), refilled at ``rate`` per second (~6% of a core per client
    at ~3 us per candidate). ``clock`` is injectable so that a test can move time instead of waiting."""

    def __init__(self, *, capacity: int = 2 * MAX_CANDIDATES, rate: float = 20_000.0,
                 clock: Callable[[], float] = time.monotonic, max_clients: int = 10_000) -> None:
        self.capacity, self.rate, self.clock, self.max_clients = capacity, rate, clock, max_clients
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # client -> (tokens, at)
        self._lock = threading.Lock()

    def charge(self, client: str, cost: int) -> float:
        """Take ``cost`` from the client's bucket; 0.0 if it had enough, else the seconds to wait
        (nothing taken)."""
        now = self.clock()
        cost = min(cost, self.capacity)  # a plan dearer than a full bucket waits for a full bucket
        with self._lock:
            tokens, at = self._buckets.pop(client, (float(self.capacity), now))
            tokens = min(float(self.capacity), tokens + (now - at) * self.rate)
            wait = 0.0 if tokens >= cost else (cost - tokens) / self.rate
            self._buckets[client] = (tokens - cost if not wait else tokens, now)
            while len(self._buckets) > self.max_clients:  # the least recently seen client goes
                self._buckets.popitem(last=False)
        return wait


# Plans, size and device comparisons kept as (answer, seconds it took): a pure function of the problem.
_PLANS: LRU[tuple[Any, float]] = LRU(max_entries=32)
_SIZES: LRU[tuple[Any, float]] = LRU(max_entries=32)
_DEVICES: LRU[tuple[Any, float]] = LRU(max_entries=32)


def _timed(compute: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    return compute(), time.perf_counter() - started


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
    problem = _problem(model, cluster, nodes, devices_per_node, global_batch, global_batch_tokens,
                       critical_batch_tokens, precision, train_tokens, price_per_device_hour, stack)
    return _plan_answer(request, caller, session, settings.backend, problem, top=top)


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
    _check_devices(problem.cluster)
    return _plan_answer(request, caller, session, settings.backend, problem, top=body.top)


def _plan_answer(request: Request, caller: Any, session: Any, backend: str, problem: Problem, *,
                 top: int) -> PlanOut:
    """The cached plan of the problem on the cluster's stored probe where there is one (``backend``'s,
    as ``meshtune plan`` does), or a new one charged to an anonymous caller's budget first."""
    m, c, t = problem.model, problem.cluster, problem.training
    row, note = (None, "") if t.stack != DEFAULT_STACK else probes.stored_in(
        session, model=m, cluster=c, training=t, backend=backend)
    c, figures = probes.plan_figures(row=row, note=note, cluster=c, training=t)
    answer = _PLANS.get((m, c, t))
    if answer is None:
        _charge(request, caller, check_planning_work(model=m, cluster=c, limit=MAX_CANDIDATES, where="plan request",
                                                     remedy="plan it with `meshtune plan`, which has no such limit"))
        probed = dataclasses.replace(problem, cluster=c)
        answer = _PLANS.put((m, c, t), _timed(lambda: plan(problem=probed)))
    result, seconds = answer
    return PlanOut(**result.to_dict(top=top), seconds=round(seconds, 4), figures=figures)


def _problem(model: str, cluster: str, nodes: int | None, devices_per_node: int | None, global_batch: int | None,
             global_batch_tokens: int | None, critical_batch_tokens: int | None, precision: str,
             train_tokens: float | None, price_per_device_hour: float | None, stack: str = "meshtune",
             ) -> Problem:
    overrides = {k: v for k, v in (("nodes", nodes), ("devices_per_node", devices_per_node),
                                   ("price_per_device_hour", price_per_device_hour)) if v is not None}
    if "," in cluster:
        raise SpecError(f"cluster={cluster}: several device types are compared by /api/plan/devices")
    c = cluster_spec({"preset": cluster, **overrides})
    _check_devices(c)
    m, t = _model_training(model, global_batch, global_batch_tokens, critical_batch_tokens, precision, train_tokens,
                           stack)
    return Problem(model=m, cluster=c, training=t)


def _model_training(model: str, global_batch: int | None, global_batch_tokens: int | None,
                    critical_batch_tokens: int | None, precision: str, train_tokens: float | None,
                    stack: str) -> tuple[ModelSpec, TrainingSpec]:
    if (global_batch is None) == (global_batch_tokens is None):
        raise SpecError("global_batch: give exactly one of global_batch and global_batch_tokens")
    m = model_spec(model)
    training: dict[str, Any] = {"precision": precision, "stack": stack}
    if global_batch is not None:
        training["global_batch"] = global_batch
    else:
        training["global_batch_tokens"] = global_batch_tokens
    if critical_batch_tokens is not None:
        training["critical_batch_tokens"] = critical_batch_tokens
    if train_tokens is not None:
        training["train_tokens"] = train_tokens
    return m, training_spec(training, seq_len=m.seq_len)


def _check_devices(c: ClusterSpec) -> None:
    if c.devices > MAX_DEVICES:
        raise SpecError(
            f"cluster.nodes x cluster.devices_per_node = {c.devices} devices exceeds this endpoint's limit of "
            f"{MAX_DEVICES}; plan larger clusters with `meshtune plan`"
        )


def _charge(request: Request, caller: Any, cost: int) -> None:
    """Charge an anonymous caller's planning budget (429 with Retry-After when it is spent)."""
    if caller.authenticated:
        return
    client = client_address(request)
    wait = request.app.state.plan_budget.charge(client, cost)
    if wait:
        raise HTTPException(429, headers={"Retry-After": str(math.ceil(wait))}, detail=(
            f"planning budget of anonymous client {client} is spent: this plan considers up to "
            f"{cost:,} candidate layouts; retry in {math.ceil(wait)} s, or send a bearer token"))


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
    batch), time to train the token budget and its cost, and the comparison as a plotly figure."""
    counts = check_node_counts(nodes, field="nodes")
    problem = _problem(model, cluster, counts[0], devices_per_node, global_batch, global_batch_tokens,
                       critical_batch_tokens, precision, train_tokens, price_per_device_hour, stack)
    m, c, t = problem.model, problem.cluster, problem.training
    sizes = [cluster_spec({**to_dict(c), "nodes": n}) for n in counts]
    answer = _bounded(_SIZES, (m, c, t, counts, scale_batch), request, caller, m, sizes,
                      lambda: plan_sizes(problem=problem, nodes=counts, scale_batch=scale_batch))
    points, seconds = answer
    title = f"{m.name} on {c.name}: best predicted layout per cluster size"
    return PlanSizesOut(model=to_dict(m), cluster=to_dict(c), training=to_dict(t), scale_batch=scale_batch,
                        sizes=[p.to_dict() for p in points], figure=sizes_figure(points, title=title),
                        seconds=round(seconds, 4))


DevicesResponses = {**{k: ERROR_RESPONSES[k] for k in (401, 403, 422)}, 429: {
    "model": ErrorOut, "description": "An anonymous client's planning budget is spent: wait Retry-After seconds."}}


@router.get("/api/plan/devices", response_model=PlanDevicesOut, responses=DevicesResponses,
            summary="Which device type: the best layout per (device type, cluster size), time and cost, compared")
def get_plan_devices(
    request: Request,
    caller: ReaderDep,
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
    figure (analytical, no device time)."""
    counts = check_node_counts(nodes, field="nodes")
    clusters = cluster_types({"preset": cluster, "price_per_device_hour": price_per_device_hour}
                             if price_per_device_hour is not None else {"preset": cluster})
    m, t = _model_training(model, global_batch, global_batch_tokens, critical_batch_tokens, precision, train_tokens,
                           stack)
    return _devices_answer(request, caller, m, clusters, t, counts, scale_batch)


@router.post("/api/plan/devices", response_model=PlanDevicesOut, responses={**DevicesResponses, **BODY_RESPONSES},
             summary="Which device type, for a problem given as mappings (cluster.preset as a list)")
def post_plan_devices(request: Request, caller: ReaderDep, body: PlanDevicesRequest) -> PlanDevicesOut:
    """As ``GET /api/plan/devices``, for ``cluster: {"preset": [...], "price_per_device_hour": {type: price}}``
    (the section's other fields apply to every type) and a model and training given as mappings."""
    m, clusters, t = body.to_problem()
    counts = check_node_counts(body.nodes, field="nodes") if body.nodes is not None else None
    return _devices_answer(request, caller, m, clusters, t, counts, body.scale_batch)


def _devices_answer(request: Request, caller: Any, m: ModelSpec, clusters: list[ClusterSpec], t: TrainingSpec,
                    counts: tuple[int, ...] | None, scale_batch: bool) -> PlanDevicesOut:
    """The cached comparison, or a new one bounded and charged as /api/plan/sizes is."""
    sizes = [cluster_spec({**to_dict(c), "nodes": n}) for c in clusters for n in (counts or (c.nodes,))]
    answer = _bounded(_DEVICES, (m, tuple(clusters), t, counts, scale_batch), request, caller, m, sizes,
                      lambda: compare_devices(model=m, clusters=clusters, training=t, nodes=counts,
                                              scale_batch=scale_batch))
    points, seconds = answer
    title = f"{m.name}: best predicted layout per device type and size (stack {t.stack})"
    return PlanDevicesOut(model=to_dict(m), clusters=[to_dict(c) for c in clusters], training=to_dict(t),
                          stack=stack_of(t).to_dict(), scale_batch=scale_batch, devices=[p.to_dict() for p in points],
                          figure=devices_figure(points, title=title), seconds=round(seconds, 4))


def _bounded(cache: LRU[tuple[Any, float]], key: tuple[Any, ...], request: Request,
             caller: Any, m: ModelSpec, sizes: list[ClusterSpec], compute: Callable[[], Any]) -> tuple[Any, float]:
    """``compute()`` (and the seconds it took), cached under ``key``; a new answer is first bounded per
    cluster size (devices, candidate layouts) and charged to an anonymous caller's budget."""
    answer = cache.get(key)
    if answer is not None:
        return answer
    cost = 0
    for size in sizes:
        _check_devices(size)
        cost += check_planning_work(model=m, cluster=size, limit=MAX_CANDIDATES, where="plan request",
                                    remedy="plan it with `meshtune plan`, which has no such limit")
    _charge(request, caller, cost)
    return cache.put(key, _timed(compute))
