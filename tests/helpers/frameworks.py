"""Each framework's own classes reading back an export of a layout (tuner.export_layout), shared by
the export tests (tests/api/export/test_export.py, tests/tuner/test_export_models.py, the CLI's end to end).

- torchtitan 0.2.x: ``ConfigManager.parse_args(["--job.config_file", f])`` builds its ``JobConfig``
  (unknown TOML fields are refused there), and ``ParallelDims`` validates the degrees.
- Megatron-LM: its ``pretrain_gpt.py`` flags become megatron-core's ``TransformerConfig``,
  ``DistributedDataParallelConfig`` and ``OptimizerConfig`` by field name, as Megatron-LM's
  ``core_transformer_config_from_args`` copies them; the other flags are checked against its argument names.
- DeepSpeed: ``DeepSpeedConfig`` with the job's data-parallel size, which checks the batch triple.
- Megatron-Bridge (NeMo): needs Transformer Engine (CUDA) to import, so its ``model.*``, ``ddp.*`` and
  ``optimizer.*`` overrides are built as the megatron-core classes Bridge subclasses.
A case is ``(name, model, cluster, training, layout)``.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import shlex
import sys
import types
import warnings
from types import SimpleNamespace

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: torchtitan 0.2 depends on tomli
    import tomli as tomllib

from tuner import SpecError, export_layout, microbatches
from tuner._export_model import trained_model
from tuner._export_titan import titan_model_args


def export_case(case, fmt):
    """The export of ``case`` in format ``fmt``."""
    _, model, cluster, training, layout = case
    return export_layout(layout, model=model, cluster=cluster, training=training, format=fmt)


def quiet_import(name):
    """``name`` imported without its import-time warnings, or the test skipped where it is not installed."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip(name, reason=f"{name} is in the test extra (pip install -e .[test])")


# --- torchtitan ------------------------------------------------------------------------------------

def torchtitan_config():
    """torchtitan.config without running torchtitan/__init__.py, which imports its MoE Triton
    kernels (no triton on a CPU torch): a bare package object over the installed directory."""
    if "torchtitan.config" in sys.modules:
        return sys.modules["torchtitan.config"], sys.modules["torchtitan.distributed.parallel_dims"]
    spec = importlib.util.find_spec("torchtitan")
    if spec is None:
        pytest.skip("torchtitan is in the test extra (pip install -e .[test])")
    pkg = types.ModuleType("torchtitan")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules.setdefault("torchtitan", pkg)
    import torchtitan.config
    import torchtitan.distributed.parallel_dims
    return torchtitan.config, torchtitan.distributed.parallel_dims


def titan_train_spec(name):
    """torchtitan's train spec ``name`` (its model class and flavours). torchtitan.models.moe imports
    Triton kernels for grouped GEMM index generation, which a model built on the meta device never
    calls: a stand-in module takes their place on a CPU torch without triton."""
    torchtitan_config()
    if importlib.util.find_spec("triton") is None:
        kernels = types.ModuleType("torchtitan.models.moe.kernels")

        def generate_permute_indices(*args, **kwargs):
            raise RuntimeError("Triton kernels are not available on this machine")

        kernels.generate_permute_indices = generate_permute_indices
        sys.modules.setdefault("torchtitan.models.moe.kernels", kernels)
    from torchtitan.protocols.train_spec import get_train_spec
    return get_train_spec(name)


def titan_model_of(job, config_dir):
    """(model class, model arguments) a parsed JobConfig trains: its [model] name and flavour, after
    importing [experimental] custom_import from ``config_dir`` as torchtitan's Trainer does."""
    if job.experimental.custom_import:
        titan_train_spec("llama3")  # torchtitan's modules first, then the flavour module that registers
        sys.path.insert(0, str(config_dir))
        try:
            sys.modules.pop(job.experimental.custom_import, None)
            from torchtitan.protocols import train_spec as registry
            registry._extra_train_specs.pop(job.model.name, None)  # registered again below, once per test
            importlib.import_module(job.experimental.custom_import)
        finally:
            sys.path.remove(str(config_dir))
    spec = titan_train_spec(job.model.name)
    assert job.model.flavor in spec.model_args, (job.model.name, job.model.flavor)
    return spec.model_cls, spec.model_args[job.model.flavor]


