"""Export a layout to the configuration of the framework a team trains with (issue 14, item 3).

``export_layout(layout, model=, cluster=, training=, format=)`` returns an ``Export``: the text to
save or paste (TOML, command-line arguments, JSON, overrides), the same settings as data, and the
mapping's caveats — what the target does differently from what meshtune measured, or has no
equivalent for. Caveats are part of every output (comments, or a ``meshtune`` key in JSON); a knob
with no equivalent is said so there, never dropped silently.

Megatron-LM and Megatron-Bridge live in tuner/_export_megatron.py. Field names follow each framework's own configuration classes, which the tests build from the
output (tests/test_export.py):

- ``torchtitan``: a job-config TOML for torchtitan 0.2.x (``torchtitan.config.JobConfig``, read by
  ``ConfigManager`` from ``--job.config_file``). torchtitan 0.3 replaced TOML files with Python
  config registries; the same ``[parallelism]``/``[training]`` fields are its CLI overrides
  (``--parallelism.tensor_parallel_degree 2``), given in a comment.
- ``megatron``: Megatron-LM ``pretrain_gpt.py`` arguments (megatron/training/arguments.py), which
  Megatron-LM copies into megatron-core's ``TransformerConfig``/``ModelParallelConfig`` and
  ``DistributedDataParallelConfig`` by field name.
- ``deepspeed``: a DeepSpeed JSON config (``deepspeed.runtime.config.DeepSpeedConfig``).
- ``nemo``: Megatron-Bridge (NeMo's successor to NeMo 2 training recipes) Hydra/OmegaConf overrides
  of a recipe's ``ConfigContainer`` (``model.*`` are TransformerConfig fields, ``ddp.*``
  DistributedDataParallelConfig, ``optimizer.*`` OptimizerConfig, ``train.*`` TrainingConfig),
  as in Megatron-Bridge's docs/megatron-lm-to-megatron-bridge.md.

Degrees: meshtune's world is tp*cp*ep*dp*pp with ep inside the data dimension (tuner/_layout.py),
so every framework's data-parallel size is meshtune's dp*ep; each output says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tuner._errors import SpecError
from tuner._export_megatron import megatron_args, nemo_overrides
from tuner._layout import Layout, check_layout
from tuner._partition import partition_stages
from tuner._specs import ClusterSpec, ModelSpec, TrainingSpec

FORMATS = ("torchtitan", "megatron", "deepspeed", "nemo")
MEDIA_TYPES = {"torchtitan": "application/toml", "megatron": "text/plain", "deepspeed": "application/json",
               "nemo": "text/plain"}
EXTENSIONS = {"torchtitan": "toml", "megatron": "args", "deepspeed": "json", "nemo": "overrides"}


@dataclass(frozen=True, eq=False)
class Export:
    """One layout in one framework's terms: ``text`` is what to save (caveats included as
    comments); ``settings`` the same as data (TOML sections, argv list, JSON dict, override list)."""

    format: str
    text: str
    settings: Any
    caveats: tuple[str, ...]
    media_type: str
    filename: str

    def __post_init__(self) -> None:
        assert self.format in FORMATS and self.text.endswith("\n"), self.format


def check_format(format: str) -> str:
    """Raise SpecError naming the value unless ``format`` is an export format."""
    if format not in FORMATS:
        raise SpecError(f"format={format!r} is not an export format (one of {', '.join(FORMATS)})")
    return format


@dataclass(frozen=True)
class _Job:
    """The numbers every format needs, derived once from the layout and the problem."""

    layout: Layout
    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    microbatches: int  # per data rank and step
    data: int  # dp*ep: the frameworks' data-parallel size
    stage_layers: tuple[int, ...]  # meshtune's partition of the layers, stage s on pp rank s % pp

    @property
    def local_batch(self) -> int:
        return self.training.global_batch // self.data

    @property
    def bf16(self) -> bool:
        return self.training.precision == "bf16"


def _job(layout: Layout, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec) -> _Job:
    m = check_layout(layout, model=model, cluster=cluster, training=training)
    stages = partition_stages(model, layout.stages).layers_per_stage if layout.pp > 1 else (model.layers,)
    return _Job(layout, model, cluster, training, m, layout.dp * layout.ep, stages)


def _common_caveats(job: _Job) -> list[str]:
    lay, out = job.layout, []
    out.append(f"meshtune's dp={lay.dp} excludes ep={lay.ep}: the framework's data-parallel size is "
               f"dp*ep={job.data} (world {lay.world_size} = tp {lay.tp} * cp {lay.cp} * ep {lay.ep} * "
               f"dp {lay.dp} * pp {lay.pp}); launch on {lay.world_size} ranks")
    if job.cluster.device_kind == "cpu":
        out.append(f"measured on CPU ranks (fp32 compute, gloo); the export uses training.precision="
                   f"{job.training.precision!r} for GPUs")
    if lay.pp > 1:
        out.append(f"pipeline stages hold {list(job.stage_layers)} layers (meshtune's cost-balanced split, "
                   f"stage s on pp rank s % {lay.pp}; embedding on the first, output and loss on the last)")
    return out


# --- torchtitan ------------------------------------------------------------------------------------

_TITAN_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B"}


def _titan_fqns(job: _Job) -> list[list[str]]:
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


def _torchtitan(job: _Job) -> tuple[dict[str, dict[str, Any]], list[str]]:
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
        caveats.append("module_fqns_per_model_part uses torchtitan's Llama module names "
                       "(tok_embeddings, layers.N, norm, output); rename for another model")
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
    caveats.append("[model] is left to you: torchtitan builds its own model (model.name, model.flavor); "
                   f"meshtune measured a {job.model.layers}-layer, hidden {job.model.hidden} decoder "
                   f"({job.model.name})")
    return {"parallelism": par, "training": training, "activation_checkpoint": ac}, caveats


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {v!r}")


# Fields of torchtitan 0.3's ParallelismConfig / TrainingConfig (torchtitan/config/configs.py) among
# the ones exported: 0.3's CLI takes these as --section.field overrides of a config_registry recipe.
_TITAN_03 = {
    "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
                    "tensor_parallel_degree", "pipeline_parallel_degree", "pipeline_parallel_schedule",
                    "pipeline_parallel_microbatch_size", "context_parallel_degree", "expert_parallel_degree"},
    "training": {"local_batch_size", "global_batch_size", "seq_len", "mixed_precision_param"},
}


def _titan_cli(sections: dict[str, dict[str, Any]]) -> tuple[str, list[str]]:
    """torchtitan >= 0.3 CLI overrides of what 0.3 still names the same, and what it does not."""
    flags, other = [], []
    for sec, fields in sections.items():
        for k, v in fields.items():
            if k in _TITAN_03.get(sec, ()):
                flags.append(f"--{sec}.{k} {v}")
            else:
                other.append(f"{sec}.{k}")
    return " ".join(flags), other


# --- DeepSpeed -------------------------------------------------------------------------------------

def _deepspeed(job: _Job) -> tuple[dict[str, Any], list[str]]:
    lay, caveats = job.layout, []
    zero: dict[str, Any] = {"stage": lay.zero}
    if lay.zero >= 1:
        zero |= {"overlap_comm": True, "contiguous_gradients": True, "reduce_scatter": True}
    cfg: dict[str, Any] = {
        "train_batch_size": job.training.global_batch,
        "train_micro_batch_size_per_gpu": lay.mbs,
        "gradient_accumulation_steps": job.microbatches,
        "zero_optimization": zero,
        "bf16": {"enabled": job.bf16},
        "optimizer": {"type": "AdamW", "params": {"lr": job.training.lr}},
    }
    if lay.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": lay.tp}
        caveats.append(f"tp={lay.tp}: DeepSpeed AutoTP training (tensor_parallel.autotp_size) shards "
                       "Hugging Face models by its own plan; sp has no AutoTP equivalent"
                       if lay.sp else
                       f"tp={lay.tp}: DeepSpeed AutoTP training (tensor_parallel.autotp_size) shards "
                       "Hugging Face models by its own plan")
    if lay.cp > 1:
        cfg["sequence_parallel_size"] = lay.cp
        caveats.append(f"cp={lay.cp} maps to DeepSpeed-Ulysses (sequence_parallel_size; all-to-all over "
                       "heads), not meshtune's K/V all-gather; the model must wrap attention in "
                       "DistributedAttention")
    if lay.pp > 1:
        cfg["pipeline"] = {"stages": lay.pp, "partition": "parameters"}
        caveats.append(f"pp={lay.pp}: DeepSpeed pipelines a PipelineModule(num_stages={lay.pp}) built in "
                       "your code (give it meshtune's layer split above); its schedule is 1F1B"
                       + (f", so schedule={lay.schedule!r} has no equivalent" if lay.schedule != "1f1b" else ""))
        if lay.zero >= 2:
            caveats.append(f"zero={lay.zero} with pp={lay.pp}: DeepSpeed's PipelineEngine supports ZeRO "
                           "stage 0 or 1 only; this layout has no DeepSpeed equivalent as measured")
    if lay.ep > 1:
        caveats.append(f"ep={lay.ep} is not a config key: pass ep_size={lay.ep} to "
                       "deepspeed.moe.layer.MoE in the model (DeepSpeed-MoE puts ep inside data parallel, "
                       "as meshtune does)")
    if lay.ac != "none":
        cfg["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False}
        caveats.append(f"ac={lay.ac}: DeepSpeed configures deepspeed.checkpointing but the model decides "
                       "what to checkpoint (wrap each block for 'full', the attention sub-layer for "
                       "'selective')")
    if lay.zero == 0 and job.data > 1 and job.microbatches > 1:
        caveats.append("zero=0: DeepSpeed all-reduces gradients at the accumulation boundary, as meshtune's "
                       "replicate does once per step")
    return cfg, caveats


# --- entry point -----------------------------------------------------------------------------------

def _comment(lines: list[str], prefix: str = "# ") -> str:
    return "".join(f"{prefix}{line}\n" for line in lines)


def export_layout(
    layout: Layout, *, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, format: str,
    header: tuple[str, ...] = (),
) -> Export:
    """``layout`` in ``format``'s configuration (see the module docstring); ``header`` lines (e.g.
    which sweep and rank, what was measured) open the output. LayoutError if the layout cannot run
    on this problem, SpecError for an unknown format."""
    check_format(format)
    job = _job(layout, model, cluster, training)
    common = _common_caveats(job)
    intro = [*header, f"meshtune layout {layout.key} ({layout.short}), {job.microbatches} micro-batch(es) "
             f"of {layout.mbs} per data rank and step"]
    name = f"meshtune-{layout.key}.{EXTENSIONS[format]}"
    if format == "torchtitan":
        sections, own = _torchtitan(job)
        caveats = tuple(common + own)
        cli, rest = _titan_cli(sections)
        body = ["torchtitan 0.2 job config: train with --job.config_file <this file>",
                f"torchtitan >= 0.3 (Python config registries, no TOML): --module ... --config ... {cli}"
                f" (not validated here; set {', '.join(rest)} in the 0.3 recipe, where they moved)",
                *(f"caveat: {c}" for c in caveats)]
        text = _comment(intro + body) + "\n[job]\n" + f"description = {_toml_value('meshtune ' + layout.key)}\n"
        for sec, fields in sections.items():
            text += f"\n[{sec}]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in fields.items())
        return Export(format, text, sections, caveats, MEDIA_TYPES[format], name)
    if format == "megatron":
        argv, own = megatron_args(job)
        caveats = tuple(common + own)
        lines, i = [], 0
        while i < len(argv):  # one flag (and its value) per line, shell-continued
            take = 2 if i + 1 < len(argv) and not argv[i + 1].startswith("--") else 1
            lines.append(" ".join(_shell(a) for a in argv[i:i + take]))
            i += take
        text = (_comment(intro + ["Megatron-LM pretrain_gpt.py arguments"] + [f"caveat: {c}" for c in caveats])
                + " \\\n".join(lines) + "\n")
        return Export(format, text, argv, caveats, MEDIA_TYPES[format], name)
    if format == "deepspeed":
        cfg, own = _deepspeed(job)
        caveats = tuple(common + own)
        # JSON has no comments: the caveats travel under a key DeepSpeed does not read.
        cfg["meshtune"] = {"about": intro, "caveats": list(caveats)}
        return Export(format, json.dumps(cfg, indent=2) + "\n", cfg, caveats, MEDIA_TYPES[format], name)
    overrides, own = nemo_overrides(job)
    caveats = tuple(common + own)
    text = (_comment(intro + ["Megatron-Bridge (NeMo) recipe overrides, Hydra/OmegaConf syntax"]
                     + [f"caveat: {c}" for c in caveats]) + "".join(f"{o}\n" for o in overrides))
    return Export(format, text, overrides, caveats, MEDIA_TYPES[format], name)


def _shell(arg: str) -> str:
    return f"'{arg}'" if set(arg) & set("|[]()*") else arg
