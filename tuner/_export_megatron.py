"""Megatron-LM arguments and Megatron-Bridge (NeMo) recipe overrides of a layout (tuner/_export.py).

Megatron-LM copies its ``pretrain_gpt.py`` arguments into megatron-core's ``TransformerConfig`` /
``ModelParallelConfig`` and ``DistributedDataParallelConfig`` by field name; Megatron-Bridge's
``ConfigContainer`` holds the same fields under ``model``/``ddp``/``optimizer`` and the batch under
``train`` (docs/megatron-lm-to-megatron-bridge.md). Megatron's data-parallel size is
world / (tp*pp*cp) = meshtune's dp*ep; its expert layers carve ep out of it, as meshtune does.
"""

from __future__ import annotations

import json
from typing import Any

from tuner._export_job import ExportJob


def _megatron_layout(job: ExportJob) -> str:
    """``--pipeline-model-parallel-layout``: E embedding, t a decoder layer, L the loss, ``|``
    between stages in stage order (megatron.core PipelineParallelLayerLayout)."""
    parts = []
    for s, n in enumerate(job.stage_layers):
        head = "E" if s == 0 else ""
        tail = "L" if s == len(job.stage_layers) - 1 else ""
        parts.append(f"{head}{'t' * n}{tail}")
    return "|".join(parts)


def _megatron_core(job: ExportJob, caveats: list[str]) -> list[tuple[str, Any]]:
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
        if job.stage_layers != job.workers_stage_layers:
            caveats.append(f"the layers per stage {list(job.stage_layers)} balance the embedding and the loss as the "
                           f"megatron stack is predicted with; meshtune's workers ran {list(job.workers_stage_layers)}")
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