def titan_refusal(model):
    """Why no torchtitan 0.2 model builds ``model`` (None when one does): the export's own rule,
    checked per architecture against torchtitan in tests/tuner/test_export_models.py."""
    try:
        titan_model_args(SimpleNamespace(model=model, trained=trained_model(model)))
    except SpecError as exc:
        return str(exc)
    return None


def check_torchtitan_export(case, config_dir):
    """torchtitan's JobConfig and ParallelDims read the torchtitan export of ``case`` as meshtune meant it
    (or the export refuses a model no torchtitan 0.2 model builds); the flavour module goes to ``config_dir``."""
    config, parallel_dims = torchtitan_config()
    _, model, _, training, lay = case
    if titan_refusal(model):
        with pytest.raises(SpecError, match=r"^format=torchtitan: no torchtitan 0\.2 model builds"):
            export_case(case, "torchtitan")
        return
    out = export_case(case, "torchtitan")
    path = config_dir / out.filename
    path.write_text(out.text)
    for name, text in out.files.items():  # the flavour module, importable as custom_import names it
        (config_dir / name).write_text(text)
    job = config.ConfigManager().parse_args(["--job.config_file", str(path)])
    titan_model_of(job, config_dir)  # the flavour it names exists (tests/tuner/test_export_models.py checks its arguments)
    p, t = job.parallelism, job.training
    assert tomllib.loads(out.text)["parallelism"] == out.settings["parallelism"]
    assert (p.tensor_parallel_degree, p.context_parallel_degree, p.pipeline_parallel_degree,
            p.expert_parallel_degree) == (lay.tp, lay.cp, lay.pp, lay.ep)
    # torchtitan's own validation of the mesh (the world excludes ep, borrowed from dp_shard * cp).
    dims = parallel_dims.ParallelDims(
        dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree, cp=p.context_parallel_degree,
        tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree, ep=p.expert_parallel_degree,
        etp=p.expert_tensor_parallel_degree, world_size=lay.world_size,
    )
    batch_degree = dims.dp_replicate * dims.dp_shard
    if dims.dp_replicate > 1 and not dims.fsdp_enabled:  # torchtitan's DDP is 1-D only (llama3 parallelize)
        assert dims.dp_replicate == lay.world_size
    assert batch_degree == lay.dp * lay.ep
    assert (dims.dp_shard * dims.cp * dims.tp) % (dims.etp * dims.ep) == 0  # torchtitan's efsdp mesh
    m = microbatches(lay, training)
    accumulation = t.global_batch_size // (t.local_batch_size * batch_degree)  # torchtitan/train.py
    assert t.global_batch_size == training.global_batch == accumulation * t.local_batch_size * batch_degree
    assert t.seq_len == model.seq_len
    if lay.pp > 1:
        from torch.distributed.pipelining.schedules import get_schedule_class
        get_schedule_class(p.pipeline_parallel_schedule)  # a schedule torch knows
        assert accumulation == 1 and t.local_batch_size // p.pipeline_parallel_microbatch_size == m
        parts = p.module_fqns_per_model_part
        assert len(parts) == lay.pp * lay.vpp
        layers = [f for part in parts for f in part if f.startswith("layers.")]
        assert layers == [f"layers.{i}" for i in range(model.layers)]
    else:
        assert accumulation == m and t.local_batch_size == lay.mbs
    assert job.activation_checkpoint.mode == lay.ac
    if lay.zero:
        assert p.data_parallel_shard_degree == lay.dp * lay.ep and p.data_parallel_replicate_degree == 1
        assert p.fsdp_reshard_after_forward == ("always" if lay.zero == 3 else "never")


# --- Megatron-LM -----------------------------------------------------------------------------------

