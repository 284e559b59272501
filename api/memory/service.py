"""A trial's memory as the trial page and GET /api/sweeps/{id}/trials/{trial_id}/memory show it: every
rank's stored timeline (workers/_memory_timeline.py) with its pipeline rank's predicted parts
(tuner/_memory_parts.py, the analytical prior), and the trial's reported peak, which is the
timelines' maximum (checked by tests/workers/test_memory_timeline.py on a real trial)."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from api import store
from api.spec import SweepSpec
from api.sweeps import service as sweeps
from tuner import Layout, memory_parts
from workers import timeline_max


def predicted_parts(spec: dict[str, Any] | None, layout: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The memory model's parts for each pp rank of ``layout`` under the sweep's problem (None when the
    stored spec no longer reads, or the layout is not one of it)."""
    try:
        problem = SweepSpec.model_validate(spec).to_problem()
        model, cluster, training = problem.model, problem.cluster, problem.training
        return memory_parts(Layout(**layout), model=model, cluster=cluster, training=training)
    except (ValueError, TypeError):
        return None


def trial_memory(session: Session, *, sweep_id: int, trial_id: int) -> dict[str, Any]:
    """The trial's timelines (an empty list when none was recorded: simulated, failed, or older), the
    predicted parts per pp rank, the stored peak and prediction."""
    sweep = sweeps.get_sweep(session, sweep_id=sweep_id)
    trial = sweeps.get_trial(session, sweep_id=sweep_id, trial_id=trial_id)
    ranks = store.trial_timeline(session, trial_id=trial.id) or []
    return {
        "sweep_id": sweep.id, "trial_id": trial.id, "number": trial.number, "layout_key": trial.layout_key,
        "memory_measure": trial.memory_measure, "peak_memory_bytes": trial.peak_memory_bytes,
        "predicted_memory_bytes": trial.predicted_memory_bytes,
        "timeline_max_bytes": max((timeline_max(r) for r in ranks), default=None),
        "ranks": ranks, "predicted": predicted_parts(sweep.spec, trial.layout) or [],
    }
