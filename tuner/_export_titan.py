"""torchtitan 0.2 job config of a layout (tuner/_export.py): ``[parallelism]``, ``[training]`` and
``[activation_checkpoint]`` from the layout, and ``[model]`` from the model: a flavour torchtitan 0.2
ships when one has the model's arguments (``llama3``: Llama 3.1 8B/70B/405B; ``qwen3``: Qwen3
0.6B-32B, 30B-A3B, 235B-A22B), else a flavour of the same model code registered by a small module
(``[experimental] custom_import``), else a refusal naming what no torchtitan 0.2 model has.

torchtitan's module names (tok_embeddings, layers.N, norm, output) are those of both models.
"""

from __future__ import annotations

import json
from typing import Any

from tuner._errors import SpecError
from tuner._export_job import ExportJob

# --- torchtitan ------------------------------------------------------------------------------------

_TITAN_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B"}


def _titan_fqns(job: ExportJob) -> list[list[str]]:
    """torchtitan's ``module_fqns_per_model_part`` for meshtune's partition (Llama module names:
    tok_embeddings, layers.N, norm, output), one list per stage in stage order."""
    parts, first = [], 0
    for s, n in enumerate(job.stage_layers):
        part = ["tok_embeddings"] if s == 0 else []
        part += [f"layers.{i}" for i in range(first, first + n)]
        if s == len(job.stage_layers) - 1:
            part += ["norm", "output"]
        parts.append(part)
        first += n
    return parts