# Megatron-LM arguments (megatron/training/arguments.py) that are not megatron-core config fields.
MEGATRON_LM_ONLY = {
    "micro_batch_size", "global_batch_size", "seq_length", "max_position_embeddings", "group_query_attention",
    "swiglu", "untie_embeddings_and_output_weights", "num_experts", "disable_bias_linear",
    "position_embedding_type", "no_gradient_accumulation_fusion", "ckpt_format", "padded_vocab_size",
    "rotary_base", "use_rope_scaling", "rope_scaling_factor", "norm_epsilon", "apply_layernorm_1p",
    "rotary_seq_len_interpolation_factor", "quick_geglu",
}


def _number(v):
    for kind in (int, float):
        try:
            return kind(v)
        except ValueError:
            pass
    return v


def megatron_flags(argv):
    """Megatron-LM's parsed arguments of the flags ``argv``, by their ``dest`` name."""
    out, i = {}, 0
    while i < len(argv):
        assert argv[i].startswith("--"), argv[i]
        key = argv[i][2:].replace("-", "_")
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[key] = _number(argv[i + 1])
            i += 2
        else:
            out[key] = True
            i += 1
    return out


def megatron_core():
    """torch and the megatron-core config classes an export is read back by."""
    quiet_import("megatron.core")
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig
    return torch, TransformerConfig, DistributedDataParallelConfig, OptimizerConfig


def field_names(cls):
    """The dataclass fields of ``cls``."""
    return {f.name for f in dataclasses.fields(cls)}


def transformer_config(TransformerConfig, torch, values, *, bf16):
    """A TransformerConfig from same-named values, as Megatron-LM builds it from its args."""
    kw = {k: v for k, v in values.items() if k in field_names(TransformerConfig)}
    dtype = torch.bfloat16 if bf16 else torch.float32
    kw |= {"params_dtype": dtype, "pipeline_dtype": dtype}
    return TransformerConfig(**kw)


def megatron_core_values(args, torch):
    """megatron-core config values of parsed Megatron-LM flags, as Megatron-LM's
    core_transformer_config_from_args copies them (same-named fields, and these renames)."""
    values = dict(args)
    if args.get("swiglu"):  # Megatron-LM: --swiglu sets these two
        values |= {"gated_linear_unit": True, "activation_func": torch.nn.functional.silu}
    if args.get("quick_geglu"):  # Megatron-LM: --quick-geglu
        from megatron.core.fusions.fused_bias_geglu import quick_gelu
        values |= {"gated_linear_unit": True, "activation_func": quick_gelu}
    if args.get("disable_bias_linear"):
        values["add_bias_linear"] = False
    values["layernorm_epsilon"] = args["norm_epsilon"]  # --norm-epsilon's dest
    values["layernorm_zero_centered_gamma"] = bool(args.get("apply_layernorm_1p"))  # --apply-layernorm-1p's dest
    if "num_experts" in args:
        values["num_moe_experts"] = args["num_experts"]
    if args.get("no_gradient_accumulation_fusion"):
        values["gradient_accumulation_fusion"] = False
    if "moe_layer_freq" in args:  # Megatron-LM's moe_freq_type evaluates the list expression
        values["moe_layer_freq"] = ast.literal_eval(args["moe_layer_freq"])
    if "window_size" in args:  # tuple_type
        values["window_size"] = tuple(int(x) for x in str(args["window_size"]).split(","))
    for key in ("moe_aux_loss_coeff",):  # nargs='+' floats
        if key in args:
            values[key] = float(args[key])
    return values


