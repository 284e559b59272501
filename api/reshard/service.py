"""Reshard checks of a sweep: validate the two layouts against the sweep's problem, run the check on
the trials' backend (Ray, workers/reshard_launch.py), store the verdict and its numbers with the sweep.

Keyword-only, the session passed in, each write committed here. Unknown sweeps raise NotFoundError,
bad layouts LayoutError/SpecError naming the field ("from_layout.tp=3 ...", "to_layout: ..."), both
before any process starts. A check whose ranks fail is stored with verdict "failed", not raised.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from api import store
from api.reshard.models import ReshardCheck
from api.spec import SweepSpec
from tuner import Layout, LayoutError, NotFoundError, SpecError
from workers.reshard import ReshardJob, ReshardReport

Runner = Callable[[ReshardJob], ReshardReport]
MAX_STEPS = 1000
LAYOUT_FIELDS = tuple(Layout.__dataclass_fields__)


def parse_layout(name: str, data: Any) -> Layout:
    """A Layout from a mapping; errors name ``<name>.<field>`` and the value."""
    if not isinstance(data, dict) or not data:
        raise SpecError(f"{name} must be a non-empty object of layout fields ({', '.join(LAYOUT_FIELDS)}), got {data!r}")
    unknown = sorted(set(data) - set(LAYOUT_FIELDS))
    if unknown:
        raise SpecError(f"{name}.{unknown[0]} is not a layout field (known: {', '.join(LAYOUT_FIELDS)})")
    try:
        return Layout(**data)
    except (SpecError, TypeError, ValueError) as exc:
        message = str(exc)
        field = next((f for f in LAYOUT_FIELDS if message.startswith(f)), None)
        raise LayoutError(f"{name}.{message}" if field else f"{name}: {message}") from None


def _steps(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_STEPS:
        raise SpecError(f"{name}={value!r} must be an integer from 1 to {MAX_STEPS}")
    return value


def build_job(sweep_spec: dict[str, Any], *, from_layout: Any, to_layout: Any, steps_before: int,
              steps_after: int, corrupt: str | None = None, checkpoint_dir: str = "<temporary>") -> ReshardJob:
    """The check for a sweep's problem (model, cluster, training), validated (raises before any run)."""
    problem = SweepSpec.model_validate(sweep_spec).to_problem()
    model, cluster, training = problem.model, problem.cluster, problem.training
    job = ReshardJob(
        model=model, cluster=cluster, training=training,
        from_layout=parse_layout("from_layout", from_layout), to_layout=parse_layout("to_layout", to_layout),
        checkpoint_dir=checkpoint_dir, steps_before=_steps("steps_before", steps_before),
        steps_after=_steps("steps_after", steps_after), corrupt=corrupt,
    )
    job.validate()
    return job


def refusal(sweep: Any) -> str | None:
    """Why a migration check of ``sweep`` must not start, or None; decided without starting anything.

    A check trains the sweep's model for real, one rank per device of its cluster. On a sweep of the
    simulate backend nothing ever ran there (a simulated 70B sweep on 64 H100 would start a real
    64-rank job from one click); and a world size beyond the Ray cluster's devices cannot run. Ray's
    size is known only once Ray is up in this process (it is never started to answer this): before
    that the Ray backend's own check refuses such a job, naming the numbers, before any rank starts."""
    try:
        problem = SweepSpec.model_validate(sweep.spec).to_problem()
        model, cluster = problem.model, problem.cluster
    except ValueError:
        return None  # build_job reports the spec's own error
    where = f"{model.name} on {cluster.devices} ranks of {cluster.name}"
    if sweep.backend == "simulate":
        return (f"the sweep is simulated (backend=simulate), so none of its layouts ran; a migration check "
                f"would train {where} for real. Check a sweep measured on a real backend")
    resource, capacity = _ray_capacity(cluster)
    if capacity is not None and cluster.devices > capacity:
        return f"a migration check runs {where}, but the Ray cluster has {capacity:g} {resource}"
    return None


def _ray_capacity(cluster: Any) -> tuple[str, float | None]:
    import sys

    resource = "GPU" if cluster.device_kind == "cuda" else "CPU"
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return resource, None
    return resource, float(ray.cluster_resources().get(resource, 0))


def default_runner(job: ReshardJob) -> ReshardReport:
    """Ray (the trials' backend: ``RAY_ADDRESS`` or a local Ray), checkpoint in a temporary directory."""
    from workers.ray_backend import RayBackend
    from workers.reshard_launch import run_with_temp_checkpoint

    return run_with_temp_checkpoint(job, backend=RayBackend())


def _finite(x: float | None) -> float | None:
    return x if x is None or math.isfinite(x) else None  # JSON (and PostgreSQL json) have no NaN/inf


def record_check(session: Session, *, sweep_id: int, report: ReshardReport, owner: str | None) -> ReshardCheck:
    row = ReshardCheck(
        sweep_id=sweep_id, owner=owner, from_layout=report.from_layout, to_layout=report.to_layout,
        from_key=Layout(**report.from_layout).key, to_key=Layout(**report.to_layout).key,
        steps_before=report.steps_before, steps_after=report.steps_after, verdict=report.verdict,
        tensors_checked=report.tensors_checked, mismatch_count=report.mismatch_count,
        mismatches=[{**asdict(m), "max_abs_diff": _finite(m.max_abs_diff)} for m in report.mismatches],
        max_abs_diff=_finite(report.max_abs_diff),
        losses_before=[_finite(x) for x in report.losses_before],
        losses_a=[_finite(x) for x in report.losses_a], losses_b=[_finite(x) for x in report.losses_b],
        max_rel_loss_diff=_finite(report.max_rel_loss_diff), tolerance=report.tolerance, corrupt=report.corrupt,
        backend=report.backend, error=report.error, save_s=report.save_s, load_s=report.load_s,
        wall_s=report.wall_s,
    )
    session.add(row)
    session.commit()
    session.refresh(row)
    return row


def run_check(
    session: Session,
    *,
    sweep_id: int,
    from_layout: Any,
    to_layout: Any,
    steps_before: int = 2,
    steps_after: int = 2,
    owner: str | None = None,
    corrupt: str | None = None,
    runner: Runner | None = None,
) -> ReshardCheck:
    """Validate, run (blocking: a few real steps of both layouts) and store one check."""
    sweep = store.get_sweep(session, sweep_id=sweep_id)
    if sweep is None:
        raise NotFoundError(f"sweep {sweep_id} does not exist")
    job = build_job(sweep.spec, from_layout=from_layout, to_layout=to_layout, steps_before=steps_before,
                    steps_after=steps_after, corrupt=corrupt)
    refused = refusal(sweep)
    if refused:
        raise SpecError(f"sweep_id={sweep_id}: {refused}")
    session.rollback()  # hold no transaction (nor an SQLite lock) during the run
    report = (runner or default_runner)(job)
    return record_check(session, sweep_id=sweep_id, report=report, owner=owner)


def list_checks(session: Session, *, sweep_id: int) -> list[ReshardCheck]:
    if store.get_sweep(session, sweep_id=sweep_id) is None:
        raise NotFoundError(f"sweep {sweep_id} does not exist")
    query = select(ReshardCheck).where(ReshardCheck.sweep_id == sweep_id).order_by(ReshardCheck.id)
    return list(session.scalars(query))
