"""Model, cluster and training specs: one small frozen dataclass per concept, validated on creation.
Named presets and the builders that read a preset name or a mapping are in tuner/_presets.py."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from tuner._errors import SpecError, require_positive_int, require_positive_number
from tuner._figures import ProbedFigures
from tuner._stack import DEFAULT_STACK, check_stack

GiB = 2**30

MLP_KINDS = ("swiglu", "gelu", "geglu")  # geglu: gated GELU-tanh (Gemma 2/3), three matrices as SwiGLU
PRECISIONS = ("bf16", "fp32")
DEVICE_KINDS = ("cuda", "cpu")


def _mean(total: int, n: int) -> int | float:
    """``total / n``, an int when it divides (every layer alike) so uniform models keep int counts."""
    return total // n if total % n == 0 else total / n


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer. ``experts > 0`` makes every layer's MLP a top-k MoE, except the
    layers listed in ``dense_layers`` (a dense ``ffn`` MLP, as Qwen-MoE's ``mlp_only_layers``).

    Shape details of published models (each defaulted so a hand-written spec is a Llama): an
    explicit ``head_dim`` (0: hidden // heads), biases on q/k/v (``qkv_bias``, Qwen2), RMSNorm of
    each query and key head (``qk_norm``, Qwen3, Gemma 3), RMSNorms per layer (``norms_per_layer``:
    4 for Gemma 2/3's sandwich norms), a shared expert of ``shared_expert_ffn`` beside the routed
    ones with an optional sigmoid gate (``shared_expert_gate``, Qwen2-MoE). ``hf_config`` holds the
    canonical JSON of the Hugging Face config.json a spec was made from (``tuner.model_from_hf_config``),
    so a workload can rebuild that exact model; empty for every other spec.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq_len: int
    tied_embeddings: bool = False
    mlp: Literal["swiglu", "gelu", "geglu"] = "swiglu"
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    head_dim: int = 0
    qkv_bias: bool = False
    qk_norm: bool = False
    norms_per_layer: int = 2
    shared_expert_ffn: int = 0
    shared_expert_gate: bool = False
    dense_layers: tuple[int, ...] = ()
    hf_config: str = ""

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len"):
            require_positive_int(f"model.{f}", getattr(self, f))
        if self.head_dim == 0:
            if self.hidden % self.heads:
                raise SpecError(f"model.heads={self.heads} does not divide model.hidden={self.hidden}")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        else:
            require_positive_int("model.head_dim", self.head_dim)
        if self.heads % self.kv_heads:
            raise SpecError(f"model.kv_heads={self.kv_heads} does not divide model.heads={self.heads}")
        if self.mlp not in MLP_KINDS:
            raise SpecError(f"model.mlp must be one of {MLP_KINDS}, got {self.mlp!r}")
        for f in ("tied_embeddings", "qkv_bias", "qk_norm", "shared_expert_gate"):
            if not isinstance(getattr(self, f), bool):
                raise SpecError(f"model.{f} must be true or false, got {getattr(self, f)!r}")
        if isinstance(self.norms_per_layer, bool) or not isinstance(self.norms_per_layer, int) \
                or self.norms_per_layer not in (2, 4):
            raise SpecError(f"model.norms_per_layer must be 2 or 4, got {self.norms_per_layer!r}")
        if not isinstance(self.hf_config, str):
            raise SpecError(f"model.hf_config must be the config.json text, got {type(self.hf_config).__name__}")
        dense = self.dense_layers
        if not isinstance(dense, (list, tuple)) or any(
                isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.layers for i in dense):
            raise SpecError(f"model.dense_layers must list layer indices in [0, {self.layers}), got {dense!r}")
        object.__setattr__(self, "dense_layers", tuple(sorted(set(dense))))
        if self.experts:
            require_positive_int("model.experts", self.experts)
            require_positive_int("model.top_k", self.top_k)
            require_positive_int("model.expert_ffn", self.expert_ffn)
            if self.top_k > self.experts:
                raise SpecError(f"model.top_k={self.top_k} exceeds model.experts={self.experts}")
            if self.shared_expert_ffn:
                require_positive_int("model.shared_expert_ffn", self.shared_expert_ffn)
            if len(self.dense_layers) == self.layers:
                raise SpecError(f"model.dense_layers lists every layer of a MoE model (experts={self.experts})")
        elif self.top_k or self.expert_ffn or self.shared_expert_ffn or self.shared_expert_gate or self.dense_layers:
            raise SpecError("model.top_k/expert_ffn/shared_expert_ffn/shared_expert_gate/dense_layers need model.experts > 0")
        if self.shared_expert_gate and not self.shared_expert_ffn:
            raise SpecError("model.shared_expert_gate needs model.shared_expert_ffn > 0")

    @property
    def q_dim(self) -> int:
        """Width of the queries (and the attention output): heads x head_dim (= hidden unless
        head_dim is explicit, e.g. Qwen3-30B-A3B: 32 x 128 on hidden 2048)."""
        return self.heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is the routed MoE (all but ``dense_layers``; 0 for a dense model)."""
        return self.layers - len(self.dense_layers) if self.is_moe else 0

    @property
    def mlp_mats(self) -> int:
        """Weight matrices of one MLP: 3 for the gated kinds (SwiGLU, GeGLU), 2 for GELU."""
        return 2 if self.mlp == "gelu" else 3

    @property
    def qk_norm_params_per_layer(self) -> int:
        return 2 * self.head_dim if self.qk_norm else 0

    @property
    def attention_params_per_layer(self) -> int:
        """q, k, v, o projections (+ q/k/v biases, + the per-head q/k RMSNorm weights)."""
        q_o = 2 * self.hidden * self.q_dim
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        bias = self.q_dim + 2 * self.kv_heads * self.head_dim if self.qkv_bias else 0
        return q_o + k_v + bias + self.qk_norm_params_per_layer

    @property
    def norm_params_per_layer(self) -> int:
        return self.norms_per_layer * self.hidden

    @property
    def routed_expert_params(self) -> int:
        """One MoE layer's routed experts (all of them)."""
        return self.experts * self.mlp_mats * self.hidden * self.expert_ffn

    @property
    def router_params(self) -> int:
        """One MoE layer's router and shared-expert gate."""
        return self.hidden * self.experts + (self.hidden if self.shared_expert_gate else 0)

    @property
    def shared_expert_params(self) -> int:
        return self.mlp_mats * self.hidden * self.shared_expert_ffn

    @property
    def dense_mlp_params(self) -> int:
        """One dense MLP of ``ffn`` (every layer of a dense model, ``dense_layers`` of a MoE one)."""
        return self.mlp_mats * self.hidden * self.ffn

    @property
    def _dense_mlp_layers(self) -> int:
        return self.layers - self.moe_layers

    @property
    def mlp_params_per_layer(self) -> int | float:
        """All MLP weights of one layer (every expert, shared expert and router for MoE), the mean
        over the layers when ``dense_layers`` mixes dense and MoE layers."""
        moe = self.routed_expert_params + self.router_params + self.shared_expert_params
        return _mean(self.moe_layers * moe + self._dense_mlp_layers * self.dense_mlp_params, self.layers)

    @property
    def active_mlp_params_per_layer(self) -> int | float:
        """MLP weights one token passes through (top-k experts, shared expert and router for MoE),
        the mean over the layers."""
        moe = (self.top_k * self.mlp_mats * self.hidden * self.expert_ffn + self.router_params
               + self.shared_expert_params)
        return _mean(self.moe_layers * moe + self._dense_mlp_layers * self.dense_mlp_params, self.layers)

    @property
    def routed_expert_params_per_layer(self) -> int | float:
        """Routed expert weights per layer (mean over the layers): what EP shards."""
        return _mean(self.moe_layers * self.routed_expert_params, self.layers)

    @property
    def params_per_layer(self) -> int | float:
        return self.attention_params_per_layer + self.mlp_params_per_layer + self.norm_params_per_layer

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def output_params(self) -> int:
        """Final norm plus the LM head (zero extra weights when tied to the embedding)."""
        return self.hidden + (0 if self.tied_embeddings else self.vocab * self.hidden)

    def _total(self, mlp_per_layer: int | float) -> int:
        per_layer = self.attention_params_per_layer + self.norm_params_per_layer
        return int(round(self.embedding_params + self.layers * (per_layer + mlp_per_layer) + self.output_params))

    @property
    def params(self) -> int:
        """Total parameter count N (embedding, layers, final norm, untied head)."""
        return self._total(self.mlp_params_per_layer)

    @property
    def active_params(self) -> int:
        """Parameters one token touches (differs from ``params`` only for MoE)."""
        return self._total(self.active_mlp_params_per_layer)


