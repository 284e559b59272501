"""Megatron-LM arguments and Megatron-Bridge (NeMo) recipe overrides of a layout (tuner/_export.py).

Megatron-LM copies its ``pretrain_gpt.py`` arguments into megatron-core's ``TransformerConfig`` /
``ModelParallelConfig`` and ``DistributedDataParallelConfig`` by field name; Megatron-Bridge's
``ConfigContainer`` holds the same fields under ``model``/``ddp``/``optimizer`` and the batch under
``train`` (docs/megatron-lm-to-megatron-bridge.md). Megatron's data-parallel size is
world / (tp*pp*cp) = meshtune's dp*ep; its expert layers carve ep out of it, as meshtune does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tuner._export import _Job


def _megatron_layout(job: _Job) -> str:
    """``--pipeline-model-parallel-layout``: E embedding, t a decoder layer, L the loss, ``|``
    between stages in stage order (megatron.core PipelineParallelLayerLayout)."""
    parts = []
    for s, n in enumerate(job.stage_layers):
        head = "E" if s == 0 else ""
        tail = "L" if s == len(job.stage_layers) - 1 else ""
        parts.append(f"{head}{'t' * n}{tail}")
    return "|".join(parts)


def _megatron_core(job: _Job, caveats: list[str]) -> list[tuple[str, Any]]:
    """(Megatron-LM flag without dashes, value) pairs shared by Megatron-LM and Megatron-Bridge;
    value True is a store_true flag."""
    lay, model = job.layout, job.model
    out: list[tuple[str, Any]] = [
        ("tensor-model-parallel-size", lay.tp), ("pipeline-model-parallel-size", lay.pp),
        ("context-parallel-size", lay.cp), ("expert-model-parallel-size", lay.ep),
    ]
    if lay.ep > 1:
        out.append(("expert-tensor-parallel-size", lay.tp))  # meshtune splits each expert's ffn over tp
    if lay.sp:
        out.append(("sequence-parallel", True))
    if lay.pp > 1:
        # The exact split (and with it the virtual stages): Megatron-LM's validate_args allows only
        # one of this, --num-virtual-stages-per-pipeline-rank and --num-layers-per-virtual-pipeline-stage.
        out.append(("pipeline-model-parallel-layout", _megatron_layout(job)))
        if lay.schedule == "gpipe":
            caveats.append("schedule=gpipe has no Megatron equivalent: Megatron runs 1F1B "
                           f"(at most pp={lay.pp} micro-batches in flight, not all {job.microbatches})")
        if lay.schedule == "interleaved":
            caveats.append(f"interleaved: the layout's {lay.stages} stages give {lay.vpp} virtual stages per "
                           "rank (Megatron derives its virtual pipeline size from the layout)")
    out += [("micro-batch-size", lay.mbs), ("global-batch-size", job.training.global_batch),
            ("seq-length", model.seq_len)]
    if lay.ac == "full":
        out += [("recompute-granularity", "full"), ("recompute-method", "uniform"), ("recompute-num-layers", 1)]
    elif lay.ac == "selective":
        out.append(("recompute-granularity", "selective"))
        caveats.append("ac=selective: Megatron's selective recompute covers core attention (softmax, "
                       "dropout, QK^T, AV); meshtune recomputed the whole attention sub-layer")
    if lay.zero >= 1:
        out.append(("use-distributed-optimizer", True))
    if lay.zero in (2, 3):
        strategy = "optim_grads" if lay.zero == 2 else "optim_grads_params"
        out += [("use-megatron-fsdp", True), ("data-parallel-sharding-strategy", strategy)]
        caveats.append(f"zero={lay.zero} maps to Megatron-FSDP ({strategy}), which needs the fsdp_dtensor "
                       "checkpoint format and no gradient-accumulation fusion (both set here)")
    elif lay.zero == 1:
        caveats.append("zero=1 maps to Megatron's distributed optimizer (optimizer state and fp32 main "
                       "weights sharded, gradients reduce-scattered once per step)")
    if job.data > 1:
        out.append(("overlap-grad-reduce", True))  # meshtune overlaps the gradient reduction
    if job.bf16:
        out.append(("bf16", True))
    return out


def _model_flags(job: _Job, caveats: list[str]) -> list[tuple[str, Any]]:
    """Megatron-LM flags of the model's shape (megatron-core TransformerConfig fields)."""
    model = job.model
    out: list[tuple[str, Any]] = [
        ("num-layers", model.layers), ("hidden-size", model.hidden), ("ffn-hidden-size", model.ffn),
        ("num-attention-heads", model.heads), ("max-position-embeddings", model.seq_len),
        # meshtune's decoder (workers/model.py): RMSNorm, RoPE, no biases but those on q/k/v.
        ("normalization", "RMSNorm"), ("position-embedding-type", "rope"), ("disable-bias-linear", True),
    ]
    if model.head_dim * model.heads != model.hidden:
        out.append(("kv-channels", model.head_dim))
    if model.kv_heads != model.heads:
        out += [("group-query-attention", True), ("num-query-groups", model.kv_heads)]
    if getattr(model, "qkv_bias", False):
        out.append(("add-qkv-bias", True))
    if getattr(model, "qk_norm", False):
        out.append(("qk-layernorm", True))
    if model.mlp == "swiglu":
        out.append(("swiglu", True))
    elif model.mlp == "geglu":
        caveats.append("mlp=geglu has no Megatron-LM flag: set TransformerConfig gated_linear_unit=True "
                       "with activation_func=gelu in your model provider")
    if getattr(model, "norms_per_layer", 2) != 2:
        caveats.append(f"norms_per_layer={model.norms_per_layer} (sandwich norms) has no Megatron-LM flag")
    if not model.tied_embeddings:
        out.append(("untie-embeddings-and-output-weights", True))
    if model.is_moe:
        out += [("num-experts", model.experts), ("moe-router-topk", model.top_k),
                ("moe-ffn-hidden-size", model.expert_ffn)]
        if getattr(model, "shared_expert_ffn", 0):
            out.append(("moe-shared-expert-intermediate-size", model.shared_expert_ffn))
            if getattr(model, "shared_expert_gate", False):
                out.append(("moe-shared-expert-gate", True))
        dense = set(getattr(model, "dense_layers", ()))
        if dense:  # a Python list expression, as Megatron-LM's moe_freq_type reads it
            out.append(("moe-layer-freq", "[" + ",".join("0" if i in dense else "1" for i in range(model.layers)) + "]"))
    return out


