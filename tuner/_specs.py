"""Model, cluster and training specs: one small frozen dataclass per concept, validated on creation."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from tuner._errors import SpecError, UnknownPresetError, require_positive_int, require_positive_number

GiB = 2**30

MLP_KINDS = ("swiglu", "gelu")
PRECISIONS = ("bf16", "fp32")
DEVICE_KINDS = ("cuda", "cpu")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer. ``experts > 0`` makes every layer's MLP a top-k MoE."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq_len: int
    tied_embeddings: bool = False
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len"):
            require_positive_int(f"model.{f}", getattr(self, f))
        if self.hidden % self.heads:
            raise SpecError(f"model.heads={self.heads} does not divide model.hidden={self.hidden}")
        if self.heads % self.kv_heads:
            raise SpecError(f"model.kv_heads={self.kv_heads} does not divide model.heads={self.heads}")
        if self.mlp not in MLP_KINDS:
            raise SpecError(f"model.mlp must be one of {MLP_KINDS}, got {self.mlp!r}")
        if self.experts:
            require_positive_int("model.experts", self.experts)
            require_positive_int("model.top_k", self.top_k)
            require_positive_int("model.expert_ffn", self.expert_ffn)
            if self.top_k > self.experts:
                raise SpecError(f"model.top_k={self.top_k} exceeds model.experts={self.experts}")
        elif self.top_k or self.expert_ffn:
            raise SpecError("model.top_k/expert_ffn need model.experts > 0")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def attention_params_per_layer(self) -> int:
        q_o = 2 * self.hidden * self.hidden
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        return q_o + k_v

    @property
    def mlp_params_per_layer(self) -> int:
        """All MLP weights of one layer (every expert plus the router for MoE)."""
        mats = 3 if self.mlp == "swiglu" else 2
        if self.is_moe:
            return self.experts * mats * self.hidden * self.expert_ffn + self.hidden * self.experts
        return mats * self.hidden * self.ffn

    @property
    def active_mlp_params_per_layer(self) -> int:
        """MLP weights one token passes through (top-k experts for MoE)."""
        mats = 3 if self.mlp == "swiglu" else 2
        if self.is_moe:
            return self.top_k * mats * self.hidden * self.expert_ffn + self.hidden * self.experts
        return self.mlp_params_per_layer

    @property
    def params_per_layer(self) -> int:
        return self.attention_params_per_layer + self.mlp_params_per_layer + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def output_params(self) -> int:
        """Final norm plus the LM head (zero extra weights when tied to the embedding)."""
        return self.hidden + (0 if self.tied_embeddings else self.vocab * self.hidden)

    @property
    def params(self) -> int:
        """Total parameter count N (embedding, layers, final norm, untied head)."""
        return self.embedding_params + self.layers * self.params_per_layer + self.output_params

    @property
    def active_params(self) -> int:
        """Parameters one token touches (differs from ``params`` only for MoE)."""
        per_layer = self.attention_params_per_layer + self.active_mlp_params_per_layer + 2 * self.hidden
        return self.embedding_params + self.layers * per_layer + self.output_params


@dataclass(frozen=True)
class ClusterSpec:
    """Identical nodes of identical devices. Bandwidths are bytes/s per device, one direction."""

    name: str
    nodes: int
    devices_per_node: int
    device_memory: int
    peak_flops: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    intra_node_latency: float = 5e-6
    inter_node_latency: float = 2e-5
    device_kind: Literal["cuda", "cpu"] = "cuda"

    def __post_init__(self) -> None:
        for f in ("nodes", "devices_per_node", "device_memory"):
            require_positive_int(f"cluster.{f}", getattr(self, f))
        for f in ("peak_flops", "intra_node_bandwidth", "inter_node_bandwidth"):
            require_positive_number(f"cluster.{f}", getattr(self, f))
        for f in ("intra_node_latency", "inter_node_latency"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise SpecError(f"cluster.{f} must be a non-negative number, got {v!r}")
        if self.device_kind not in DEVICE_KINDS:
            raise SpecError(f"cluster.device_kind must be one of {DEVICE_KINDS}, got {self.device_kind!r}")

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node


@dataclass(frozen=True)
class TrainingSpec:
    """What one optimiser step trains on. ``global_batch`` and ``critical_batch`` count sequences."""

    global_batch: int
    critical_batch: int | None = None
    precision: Literal["bf16", "fp32"] = "bf16"
    optimizer: Literal["adamw"] = "adamw"
    lr: float = 3e-4
    seed: int = 0

    def __post_init__(self) -> None:
        require_positive_int("training.global_batch", self.global_batch)
        if self.critical_batch is not None:
            require_positive_int("training.critical_batch", self.critical_batch)
        if self.precision not in PRECISIONS:
            raise SpecError(f"training.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.optimizer != "adamw":
            raise SpecError(f"training.optimizer must be 'adamw', got {self.optimizer!r}")
        require_positive_number("training.lr", self.lr)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise SpecError(f"training.seed must be a non-negative integer, got {self.seed!r}")


# --- presets -------------------------------------------------------------------------------------

MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        # CPU-sized shapes for tests and the embedded default.
        ModelSpec("tiny", layers=4, hidden=64, heads=4, kv_heads=2, ffn=192, vocab=256, seq_len=64),
        ModelSpec("tiny-moe", layers=4, hidden=64, heads=4, kv_heads=2, ffn=192, vocab=256, seq_len=64,
                  experts=4, top_k=2, expert_ffn=96),
        ModelSpec("small", layers=8, hidden=256, heads=8, kv_heads=4, ffn=768, vocab=1024, seq_len=256),
        # Llama 3.2 1B (Meta model card): a 1B-class shape for single-node GPU measurements.
        ModelSpec("llama3-1b", layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256,
                  seq_len=2048, tied_embeddings=True),
        # Llama 3 herd (Dubey et al. 2024, Table 3).
        ModelSpec("llama3-8b", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256,
                  seq_len=8192),
        ModelSpec("llama3-70b", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256,
                  seq_len=8192),
        ModelSpec("llama3-405b", layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256,
                  seq_len=8192),
        # GPT-3 175B (Brown et al. 2020, Table 2.1); vocab padded as Megatron does.
        ModelSpec("gpt3-175b", layers=96, hidden=12288, heads=96, kv_heads=96, ffn=49152, vocab=51200,
                  seq_len=2048, tied_embeddings=True, mlp="gelu"),
        # BLOOM-176B (BigScience 2022).
        ModelSpec("bloom-176b", layers=70, hidden=14336, heads=112, kv_heads=112, ffn=57344, vocab=250880,
                  seq_len=2048, tied_embeddings=True, mlp="gelu"),
        # Mixtral 8x7B (Jiang et al. 2024).
        ModelSpec("mixtral-8x7b", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000,
                  seq_len=4096, experts=8, top_k=2, expert_ffn=14336),
    )
}

CLUSTER_PRESETS: dict[str, ClusterSpec] = {
    c.name: c
    for c in (
        # A100 SXM 80GB: 312 TFLOP/s bf16 dense, NVLink3 600 GB/s bidirectional, HDR 200 Gb/s per GPU.
        ClusterSpec("a100-80g", nodes=1, devices_per_node=8, device_memory=80 * GiB, peak_flops=312e12,
                    intra_node_bandwidth=300e9, inter_node_bandwidth=25e9),
        # H100 SXM: 989 TFLOP/s bf16 dense, NVLink4 900 GB/s bidirectional, NDR 400 Gb/s per GPU.
        ClusterSpec("h100-sxm", nodes=1, devices_per_node=8, device_memory=80 * GiB, peak_flops=989e12,
                    intra_node_bandwidth=450e9, inter_node_bandwidth=50e9),
        # H200 SXM: H100 compute with 141 GB HBM3e.
        ClusterSpec("h200", nodes=1, devices_per_node=8, device_memory=141 * 10**9, peak_flops=989e12,
                    intra_node_bandwidth=450e9, inter_node_bandwidth=50e9),
        # CPU processes on one host talking over gloo (the embedded default and CI).
        ClusterSpec("cpu-local", nodes=1, devices_per_node=4, device_memory=4 * GiB, peak_flops=5e10,
                    intra_node_bandwidth=5e9, inter_node_bandwidth=5e9, intra_node_latency=5e-5,
                    inter_node_latency=5e-5, device_kind="cpu"),
    )
}

_T = TypeVar("_T")


def _build(cls: type[_T], section: str, value: Any, presets: Mapping[str, _T]) -> _T:
    """A spec from a preset name, or a mapping with an optional ``preset`` key plus overrides."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        value = {"preset": value}
    if not isinstance(value, Mapping):
        raise SpecError(f"{section} must be a preset name or a mapping, got {value!r}")
    data = dict(value)
    base: dict[str, Any] = {}
    preset = data.pop("preset", None)
    if preset is not None:
        if preset not in presets:
            raise UnknownPresetError(
                f"{section}.preset={preset!r} is not a known preset (known: {', '.join(sorted(presets))})"
            )
        base = dataclasses.asdict(presets[preset])  # type: ignore[call-overload]
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - fields)
    if unknown:
        raise SpecError(f"{section}.{unknown[0]} is not a known field (known: {', '.join(sorted(fields))})")
    base.update(data)
    if "name" in fields and "name" not in base:
        base["name"] = "custom"
    try:
        return cls(**base)
    except TypeError as exc:  # missing required fields
        raise SpecError(f"{section}: {exc}") from None