def padded_vocab(job: ExportJob, caveats: list[str]) -> int:
    """The embedding rows Megatron builds: the model's vocabulary as it is (Megatron-LM takes
    ``--padded-vocab-size`` without padding it again, megatron/training/tokenizer/tokenizer.py), rounded
    up to a multiple of tp only where tp does not divide it (VocabParallelEmbedding splits it evenly)."""
    vocab, tp = job.model.vocab, job.layout.tp
    padded = -(-vocab // tp) * tp
    if padded != vocab:
        caveats.append(f"vocab_size={vocab} is not divisible by tp={tp}: Megatron's embedding and output "
                       f"layer hold {padded} rows ({padded - vocab} padding)")
    return padded


def _rope_flags(job: ExportJob, caveats: list[str]) -> list[tuple[str, Any]]:
    """RoPE base and scaling (Megatron-LM: --rotary-base is an int; --use-rope-scaling applies Llama
    3.1's scaling with low/high frequency factors 1/4 over 8192 original positions, and Megatron-LM's
    gpt_builders.py passes GPTModel no factor, so 8 is the only one it trains)."""
    tm = job.trained
    out: list[tuple[str, Any]] = [("position-embedding-type", "rope")]
    if tm.rope_theta != int(tm.rope_theta):
        caveats.append(f"rope_theta={tm.rope_theta:g} is not an integer: Megatron-LM's --rotary-base takes one "
                       f"(exported as {int(tm.rope_theta)})")
    out.append(("rotary-base", int(tm.rope_theta)))
    sc = tm.rope_scaling
    if sc is None:
        return out
    kind = sc.get("rope_type")
    if kind == "llama3":
        out += [("use-rope-scaling", True), ("rope-scaling-factor", float(sc.get("factor", 8.0)))]
        fixed = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        differ = {k: sc.get(k) for k, v in fixed.items() if sc.get(k, v) != v}
        if differ:
            caveats.append(f"rope_scaling {json.dumps(differ, sort_keys=True)}: Megatron-LM applies Llama 3.1's "
                           "factor 8, low/high frequency factors 1/4 and 8192 original positions only")
    elif kind == "linear" and float(sc.get("factor", 0)) == int(sc.get("factor", 0)):
        out.append(("rotary-seq-len-interpolation-factor", int(sc["factor"])))
    else:
        caveats.append(f"rope_scaling={json.dumps(sc, sort_keys=True)} has no Megatron-LM flag (plain RoPE "
                       f"with base {int(tm.rope_theta)} is exported)")
    return out


def _model_flags(job: ExportJob, caveats: list[str]) -> list[tuple[str, Any]]:
    """Megatron-LM flags of the model (megatron-core TransformerConfig fields): its shape and every
    property that changes what is trained (tuner/_export_model.py)."""
    model, tm = job.model, job.trained
    out: list[tuple[str, Any]] = [
        ("num-layers", model.layers), ("hidden-size", model.hidden), ("ffn-hidden-size", model.ffn),
        ("num-attention-heads", model.heads), ("max-position-embeddings", model.seq_len),
        ("padded-vocab-size", padded_vocab(job, caveats)), *_rope_flags(job, caveats),
        ("normalization", "RMSNorm"), ("norm-epsilon", tm.norm_eps), ("disable-bias-linear", True),
        ("attention-dropout", tm.attention_dropout), ("hidden-dropout", tm.hidden_dropout),
        ("init-method-std", tm.init_std),
    ]
    if tm.norm_plus_one:
        out.append(("apply-layernorm-1p", True))
    if model.head_dim * model.heads != model.hidden:
        out.append(("kv-channels", model.head_dim))
    if model.kv_heads != model.heads:
        out += [("group-query-attention", True), ("num-query-groups", model.kv_heads)]
    if model.qkv_bias:
        out.append(("add-qkv-bias", True))
    if model.qk_norm:
        out.append(("qk-layernorm", True))
        if tm.qk_norm_eps != tm.norm_eps:
            caveats.append(f"q/k norm eps={tm.qk_norm_eps:g} (the layer norms' is {tm.norm_eps:g}): Megatron's "
                           "q/k layernorms use --norm-epsilon")
    if model.mlp == "swiglu":
        out.append(("swiglu", True))
    elif model.mlp == "geglu":  # the gated MLP's shape; its activation is the sigmoid approximation
        out.append(("quick-geglu", True))
        caveats.append("mlp=geglu: Megatron-LM's --quick-geglu gates with quick_gelu (x * sigmoid(1.702 x)), not "
                       "gelu_pytorch_tanh (exact in a model provider: gated_linear_unit=True, activation_func=gelu)")
    if tm.sliding_window is not None:
        out.append(("window-size", f"{tm.sliding_window - 1},0"))  # HF: key j seen from i iff i - j < window
        caveats.append(f"sliding_window={tm.sliding_window}: Megatron's --window-size needs Transformer "
                       "Engine's (flash) attention")
    for prop, value in tm.other:
        caveats.append(f"{prop}={value} has no Megatron-LM flag: pretrain_gpt.py trains without it")
    if not model.tied_embeddings:
        out.append(("untie-embeddings-and-output-weights", True))
    if model.is_moe:
        out += [("num-experts", model.experts), ("moe-router-topk", model.top_k),
                ("moe-ffn-hidden-size", model.expert_ffn)]
        # Megatron's default routing (softmax over the top-k logits) is the renormalised one; a
        # softmax over every expert, not renormalised (Qwen-MoE's norm_topk_prob=false), is pre-softmax.
        if not tm.router_renorm:
            out.append(("moe-router-pre-softmax", True))
        if tm.aux_loss_coef:
            out += [("moe-router-load-balancing-type", "aux_loss"), ("moe-aux-loss-coeff", tm.aux_loss_coef)]
        else:
            out.append(("moe-router-load-balancing-type", "none"))
        if job.layout.ep > 1:
            out.append(("moe-token-dispatcher-type", "alltoall"))  # meshtune's expert parallelism is all-to-all
        if model.shared_expert_ffn:
            out.append(("moe-shared-expert-intermediate-size", model.shared_expert_ffn))
            if model.shared_expert_gate:
                out.append(("moe-shared-expert-gate", True))
        dense = set(model.dense_layers)
        if dense:  # a Python list expression, as Megatron-LM's moe_freq_type reads it
            out.append(("moe-layer-freq", "[" + ",".join("0" if i in dense else "1" for i in range(model.layers)) + "]"))
    return out


def megatron_env(job: ExportJob) -> dict[str, str]:
    """The environment Megatron-LM's validate_args asks of a launch: tp or cp > 1 on GPUs before
    Blackwell needs CUDA_DEVICE_MAX_CONNECTIONS=1 (communication kernels queued ahead of compute),
    which Megatron-FSDP (zero 2/3 here) refuses."""
    lay = job.layout
    return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if (lay.tp > 1 or lay.cp > 1) and lay.zero < 2 else {}


def megatron_args(job: ExportJob) -> tuple[list[str], list[str]]:
    caveats: list[str] = []
    for name, value in megatron_env(job).items():
        caveats.append(f"environment: {name}={value} (Megatron-LM requires it for tp/cp > 1 on GPUs before "
                       "Blackwell; megatron-launch exports it)")
    pairs = _megatron_core(job, caveats)
    pairs += _model_flags(job, caveats)
    if job.layout.zero in (2, 3):
        pairs += [("no-gradient-accumulation-fusion", True), ("ckpt-format", "fsdp_dtensor")]
    caveats.append("data and tokenizer: add your --data-path and --tokenizer-type/--tokenizer-model (or "
                   f"--mock-data --tokenizer-type NullTokenizer --vocab-size {job.model.vocab - 1} for a smoke run); "
                   f"--padded-vocab-size keeps the model's {job.model.vocab} rows whatever the tokenizer's size")
    argv: list[str] = []
    for flag, value in pairs:
        argv.append(f"--{flag}")
        if value is not True:
            argv.append(str(value))
    return argv, caveats


# --- NeMo / Megatron-Bridge ------------------------------------------------------------------------

# Megatron-LM flag -> Megatron-Bridge ConfigContainer key (docs/megatron-lm-to-megatron-bridge.md:
# parallelism and model on ``model`` (a GPTModelProvider, a TransformerConfig), batch on ``train``).
_BRIDGE_KEYS = {
    "micro-batch-size": ("train.micro_batch_size",), "global-batch-size": ("train.global_batch_size",),
    "seq-length": ("model.seq_length", "dataset.seq_length"),
    "use-distributed-optimizer": ("ddp.use_distributed_optimizer", "optimizer.use_distributed_optimizer"),
    "use-megatron-fsdp": ("ddp.use_megatron_fsdp",),
    "data-parallel-sharding-strategy": ("ddp.data_parallel_sharding_strategy",),
    "overlap-grad-reduce": ("ddp.overlap_grad_reduce",),
    # the model: GPTModelProvider / TransformerConfig fields named otherwise than the flag
    "num-experts": ("model.num_moe_experts",), "norm-epsilon": ("model.layernorm_epsilon",),
    "apply-layernorm-1p": ("model.layernorm_zero_centered_gamma",), "padded-vocab-size": ("model.vocab_size",),
    "rotary-seq-len-interpolation-factor": ("model.seq_len_interpolation_factor",),
    "swiglu": ("model.gated_linear_unit",), "rope-scaling-factor": ("model.scale_factor",),  # Llama31ModelProvider
}
# Megatron-LM-only flags with no provider field (the provider derives or fixes them).
_BRIDGE_SKIP = {"group-query-attention", "max-position-embeddings", "use-rope-scaling", "no-gradient-accumulation-fusion",
                "ckpt-format", "quick-geglu"}
# store_true flags a recipe's provider may have set the other way: always given explicitly.
_BRIDGE_BOOLS = {"qk-layernorm": "model.qk_layernorm", "add-qkv-bias": "model.add_qkv_bias",
                 "apply-layernorm-1p": "model.layernorm_zero_centered_gamma",
                 "moe-router-pre-softmax": "model.moe_router_pre_softmax",
                 "moe-shared-expert-gate": "model.moe_shared_expert_gate", "sequence-parallel": "model.sequence_parallel"}

# Megatron-Bridge 0.3 pretraining recipes (src/megatron/bridge/recipes/{llama,qwen,gemma}; v0.3.x pairs
# with megatron-core 0.15-0.16): (recipe, model_type, layers, hidden, Llama 3.1 RoPE scaling).
_RECIPES = (
    ("llama3_8b", "llama", 32, 4096, False), ("llama3_70b", "llama", 80, 8192, False),
    ("llama31_8b", "llama", 32, 4096, True), ("llama31_70b", "llama", 80, 8192, True),
    ("llama31_405b", "llama", 126, 16384, True), ("llama32_1b", "llama", 16, 2048, True),
    ("llama32_3b", "llama", 28, 3072, True),
    ("qwen25_500m", "qwen2", 24, 896, False), ("qwen25_1p5b", "qwen2", 28, 1536, False),
    ("qwen25_7b", "qwen2", 28, 3584, False), ("qwen25_14b", "qwen2", 48, 5120, False),
    ("qwen25_32b", "qwen2", 64, 5120, False), ("qwen25_72b", "qwen2", 80, 8192, False),
    ("qwen3_600m", "qwen3", 28, 1024, False), ("qwen3_1p7b", "qwen3", 28, 2048, False),
    ("qwen3_4b", "qwen3", 36, 2560, False), ("qwen3_8b", "qwen3", 36, 4096, False),
    ("qwen3_14b", "qwen3", 40, 5120, False), ("qwen3_32b", "qwen3", 64, 5120, False),
    ("qwen3_30b_a3b", "qwen3_moe", 48, 2048, False), ("qwen3_235b_a22b", "qwen3_moe", 94, 4096, False),
    ("gemma2_2b", "gemma2", 26, 2304, False), ("gemma2_9b", "gemma2", 42, 3584, False),
    ("gemma2_27b", "gemma2", 46, 4608, False), ("gemma3_1b", "gemma3_text", 26, 1152, False),
)
# Architectures without a Bridge 0.3 recipe: the recipe of the same provider code, every model field overridden.
_BRIDGE_FAMILY = {"mistral": "llama", "mixtral": "qwen3_moe", "qwen2_moe": "qwen3_moe", "": "llama"}


def bridge_recipe(job: ExportJob, caveats: list[str]) -> str:
    """The Megatron-Bridge recipe to start from: the model's own (same architecture and size), else
    the first of its architecture family with the same RoPE scaling, named in a caveat."""
    m, tm = job.model, job.trained
    scaled = bool(tm.rope_scaling and tm.rope_scaling.get("rope_type") == "llama3")
    family = _BRIDGE_FAMILY.get(tm.model_type, tm.model_type)
    same = [r for r in _RECIPES if r[1] == family and r[4] == scaled]
    exact = [r for r in same if (r[2], r[3]) == (m.layers, m.hidden) and family == tm.model_type]
    recipe = (exact or same or [r for r in _RECIPES if r[1] == family] or [_RECIPES[0]])[0][0]
    if not exact:
        caveats.append(f"no Megatron-Bridge 0.3 recipe of {m.name} ({tm.model_type or 'built-in'}, {m.layers} layers, "
                       f"hidden {m.hidden}): {recipe} (the {family} provider) with every model property overridden")
    return f"{recipe}_pretrain_config"


def _bridge_value(flag: str, value: Any) -> str:
    if value is True:
        return "true"
    if flag == "pipeline-model-parallel-layout":
        return f'"{value}"'
    if flag == "window-size":
        return f"[{value}]"
    return str(value)


def nemo_overrides(job: ExportJob) -> tuple[str, list[str], list[str]]:
    """(recipe, Hydra overrides, caveats): ``run_recipe.py --recipe <recipe> <overrides>``."""
    caveats: list[str] = []
    recipe = bridge_recipe(job, caveats)
    gemma = job.trained.model_type.startswith("gemma") and recipe.startswith("gemma")
    model_caveats: list[str] = []
    pairs = _megatron_core(job, caveats) + _model_flags(job, model_caveats)
    if gemma:  # the Gemma providers build sandwich norms, GeGLU, softcapping, windows, scaled embeddings
        caveats.append(f"{recipe}'s Gemma provider builds {', '.join(p for p, _ in job.trained.other)} as "
                       "Gemma does; check its window and RoPE bases against "
                       + ", ".join(f"{p}={v}" for p, v in job.trained.other))
        model_caveats = [c for c in model_caveats if "no Megatron-LM flag" not in c]
        pairs = [(f, v) for f, v in pairs if f not in ("rotary-base", "window-size")]
    caveats += [c.replace("Megatron-LM", "Megatron-Bridge") for c in model_caveats]
    given = {flag for flag, _ in pairs}
    overrides = []
    for flag, value in pairs:
        if flag in _BRIDGE_SKIP:
            continue
        if flag == "bf16":
            overrides.append("mixed_precision=bf16_mixed")
        elif flag == "disable-bias-linear":
            overrides.append("model.add_bias_linear=false")
        elif flag == "untie-embeddings-and-output-weights":
            continue  # given below, both ways
        else:
            keys = _BRIDGE_KEYS.get(flag, (f"model.{flag.replace('-', '_')}",))
            overrides += [f"{key}={_bridge_value(flag, value)}" for key in keys]
    overrides.append(f"model.share_embeddings_and_output_weights={'true' if job.model.tied_embeddings else 'false'}")
    overrides += [f"{key}=false" for flag, key in _BRIDGE_BOOLS.items() if flag not in given]
    overrides.append("model.should_pad_vocab=false")  # model.vocab_size is the padded size already
    if not job.bf16:
        overrides.append("mixed_precision=null")  # fp32: no mixed-precision preset over the recipe's
    if job.layout.pp > 1 and job.layout.vpp > 1:
        overrides.append(f"model.virtual_pipeline_model_parallel_size={job.layout.vpp}")
    if job.layout.zero in (2, 3):
        overrides.append("checkpoint.ckpt_format=fsdp_dtensor")
        overrides.append("model.gradient_accumulation_fusion=false")
    caveats.append("the recipe's own data, tokenizer, optimizer and schedule apply; append further overrides "
                   "(e.g. train.train_iters=...); NeMo 2.0 recipes name the same parallel sizes "
                   "recipe.trainer.strategy.<field>")
    return recipe, overrides, caveats