def check_megatron_export(case):
    """megatron-core's configs, built from the Megatron-LM export of ``case``, hold its model and layout."""
    torch, TransformerConfig, DDPConfig, OptimizerConfig = megatron_core()
    _, model, _, training, lay = case
    out = export_case(case, "megatron")
    args = megatron_flags(out.settings)
    assert shlex.split(out.text) == out.settings  # the text is the argv, shell-quoted, and nothing else
    assert "#" not in out.text and "\\" not in out.text
    core = field_names(TransformerConfig) | field_names(DDPConfig) | field_names(OptimizerConfig)
    assert set(args) - core <= MEGATRON_LM_ONLY, set(args) - core - MEGATRON_LM_ONLY
    # Megatron-LM's validate_args: at most one way to give the virtual stages.
    assert sum(k in args for k in ("pipeline_model_parallel_layout", "num_virtual_stages_per_pipeline_rank",
                                   "num_layers_per_virtual_pipeline_stage")) <= 1
    values = megatron_core_values(args, torch)
    cfg = transformer_config(TransformerConfig, torch, values, bf16=training.precision == "bf16")
    assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.context_parallel_size,
            cfg.expert_model_parallel_size) == (lay.tp, lay.pp, lay.cp, lay.ep)
    assert cfg.sequence_parallel == lay.sp
    assert cfg.num_layers == model.layers and cfg.num_query_groups == model.kv_heads
    assert cfg.kv_channels == model.head_dim and cfg.qk_layernorm == model.qk_norm
    assert cfg.add_qkv_bias == model.qkv_bias and not cfg.add_bias_linear
    if model.is_moe:
        assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (
            model.experts, model.top_k, model.expert_ffn)
        assert (cfg.moe_shared_expert_intermediate_size or 0) == model.shared_expert_ffn
        assert cfg.moe_shared_expert_gate == model.shared_expert_gate
        assert cfg.moe_layer_freq in (1, [0 if i in model.dense_layers else 1 for i in range(model.layers)])
    if lay.pp > 1:
        cfg.pipeline_model_parallel_layout.validate_layer_layout(num_layers=model.layers, mtp_num_layers=None)
        want_vpp = lay.vpp if lay.vpp > 1 else None
        assert (cfg.virtual_pipeline_model_parallel_size or None) == want_vpp
    assert cfg.recompute_granularity == {"none": None, "selective": "selective", "full": "full"}[lay.ac]
    ddp = DDPConfig(**{k: v for k, v in values.items() if k in field_names(DDPConfig)})
    assert ddp.use_distributed_optimizer == (lay.zero >= 1)
    assert ddp.use_megatron_fsdp == (lay.zero >= 2)
    if lay.zero >= 2:
        assert ddp.data_parallel_sharding_strategy == ("optim_grads" if lay.zero == 2 else "optim_grads_params")
    OptimizerConfig(**{k: v for k, v in values.items() if k in field_names(OptimizerConfig)})
    # Megatron's data-parallel size is world / (tp * pp * cp) = meshtune's dp * ep, and its
    # micro-batches per step global / (mbs * dp) are meshtune's m.
    dp = lay.world_size // (lay.tp * lay.pp * lay.cp)
    assert dp == lay.dp * lay.ep
    assert args["global_batch_size"] % (args["micro_batch_size"] * dp) == 0
    assert args["global_batch_size"] // (args["micro_batch_size"] * dp) == microbatches(lay, training)


# --- DeepSpeed -------------------------------------------------------------------------------------

class _DataParallel:
    """The ``mpu`` DeepSpeedConfig asks for the data-parallel world size."""

    def __init__(self, size):
        self.size = size

    def get_data_parallel_world_size(self):
        return self.size


def deepspeed_config(monkeypatch, cfg, data):
    """DeepSpeed's reading of the config ``cfg`` on ``data`` data-parallel ranks."""
    quiet_import("deepspeed")
    import deepspeed.runtime.config as ds_config
    # DeepSpeedConfig reads the rank from an initialised deepspeed.comm (else it assumes world 1);
    # the data-parallel size comes from the mpu, so give it rank 0 without a process group.
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda: 0)
    return ds_config.DeepSpeedConfig(json.loads(json.dumps(cfg)), mpu=_DataParallel(data))


def check_deepspeed_export(case, monkeypatch):
    """DeepSpeedConfig reads the DeepSpeed export of ``case`` with its batch triple, ZeRO stage and tp."""
    _, _, _, training, lay = case
    out = export_case(case, "deepspeed")
    assert json.loads(out.text) == out.settings
    cfg = deepspeed_config(monkeypatch, out.settings, lay.dp * lay.ep)
    assert cfg.train_batch_size == training.global_batch
    assert cfg.train_micro_batch_size_per_gpu == lay.mbs
    assert cfg.gradient_accumulation_steps == microbatches(lay, training)
    assert cfg.zero_optimization_stage == lay.zero
    assert cfg.bfloat16_config.enabled == (training.precision == "bf16")
    assert cfg.tensor_parallel_config.autotp_size == (lay.tp if lay.tp > 1 else 0)
    if lay.pp > 1:
        assert cfg.pipeline["stages"] == lay.pp


