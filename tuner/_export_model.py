"""What a model trains as beyond its shape: the properties an export must carry so that the
framework trains the model that was tuned (RoPE base and scaling, norm epsilon, dropout, init,
MoE routing and its auxiliary loss, sliding windows, Gemma's extras).

``trained_model(spec)`` reads them from the Hugging Face config a spec was made from, with the
transformers config class's default where config.json omits a key (transformers reads it so), or
takes the built-in model's (workers/model.py) for every other spec. ``TrainedModel.hf_config`` is
the complete config.json to train with in transformers: the given one, or for a built-in spec the
architecture that builds the same model (none for shapes no transformers architecture has).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tuner._specs import ModelSpec

# The built-in model's constants (workers/model.py builds with these).
BUILTIN_ROPE_THETA = 500_000.0  # Llama 3 (Dubey et al. 2024, Table 3)
BUILTIN_NORM_EPS = 1e-5  # the layer and final RMSNorms
BUILTIN_QK_NORM_EPS = 1e-6  # the per-head q/k RMSNorms (Qwen3's value)
BUILTIN_INIT_STD = 0.02  # normal(0, 0.02), residual-out projections scaled by 1/sqrt(2 * layers)

# transformers' config-class defaults (configuration_<model_type>.py, transformers 4.4x-5.x) for the
# keys a config.json may omit; tests/tuner/test_export_models.py reads them back from transformers itself.
_COMMON = {"attention_dropout": 0.0, "initializer_range": 0.02}
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rope_theta": 10_000.0, "rms_norm_eps": 1e-6},
    "mistral": {"rope_theta": 10_000.0, "rms_norm_eps": 1e-6, "sliding_window": 4096},
    "qwen2": {"rope_theta": 10_000.0, "rms_norm_eps": 1e-6},
    "qwen3": {"rope_theta": 10_000.0, "rms_norm_eps": 1e-6},
    "mixtral": {"rope_theta": 1_000_000.0, "rms_norm_eps": 1e-5, "router_aux_loss_coef": 0.001},
    "qwen2_moe": {"rope_theta": 10_000.0, "rms_norm_eps": 1e-6, "router_aux_loss_coef": 0.001,
                  "norm_topk_prob": False},
    "qwen3_moe": {"rope_theta": 10_000.0, "rms_norm_eps": 1e-6, "router_aux_loss_coef": 0.001,
                  "norm_topk_prob": False},
    "gemma2": {"rope_theta": 10_000.0, "rms_norm_eps": 1e-6, "sliding_window": 4096, "query_pre_attn_scalar": 256,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3_text": {"rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6, "sliding_window": 4096,
                    "query_pre_attn_scalar": 256, "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 6},
}
# Qwen2/Qwen3(-MoE) use a sliding window only with use_sliding_window=true, and then only on the
# layers from max_window_layers on (Qwen2Attention): never one window for every layer.
_QWEN_WINDOWS = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")


@dataclass(frozen=True)
class TrainedModel:
    """The training properties of a ModelSpec (see the module docstring)."""

    source: str  # "hf": from the spec's config.json; "builtin": workers/model.py
    model_type: str  # the transformers architecture ("" when a built-in shape has none)
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # HF's form, rope_type "llama3" | "linear" | "yarn" | ...; None: plain RoPE
    norm_eps: float
    qk_norm_eps: float  # the q/k norms' epsilon (Hugging Face: the same as norm_eps)
    attention_dropout: float
    hidden_dropout: float
    init_std: float
    aux_loss_coef: float  # the router's load-balancing loss coefficient (0: none)
    router_renorm: bool  # top-k routing weights renormalised to sum 1 (Mixtral, norm_topk_prob=true)
    sliding_window: int | None  # one attention window on every layer, shorter than seq_len
    norm_plus_one: bool  # RMSNorm scales by (1 + weight) (Gemma)
    other: tuple[tuple[str, Any], ...]  # (property, value) with no generic framework flag (Gemma's)
    hf_config: dict[str, Any]  # the config.json to train with in transformers ({} if none)
    no_hf: str = ""  # why a built-in shape has no transformers architecture

    def describe(self) -> str:
        """One line of what the frameworks must train, for the exports' headers."""
        rope = f"rope_theta={self.rope_theta:.10g}"
        if self.rope_scaling:
            rope += f", rope_scaling={json.dumps(self.rope_scaling, sort_keys=True)}"
        parts = [rope, f"norm eps={self.norm_eps:g}", f"attention/hidden dropout={self.attention_dropout:g}/"
                 f"{self.hidden_dropout:g}", f"init std={self.init_std:g}"]
        if self.qk_norm_eps != self.norm_eps:
            parts.append(f"q/k norm eps={self.qk_norm_eps:g}")
        return ", ".join(parts)