def titan_parallelism(job: ExportJob) -> tuple[dict[str, dict[str, Any]], list[str]]:
    lay, caveats = job.layout, []
    fsdp = lay.zero > 0
    # torchtitan borrows EP from dp_shard*cp (parallel_dims: efsdp = dp_shard*cp*tp/(etp*ep)), so
    # with experts the ep ranks must be in the shard dimension even at ZeRO-0; and its DDP runs only
    # as the sole parallelism (llama3/infra/parallelize.py: "DDP has not supported > 1D parallelism").
    if fsdp:
        replicate, shard = 1, job.data
    elif lay.ep > 1:
        replicate, shard = lay.dp, lay.ep
        caveats.append(f"zero=0 with ep={lay.ep}: torchtitan takes expert parallelism from the FSDP "
                       f"dimension, so dense weights are FSDP-sharded over the ep group (replicate "
                       f"{lay.dp} x shard {lay.ep}, HSDP), where meshtune replicated them")
    elif job.data > 1 and lay.cp == 1 and lay.world_size > job.data:
        replicate, shard, fsdp = 1, job.data, True
        caveats.append(f"zero=0 with tp={lay.tp}, pp={lay.pp}: torchtitan's DDP runs only without other "
                       "parallelism, so this is FSDP over the data ranks with weights kept gathered "
                       "from forward to backward (ZeRO-2-like: states sharded, where meshtune "
                       "replicated them)")
    else:
        replicate, shard = job.data, 1
    if not fsdp and lay.cp > 1:
        caveats.append(f"zero=0 with cp={lay.cp}: torchtitan applies FSDP over dp_shard*cp whenever "
                       "cp > 1, so weights are sharded over the cp group (meshtune replicated them)")
    par: dict[str, Any] = {
        "data_parallel_replicate_degree": replicate,
        "data_parallel_shard_degree": shard,
        "tensor_parallel_degree": lay.tp,
        "context_parallel_degree": lay.cp,
        "expert_parallel_degree": lay.ep,
        "expert_tensor_parallel_degree": lay.tp if lay.ep > 1 else 1,
        "pipeline_parallel_degree": lay.pp,
    }
    if fsdp:
        # ZeRO-3 frees each block's gathered weights after forward; ZeRO-1/2 keep them (FSDP2
        # reshard_after_forward=False, as meshtune's workers build them).
        par["fsdp_reshard_after_forward"] = "always" if lay.zero == 3 else "never"  # zero=0 here: never
        if lay.zero >= 2 and job.microbatches > 1 and lay.pp > 1:
            # tuner/_realise.py: torch.distributed.pipelining alone defers every FSDP sync to the step's end.
            caveats.append(f"zero={lay.zero} with pp={lay.pp}: torch.distributed.pipelining (torchtitan's "
                           "schedules) reduce-scatters gradients once at the step's end, holding them "
                           "unsharded; meshtune's workers synced after every micro-batch")
    if lay.tp > 1:
        par["disable_loss_parallel"] = False  # meshtune's loss is torch's loss_parallel under tp
        if not lay.sp:
            caveats.append("sp=false has no torchtitan equivalent: its TP plan always shards norms "
                           "along the sequence (sequence parallel) when tensor_parallel_degree > 1")
    if lay.cp > 1:
        par["context_parallel_rotate_method"] = "allgather"
        caveats.append("cp: torchtitan's context parallel is ring attention over SDPA with the K/V "
                       "rotated by all-gather; meshtune all-gathers kv_heads-sized K/V per layer once")
    if lay.pp > 1:
        par["pipeline_parallel_schedule"] = _TITAN_SCHEDULES[lay.schedule]
        par["pipeline_parallel_microbatch_size"] = lay.mbs
        par["module_fqns_per_model_part"] = _titan_fqns(job)
        if lay.schedule == "interleaved":
            caveats.append(f"interleaved: {lay.vpp} virtual stages per rank are the "
                           f"{lay.stages} model parts of module_fqns_per_model_part")
    elif job.microbatches > 1 and job.data > 1:
        caveats.append(f"m={job.microbatches} micro-batches at pp=1 are torchtitan's gradient accumulation "
                       "(global_batch_size / (local_batch_size * data degree)); it syncs gradients after "
                       "every one" + ("" if lay.zero >= 2 else
                                      f", where meshtune's zero={lay.zero} reduced once per step"))
    ac: dict[str, Any] = {"mode": lay.ac}
    if lay.ac == "selective":
        ac["selective_ac_option"] = "op"
        caveats.append("ac=selective: meshtune recomputes each block's attention sub-layer; torchtitan's "
                       "selective 'op' mode saves matmul outputs and recomputes the rest")
    # Per data rank: pp > 1 splits local_batch_size into micro-batches of
    # pipeline_parallel_microbatch_size; pp = 1 accumulates global / (local * data degree) of them.
    training = {
        "local_batch_size": job.local_batch if lay.pp > 1 else lay.mbs,
        "global_batch_size": job.training.global_batch,
        "seq_len": job.model.seq_len,
        "mixed_precision_param": "bfloat16" if job.bf16 else "float32",
    }
    return {"parallelism": par, "training": training, "activation_checkpoint": ac}, caveats


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {v!r}")


# Fields of torchtitan 0.3's ParallelismConfig / TrainingConfig (torchtitan/config/configs.py) among
# the ones exported: 0.3's CLI takes these as --section.field overrides of a config_registry recipe.
_TITAN_03 = {
    "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
                    "tensor_parallel_degree", "pipeline_parallel_degree", "pipeline_parallel_schedule",
                    "pipeline_parallel_microbatch_size", "context_parallel_degree", "expert_parallel_degree"},
    "training": {"local_batch_size", "global_batch_size", "seq_len", "mixed_precision_param"},
}


def titan_cli(sections: dict[str, dict[str, Any]]) -> tuple[str, list[str]]:
    """torchtitan >= 0.3 CLI overrides of what 0.3 still names the same, and what it does not."""
    flags, other = [], []
    for sec, fields in sections.items():
        for k, v in fields.items():
            if k in _TITAN_03.get(sec, ()):
                flags.append(f"--{sec}.{k} {v}")
            else:
                other.append(f"{sec}.{k}")
    return " ".join(flags), other



# --- [model] ---------------------------------------------------------------------------------------