# --- NeMo / Megatron-Bridge ------------------------------------------------------------------------

# Megatron-Bridge 0.3 ConfigContainer fields outside megatron-core (megatron/bridge/training/config.py:
# TrainingConfig.micro/global_batch_size, GPTDatasetConfig.seq_length, CheckpointConfig.ckpt_format,
# GPTModelProvider.seq_length, ConfigContainer.mixed_precision).
# GPTModelProvider's own fields (megatron/bridge/models/gpt_provider.py: vocab_size, should_pad_vocab,
# share_embeddings_and_output_weights, rotary_base, position_embedding_type, seq_len_interpolation_factor)
# and Llama31ModelProvider's scale_factor (models/llama/llama_provider.py).
BRIDGE_ONLY = {"train.micro_batch_size", "train.global_batch_size", "dataset.seq_length", "model.seq_length",
               "checkpoint.ckpt_format", "mixed_precision", "model.vocab_size", "model.should_pad_vocab",
               "model.share_embeddings_and_output_weights", "model.rotary_base", "model.position_embedding_type",
               "model.seq_len_interpolation_factor", "model.scale_factor"}


def check_nemo_export(case):
    """The Megatron-Bridge overrides of ``case`` build the megatron-core classes Bridge subclasses."""
    torch, TransformerConfig, DDPConfig, OptimizerConfig = megatron_core()
    _, model, _, training, lay = case
    out = export_case(case, "nemo")
    assert shlex.split(out.text) == out.settings and "#" not in out.text  # run_recipe.py's argv, nothing else
    assert out.settings[0] == "--recipe" and out.settings[1].endswith("_pretrain_config")
    groups = {"model": {}, "ddp": {}, "optimizer": {}}
    for line in out.settings[2:]:
        key, value = line.split("=", 1)
        value = {"true": True, "false": False, "null": None}.get(value, value.strip('"'))
        if isinstance(value, str) and value.startswith("["):
            value = ast.literal_eval(value)
        value = _number(value) if isinstance(value, str) else value
        group, _, name = key.partition(".")
        if key in BRIDGE_ONLY:
            continue
        assert group in groups, key
        groups[group][name] = value
    assert set(groups["model"]) <= field_names(TransformerConfig)
    # A recipe supplies the model's shape; these overrides then set the layout on it.
    cfg = transformer_config(TransformerConfig, torch, groups["model"], bf16=True)
    # The overrides set the whole model, whatever the recipe's provider held.
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.ffn_hidden_size,
            cfg.kv_channels, cfg.add_bias_linear, cfg.add_qkv_bias, cfg.qk_layernorm) == (
        model.layers, model.hidden, model.heads, model.kv_heads, model.ffn, model.head_dim, False, model.qkv_bias,
        model.qk_norm)
    if model.is_moe:
        assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (
            model.experts, model.top_k, model.expert_ffn)
    assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.context_parallel_size,
            cfg.expert_model_parallel_size, cfg.sequence_parallel) == (lay.tp, lay.pp, lay.cp, lay.ep, lay.sp)
    if lay.vpp > 1:
        assert cfg.virtual_pipeline_model_parallel_size == lay.vpp
    ddp = DDPConfig(**groups["ddp"])
    assert ddp.use_distributed_optimizer == (lay.zero >= 1)
    OptimizerConfig(**groups["optimizer"])
    assert f"model.vocab_size={model.vocab}" in out.settings
    assert f"train.global_batch_size={training.global_batch}" in out.settings
    assert f"train.micro_batch_size={lay.mbs}" in out.settings


# --- the notes of meshtune's export service -------------------------------------------------------

def service_header(notes):
    """The lines the service puts before tuner.export_layout's own notes (sweep, rank, how sure)."""
    notes = list(notes)
    return tuple(notes[:next(i for i, line in enumerate(notes) if line.startswith("meshtune layout "))])