@dataclass(frozen=True)
class ClusterSpec:
    """Identical nodes of identical devices. Bandwidths are bytes/s per device, one direction.

    Three tiers of links: inside a node, inside a fast domain of ``fast_domain_devices`` (whole
    nodes sharing a scale-up fabric, e.g. GB200 NVL72's NVLink over 18 trays of 4), and the network.
    ``fast_domain_devices=None`` makes the domain the node, so a spec without it has two tiers.
    ``price_per_device_hour`` (any currency; None = unknown) prices device time and training runs.
    ``probed``: figures measured on the cluster (``meshtune probe``, tuner/_figures.py); the time and
    memory models use each one in place of the datasheet's.
    """

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
    fast_domain_devices: int | None = None
    fast_domain_bandwidth: float | None = None  # None: the node's (one scale-up fabric, as NVL72)
    fast_domain_latency: float | None = None  # None: the node's
    price_per_device_hour: float | None = None
    probed: ProbedFigures | None = None

    def __post_init__(self) -> None:
        if self.probed is not None:
            object.__setattr__(self, "probed", ProbedFigures.from_dict(self.probed))
        for f in ("nodes", "devices_per_node", "device_memory"):
            require_positive_int(f"cluster.{f}", getattr(self, f))
        for f in ("peak_flops", "intra_node_bandwidth", "inter_node_bandwidth"):
            require_positive_number(f"cluster.{f}", getattr(self, f))
        for f in ("intra_node_latency", "inter_node_latency", "fast_domain_latency", "price_per_device_hour"):
            v = getattr(self, f)
            if v is None and f in ("fast_domain_latency", "price_per_device_hour"):
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise SpecError(f"cluster.{f} must be a non-negative number, got {v!r}")
        if self.device_kind not in DEVICE_KINDS:
            raise SpecError(f"cluster.device_kind must be one of {DEVICE_KINDS}, got {self.device_kind!r}")
        if self.fast_domain_devices is not None:
            require_positive_int("cluster.fast_domain_devices", self.fast_domain_devices)
            if self.fast_domain_devices % self.devices_per_node:
                raise SpecError(
                    f"cluster.fast_domain_devices={self.fast_domain_devices} is not a multiple of "
                    f"cluster.devices_per_node={self.devices_per_node} (a fast domain is whole nodes)")
        if self.fast_domain_bandwidth is not None:
            require_positive_number("cluster.fast_domain_bandwidth", self.fast_domain_bandwidth)
            if self.fast_domain_bandwidth < self.inter_node_bandwidth:
                raise SpecError(
                    f"cluster.fast_domain_bandwidth={self.fast_domain_bandwidth:g} is below "
                    f"cluster.inter_node_bandwidth={self.inter_node_bandwidth:g}: a fast domain slower than "
                    "the network is not one")

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def domain_devices(self) -> int:
        """Devices of one fast domain (the node when the spec names none)."""
        return self.fast_domain_devices or self.devices_per_node

    @property
    def domain_bandwidth(self) -> float:
        bw = self.fast_domain_bandwidth
        return self.intra_node_bandwidth if bw is None else bw

    @property
    def domain_latency(self) -> float:
        lat = self.fast_domain_latency
        return self.intra_node_latency if lat is None else lat


