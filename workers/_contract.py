"""The backend contract: ``Backend.run(TrialRequest) -> TrialResult``. Imports no torch.

A backend turns one layout of one model into a measurement. Every backend (Ray, simulate, a user's
``module:attr``) speaks these two dataclasses; a failed trial is a ``TrialResult`` with a failure
status, never an exception (exceptions are for a backend that cannot run anything at all).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from tuner import (
    BackendError,
    ClusterSpec,
    Layout,
    ModelSpec,
    TrainingSpec,
    cluster_spec,
    model_spec,
    training_spec,
)


class BackendUnavailable(BackendError):  # noqa: N818 - reads as the condition it names
    """The backend exists and is configured but cannot run anything *now*: Ray did not start or is
    not reachable, no room for the trial's placement groups, rank processes did not start. An
    infrastructure condition, not the trial's nor the spec's fault: callers retry it with back-off
    (the sweep engine re-runs the trial and, if it persists, leaves the sweep resumable instead of
    failing it). A plug-in backend raises it for the same conditions; a plain ``BackendError`` means
    the backend cannot run this sweep at all (e.g. it cannot be imported)."""


TrialStatus = Literal["completed", "oom", "timeout", "crash", "nan"]
TRIAL_STATUSES: tuple[str, ...] = ("completed", "oom", "timeout", "crash", "nan")
# The options that inject failures, slowness or a smaller device (TrialRequest.options): a run that
# uses one is a diagnostic, never a real measurement of its layout.
DIAGNOSTIC_OPTIONS: tuple[str, ...] = ("fail", "sleep_per_step_s", "min_step_s", "memory_cap_bytes")


@dataclass(frozen=True)
class TrialRequest:
    """One short training run of ``layout``.

    ``warmup_steps`` are run and discarded, then ``measure_steps`` are timed. ``step_timeout_s`` is
    the per-step watchdog: a step that takes longer kills the trial (status ``timeout``).

    ``options`` are test/diagnostic hooks understood by the workers (all optional):

    - ``fail``: one of "crash", "hang", "oom", "nan", injected on rank ``fail_rank`` (default 0)
      before step ``fail_step`` (default 1) — a real raised error, sleep, 1 PiB allocation or
      infinite embedding output;
    - ``sleep_per_step_s``: seconds slept inside every timed step (an injected slowdown);
    - ``min_step_s``: every timed step lasts at least this long (the rank sleeps the rest): a step
      time that machine load cannot move as long as the compute fits in it (a deterministic
      baseline for tests of slowdowns on a shared machine);
    - ``memory_cap_bytes``: a real per-rank memory cap for the trial (CUDA: the caching
      allocator's per-process fraction; CPU: ``RLIMIT_DATA`` above what the process already
      holds; see ``workers._launch.memory_cap``);
    - ``init_timeout_s``: start-up allowance before the first step (Ray backend watchdog);
    - ``allow_tp_across_nodes``: if true, a layout whose TP groups cross nodes runs (the Ray backend
      refuses it otherwise, before any process starts, as ``tuner.place`` does);
    - ``grad_norm``: if true, every rank records the global gradient norm of each step before the
      optimiser update (``RankReport.grad_norms``; a numerics diagnostic, since Adam hides a wrong
      gradient scale from the losses). Its gathers then count in the step time;
    - ``cpu_bf16``: if true and ``training.precision`` is "bf16", CPU ranks run the GPU's mixed-
      precision path instead of falling back to fp32 (the fallback is noted in the result), so CI
      exercises it: bf16 compute with fp32 master weights and optimiser state — FSDP's
      MixedPrecisionPolicy (bf16 parameters in forward/backward, fp32 gradient reduction) under
      FSDP (ZeRO >= 1 with data parallelism), ``torch.autocast`` otherwise. Ignored on CUDA ranks, which run bf16 when asked.
    """

    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    layout: Layout
    warmup_steps: int = 2
    measure_steps: int = 3
    step_timeout_s: float = 120.0
    seed: int = 0
    trial_id: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    workload: str = "builtin"  # the model code trained: "builtin", "hf" or "module:attr" (workers/workload.py)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialRequest:
        data = dict(data)
        model = model_spec(data.pop("model"))
        return cls(
            model=model,
            cluster=cluster_spec(data.pop("cluster")),
            training=training_spec(data.pop("training"), seq_len=model.seq_len),
            layout=Layout(**data.pop("layout")),
            **data,
        )


@dataclass
class TrialError:
    """Why a trial failed, from structured exceptions (never from grepping logs)."""

    kind: TrialStatus
    message: str
    rank: int | None = None
    exception_type: str | None = None
    traceback_tail: str | None = None
    bytes_requested: int | None = None  # for oom, when torch says how much it asked for
    # The cluster failed, not the layout: "node_lost" (a node died under the trial) or "cluster_shrank"
    # (refused: it no longer fits the nodes that remain). Never counted against the layout.
    infra: str | None = None


@dataclass
class TrialResult:
    """A measurement (or a failure) of one trial. Per-step lists cover the measured steps only,
    except ``losses`` which covers every step run (warm-up included) for numerics comparisons."""

    status: TrialStatus
    backend: str
    simulated: bool = False
    step_times_s: list[float] = field(default_factory=list)
    step_time_s: float | None = None  # median of step_times_s
    tokens_per_s: float | None = None
    tokens_per_s_per_device: float | None = None
    mfu: float | None = None  # None where the device has no meaningful peak (CPU)
    peak_memory_bytes: int | None = None  # max over ranks
    peak_memory_per_rank: list[int] = field(default_factory=list)
    memory_measure: str | None = None  # e.g. "cuda.max_memory_allocated", "cpu.VmHWM"
    peak_reserved_bytes: int | None = None  # GPU caching allocator reserve, max over ranks
    losses: list[float] = field(default_factory=list)
    stage_times_s: list[float] = field(default_factory=list)  # per pipeline stage, measured
    stage_imbalance: float | None = None  # max/mean of stage_times_s
    env: dict[str, Any] = field(default_factory=dict)
    # rank -> the (Ray) node id its process ran on, in rank order; empty where no real process ran.
    rank_nodes: list[str] = field(default_factory=list)
    error: TrialError | None = None
    wall_s: float | None = None  # whole trial incl. launch
    device_seconds: float | None = None  # wall_s * devices held
    # Per rank (rank order): memory over one measured step, its phases and where its peak falls, whose
    # maximum is that rank's peak (workers/_memory_timeline.py); None where no real process ran.
    memory_timeline: list[dict[str, Any]] | None = None

    @property
    def ok(self) -> bool:
        return self.status == "completed"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialResult:
        data = dict(data)
        err = data.pop("error", None)
        return cls(error=TrialError(**err) if err else None, **data)


def timeline_max(rank: dict[str, Any]) -> int:
    """A rank's memory timeline maximum (``TrialResult.memory_timeline``): its series and the
    high-water marks before and after its recorded step; the rank's reported peak by construction."""
    return max(max(rank.get("bytes") or [0]), int(rank.get("before_bytes") or 0), int(rank.get("after_bytes") or 0))


@runtime_checkable
class Backend(Protocol):
    """Runs trials. ``capacity()`` is how many devices it can hold at once (for concurrent trials)."""

    name: str

    def run(self, request: TrialRequest) -> TrialResult: ...

    def capacity(self) -> int: ...

    def close(self) -> None: ...