# The flavours torchtitan 0.2 ships for the two model codes meshtune's architectures map to
# (torchtitan/models/llama3/__init__.py llama3_args, models/qwen3/__init__.py qwen3_args; the debug
# and flex/varlen-attention variants left out), in torchtitan's field names. tests/tuner/test_export_models.py
# reads every one back from the installed torchtitan.
_LLAMA31 = {"norm_eps": 1e-5, "rope_theta": 500_000.0, "rope_scaling": (8.0, 1.0, 4.0, 8192), "vocab_size": 128256}
_QWEN3 = {"vocab_size": 151936, "head_dim": 128, "norm_eps": 1e-6, "rope_theta": 1_000_000.0, "qk_norm": True,
          "moe_enabled": False}
_QWEN3_MOE = {"num_shared_experts": 0, "score_func": "softmax", "route_norm": True, "route_scale": 1.0,
              "score_before_experts": False}
TITAN_FLAVOURS: dict[tuple[str, str], dict[str, Any]] = {
    ("llama3", "8B"): _LLAMA31 | {"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8,
                                  "ffn_dim_multiplier": 1.3, "multiple_of": 1024},
    ("llama3", "70B"): _LLAMA31 | {"dim": 8192, "n_layers": 80, "n_heads": 64, "n_kv_heads": 8,
                                   "ffn_dim_multiplier": 1.3, "multiple_of": 4096},
    ("llama3", "405B"): _LLAMA31 | {"dim": 16384, "n_layers": 126, "n_heads": 128, "n_kv_heads": 8,
                                    "ffn_dim_multiplier": 1.2, "multiple_of": 4096},
    ("qwen3", "0.6B"): _QWEN3 | {"dim": 1024, "n_layers": 28, "n_heads": 16, "n_kv_heads": 8, "hidden_dim": 3072,
                                 "enable_weight_tying": True},
    ("qwen3", "1.7B"): _QWEN3 | {"dim": 2048, "n_layers": 28, "n_heads": 16, "n_kv_heads": 8, "hidden_dim": 6144,
                                 "enable_weight_tying": True},
    ("qwen3", "4B"): _QWEN3 | {"dim": 2560, "n_layers": 36, "n_heads": 32, "n_kv_heads": 8, "hidden_dim": 9728,
                               "enable_weight_tying": True},
    ("qwen3", "8B"): _QWEN3 | {"dim": 4096, "n_layers": 36, "n_heads": 32, "n_kv_heads": 8, "hidden_dim": 12288,
                               "enable_weight_tying": False},
    ("qwen3", "14B"): _QWEN3 | {"dim": 5120, "n_layers": 40, "n_heads": 40, "n_kv_heads": 8, "hidden_dim": 17408,
                                "enable_weight_tying": False},
    ("qwen3", "32B"): _QWEN3 | {"dim": 5120, "n_layers": 64, "n_heads": 64, "n_kv_heads": 8, "hidden_dim": 25600,
                                "enable_weight_tying": False},
    ("qwen3", "30B-A3B"): _QWEN3 | {"dim": 2048, "n_layers": 48, "n_heads": 32, "n_kv_heads": 4, "hidden_dim": 6144,
                                    "enable_weight_tying": False, "moe_enabled": True, "moe_inter_dim": 768,
                                    "moe_args": _QWEN3_MOE | {"num_experts": 128, "top_k": 8}},
    ("qwen3", "235B-A22B"): _QWEN3 | {"dim": 4096, "n_layers": 94, "n_heads": 64, "n_kv_heads": 4,
                                      "hidden_dim": 12288, "rope_theta": 5_000_000.0, "enable_weight_tying": False,
                                      "moe_enabled": True, "moe_inter_dim": 1536,
                                      "moe_args": _QWEN3_MOE | {"num_experts": 128, "top_k": 8}},
}
FLAVOUR_MODULE = "meshtune_flavor"  # the module a custom flavour is registered by (custom_import)


