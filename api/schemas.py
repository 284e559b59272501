"""Response models of the HTTP API. Every field carries a description (it is the OpenAPI document).

Request bodies are ``api.spec.SweepSpec``; these models only shape what the coordinator returns.
They read ORM rows directly (``from_attributes``), so the services stay free to return rows or dicts.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Out(BaseModel):
    model_config = ConfigDict(from_attributes=True)


# --- errors --------------------------------------------------------------------------------------


class FieldError(_Out):
    field: str = Field(description="Dotted path of the offending field, e.g. 'search.max_trials' or 'model.heads'.")
    value: Any = Field(None, description="The value that was rejected (absent when the field was missing).")
    message: str = Field(description="Why the value was rejected.")
    type: str = Field(description="Machine-readable error kind (pydantic's error type, or 'spec' for a model rule).")
    loc: list[str | int] = Field(description="Location as FastAPI reports it: ('body'|'query'|'path', ...field).")


class ValidationErrorOut(_Out):
    detail: str = Field(description="One line naming the first offending field and value.")
    errors: list[FieldError] = Field(description="Every rejected field.")


class ErrorOut(_Out):
    detail: str = Field(description="What went wrong, in one line.")


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorOut, "description": "No bearer token was sent and this endpoint needs one."},
    403: {"model": ErrorOut, "description": "The bearer token matches none of the configured tokens, or its role may not take this "
          "action (a read-only token writing; a member acting on another owner's sweep or schedule)."},
    422: {"model": ValidationErrorOut, "description": "A field has an invalid value (named with its value), or "
          "text the store cannot hold (a NUL character); for a body that is not UTF-8 JSON or nests deeper "
          "than 32 levels the field is 'body'. Ids out of 1..2^31-1 are 422 naming the parameter."},
}
NOT_FOUND = {404: {"model": ErrorOut, "description": "No sweep (or trial) with this id."}}
# Routes that take a body: one larger than api._http.MAX_BODY_BYTES (1 MiB) is refused unread.
BODY_RESPONSES: dict[int | str, dict[str, Any]] = {
    413: {"model": ErrorOut, "description": "The request body exceeds 1 MiB (1,048,576 bytes)."},
}


# --- sweeps and trials ---------------------------------------------------------------------------


class SweepOut(_Out):
    id: int = Field(description="Sweep id (used in every /api/sweeps/{id} URL).")
    name: str = Field(description="The label given in the spec.")
    owner: str | None = Field(description="Name of the API token that submitted the sweep ('anonymous' without auth).")
    status: str = Field(description="queued, running, completed, cancelled or failed.")
    backend: str = Field(description="Trial backend: ray (real runs), simulate (labelled simulated), or module:attr.")
    sampler: str = Field(description="Optuna sampler: tpe, nsga2, gp, random or grid; 'layouts' when search.layouts lists them.")
    spec: dict[str, Any] = Field(description="The submitted sweep spec, as validated (defaults filled in).")
    error: str | None = Field(None, description="Why the sweep failed, when its status is 'failed'.")
    created_at: datetime = Field(description="When the sweep was submitted (UTC).")
    started_at: datetime | None = Field(None, description="When its first trial started (UTC).")
    finished_at: datetime | None = Field(None, description="When it completed, failed or was cancelled (UTC).")
    n_trials: int = Field(0, description="Trials recorded so far (pruned ones included, interrupted attempts not).")
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


class SweepPage(_Out):
    items: list[SweepOut] = Field(description="Sweeps on this page, newest first.")
    total: int = Field(description="Sweeps matching the filters, over all pages.")
    limit: int = Field(description="Page size used.")
    offset: int = Field(description="Sweeps skipped before this page.")


class TrialOut(_Out):
    id: int = Field(description="Row id of this trial attempt.")
    sweep_id: int = Field(description="Sweep the trial belongs to.")
    number: int = Field(description="Sweep-wide trial number (each number has exactly one non-interrupted attempt).")
    attempt: int = Field(description="0, or higher when a coordinator restart re-ran an interrupted attempt.")
    phase: str = Field(description="'search' (proposed by the sampler) or 'remeasure' (repeat of a leading layout).")
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


class TrialPage(_Out):
    items: list[TrialOut] = Field(description="Trials on this page, by number.")
    total: int = Field(description="Trials matching the filters, over all pages.")
    limit: int = Field(description="Page size used.")
    offset: int = Field(description="Trials skipped before this page.")


# --- presets and health --------------------------------------------------------------------------


class ModelPresetOut(_Out):
    name: str = Field(description="Preset name (use it as the spec's 'model').")
    layers: int = Field(description="Transformer layers.")
    hidden: int = Field(description="Hidden size.")
    heads: int = Field(description="Attention heads.")
    kv_heads: int = Field(description="Key/value heads (grouped-query attention when fewer than heads).")
    ffn: int = Field(description="MLP inner size.")
    vocab: int = Field(description="Vocabulary size.")
    seq_len: int = Field(description="Sequence length, tokens.")
    tied_embeddings: bool = Field(description="Whether the LM head shares the embedding's weights.")
    mlp: str = Field(description="MLP kind: swiglu or gelu.")
    experts: int = Field(description="MoE experts per layer (0 = dense).")
    top_k: int = Field(description="Experts each token is routed to.")
    expert_ffn: int = Field(description="Inner size of one expert.")
    params: int = Field(description="Total parameter count.")
    active_params: int = Field(description="Parameters one token passes through (differs from params for MoE).")


class ClusterPresetOut(_Out):
    name: str = Field(description="Preset name (use it as the spec's 'cluster').")
    nodes: int = Field(description="Nodes (override with {'preset': name, 'nodes': n}).")
    devices_per_node: int = Field(description="Devices per node.")
    device_memory: int = Field(description="Memory per device, bytes.")
    peak_flops: float = Field(description="Peak dense FLOP/s per device at the training precision.")
    intra_node_bandwidth: float = Field(description="Bytes/s per device, one direction, inside a node.")
    inter_node_bandwidth: float = Field(description="Bytes/s per device, one direction, between nodes.")
    intra_node_latency: float = Field(description="Seconds per message inside a node.")
    inter_node_latency: float = Field(description="Seconds per message between nodes.")
    device_kind: str = Field(description="cuda or cpu.")
    fast_domain_devices: int | None = Field(None, description="Devices of one fast domain (whole nodes on one "
                                            "scale-up fabric, e.g. 72 for GB200 NVL72); null: the node.")
    fast_domain_bandwidth: float | None = Field(None, description="Bytes/s per device, one direction, inside a fast "
                                                "domain; null: the node's.")
    fast_domain_latency: float | None = Field(None, description="Seconds per message inside a fast domain; null: the node's.")
    price_per_device_hour: float | None = Field(None, description="Price of one device-hour (null: unknown); set it per sweep.")
    devices: int = Field(description="nodes x devices_per_node.")


class PresetsOut(_Out):
    models: list[ModelPresetOut] = Field(description="Model presets.")
    clusters: list[ClusterPresetOut] = Field(description="Cluster presets.")
    samplers: list[str] = Field(description="Sampler names accepted in the spec's search.sampler.")


class ComponentHealth(_Out):
    ok: bool | None = Field(description="True reachable, False unreachable, None not checked (see detail).")
    detail: str = Field(description="What was checked and what was found (never a password).")
    latency_ms: float | None = Field(None, description="Round-trip time of the check, milliseconds.")


class HealthOut(_Out):
    status: str = Field(description="'ok' when every checked component is reachable, else 'degraded'.")
    database: ComponentHealth = Field(description="The SQL store (a SELECT 1 round trip).")
    ray: ComponentHealth = Field(description="The Ray cluster (GCS port probe; Ray is never started for this).")


# --- ranking and pareto --------------------------------------------------------------------------


class RankingRowOut(_Out):
    rank: int = Field(description="1 = best median; tied layouts keep distinct ranks but share a tie_group.")
    layout_key: str = Field(description="Stable readable identity of the layout.")
    layout: dict[str, Any] = Field(description="The parallel layout.")
    n: int = Field(description="Measurements of this layout (1 + re-measurements).")
    median: float = Field(description="Median of the ranking metric over the measurements.")
    low: float | None = Field(description="Lower end of the 95% interval of the metric (Student t on log values); "
                              "null when n < 2: one run gives no interval (shown as 'n=1') and is never 'not tied'.")
    high: float | None = Field(description="Upper end of the 95% interval of the metric; null when n < 2.")
    tie_group: int = Field(description="Layouts whose intervals overlap share a group number.")
    tied_with_best: bool = Field(description="True when this layout's interval overlaps the best one's.")
    tokens_per_s_per_device: float = Field(description="Median measured tokens/s per device.")
    useful_tokens_per_s: float | None = Field(
        description="Median measured useful tokens/s of the whole job, all devices (critical-batch discounted).")
    useful_tokens_per_s_per_device: float | None = Field(
        None, description="Median measured useful tokens/s per device (comparable with tokens_per_s_per_device).")
    peak_memory_bytes: int | None = Field(description="Median measured peak memory, bytes (max over ranks).")
    predicted_tokens_per_s_per_device: float | None = Field(description="Analytical prediction at proposal time.")
    prediction_error: float | None = Field(description="(predicted - measured) / measured for tokens/s per device.")
    predicted_memory_bytes: int | None = Field(description="Analytical peak memory prediction, bytes.")
    memory_prediction_error: float | None = Field(description="(predicted - measured) / measured for peak memory.")
    simulated: bool = Field(description="True when the measurements come from the simulate backend.")
    trial_numbers: list[int] = Field(description="Numbers of the trials that measured this layout.")
    budget: dict[str, Any] | None = Field(
        None, description="Time and cost to train the sweep's training.train_tokens at this layout's median measured "
        "tokens/s (time_to_train_s, device_hours, cost, cost_per_token at cluster.price_per_device_hour; null parts "
        "where no budget or price is set); simulated when the row is.")


class RankingOut(_Out):
    sweep_id: int = Field(description="The ranked sweep.")
    metric: str = Field(description="What median/low/high are of: tokens_per_s_per_device, or useful_tokens_per_s "
                        "(whole job, all devices).")
    rows: list[RankingRowOut] = Field(description="Measured layouts, best first (the requested page of them).")
    total: int = Field(0, description="Measured layouts in the whole ranking.")
    calibration: dict[str, Any] | None = Field(
        description="The analytical model's efficiency and bandwidth factors fitted to this sweep's measurements."
    )
    simulated: bool = Field(description="True when any row comes from the simulate backend.")
    diagnostic: bool = Field(False, description="True when the sweep's trial.options are diagnostic (injected "
                             "failures, sleeps or memory caps): never mistake these numbers for real measurements.")
    budget: dict[str, Any] | None = Field(
        None, description="The sweep's budget: train_tokens, price_per_device_hour, devices, and what its search "
        "spent (search_device_seconds, search_device_hours, search_cost; simulated on the simulate backend).")


class ParetoPointOut(_Out):
    layout_key: str = Field(description="Stable readable identity of the layout.")
    layout: dict[str, Any] = Field(description="The parallel layout.")
    tokens_per_s_per_device: float = Field(description="Median measured tokens/s per device.")
    peak_memory_bytes: int = Field(description="Median measured peak memory, bytes.")
    on_front: bool = Field(description="No other measured layout is both faster and lighter.")
    simulated: bool = Field(description="True when measured by the simulate backend.")


class ParetoOut(_Out):
    sweep_id: int = Field(description="The sweep.")
    points: list[ParetoPointOut] = Field(description="Front first (by ascending memory), then the dominated layouts.")


# --- plan ----------------------------------------------------------------------------------------


class PlannedLayoutOut(_Out):
    key: str = Field(description="Stable readable identity of the layout.")
    layout: dict[str, Any] = Field(description="The parallel layout (tp, pp, dp, cp, ep, zero, mbs, ac, sp, schedule, vpp).")
    microbatches: int = Field(description="Microbatches per step per data-parallel rank.")
    placement: dict[str, Any] = Field(
        description="How the mesh axes map onto the topology: summary, order, mesh_dim_names, mesh_shape."
    )
    memory: dict[str, Any] = Field(
        description="Predicted bytes per device: params, grads, optimizer, activations, overhead, total; "
        "stage = the pipeline stage with the peak; fits."
    )
    time: dict[str, Any] = Field(
        description="Predicted step_time_s, tokens_per_s, tokens_per_s_per_device, mfu, hfu, useful_tokens_per_s, "
        "and the step-time breakdown (compute, communication, bubble, ... seconds)."
    )
    budget: dict[str, Any] | None = Field(
        None, description="Time and cost to train training.train_tokens at the predicted tokens/s: time_to_train_s, "
        "device_hours, cost, cost_per_token (null parts where no budget or price is given).")


class PlanSizesOut(_Out):
    model: dict[str, Any] = Field(description="The resolved model spec.")
    cluster: dict[str, Any] = Field(description="The resolved cluster spec (nodes: the first size).")
    training: dict[str, Any] = Field(description="The resolved training spec (the first size's batch).")
    scale_batch: bool = Field(description="Whether the global batch grows with the device count.")
    sizes: list[dict[str, Any]] = Field(
        description="Per node count: devices, global_batch, the best predicted layout (null when none fits, with "
        "why), tokens_per_s, tokens_per_s_per_device, mfu, useful_tokens_per_s (critical batch), budget "
        "(time_to_train_s, device_hours, cost, cost_per_token).")
    figure: dict[str, Any] = Field(description="The comparison as a plotly figure (data and layout) for plotly.js.")
    seconds: float = Field(description="Time the analytical planner took, seconds.")


class PlanOut(_Out):
    model: dict[str, Any] = Field(description="The resolved model spec.")
    cluster: dict[str, Any] = Field(description="The resolved cluster spec.")
    training: dict[str, Any] = Field(description="The resolved training spec (batch in sequences).")
    feasible: int = Field(description="Valid layouts predicted to fit in device memory: the distinct runs, each a "
                          "different program (layouts that run the same program are one canonical layout).")
    infeasible: int = Field(description="Valid layouts predicted not to fit (pruned with no device time).")
    rejected: dict[str, int] = Field(description="Candidates rejected before estimation, counted by reason.")
    twins: int = Field(0, description="Space combinations that run the same program as a counted layout, "
                       "folded into it (e.g. zero 1-3 with dp*cp*ep = 1 is the zero=0 program).")
    entries: list[PlannedLayoutOut] = Field(description="The fastest predicted feasible layouts, best first (top N).")
    seconds: float = Field(description="Time the analytical planner took, seconds.")
