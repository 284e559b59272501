"""Request and response bodies of the reshard-check routes."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api.reshard import service
from api.spec import RequestModel


class ReshardCheckIn(RequestModel):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"from_layout": {"tp": 2, "dp": 2}, "to_layout": {"dp": 4, "zero": 3}, "steps_before": 2, "steps_after": 2}
    ]})

    from_layout: dict[str, Any] = Field(description="Layout A (tuner.Layout fields: tp, pp, dp, cp, ep, zero, mbs, ac, sp, schedule, vpp); the run is trained and saved under it.")
    to_layout: dict[str, Any] = Field(description="Layout B: the checkpoint is loaded under it and training continues.")
    steps_before: int = Field(2, ge=1, le=service.MAX_STEPS, description="Steps trained under A before the save.")
    steps_after: int = Field(2, ge=1, le=service.MAX_STEPS, description="Steps trained after the save, by A uninterrupted and by B after the load.")
    corrupt: Literal["swap-layers"] | None = Field(None, description="Self-test of the check: deliberately load wrongly (swap two layers' tensors); the verdict must be 'corrupted'.")


class MismatchOut(BaseModel):
    key: str = Field(description="'model/<fqn>' or 'optim/<fqn>/<state>', FQNs of the unsplit model.")
    max_abs_diff: float | None = Field(description="Largest absolute difference (null: shape/dtype differ or missing).")
    detail: str = Field(description="What differs.")


class ReshardCheckOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int = Field(description="Check id.")
    sweep_id: int = Field(description="The sweep whose model, cluster and training were used.")
    owner: str | None = Field(description="Token name that requested the check.")
    verdict: Literal["ok", "corrupted", "diverged", "failed"] = Field(description="ok: bit-identical state after the load and continued losses within tolerance; corrupted: some tensor differs or is missing; diverged: state identical but losses outside tolerance; failed: the run itself failed (see error).")
    from_layout: dict[str, Any] = Field(description="Layout A.")
    to_layout: dict[str, Any] = Field(description="Layout B.")
    from_key: str = Field(description="Layout A's key.")
    to_key: str = Field(description="Layout B's key.")
    steps_before: int = Field(description="Steps under A before the save.")
    steps_after: int = Field(description="Steps compared after the save.")
    tensors_checked: int = Field(description="Parameters and optimizer tensors compared, gathered to full.")
    mismatch_count: int = Field(description="Tensors not bit-identical (or missing) after the load.")
    mismatches: list[MismatchOut] = Field(description="The mismatching tensors (at most 200 listed).")
    max_abs_diff: float | None = Field(description="Largest absolute difference over every compared tensor (0.0: bit-identical).")
    losses_before: list[float | None] = Field(description="A's losses before the save.")
    losses_a: list[float | None] = Field(description="A's losses after the save, uninterrupted.")
    losses_b: list[float | None] = Field(description="B's losses after the load, same steps and batches.")
    max_rel_loss_diff: float | None = Field(description="max |B - A| / |A| over the continued steps.")
    tolerance: float = Field(description="Relative tolerance on each continued loss (the workers' numerics tolerance).")
    corrupt: str | None = Field(description="The deliberate corruption injected, if any.")
    backend: str = Field(description="Where it ran (ray).")
    error: str | None = Field(description="Why the run failed, when verdict is 'failed'.")
    save_s: float | None = Field(description="Seconds to save the DCP checkpoint (rank 0).")
    load_s: float | None = Field(description="Seconds to load and apply it under B (rank 0).")
    wall_s: float | None = Field(description="Seconds for the whole check, launch included.")
    created_at: datetime = Field(description="When the check finished (UTC).")
