"""Export a layout to the configuration of the framework a team trains with.

``export_layout(layout, model=, cluster=, training=, format=)`` returns an ``Export``: the text to
save or paste (TOML, command-line arguments, JSON, overrides), the same settings as data, and the
mapping's caveats (what the target does differently from what meshtune measured, or has no
equivalent for), part of every output: a knob with no equivalent is said so, never dropped.
Formats: torchtitan (tuner/_export_titan.py), Megatron-LM and Megatron-Bridge
(tuner/_export_megatron.py), DeepSpeed, and their launch scripts (tuner/_export_launch.py); the
numbers every format needs are one ``ExportJob`` (tuner/_export_job.py). The field mapping of each
format: docs/tuner.md, "Export".
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Any

from tuner._errors import SpecError
from tuner._export_job import ExportJob, export_job
from tuner._export_launch import megatron_launch, shell_lines, titan_launch
from tuner._export_megatron import megatron_args, megatron_env, nemo_overrides
from tuner._export_titan import FLAVOUR_MODULE, titan_cli, titan_model, titan_parallelism, toml_value
from tuner._layout import Layout
from tuner._specs import ClusterSpec, ModelSpec, TrainingSpec
from tuner._stack import STACKS

FORMATS = ("torchtitan", "torchtitan-launch", "megatron", "megatron-launch", "deepspeed", "nemo")
MEGATRON_FORMATS = ("megatron", "megatron-launch", "nemo")
MEDIA_TYPES = {"torchtitan": "application/toml", "torchtitan-launch": "text/x-shellscript", "megatron": "text/plain",
               "megatron-launch": "text/x-shellscript", "deepspeed": "application/json", "nemo": "text/plain"}
EXTENSIONS = {"torchtitan": "toml", "torchtitan-launch": "sh", "megatron": "args", "megatron-launch": "sh",
              "deepspeed": "json", "nemo": "args"}


@dataclass(frozen=True, eq=False)
class Export:
    """One layout in one framework's terms: ``text`` is what to save or paste (the TOML, JSON and
    scripts carry the notes as comments or under a ``meshtune`` key; argument lists are only the
    arguments); ``settings`` the same as data (TOML sections, argv list, JSON dict); ``notes`` the
    header and caveat lines; ``files`` what must sit beside ``text`` (a torchtitan flavour module)."""

    format: str
    text: str
    settings: Any
    caveats: tuple[str, ...]
    media_type: str
    filename: str
    notes: tuple[str, ...] = ()
    files: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.format in FORMATS and self.text.endswith("\n"), self.format


def check_format(format: str) -> str:
    """Raise SpecError naming the value unless ``format`` is an export format."""
    if format not in FORMATS:
        raise SpecError(f"format={format!r} is not an export format (one of {', '.join(FORMATS)})")
    return format


def _common_caveats(job: ExportJob) -> list[str]:
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


# --- DeepSpeed -------------------------------------------------------------------------------------

def _deepspeed(job: ExportJob) -> tuple[dict[str, Any], list[str]]:
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


def _deepspeed_model(job: ExportJob) -> tuple[dict[str, Any], list[str]]:
    """The Hugging Face config.json an HF-Trainer run builds the model from, and its caveats."""
    tm, caveats = job.trained, []
    if not tm.hf_config:
        caveats.append(f"no transformers architecture builds meshtune's built-in {job.model.name} ({tm.no_hf}): "
                       "meshtune.hf_config is empty; bring the model code yourself")
        return {}, caveats
    if tm.source == "builtin":
        caveats.append(f"meshtune.hf_config is the {tm.model_type} config that builds the built-in "
                       f"{job.model.name} (rope_theta {tm.rope_theta:g}, eps {tm.norm_eps:g}, no dropout)")
        if job.model.qk_norm and tm.qk_norm_eps != tm.norm_eps:
            caveats.append(f"q/k norm eps={tm.qk_norm_eps:g} (the layer norms' is {tm.norm_eps:g}): transformers' "
                           f"{tm.model_type} uses rms_norm_eps for both")
    if job.model.is_moe and tm.aux_loss_coef:
        caveats.append(f"router_aux_loss_coef={tm.aux_loss_coef:g} is added to the loss by transformers only with "
                       "output_router_logits=true in the config")
    return dict(tm.hf_config), caveats


# --- entry point -----------------------------------------------------------------------------------

def _comment(lines: list[str], prefix: str = "# ") -> str:
    return "".join(f"{prefix}{line}\n" for line in lines)


def export_layout(
    layout: Layout, *, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, format: str,
    header: tuple[str, ...] = (),
) -> Export:
    """``layout`` in ``format``'s configuration (see the module docstring); ``header`` lines (e.g.
    which sweep and rank, what was measured) open the notes. LayoutError if the layout cannot run
    on this problem, SpecError for an unknown format or a model the framework has no equivalent of."""
    check_format(format)
    # Megatron's formats split the layers as the megatron stack is predicted with (its layout flag takes
    # an embedding-only first and a loss-only last stage); the others as meshtune's workers do.
    job = export_job(layout, model, cluster, training,
                     end_stages=format in MEGATRON_FORMATS and STACKS["megatron"].end_stages)
    common = _common_caveats(job)
    tm = job.trained
    intro = [*header, f"meshtune layout {layout.key} ({layout.short}), {job.microbatches} micro-batch(es) "
             f"of {layout.mbs} per data rank and step, on {cluster.nodes} node(s) x {cluster.devices_per_node} "
             f"device(s)",
             f"model {model.name} ({tm.model_type or 'built-in'}, {'config.json' if tm.source == 'hf' else 'built-in model'}"
             f"): {tm.describe()}"]
    name = f"meshtune-{layout.key}.{EXTENSIONS[format]}"
    files: dict[str, str] = {}
    if format in ("torchtitan", "torchtitan-launch"):
        sections, own = titan_parallelism(job)
        model_section, experimental, module, model_caveats = titan_model(job)
        sections = {"model": model_section, **sections}
        if experimental:
            sections["experimental"] = experimental
            files[f"{FLAVOUR_MODULE}.py"] = module  # type: ignore[assignment]
        caveats = tuple(common + own + model_caveats)
        cli, rest = titan_cli({k: v for k, v in sections.items() if k not in ("model", "experimental")})
        body = ["torchtitan 0.2 job config: train with --job.config_file <this file>",
                f"torchtitan >= 0.3 (Python config registries, no TOML): --module ... --config ... {cli}"
                f" (not validated here; set {', '.join(rest)} in the 0.3 recipe, where they moved)",
                *(f"caveat: {c}" for c in caveats)]
        toml = _comment(intro + body) + "\n[job]\n" + f"description = {toml_value('meshtune ' + layout.key)}\n"
        for sec, fields in sections.items():
            toml += f"\n[{sec}]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in fields.items())
        notes = tuple(intro + [f"caveat: {c}" for c in caveats])
        if format == "torchtitan":
            return Export(format, toml, sections, caveats, MEDIA_TYPES[format], name, notes, files)
        script = titan_launch(job, toml=toml, toml_name=f"meshtune-{layout.key}.toml", files=files, notes=notes)
        return Export(format, script, sections, caveats, MEDIA_TYPES[format], name, notes, files)
    if format in ("megatron", "megatron-launch"):
        argv, own = megatron_args(job)
        caveats = tuple(common + own)
        notes = tuple(intro + ["Megatron-LM pretrain_gpt.py arguments"] + [f"caveat: {c}" for c in caveats])
        text = shell_lines(argv) if format == "megatron" else megatron_launch(job, argv=argv, notes=notes, env=megatron_env(job))
        return Export(format, text, argv, caveats, MEDIA_TYPES[format], name, notes)
    if format == "deepspeed":
        cfg, own = _deepspeed(job)
        hf, model_caveats = _deepspeed_model(job)
        caveats = tuple(common + own + model_caveats)
        # JSON has no comments: the notes and the model's config travel under a key DeepSpeed does not read.
        about = [*intro, "Hugging Face Trainer: model = AutoModelForCausalLM.from_config(AutoConfig.for_model("
                 "**meshtune['hf_config'])); TrainingArguments(deepspeed=<this file>, per_device_train_batch_size="
                 f"{layout.mbs}, gradient_accumulation_steps={job.microbatches})"]
        cfg["meshtune"] = {"about": about, "caveats": list(caveats), "hf_config": hf}
        notes = tuple(about + [f"caveat: {c}" for c in caveats])
        return Export(format, json.dumps(cfg, indent=2) + "\n", cfg, caveats, MEDIA_TYPES[format], name, notes)
    recipe, overrides, own = nemo_overrides(job)
    caveats = tuple(common + own)
    argv = ["--recipe", recipe, *overrides]
    notes = tuple(intro + ["Megatron-Bridge (NeMo) scripts/training/run_recipe.py arguments: the recipe and its "
                           "Hydra/OmegaConf overrides"] + [f"caveat: {c}" for c in caveats])
    text = shell_lines(argv[:2]) + "".join(f"{shlex.quote(o)}\n" for o in overrides)  # one override a line
    return Export(format, text, argv, caveats, MEDIA_TYPES[format], name, notes)
