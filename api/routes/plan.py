"""GET /api/plan: the analytical answer (valid layouts that fit, fastest predicted first), no device time.

The tuner's plan is a pure function of frozen specs, so answers are memoised per (model, cluster,
training): the first call for a 64-GPU 70B problem enumerates ~10^4 layouts, repeats are instant.
"""

from __future__ import annotations

import time
from functools import lru_cache
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query

from api.deps import ReaderDep
from api.schemas import ERROR_RESPONSES, PlanOut
from tuner import (
    ClusterSpec,
    ModelSpec,
    SpecError,
    TrainingSpec,
    cluster_spec,
    model_spec,
    plan,
    training_spec,
)

router = APIRouter(tags=["plan"])

MAX_TOP = 200
MAX_DEVICES = 65_536  # bounds the divisor enumeration (16,384 devices plan in ~0.5 s; see benchmarks/bench_plan.py)


@lru_cache(maxsize=32)
def _plan(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec) -> tuple[Any, float]:
    started = time.perf_counter()
    result = plan(model=model, cluster=cluster, training=training)
    return result, time.perf_counter() - started


@router.get(
    "/api/plan",
    response_model=PlanOut,
    summary="Analytical plan (instant, no device time)",
    responses={k: ERROR_RESPONSES[k] for k in (401, 403, 422)},
)
def get_plan(
    _: ReaderDep,
    model: Annotated[str, Query(max_length=100, description="Model preset name (see /api/presets).")],
    cluster: Annotated[str, Query(max_length=100, description="Cluster preset name (see /api/presets).")],
    nodes: Annotated[int | None, Query(ge=1, le=100_000, description="Override the preset's node count.")] = None,
    devices_per_node: Annotated[
        int | None, Query(ge=1, le=1024, description="Override the preset's devices per node.")
    ] = None,
    global_batch: Annotated[int | None, Query(ge=1, le=2**31 - 1, description="Sequences per optimiser step.")] = None,
    global_batch_tokens: Annotated[
        int | None, Query(ge=1, le=2**40, description="Tokens per step (a multiple of the model's seq_len).")
    ] = None,
    critical_batch_tokens: Annotated[
        int | None, Query(ge=1, le=2**40, description="Critical batch in tokens (beyond it throughput is discounted).")
    ] = None,
    precision: Annotated[Literal["bf16", "fp32"], Query(description="Training precision.")] = "bf16",
    top: Annotated[int, Query(ge=1, le=MAX_TOP, description="How many of the fastest layouts to return.")] = 10,
) -> PlanOut:
    """Enumerate every valid layout of the model on the cluster, drop those predicted not to fit,
    and return the fastest predicted ones with their memory and time breakdowns."""
    if (global_batch is None) == (global_batch_tokens is None):
        raise SpecError("give exactly one of global_batch and global_batch_tokens")
    m = model_spec(model)
    overrides = {k: v for k, v in (("nodes", nodes), ("devices_per_node", devices_per_node)) if v is not None}
    c = cluster_spec({"preset": cluster, **overrides})
    if c.devices > MAX_DEVICES:
        raise SpecError(
            f"cluster.nodes x cluster.devices_per_node = {c.devices} devices exceeds this endpoint's limit of "
            f"{MAX_DEVICES}; plan larger clusters with `meshtune plan`"
        )
    training: dict[str, Any] = {"precision": precision}
    if global_batch is not None:
        training["global_batch"] = global_batch
    else:
        training["global_batch_tokens"] = global_batch_tokens
    if critical_batch_tokens is not None:
        training["critical_batch_tokens"] = critical_batch_tokens
    t = training_spec(training, seq_len=m.seq_len)
    result, seconds = _plan(m, c, t)
    return PlanOut(**result.to_dict(top=top), seconds=round(seconds, 4))
