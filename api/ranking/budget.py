"""What a sweep's layouts would cost to train with, and what its search spent.

A ranked layout's time and cost to train ``training.train_tokens`` come from its median *measured*
tokens/s per device times the sweep's devices, at ``cluster.price_per_device_hour``; on the
simulate backend they are marked simulated like the throughput they come from. The search's spend
is the sweep's recorded device-seconds (wall time x devices held, every trial).
"""

from __future__ import annotations

import json
from typing import Any

from api._lru import LRU
from api.spec import SweepSpec
from tuner import ClusterSpec, TrainingSpec, training_budget

_PROBLEMS: LRU[tuple[ClusterSpec, TrainingSpec] | None] = LRU(max_entries=256)


def problem(sweep: Any) -> tuple[ClusterSpec, TrainingSpec] | None:
    """The sweep's cluster and training specs (None for a stored spec this version cannot read).
    A pure function of the spec's model, cluster and training sections, memoised on their text:
    the sweeps list ranks every sweep it shows, and validating a spec costs milliseconds."""
    spec = sweep.spec or {}
    key = json.dumps([spec.get("model"), spec.get("cluster"), spec.get("training")], sort_keys=True, default=str)
    return _PROBLEMS.get_or_build(key, lambda: _problem_of(spec))


def _problem_of(spec: dict[str, Any]) -> tuple[ClusterSpec, TrainingSpec] | None:
    try:
        problem = SweepSpec.model_validate(spec).to_problem()
        cluster, training = problem.cluster, problem.training
    except ValueError:
        return None
    return cluster, training


def row_budget(tokens_per_s_per_device: float | None, *, cluster: ClusterSpec, training: TrainingSpec,
               simulated: bool) -> dict[str, Any] | None:
    """``tuner.TrainingBudget`` of one ranked layout as a dict, plus whether it is simulated."""
    if not tokens_per_s_per_device:
        return None
    b = training_budget(tokens_per_s_per_device * cluster.devices, devices=cluster.devices,
                        train_tokens=training.train_tokens, price_per_device_hour=cluster.price_per_device_hour)
    return {**b.to_dict(), "simulated": simulated}


def attach(sweep: Any, rows: list[Any]) -> dict[str, Any] | None:
    """Set each ranking row's ``budget``; return the sweep's budget summary (None if unreadable)."""
    prob = problem(sweep)
    if prob is None:
        return None
    cluster, training = prob
    for r in rows:
        r.budget = row_budget(r.tokens_per_s_per_device, cluster=cluster, training=training, simulated=r.simulated)
    return search_spend(sweep, cluster=cluster, training=training)


def search_spend(sweep: Any, *, cluster: ClusterSpec, training: TrainingSpec) -> dict[str, Any]:
    seconds = float(sweep.device_seconds or 0.0)
    price = cluster.price_per_device_hour
    return {
        "train_tokens": training.train_tokens, "price_per_device_hour": price, "devices": cluster.devices,
        "search_device_seconds": seconds, "search_device_hours": seconds / 3600,
        "search_cost": None if price is None else seconds / 3600 * price,
        "simulated": sweep.backend == "simulate",
    }
