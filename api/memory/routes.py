"""/api/sweeps/{id}/trials/{trial_id}/memory: a trial's memory timeline per rank and the predicted parts."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import Field

from api._http import GuardedRoute
from api.deps import ReaderDep, SessionDep, SweepId, TrialId
from api.memory import service
from api.schemas import ERROR_RESPONSES, NOT_FOUND, ResponseModel

router = APIRouter(prefix="/api/sweeps", tags=["memory"], route_class=GuardedRoute)


class TrialMemoryOut(ResponseModel):
    sweep_id: int = Field(description="The sweep.")
    trial_id: int = Field(description="The trial attempt's row id.")
    number: int = Field(description="Its trial number.")
    layout_key: str = Field(description="Its layout.")
    memory_measure: str | None = Field(description="What the peak measures: cpu.VmHWM or cuda.max_memory_allocated.")
    peak_memory_bytes: int | None = Field(description="The trial's reported peak, bytes (max over ranks).")
    predicted_memory_bytes: int | None = Field(description="The prediction stored with the trial (costliest rank, "
                                               "calibrated when the sweep had a fit).")
    timeline_max_bytes: int | None = Field(description="The timelines' maximum: equals peak_memory_bytes.")
    ranks: list[dict[str, Any]] = Field(description="Per rank (rank order): rank, pp_stage, step (the recorded step, "
                                        "warm-up included), series (cpu.VmRSS sampled, or cuda.memory_allocated from "
                                        "the allocator's history), t_ms and bytes (a few hundred points), phases "
                                        "([t_ms, phase, stage, micro_batch]), before_bytes / step_peak_bytes / "
                                        "after_bytes (high-water marks before, during and after the step), "
                                        "peak_bytes, and peak (where, phase, stage, micro_batch, t_ms).")
    predicted: list[dict[str, Any]] = Field(description="The memory model's parts per pp rank (stage): params, "
                                            "grads, optimizer, buffers, activations (per_micro_batch x in_flight), "
                                            "working, logits, constants, overhead, total; bytes, uncalibrated.")


@router.get("/{sweep_id}/trials/{trial_id}/memory", response_model=TrialMemoryOut, summary="A trial's memory",
            responses={**{k: ERROR_RESPONSES[k] for k in (401, 403, 422)}, **NOT_FOUND})
def trial_memory(sweep_id: SweepId, trial_id: TrialId, session: SessionDep, _: ReaderDep) -> TrialMemoryOut:
    """Each rank's memory over one measured step (the trial's last), its phases and where its peak
    falls, beside the memory model's predicted parts for its pipeline rank."""
    return TrialMemoryOut.model_validate(service.trial_memory(session, sweep_id=sweep_id, trial_id=trial_id))