def llama3_ffn(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """torchtitan llama3 FeedForward's hidden size: 2/3 of 4*dim (Shazeer 2020's SwiGLU at equal
    parameters), times ffn_dim_multiplier, rounded up to multiple_of (models/llama3/model/model.py)."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def _comparable(model: str, args: dict[str, Any]) -> dict[str, Any]:
    """What a flavour's arguments build, so that two spellings of one model compare equal."""
    out = dict(args)
    if model == "llama3":
        out["ffn"] = llama3_ffn(out["dim"], out.pop("multiple_of"), out.pop("ffn_dim_multiplier"))
    elif not out.get("moe_enabled"):
        out.pop("moe_inter_dim", None)
        out.pop("moe_args", None)
    return out


def titan_model_args(job: ExportJob) -> tuple[str, dict[str, Any]]:
    """(torchtitan model, its arguments) that build ``job.model`` as it trains; SpecError naming every
    property no torchtitan 0.2 model has."""
    m, tm = job.model, job.trained
    missing = []
    if m.qkv_bias:
        missing.append("qkv_bias=true (q/k/v projection biases)")
    if m.mlp != "swiglu":
        missing.append(f"mlp={m.mlp}")
    if m.norms_per_layer != 2:
        missing.append(f"norms_per_layer={m.norms_per_layer}")
    if m.shared_expert_ffn:
        missing.append(f"shared_expert_ffn={m.shared_expert_ffn}" + (" with a sigmoid gate" if m.shared_expert_gate else ""))
    if m.dense_layers:
        missing.append(f"dense_layers={list(m.dense_layers)} (dense MLPs among MoE layers)")
    if tm.norm_plus_one:
        missing.append("RMSNorm scaled by (1 + weight)")
    if tm.sliding_window is not None:
        missing.append(f"sliding_window={tm.sliding_window}")
    missing += [f"{prop}={value}" for prop, value in tm.other]
    sc = tm.rope_scaling
    llama_rope = sc is None or sc.get("rope_type") == "llama3"
    use_llama = not (m.is_moe or m.qk_norm or m.tied_embeddings or m.head_dim * m.heads != m.hidden)
    if not use_llama and sc is not None:
        missing.append(f"rope_scaling={json.dumps(sc, sort_keys=True)} (torchtitan's qwen3 has plain RoPE)")
    elif use_llama and not llama_rope:
        missing.append(f"rope_scaling={json.dumps(sc, sort_keys=True)} (torchtitan's llama3 scales as Llama 3.1)")
    if missing:
        raise SpecError(f"format=torchtitan: no torchtitan 0.2 model builds {m.name} ({tm.model_type or 'built-in'}): "
                        f"{'; '.join(missing)} (torchtitan ships llama3 and qwen3 of these architectures)")
    common = {"dim": m.hidden, "n_layers": m.layers, "n_heads": m.heads, "n_kv_heads": m.kv_heads,
              "vocab_size": m.vocab, "norm_eps": tm.norm_eps, "rope_theta": tm.rope_theta}
    if use_llama:
        scaling = (1.0, 1.0, 4.0, 8192) if sc is None else (  # factor 1: Llama 3.1's scaling is the identity
            float(sc.get("factor", 8.0)), float(sc.get("low_freq_factor", 1.0)),
            float(sc.get("high_freq_factor", 4.0)), int(sc.get("original_max_position_embeddings", 8192)))
        # multiple_of = ffn with a multiplier that lands at most on it: the rounding gives ffn exactly.
        base = llama3_ffn(m.hidden, 1, None)
        return "llama3", common | {"rope_scaling": scaling, "multiple_of": m.ffn, "ffn_dim_multiplier": m.ffn / base}
    args = common | {"head_dim": m.head_dim, "hidden_dim": m.ffn, "qk_norm": m.qk_norm,
                     "enable_weight_tying": m.tied_embeddings, "moe_enabled": m.is_moe}
    if m.is_moe:
        args |= {"moe_inter_dim": m.expert_ffn, "moe_args": _QWEN3_MOE | {
            "num_experts": m.experts, "top_k": m.top_k, "route_norm": tm.router_renorm}}
    return "qwen3", args


def shipped_flavour(model: str, args: dict[str, Any]) -> str | None:
    """The torchtitan 0.2 flavour of ``model`` that builds ``args``, if one does."""
    want = _comparable(model, args)
    for (name, flavour), shipped in TITAN_FLAVOURS.items():
        if name == model and _comparable(model, shipped) == want:
            return flavour
    return None


def _py(value: Any) -> str:
    if isinstance(value, dict):
        return "MoEArgs(" + ", ".join(f"{k}={_py(v)}" for k, v in value.items()) + ")"
    if isinstance(value, tuple):
        return "RoPEScalingArgs(scaling_factor={!r}, low_freq_factor={!r}, high_freq_factor={!r}, " \
               "original_max_position_embeddings={!r})".format(*value)
    return repr(value)


def flavour_module(model: str, flavour: str, args: dict[str, Any], *, about: str) -> str:
    """A module registering torchtitan train spec ``meshtune_<model>``: torchtitan's own ``model``
    spec with one flavour, ``args`` (``[experimental] custom_import`` imports it)."""
    kind = {"llama3": ("TransformerModelArgs", "from torchtitan.models.llama3.model.args import RoPEScalingArgs\n"),
            "qwen3": ("Qwen3ModelArgs", "from torchtitan.models.moe import MoEArgs\n")}[model]
    fields = ",\n        ".join(f"{k if k != 'rope_scaling' else 'rope_scaling_args'}={_py(v)}" for k, v in args.items())
    return (f'"""torchtitan flavour {flavour!r} of {model}: {about} (written by meshtune export)."""\n\n'
            "from dataclasses import replace\n\n"
            f"from torchtitan.models.{model} import {kind[0]}, get_train_spec\n{kind[1]}"
            "from torchtitan.protocols.train_spec import register_train_spec\n\n"
            f"register_train_spec(\"meshtune_{model}\", replace(get_train_spec(), model_args={{\n"
            f"    {flavour!r}: {kind[0]}(\n        {fields},\n    ),\n}}))\n")


def titan_model(job: ExportJob) -> tuple[dict[str, Any], dict[str, Any], str | None, list[str]]:
    """``[model]`` (and ``[experimental]`` when a flavour module is needed), the module's text (None
    when torchtitan ships the flavour), and the caveats."""
    model, args = titan_model_args(job)
    tm, caveats = job.trained, []
    if tm.attention_dropout or tm.hidden_dropout:
        caveats.append(f"attention/hidden dropout={tm.attention_dropout:g}/{tm.hidden_dropout:g}: torchtitan's "
                       "models have no dropout")
    if job.model.qk_norm and tm.qk_norm_eps != tm.norm_eps:
        caveats.append(f"q/k norm eps={tm.qk_norm_eps:g} (the layer norms' is {tm.norm_eps:g}): torchtitan's qwen3 "
                       "uses norm_eps for both")
    if job.model.is_moe:
        caveats.append(("router_aux_loss_coef=" f"{tm.aux_loss_coef:g}" if tm.aux_loss_coef else "no auxiliary loss")
                       + ": torchtitan's MoE has no auxiliary loss; it balances experts by updating a routing bias "
                       "(moe_args.load_balance_coeff=0.001)")
    caveats.append(f"init: torchtitan's own (truncated normal, depth-scaled), not normal(0, {tm.init_std:g})"
                   " (matters only from scratch)")
    caveats.append("[model] hf_assets_path: set it to the model's tokenizer directory (torchtitan's default is "
                   "its test tokenizer)")
    flavour = shipped_flavour(model, args)
    if flavour is not None:
        return {"name": model, "flavor": flavour}, {}, None, caveats
    flavour = "meshtune"
    caveats.append(f"torchtitan 0.2 ships no {model} flavour with these arguments: {FLAVOUR_MODULE}.py registers "
                   f"train spec meshtune_{model}, flavour {flavour!r} (keep it on PYTHONPATH beside the job config)")
    text = flavour_module(model, flavour, args, about=f"{job.model.name}, {job.model.layers} layers, hidden {job.model.hidden}")
    return {"name": f"meshtune_{model}", "flavor": flavour}, {"custom_import": FLAVOUR_MODULE}, text, caveats
