"""Response bodies of the sweeps routes: sweeps, trials and the Pareto front (the ranking's are
``api.ranking.schemas``)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import Field

from api.schemas import ResponseModel


class SweepOut(ResponseModel):
    id: int = Field(description="Sweep id (used in every /api/sweeps/{id} URL).")
    name: str = Field(description="The label given in the spec.")
    owner: str | None = Field(description="Name of the API token that submitted the sweep ('anonymous' without auth).")
    status: str = Field(description="queued, running, completed, cancelled or failed.")
    backend: str = Field(description="Trial backend: ray (real runs), simulate (labelled simulated), or module:attr.")
    sampler: str = Field(description="Optuna sampler: tpe, nsga2, gp, random or grid; 'layouts' when search.layouts lists them.")
    spec: dict[str, Any] = Field(description="The submitted sweep spec, as validated (defaults filled in).")
    error: str | None = Field(None, description="Why the sweep failed, when its status is 'failed'.")
    stop_reason: str | None = Field(
        None, description="Why the sweep ended, one line: reached max_trials, its device budget "
        "(max_device_seconds), patience, every layout tried, the memory model predicting that none of the "
        "unseen layouts fits, cancelled, or failed with its cause; null while it runs.")
    created_at: datetime = Field(description="When the sweep was submitted (UTC).")
    started_at: datetime | None = Field(None, description="When its first trial started (UTC).")
    finished_at: datetime | None = Field(None, description="When it completed, failed or was cancelled (UTC).")
    n_trials: int = Field(0, description="Trials recorded so far (pruned ones included; interrupted attempts, and a node-lost trial once its re-run exists, not).")
    n_completed: int = Field(0, description="Trials that ran and were measured.")
    n_pruned: int = Field(0, description="Trials rejected by the memory model before running (no device time).")
    n_failed: int = Field(0, description="Trials that ran and failed (oom, timeout, crash, nan).")
    simulated: bool = Field(False, description="True for a sweep on the simulate backend: its trials are the analytical "
                            "model with noise, and its device_seconds and best_* figures are simulated, not measured.")
    device_seconds: float = Field(0.0, description="Device time spent: sum over trials of wall time x devices held "
                                  "(simulated device time when `simulated` is true).")
    best_layout_key: str | None = Field(None, description="The ranking's #1: the layout with the best median tokens/s "
                                        "per device over its measurements so far (the same row as /ranking's first).")
    best_tokens_per_s_per_device: float | None = Field(None, description="Its median tokens/s per device.")
    best_useful_tokens_per_s: float | None = Field(
        None, description="Its median useful tokens/s (throughput discounted beyond the critical batch)."
    )
    best_peak_memory_bytes: int | None = Field(None, description="Median peak memory of that layout, bytes (max over ranks).")
    diagnostic: bool = Field(False, description="True when trial.options inject failures, slowness or a memory cap "
                             "(fail, sleep_per_step_s, min_step_s, memory_cap_bytes): its numbers are not real measurements.")
    priority: str = Field("normal", description="Queue priority: high, normal or low (ordered after fair share "
                          "between owners: the owner holding the fewest devices goes first).")
    queue_position: int | None = Field(None, description="Place among the queued sweeps (1 = the next to start); "
                                       "null once it is claimed by a coordinator or finished.")
    running_trials: int = Field(0, description="Trials of this sweep running now (each on its own placement group).")
    confirm: dict[str, Any] | None = Field(None, description="The latest confirm round asked (round, top_k, steps, the "
                                           "layouts in ranking order, source, requested_by); its report is "
                                           "GET /api/sweeps/{id}/confirm.")


class SweepPage(ResponseModel):
    items: list[SweepOut] = Field(description="Sweeps on this page, newest first.")
    total: int = Field(description="Sweeps matching the filters, over all pages.")
    limit: int = Field(description="Page size used.")
    offset: int = Field(description="Sweeps skipped before this page.")


class TrialOut(ResponseModel):
    id: int = Field(description="Row id of this trial attempt.")
    sweep_id: int = Field(description="Sweep the trial belongs to.")
    number: int = Field(description="Sweep-wide trial number (each number has exactly one non-interrupted attempt).")
    attempt: int = Field(description="0, or higher when a coordinator restart re-ran an interrupted attempt.")
    phase: str = Field(description="'search' (proposed by the sampler), 'remeasure' (repeat of a leading layout) or "
                       "'confirm' (a longer run of a leading layout: not in the ranking; repeat = the confirm round).")
    source: str = Field(description="Who proposed it: sampler, warm_start, reference, ...")
    repeat: int = Field(description="0 for the first measurement of a layout, k for its k-th re-measurement.")
    layout: dict[str, Any] = Field(description="The parallel layout (tp, pp, dp, cp, ep, zero, mbs, ac, sp, schedule, vpp).")
    layout_key: str = Field(description="Stable readable identity of the layout.")
    world_size: int = Field(description="Devices (ranks) the layout uses.")
    status: str = Field(description="running, pruned, completed, oom, timeout, crash, nan or interrupted.")
    cause: str | None = Field(None, description="Why it did not complete (one line), if it did not.")
    error: dict[str, Any] | None = Field(None, description="Structured error of a failed run (kind, rank, exception type).")
    predicted_memory_bytes: int | None = Field(None, description="Analytical peak memory per device, bytes.")
    predicted_step_time_s: float | None = Field(None, description="Analytical step time, seconds.")
    predicted_tokens_per_s_per_device: float | None = Field(None, description="Analytical tokens/s per device.")
    useful_fraction: float | None = Field(None, description="Share of the throughput that is useful given the critical batch.")
    step_time_s: float | None = Field(None, description="Measured median step time, seconds.")
    tokens_per_s: float | None = Field(None, description="Measured tokens/s over all devices.")
    tokens_per_s_per_device: float | None = Field(None, description="Measured tokens/s per device.")
    useful_tokens_per_s: float | None = Field(None, description="Measured tokens/s times the useful fraction.")
    mfu: float | None = Field(None, description="Model FLOPs utilisation (None on CPU, which has no meaningful peak).")
    peak_memory_bytes: int | None = Field(None, description="Measured peak memory, bytes (max over ranks).")
    peak_reserved_bytes: int | None = Field(None, description="GPU caching-allocator reserve, bytes (max over ranks).")
    memory_measure: str | None = Field(None, description="How memory was measured, e.g. cuda.max_memory_allocated, cpu.VmHWM.")
    step_times_s: list[Any] | None = Field(None, description="Every measured step time, seconds.")
    losses: list[Any] | None = Field(None, description="Loss of every step run (warm-up included).")
    stage_times_s: list[Any] | None = Field(None, description="Measured time per pipeline stage, seconds.")
    stage_imbalance: float | None = Field(None, description="max/mean of the stage times (1.0 = balanced).")
    env: dict[str, Any] | None = Field(None, description="Environment of the run (torch version, devices, hosts).")
    env_fingerprint: str | None = Field(None, description="Hash of the environment, to compare like with like.")
    rank_nodes: list[Any] | None = Field(
        None, description="Node id each rank's process ran on, in rank order (where the placement landed; real runs).")
    backend: str | None = Field(None, description="Backend that ran the trial.")
    simulated: bool = Field(False, description="True when the numbers come from the simulate backend, not a real run.")
    wall_s: float | None = Field(None, description="Wall time of the whole trial including launch, seconds.")
    device_seconds: float = Field(0.0, description="wall_s times devices held.")
    created_at: datetime = Field(description="When the trial was proposed (UTC).")
    started_at: datetime | None = Field(None, description="When it started running (UTC).")
    finished_at: datetime | None = Field(None, description="When its result was recorded (UTC).")


class TrialPage(ResponseModel):
    items: list[TrialOut] = Field(description="Trials on this page, by number.")
    total: int = Field(description="Trials matching the filters, over all pages.")
    limit: int = Field(description="Page size used.")
    offset: int = Field(description="Trials skipped before this page.")


class ParetoPointOut(ResponseModel):
    layout_key: str = Field(description="Stable readable identity of the layout.")
    layout: dict[str, Any] = Field(description="The parallel layout.")
    tokens_per_s_per_device: float = Field(description="Median measured tokens/s per device.")
    peak_memory_bytes: int = Field(description="Median measured peak memory, bytes.")
    on_front: bool = Field(description="No other measured layout is both faster and lighter.")
    simulated: bool = Field(description="True when measured by the simulate backend.")


class ParetoOut(ResponseModel):
    sweep_id: int = Field(description="The sweep.")
    points: list[ParetoPointOut] = Field(description="Front first (by ascending memory), then the dominated layouts.")