@dataclass(frozen=True)
class TrainingSpec:
    """What one optimiser step trains on. ``global_batch`` and ``critical_batch`` count sequences;
    ``train_tokens`` is the token budget of the whole training run (None = not given); ``stack`` the
    runtime it is trained with (tuner/_stack.py: ``meshtune``'s workers, ``torchtitan``, ``megatron``),
    which the memory and time models predict for."""

    global_batch: int
    critical_batch: int | None = None
    precision: Literal["bf16", "fp32"] = "bf16"
    optimizer: Literal["adamw"] = "adamw"
    lr: float = 3e-4
    seed: int = 0
    train_tokens: float | None = None
    stack: str = DEFAULT_STACK

    def __post_init__(self) -> None:
        require_positive_int("training.global_batch", self.global_batch)
        check_stack(self.stack)
        if self.critical_batch is not None:
            require_positive_int("training.critical_batch", self.critical_batch)
        if self.precision not in PRECISIONS:
            raise SpecError(f"training.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.optimizer != "adamw":
            raise SpecError(f"training.optimizer must be 'adamw', got {self.optimizer!r}")
        require_positive_number("training.lr", self.lr)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise SpecError(f"training.seed must be a non-negative integer, got {self.seed!r}")
        if self.train_tokens is not None:
            require_positive_number("training.train_tokens", self.train_tokens)
            if self.train_tokens == float("inf"):
                raise SpecError(f"training.train_tokens must be a finite number, got {self.train_tokens!r}")


def to_dict(spec: Any) -> dict[str, Any]:
    """JSON-ready dict of any spec/layout dataclass (the inverse of the ``*_spec`` builders)."""
    return dataclasses.asdict(spec)
