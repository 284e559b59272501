"""Verified checkpoint resharding: train under layout A, save with DCP, load under layout B, continue.

The check's values: ``ReshardJob`` (two layouts, steps before and after the save, an optional
deliberate ``corrupt``ion), each rank's ``RankOutcome`` and the merged ``ReshardReport`` whose
verdict is "corrupted" (a tensor differs or is missing), "diverged" (a continued loss beyond the
workers' numerics tolerance), "ok", or "failed". Light: the coordinator imports it without torch.
The rank program is workers/reshard_rank.py, its torch side workers/_reshard_state.py, the launch
workers/reshard_launch.py. The two phases and the corruptions: docs/workers.md, "Reshard check".
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from tuner import ClusterSpec, Layout, LayoutError, ModelSpec, SpecError, TrainingSpec, check_layout
from workers._contract import TrialRequest

# The workers' numerics tolerances (tests/workers/test_workers_numerics.py RTOL / BF16_RTOL, same values,
# checked by tests/api/reshard/test_reshard.py): fp32 reduction-order noise, and one bf16 rounding step.
LOSS_RTOL = 1e-5
BF16_LOSS_RTOL = 2e-3
CORRUPTIONS = ("swap-layers", "permute-shards")
Verdict = Literal["ok", "corrupted", "diverged", "failed"]
VERDICTS: tuple[str, ...] = ("ok", "corrupted", "diverged", "failed")
MAX_LISTED_MISMATCHES = 200  # the report lists at most this many tensors (the count is exact)


@dataclass(frozen=True)
class ReshardJob:
    """One check: ``from_layout`` for ``steps_before`` steps, save, load under ``to_layout``,
    ``steps_after`` more steps. ``checkpoint_dir`` must be visible to every rank (shared storage on
    a multi-node cluster) and is written under ``<checkpoint_dir>/dcp`` and ``/full``."""

    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    from_layout: Layout
    to_layout: Layout
    checkpoint_dir: str
    steps_before: int = 2
    steps_after: int = 2
    corrupt: str | None = None
    step_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("steps_before", "steps_after"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecError(f"{name} must be a positive integer, got {value!r}")
        if self.corrupt is not None and self.corrupt not in CORRUPTIONS:
            raise SpecError(f"corrupt must be one of {CORRUPTIONS} or None, got {self.corrupt!r}")
        if not self.checkpoint_dir:
            raise SpecError("checkpoint_dir must be a directory path")

    def validate(self) -> None:
        """Raise LayoutError naming the field for a layout this check cannot run (before any process)."""
        for name in ("from_layout", "to_layout"):
            layout = getattr(self, name)
            try:
                check_layout(layout, model=self.model, cluster=self.cluster, training=self.training)
            except LayoutError as exc:
                raise LayoutError(f"{name}: {exc}") from None
            if layout.ep > 1:
                raise LayoutError(f"{name}.ep={layout.ep}: expert-parallel weights are local slices, not "
                                  "DTensors, so DCP cannot reshard them; reshard-check needs ep=1")
        to = self.to_layout
        if self.corrupt == "permute-shards" and to.tp == 1 and not (to.zero > 0 and to.dp * to.cp > 1):
            raise LayoutError(f"to_layout={to.key} shards no tensor (tp=1, no ZeRO over dp*cp>1), so "
                              "corrupt='permute-shards' would change nothing; use a sharded to_layout")
        if self.model.tied_embeddings and self.from_layout.pp != self.to_layout.pp and 1 in (
            self.from_layout.pp, self.to_layout.pp
        ):
            raise LayoutError(f"to_layout.pp={self.to_layout.pp} with from_layout.pp={self.from_layout.pp}: a "
                              "tied-embedding model trains untied under pp>1 (two copies), so moving between "
                              "pp=1 and pp>1 cannot keep its state")

    def request(self, layout: Layout) -> TrialRequest:
        """The TrialRequest the launchers and run_rank expect (its layout sets the world size)."""
        return TrialRequest(model=self.model, cluster=self.cluster, training=self.training, layout=layout,
                            warmup_steps=0, measure_steps=self.steps_before + self.steps_after,
                            step_timeout_s=self.step_timeout_s, seed=self.training.seed)


@dataclass
class TensorMismatch:
    key: str  # "model/<fqn>" or "optim/<fqn>/<state>"
    max_abs_diff: float | None  # None when shapes/dtypes differ or the tensor is missing
    detail: str
    # When values differ: the sums of all values (float64). Equal sums (and detail "values
    # permuted") say the values are all there in the wrong places: a wrong mapping, not noise.
    saved_sum: float | None = None
    loaded_sum: float | None = None


@dataclass
class RankOutcome:
    """What one rank returns (the global parts are identical on every rank)."""

    rank: int
    losses_a: list[float]  # steps 0 .. steps_before + steps_after - 1, uninterrupted
    losses_b: list[float]  # steps steps_before .. end, after the reshard
    tensors_checked: int
    mismatches: list[dict[str, Any]]
    mismatch_count: int
    max_abs_diff: float
    dtype: str
    save_s: float
    load_s: float


@dataclass
class ReshardReport:
    """The verdict of one reshard check and the numbers behind it."""

    verdict: Verdict
    from_layout: dict[str, Any]
    to_layout: dict[str, Any]
    steps_before: int
    steps_after: int
    tolerance: float  # relative, on each continued loss
    tensors_checked: int = 0
    mismatch_count: int = 0
    mismatches: list[TensorMismatch] = field(default_factory=list)
    max_abs_diff: float | None = None  # over every compared tensor (0.0 when bit-identical)
    losses_before: list[float] = field(default_factory=list)  # A's first steps_before losses
    losses_a: list[float] = field(default_factory=list)  # A continued (uninterrupted), steps_after
    losses_b: list[float] = field(default_factory=list)  # B after the load, same steps
    max_rel_loss_diff: float | None = None
    corrupt: str | None = None  # the deliberate corruption injected, if any
    backend: str = ""
    error: str | None = None
    save_s: float | None = None
    load_s: float | None = None
    wall_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReshardReport:
        data = dict(data)
        data["mismatches"] = [TensorMismatch(**m) for m in data.get("mismatches", [])]
        return cls(**data)


def failed_report(job: ReshardJob, error: str, *, backend: str, wall_s: float | None = None) -> ReshardReport:
    return ReshardReport(verdict="failed", from_layout=asdict(job.from_layout), to_layout=asdict(job.to_layout),
                         steps_before=job.steps_before, steps_after=job.steps_after, tolerance=tolerance(job),
                         corrupt=job.corrupt, backend=backend, error=error, wall_s=wall_s)


def tolerance(job: ReshardJob, dtype: str = "float32") -> float:
    return BF16_LOSS_RTOL if dtype == "bfloat16" else LOSS_RTOL


def report_from_ranks(job: ReshardJob, outcomes: list[Any], *, backend: str, wall_s: float | None = None
                      ) -> ReshardReport:
    """Merge the ranks' outcomes (RankOutcome or its dict) into the verdict."""
    first = outcomes[0] if isinstance(outcomes[0], dict) else asdict(outcomes[0])
    n = job.steps_before
    losses_a, losses_b = first["losses_a"], first["losses_b"]
    rtol = tolerance(job, first["dtype"])
    cont = losses_a[n:]
    rel = [abs(b - a) / abs(a) if a else abs(b - a) for a, b in zip(cont, losses_b, strict=True)]
    max_rel = max(rel) if rel else 0.0
    if first["mismatch_count"]:
        verdict: Verdict = "corrupted"
    elif any(not math.isfinite(x) for x in losses_b) or max_rel > rtol:
        verdict = "diverged"
    else:
        verdict = "ok"
    return ReshardReport(
        verdict=verdict, from_layout=asdict(job.from_layout), to_layout=asdict(job.to_layout),
        steps_before=n, steps_after=job.steps_after, tolerance=rtol,
        tensors_checked=first["tensors_checked"], mismatch_count=first["mismatch_count"],
        mismatches=[TensorMismatch(**m) for m in first["mismatches"]], max_abs_diff=first["max_abs_diff"],
        losses_before=losses_a[:n], losses_a=cont, losses_b=losses_b, max_rel_loss_diff=max_rel,
        corrupt=job.corrupt, backend=backend, save_s=first["save_s"], load_s=first["load_s"], wall_s=wall_s,
    )