def model_spec(value: Any) -> ModelSpec:
    return _build(ModelSpec, "model", value, MODEL_PRESETS)


def cluster_spec(value: Any) -> ClusterSpec:
    return _build(ClusterSpec, "cluster", value, CLUSTER_PRESETS)


def training_spec(value: Any, *, seq_len: int | None = None) -> TrainingSpec:
    """A TrainingSpec from a mapping; ``global_batch_tokens`` is converted with the model's seq_len."""
    if isinstance(value, TrainingSpec):
        return value
    if not isinstance(value, Mapping):
        raise SpecError(f"training must be a mapping, got {value!r}")
    data = dict(value)
    for key in ("global_batch_tokens", "critical_batch_tokens"):
        if key in data:
            tokens = data.pop(key)
            require_positive_int(f"training.{key}", tokens)
            assert seq_len is not None, "token batch sizes need the model's seq_len"
            if tokens % seq_len:
                raise SpecError(f"training.{key}={tokens} is not a multiple of model.seq_len={seq_len}")
            data[key.removesuffix("_tokens")] = tokens // seq_len
    return _build(TrainingSpec, "training", data, {})


def to_dict(spec: Any) -> dict[str, Any]:
    """JSON-ready dict of any spec/layout dataclass (the inverse of the ``*_spec`` builders)."""
    return dataclasses.asdict(spec)