def megatron_args(job: _Job) -> tuple[list[str], list[str]]:
    caveats: list[str] = []
    pairs = _megatron_core(job, caveats)
    pairs += _model_flags(job, caveats)
    if job.layout.zero in (2, 3):
        pairs += [("no-gradient-accumulation-fusion", True), ("ckpt-format", "fsdp_dtensor")]
    caveats.append(f"the model flags describe meshtune's {job.model.name}; the tokenizer decides the "
                   f"vocabulary (meshtune's vocab={job.model.vocab}): add your data and tokenizer flags")
    argv: list[str] = []
    for flag, value in pairs:
        argv.append(f"--{flag}")
        if value is not True:
            argv.append(str(value))
    return argv, caveats


# --- NeMo / Megatron-Bridge ------------------------------------------------------------------------

# Megatron-LM flag -> Megatron-Bridge ConfigContainer key (docs/megatron-lm-to-megatron-bridge.md:
# parallelism and model shape on ``model`` (a TransformerConfig), batch on ``train``).
_BRIDGE_KEYS = {
    "micro-batch-size": ("train.micro_batch_size",), "global-batch-size": ("train.global_batch_size",),
    "seq-length": ("model.seq_length", "dataset.seq_length"),
    "use-distributed-optimizer": ("ddp.use_distributed_optimizer", "optimizer.use_distributed_optimizer"),
    "use-megatron-fsdp": ("ddp.use_megatron_fsdp",),
    "data-parallel-sharding-strategy": ("ddp.data_parallel_sharding_strategy",),
    "overlap-grad-reduce": ("ddp.overlap_grad_reduce",),
}


def nemo_overrides(job: _Job) -> tuple[list[str], list[str]]:
    caveats: list[str] = []
    overrides = []
    for flag, value in _megatron_core(job, caveats):
        if flag == "bf16":
            overrides.append("mixed_precision=bf16_mixed")
            continue
        keys = _BRIDGE_KEYS.get(flag, (f"model.{flag.replace('-', '_')}",))
        text = "true" if value is True else (f'"{value}"' if flag == "pipeline-model-parallel-layout" else value)
        overrides += [f"{key}={text}" for key in keys]
    if not job.bf16:
        overrides.append("mixed_precision=null")  # fp32: no mixed-precision preset over the recipe's
    if job.layout.pp > 1 and job.layout.vpp > 1:
        overrides.append(f"model.virtual_pipeline_model_parallel_size={job.layout.vpp}")
    if job.layout.zero in (2, 3):
        overrides.append("checkpoint.ckpt_format=fsdp_dtensor")
        overrides.append("model.gradient_accumulation_fusion=false")
    caveats.append("recipe overrides: start from the Megatron-Bridge recipe of your model "
                   "(e.g. run_recipe.py --recipe llama3_8b_pretrain_config) and append these; NeMo 2.0 "
                   "recipes name the same parallel sizes recipe.trainer.strategy.<field>")
    return overrides, caveats