def _float(config: dict[str, Any], key: str, default: Any) -> Any:
    value = config.get(key)
    return default if value is None else value


def _rope(cfg: dict[str, Any], defaults: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float | None]:
    """(theta, scaling, local theta) from transformers 5's ``rope_parameters`` (per layer type for
    Gemma 3) or 4.x's ``rope_theta``/``rope_scaling``/``rope_local_base_freq``."""
    params = cfg.get("rope_parameters")
    local = None
    if isinstance(params, dict) and "full_attention" in params:
        local = (params.get("sliding_attention") or {}).get("rope_theta")
        params = params["full_attention"]
    if isinstance(params, dict):
        theta = params.get("rope_theta", defaults["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = _float(cfg, "rope_theta", defaults["rope_theta"])
        scaling = dict(cfg.get("rope_scaling") or {})
        local = cfg.get("rope_local_base_freq", defaults.get("rope_local_base_freq"))
    if "type" in scaling and "rope_type" not in scaling:  # the legacy spelling
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        scaling = {}
    return float(theta), scaling or None, (float(local) if local is not None else None)


def _from_hf(model: ModelSpec) -> TrainedModel:
    cfg = json.loads(model.hf_config)
    mt = cfg["model_type"]
    d = _COMMON | HF_DEFAULTS[mt]
    theta, scaling, local_theta = _rope(cfg, d)
    eps = float(_float(cfg, "rms_norm_eps", d["rms_norm_eps"]))
    other: list[tuple[str, Any]] = []
    window = cfg.get("sliding_window", d.get("sliding_window"))
    every_layer_window = None
    if mt in _QWEN_WINDOWS:
        if cfg.get("use_sliding_window") and window and window < model.seq_len:
            other.append(("sliding_window (use_sliding_window=true, layers from max_window_layers="
                          f"{cfg.get('max_window_layers')})", window))
    elif mt.startswith("gemma"):
        pattern = "1 of 2 layers" if mt == "gemma2" else \
            f"{cfg.get('sliding_window_pattern', d.get('sliding_window_pattern'))} of every layer_types pattern"
        if window and window < model.seq_len:
            other.append((f"sliding_window ({pattern}, the others full)", window))
        other += [("norms_per_layer (sandwich norms around attention and MLP)", model.norms_per_layer),
                  ("embedding scale (inputs times sqrt(hidden_size))", f"sqrt({model.hidden})")]
        scalar = cfg.get("query_pre_attn_scalar", d["query_pre_attn_scalar"])
        if scalar != model.head_dim:
            other.append(("query_pre_attn_scalar (attention scale 1/sqrt of it, not of head_dim)", scalar))
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            cap = cfg[key] if key in cfg else d.get(key)
            if cap:
                other.append((key, cap))
        if mt == "gemma3_text" and local_theta is not None:
            other.append(("rope_local_base_freq (RoPE base of the sliding-window layers)", local_theta))
    elif window and window < model.seq_len:  # mistral, mixtral: one window on every layer
        every_layer_window = int(window)
    moe = model.is_moe
    return TrainedModel(
        source="hf", model_type=mt, rope_theta=theta, rope_scaling=scaling, norm_eps=eps, qk_norm_eps=eps,
        attention_dropout=float(_float(cfg, "attention_dropout", d["attention_dropout"])), hidden_dropout=0.0,
        init_std=float(_float(cfg, "initializer_range", d["initializer_range"])),
        aux_loss_coef=float(_float(cfg, "router_aux_loss_coef", d.get("router_aux_loss_coef", 0.0))) if moe else 0.0,
        # Mixtral always renormalises its top-k weights; Qwen-MoE only with norm_topk_prob.
        router_renorm=moe and (mt == "mixtral" or bool(cfg.get("norm_topk_prob", d.get("norm_topk_prob")))),
        sliding_window=every_layer_window, norm_plus_one=mt.startswith("gemma"), other=tuple(other), hf_config=cfg,
    )


def _builtin_architecture(m: ModelSpec) -> tuple[str, str]:
    """(transformers model_type that builds the built-in model of ``m``, or "" and why not)."""
    if m.mlp == "gelu":
        return "", "mlp=gelu: no transformers decoder has RoPE and RMSNorm with a plain GELU MLP"
    if m.mlp != "swiglu" or m.norms_per_layer != 2:
        return "", (f"mlp={m.mlp}, norms_per_layer={m.norms_per_layer}: Gemma also scales embeddings and "
                    "norms by (1 + w), which the built-in model does not")
    plain_heads = m.head_dim * m.heads == m.hidden
    if not m.is_moe:
        if m.qkv_bias and m.qk_norm:
            return "", "q/k/v biases and q/k norms together"
        if m.qkv_bias:
            return ("qwen2", "") if plain_heads else ("", "q/k/v biases with an explicit head_dim")
        return ("qwen3" if m.qk_norm else "llama"), ""
    if m.qk_norm and not m.qkv_bias and not m.shared_expert_ffn:
        return "qwen3_moe", ""
    if m.qkv_bias and not m.qk_norm and m.shared_expert_ffn and m.shared_expert_gate and plain_heads:
        return "qwen2_moe", ""
    if not (m.qkv_bias or m.qk_norm or m.shared_expert_ffn or m.dense_layers) and plain_heads:
        return "mixtral", ""
    return "", (f"experts with qkv_bias={m.qkv_bias}, qk_norm={m.qk_norm}, shared_expert_ffn={m.shared_expert_ffn}, "
                f"shared_expert_gate={m.shared_expert_gate}, dense_layers={list(m.dense_layers)}")


def _builtin_hf_config(m: ModelSpec, mt: str) -> dict[str, Any]:
    """The config.json of architecture ``mt`` that builds the built-in model of ``m``."""
    cfg: dict[str, Any] = {
        "model_type": mt, "hidden_size": m.hidden, "num_hidden_layers": m.layers, "num_attention_heads": m.heads,
        "num_key_value_heads": m.kv_heads, "intermediate_size": m.ffn, "vocab_size": m.vocab,
        "max_position_embeddings": m.seq_len, "tie_word_embeddings": m.tied_embeddings, "hidden_act": "silu",
        "rms_norm_eps": BUILTIN_NORM_EPS, "rope_theta": BUILTIN_ROPE_THETA, "rope_scaling": None,
        "attention_dropout": 0.0, "initializer_range": BUILTIN_INIT_STD,
    }
    if mt in ("llama", "qwen3", "qwen3_moe"):
        cfg["head_dim"] = m.head_dim
    if mt == "mixtral":
        cfg |= {"num_local_experts": m.experts, "num_experts_per_tok": m.top_k, "intermediate_size": m.expert_ffn}
    elif mt in ("qwen2_moe", "qwen3_moe"):
        cfg |= {"num_experts": m.experts, "num_experts_per_tok": m.top_k, "moe_intermediate_size": m.expert_ffn,
                "decoder_sparse_step": 1, "mlp_only_layers": list(m.dense_layers), "norm_topk_prob": True}
        if mt == "qwen2_moe":
            cfg |= {"shared_expert_intermediate_size": m.shared_expert_ffn, "qkv_bias": True}
    if m.is_moe:
        cfg |= {"router_aux_loss_coef": 0.0, "output_router_logits": False}
    if mt == "llama":
        cfg |= {"attention_bias": False, "mlp_bias": False}
    return cfg


def trained_model(model: ModelSpec) -> TrainedModel:
    """What ``model`` trains as (see the module docstring)."""
    if model.hf_config:
        return _from_hf(model)
    mt, why = _builtin_architecture(model)
    return TrainedModel(
        source="builtin", model_type=mt, rope_theta=BUILTIN_ROPE_THETA, rope_scaling=None, norm_eps=BUILTIN_NORM_EPS,
        qk_norm_eps=BUILTIN_QK_NORM_EPS if model.qk_norm else BUILTIN_NORM_EPS, attention_dropout=0.0,
        hidden_dropout=0.0, init_std=BUILTIN_INIT_STD, aux_loss_coef=0.0, router_renorm=model.is_moe,
        sliding_window=None, norm_plus_one=False, other=(),
        hf_config=_builtin_hf_config(model, mt) if mt else {}, no_hf=why,
    )
