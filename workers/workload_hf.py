"""The Hugging Face workload (``workload: hf``): ``transformers.AutoModelForCausalLM.from_config``
of the spec's ``model.hf_config`` (the config.json text), random weights, cut to the workload
contract (workers/workload.py) so that meshtune's layouts apply to the real implementation.

Pipeline stages take contiguous runs of the decoder layers (each with its own rotary module),
TP/SP splits q/k/v and gate/up by column and o/down by row, FSDP2/ZeRO and activation checkpointing
are the built-in model's code. Not realised (declared, so validation refuses them): context and
expert parallelism, and tensor parallelism of MoE models. How: docs/workers.md, "Workloads".
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from tuner import Capabilities, ModelSpec, SpecError, TrainingSpec
from workers.workload import Parts, Workload

# Decoder layers that need only hidden states + rotary position embeddings (full causal attention).
DENSE_TYPES = ("llama", "mistral", "qwen2", "qwen3")
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
SUPPORTED = DENSE_TYPES + MOE_TYPES


def hf_config_dict(spec: ModelSpec) -> dict[str, Any]:
    """The config.json mapping a spec was made from (``model.hf_config``); SpecError if none."""
    text = getattr(spec, "hf_config", "")
    if not text:
        # check_workload prefixes "workload='hf': " (it said workload='hf' twice).
        raise SpecError(f"needs model.hf_config (a Hugging Face config.json); model {spec.name!r} has none")
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise SpecError(f"model.hf_config is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise SpecError(f"model.hf_config must be a JSON object, got {type(data).__name__}")
    model_type = data.get("model_type")
    if model_type not in SUPPORTED:
        raise SpecError(f"model.hf_config model_type={model_type!r} is not supported by workload='hf' "
                        f"(supported: {', '.join(SUPPORTED)})")
    return data


def hf_config(data: dict[str, Any], spec: ModelSpec):
    """A transformers config from the mapping, checked against the ModelSpec the tuner plans with."""
    from transformers import AutoConfig

    fields = {k: v for k, v in data.items() if k not in ("model_type", "architectures", "transformers_version")}
    cfg = AutoConfig.for_model(data["model_type"], **fields)
    for ours, theirs in (("layers", "num_hidden_layers"), ("hidden", "hidden_size"), ("vocab", "vocab_size"),
                         ("heads", "num_attention_heads"), ("kv_heads", "num_key_value_heads")):
        if getattr(cfg, theirs, None) != getattr(spec, ours):
            raise SpecError(f"model.hf_config {theirs}={getattr(cfg, theirs, None)} but model.{ours}={getattr(spec, ours)}")
    window = getattr(cfg, "sliding_window", None)
    if window and window < spec.seq_len:  # full causal attention is what the workload runs
        raise SpecError(f"model.hf_config sliding_window={window} < model.seq_len={spec.seq_len}: "
                        "workload='hf' runs full causal attention only")
    return cfg


class RotaryContext(nn.Module):
    """Every decoder layer's ``position_embeddings`` (cos, sin) from the positions, computed per
    pipeline stage with the model's own rotary module (no parameters)."""

    def __init__(self, rotary: nn.Module) -> None:
        super().__init__()
        self.rotary = rotary

    def forward(self, h: torch.Tensor, positions: torch.Tensor) -> dict[str, Any]:
        like = torch.empty(0, dtype=h.dtype, device=positions.device)  # HF reads only dtype and device
        return {"position_embeddings": self.rotary(like, positions[None])}


def _local_heads(block: nn.Module, q_heads: int, kv_heads: int) -> None:
    block.self_attn.num_key_value_groups = q_heads // kv_heads


def _is_moe(data: dict[str, Any]) -> bool:
    return data.get("model_type") in MOE_TYPES


def build(spec: ModelSpec, training: TrainingSpec) -> Parts:
    from transformers import AutoModelForCausalLM

    data = hf_config_dict(spec)
    cfg = hf_config(data, spec)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    model.train()
    inner = model.model
    plan: dict[str, str] = {
        "input_layernorm": "sequence_parallel", "post_attention_layernorm": "sequence_parallel",
        "self_attn": "sequence_gather", "mlp": "sequence_gather",
        "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
        "self_attn.o_proj": "rowwise",
    }
    if not _is_moe(data):
        plan.update({"mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"})
    if hasattr(inner.layers[0].self_attn, "q_norm"):  # Qwen3: RMSNorm per head, each rank its heads
        plan.update({"self_attn.q_norm": "head_norm", "self_attn.k_norm": "head_norm"})
    return Parts(embed=inner.embed_tokens, blocks=list(inner.layers), norm=inner.norm, head=model.lm_head,
                 context=RotaryContext(inner.rotary_emb), tp_plan=plan,
                 kv_projections=("self_attn.k_proj", "self_attn.v_proj"), on_tp=_local_heads,
                 selective_ac="self_attn")


def capabilities(spec: ModelSpec) -> Capabilities:
    moe = _is_moe(hf_config_dict(spec))
    return Capabilities(workload="hf", tp=not moe, sp=not moe, pp=True, cp=False, ep=False)


HF = Workload(name="hf", build=build, capabilities=capabilities)
