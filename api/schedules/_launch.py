"""What a fire runs: the sweeps it creates, claimed and created in one transaction.

``fire_schedule`` inserts the fire row (ON CONFLICT DO NOTHING) and, only when that insert took
effect, the fire's sweeps as "queued" in the same transaction, so there is never a claimed fire
without its sweeps nor a sweep without its fire. A re-measurement becomes one sweep listing the
layouts with ``search.repeats``.

The sweeps are created by the sweeps service in the fire's transaction: docs/api.md#launching-a-fire.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from api import store
from api.ranking import service as rankings
from api.schedules import _store
from api.schedules.models import Schedule
from api.spec import SearchSettings, SweepSpec
from api.sweeps import service as svc
from tuner import Layout, NotFoundError, SpecError


def pinned_space(layout: Layout) -> dict[str, Any]:
    """A search space (SweepSpec.space) holding ``layout`` and no other layout (for templates that
    pin one layout; re-measurements list their layouts with ``search.layouts`` instead)."""
    space: dict[str, Any] = {
        "tp": [layout.tp], "pp": [layout.pp], "cp": [layout.cp], "ep": [layout.ep], "zero": [layout.zero],
        "mbs": [layout.mbs], "ac": [layout.ac], "sp": [layout.sp], "schedules": [layout.schedule],
    }
    if layout.schedule == "interleaved":
        space["vpp"] = [layout.vpp]
    return space


def remeasure_spec(source: SweepSpec, layouts: list[Layout], *, repeats: int, name: str) -> SweepSpec:
    """``source``'s problem, run as ``repeats`` measurements of each of ``layouts`` and nothing else."""
    data = source.model_dump(mode="json")
    data.update(
        name=name[:200],
        space={},
        search=SearchSettings(
            sampler=source.search.sampler, warm_start_top_k=0, reference_layouts=[], repeats=repeats,
            seed=source.search.seed, layouts=[dataclasses.asdict(layout) for layout in layouts],
        ).model_dump(mode="json"),
    )
    return SweepSpec.model_validate(data)


def top_layouts(session: Session, *, sweep_id: int, k: int) -> list[Layout]:
    """The k best measured layouts of a sweep (the engine's ranking order)."""
    rows = rankings.ranking(session, sweep_id=sweep_id).rows[:k]
    return [Layout(**row.layout) for row in rows]


def fire_specs(session: Session, *, schedule: Schedule, fire_time: datetime) -> list[SweepSpec]:
    """The sweeps a fire of ``schedule`` runs (raises SpecError/NotFoundError when it cannot run)."""
    stamp = fire_time.strftime("%Y-%m-%d %H:%M:%S")
    if schedule.kind == "template":
        return [SweepSpec.model_validate({**(schedule.template or {}), "name": f"{schedule.name} @ {stamp}"[:200]})]
    assert schedule.kind == "remeasure", schedule.kind
    if schedule.source_sweep_id is None:
        raise NotFoundError("source_sweep_id: the sweep to re-measure was deleted")
    source = store.get_sweep(session, sweep_id=schedule.source_sweep_id)
    if source is None:
        raise NotFoundError(f"source_sweep_id={schedule.source_sweep_id}: sweep does not exist")
    layouts = top_layouts(session, sweep_id=source.id, k=int(schedule.top_k or 1))
    if not layouts:
        raise SpecError(f"source_sweep_id={source.id}: sweep {source.id} has no measured layout to re-measure")
    base = SweepSpec.model_validate(source.spec)
    return [remeasure_spec(base, layouts, repeats=schedule.repeats, name=f"{schedule.name} @ {stamp}")]


def fire_schedule(
    session: Session, *, schedule: Schedule, fire_time: datetime, claimed_by: str, trigger: str = "cron"
) -> int | None:
    """Claim ``fire_time`` of ``schedule`` and create its sweeps, in the caller's transaction (the
    caller commits). Returns the fire id if this call claimed it, None if another replica had.

    A fire that cannot be launched (template no longer valid, source sweep gone or unmeasured) is
    recorded as failed with its reason and a failure alert; it is not retried.
    """
    fire_id = _store.insert_fire(
        session, schedule_id=schedule.id, fire_time=fire_time, status="running", claimed_by=claimed_by,
        trigger=trigger,
    )
    if fire_id is None:
        return None
    try:
        specs = fire_specs(session, schedule=schedule, fire_time=fire_time)
        for spec in specs:  # the sweeps service's own checks (a sweep it learns from may be gone since)
            svc.check_submission(session, spec=spec, owner=f"schedule:{schedule.id}",
                                 priority=schedule.priority or "normal")
    except (SpecError, NotFoundError, ValueError) as exc:
        reason = f"cannot launch: {exc}"
        _store.finish_fire(session, fire_id=fire_id, status="failed", error=reason)
        _store.insert_alert(
            session, fire_id=fire_id, schedule_id=schedule.id, kind="failure", layout_key=None,
            message=f"schedule {schedule.name!r}: fire at {fire_time.isoformat()} {reason}",
            detail={"error": reason}, deliver=bool(schedule.webhook_url),
        )
        return fire_id
    sweep_ids = [svc.create_sweep(session, spec=spec, owner=f"schedule:{schedule.id}",
                                  priority=schedule.priority or "normal", commit=False).id for spec in specs]
    _store.set_fire_sweeps(session, fire_id=fire_id, sweep_ids=sweep_ids)
    return fire_id
