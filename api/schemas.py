"""Response models shared by the HTTP API (errors, presets, health; a feature's own bodies sit
with its routes, e.g. ``api.sweeps.schemas``, ``api.plan.schemas``). Every field carries a description (it is the OpenAPI document).

Request bodies are ``api.spec.SweepSpec``; these models only shape what the coordinator returns.
They read ORM rows directly (``from_attributes``), so the services stay free to return rows or dicts.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class ResponseModel(BaseModel):
    """Base of every response body: reads ORM rows directly (``from_attributes``)."""

    model_config = ConfigDict(from_attributes=True)


# --- errors --------------------------------------------------------------------------------------


class FieldError(ResponseModel):
    field: str = Field(description="Dotted path of the offending field, e.g. 'search.max_trials' or 'model.heads'.")
    value: Any = Field(None, description="The value that was rejected (absent when the field was missing).")
    message: str = Field(description="Why the value was rejected.")
    type: str = Field(description="Machine-readable error kind (pydantic's error type, or 'spec' for a model rule).")
    loc: list[str | int] = Field(description="Location as FastAPI reports it: ('body'|'query'|'path', ...field).")


class ValidationErrorOut(ResponseModel):
    detail: str = Field(description="One line naming the first offending field and value.")
    errors: list[FieldError] = Field(description="Every rejected field.")


class ErrorOut(ResponseModel):
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


# --- presets and health --------------------------------------------------------------------------


class ModelPresetOut(ResponseModel):
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


class ClusterPresetOut(ResponseModel):
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


class PresetsOut(ResponseModel):
    models: list[ModelPresetOut] = Field(description="Model presets.")
    clusters: list[ClusterPresetOut] = Field(description="Cluster presets.")
    samplers: list[str] = Field(description="Sampler names accepted in the spec's search.sampler.")


class ComponentHealth(ResponseModel):
    ok: bool | None = Field(description="True reachable, False unreachable, None not checked (see detail).")
    detail: str = Field(description="What was checked and what was found (never a password).")
    latency_ms: float | None = Field(None, description="Round-trip time of the check, milliseconds.")


class HealthOut(ResponseModel):
    status: str = Field(description="'ok' when every checked component is reachable, else 'degraded'.")
    database: ComponentHealth = Field(description="The SQL store (a SELECT 1 round trip).")
    ray: ComponentHealth = Field(description="The Ray cluster (GCS port probe; Ray is never started for this).")
