"""Exports of a layout (tuner/_export.py) read back by each framework's own configuration classes.

- torchtitan 0.2.x: ``ConfigManager.parse_args(["--job.config_file", f])`` builds its ``JobConfig``
  (unknown TOML fields are refused there), and ``ParallelDims`` validates the degrees.
- Megatron-LM: its ``pretrain_gpt.py`` flags become megatron-core's ``TransformerConfig`` (a
  ``ModelParallelConfig``), ``DistributedDataParallelConfig`` and ``OptimizerConfig`` by field name,
  as Megatron-LM's ``core_transformer_config_from_args`` copies them; Megatron-LM's own argument
  parser is not on PyPI, so the flags that are not megatron-core fields are checked against its
  argument names (megatron/training/arguments.py).
- DeepSpeed: ``DeepSpeedConfig`` with the job's data-parallel size, which checks the batch triple.
- Megatron-Bridge (NeMo): needs Transformer Engine (CUDA) to import, so its ``model.*``, ``ddp.*``
  and ``optimizer.*`` overrides are built as the megatron-core classes Bridge subclasses, and the rest
  checked against Bridge 0.3's ConfigContainer field names.
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
from pathlib import Path
from types import SimpleNamespace

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: torchtitan 0.2 depends on tomli
    import tomli as tomllib

from tuner import (
    EXPORT_FORMATS,
    MODEL_PRESETS,
    Layout,
    LayoutError,
    SpecError,
    TrainingSpec,
    cluster_spec,
    export_layout,
    load_hf_config,
    microbatches,
    model_from_hf_config,
)
from tuner._export_model import trained_model
from tuner._export_titan import titan_model_args

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
# megatron-core warns about Transformer Engine features (CUDA graphs, fused attention) on CPU.
pytestmark = pytest.mark.filterwarnings(r"ignore::UserWarning:megatron\.core\..*")

def _hf(name):
    return model_from_hf_config(load_hf_config(EXAMPLES / "hf" / f"{name}.json"), name=name, seq_len=4096)


H100x32 = cluster_spec({"preset": "h100-sxm", "nodes": 4})
CPU = cluster_spec("cpu-local")
GB64 = TrainingSpec(global_batch=64)

# (name, model, cluster, training, layout): pp with virtual stages, ZeRO-3, ep, cp, gpipe, ZeRO-0 + ep.
CASES = [
    ("pp4-interleaved-v2-z1-sp", MODEL_PRESETS["llama3-8b"], H100x32, GB64,
     Layout(tp=2, pp=4, dp=4, zero=1, ac="selective", sp=True, schedule="interleaved", vpp=2)),
    ("moe-tp2-cp2-ep2-pp2-z3-v2", MODEL_PRESETS["mixtral-8x7b"], H100x32, GB64,
     Layout(tp=2, pp=2, dp=2, cp=2, ep=2, zero=3, ac="full", sp=True, schedule="interleaved", vpp=2)),
    ("tp8-pp2-gpipe-z2-mbs2", MODEL_PRESETS["llama3-8b"], H100x32, GB64,
     Layout(tp=8, pp=2, dp=2, zero=2, mbs=2, ac="full", schedule="gpipe")),
    ("cp4-dp8-z0", MODEL_PRESETS["llama3-8b"], H100x32, GB64, Layout(cp=4, dp=8)),
    ("tiny-moe-ep2-dp2-z0-mbs2", MODEL_PRESETS["tiny-moe"], CPU, TrainingSpec(global_batch=8),
     Layout(ep=2, dp=2, mbs=2)),
    ("tp4-dp8-z0", MODEL_PRESETS["llama3-8b"], H100x32, GB64, Layout(tp=4, dp=8)),
    # Hugging Face configs (examples/hf): explicit head_dim and qk_norm; shared expert, gate, q/k/v bias.
    ("qwen3-moe-tp4-ep8-z1", _hf("qwen3-30b-a3b"), H100x32, GB64, Layout(tp=4, ep=8, zero=1, ac="full")),
    ("qwen1.5-moe-tp2-ep4-dp4-z3", _hf("qwen1.5-moe-a2.7b"), H100x32, GB64, Layout(tp=2, ep=4, dp=4, zero=3, mbs=2)),
    ("moe-dense-layer0-ep2-pp2", dataclasses.replace(MODEL_PRESETS["tiny-moe"], dense_layers=(0,)), CPU,
     TrainingSpec(global_batch=8), Layout(ep=2, pp=2, schedule="gpipe")),
]
IDS = [c[0] for c in CASES]


def _export(case, fmt):
    _, model, cluster, training, layout = case
    return export_layout(layout, model=model, cluster=cluster, training=training, format=fmt)


def _quiet_import(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip(name, reason=f"{name} is in the test extra (pip install -e .[test])")


# --- torchtitan ------------------------------------------------------------------------------------

def _titan():
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
    _titan()
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


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_torchtitan_job_config_is_read_by_torchtitan(case, tmp_path):
    config, parallel_dims = _titan()
    _, model, _, training, lay = case
    if titan_refusal(model):
        with pytest.raises(SpecError, match=r"^format=torchtitan: no torchtitan 0\.2 model builds"):
            _export(case, "torchtitan")
        return
    out = _export(case, "torchtitan")
    path = tmp_path / out.filename
    path.write_text(out.text)
    for name, text in out.files.items():  # the flavour module, importable as custom_import names it
        (tmp_path / name).write_text(text)
    job = config.ConfigManager().parse_args(["--job.config_file", str(path)])
    titan_model_of(job, tmp_path)  # the flavour it names exists (tests/tuner/test_export_models.py checks its arguments)
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


def test_torchtitan_refuses_a_field_it_does_not_have(tmp_path):
    """The read-back is a real check: torchtitan rejects a TOML field outside its JobConfig."""
    config, _ = _titan()
    path = tmp_path / "bad.toml"
    path.write_text(_export(CASES[0], "torchtitan").text + "not_a_field = 1\n")
    assert "[model]" in path.read_text()
    with pytest.raises(ValueError, match="not_a_field"):
        config.ConfigManager().parse_args(["--job.config_file", str(path)])


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


def _flags(argv):
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


def _megatron_core():
    _quiet_import("megatron.core")
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig
    return torch, TransformerConfig, DistributedDataParallelConfig, OptimizerConfig


def _field_names(cls):
    return {f.name for f in dataclasses.fields(cls)}


def _transformer_config(TransformerConfig, torch, values, *, bf16):
    """A TransformerConfig from same-named values, as Megatron-LM builds it from its args."""
    kw = {k: v for k, v in values.items() if k in _field_names(TransformerConfig)}
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


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_megatron_args_build_megatron_core_configs(case):
    torch, TransformerConfig, DDPConfig, OptimizerConfig = _megatron_core()
    _, model, _, training, lay = case
    out = _export(case, "megatron")
    args = _flags(out.settings)
    assert shlex.split(out.text) == out.settings  # the text is the argv, shell-quoted, and nothing else
    assert "#" not in out.text and "\\" not in out.text
    core = _field_names(TransformerConfig) | _field_names(DDPConfig) | _field_names(OptimizerConfig)
    assert set(args) - core <= MEGATRON_LM_ONLY, set(args) - core - MEGATRON_LM_ONLY
    # Megatron-LM's validate_args: at most one way to give the virtual stages.
    assert sum(k in args for k in ("pipeline_model_parallel_layout", "num_virtual_stages_per_pipeline_rank",
                                   "num_layers_per_virtual_pipeline_stage")) <= 1
    values = megatron_core_values(args, torch)
    cfg = _transformer_config(TransformerConfig, torch, values, bf16=training.precision == "bf16")
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
    ddp = DDPConfig(**{k: v for k, v in values.items() if k in _field_names(DDPConfig)})
    assert ddp.use_distributed_optimizer == (lay.zero >= 1)
    assert ddp.use_megatron_fsdp == (lay.zero >= 2)
    if lay.zero >= 2:
        assert ddp.data_parallel_sharding_strategy == ("optim_grads" if lay.zero == 2 else "optim_grads_params")
    OptimizerConfig(**{k: v for k, v in values.items() if k in _field_names(OptimizerConfig)})
    # Megatron's data-parallel size is world / (tp * pp * cp) = meshtune's dp * ep, and its
    # micro-batches per step global / (mbs * dp) are meshtune's m.
    dp = lay.world_size // (lay.tp * lay.pp * lay.cp)
    assert dp == lay.dp * lay.ep
    assert args["global_batch_size"] % (args["micro_batch_size"] * dp) == 0
    assert args["global_batch_size"] // (args["micro_batch_size"] * dp) == microbatches(lay, training)


def test_megatron_core_refuses_a_wrong_layout():
    """The read-back is a real check: TransformerConfig refuses a pipeline layout that loses a layer."""
    torch, TransformerConfig, _, _ = _megatron_core()
    case = CASES[0]
    args = _flags(_export(case, "megatron").settings)
    args["pipeline_model_parallel_layout"] = args["pipeline_model_parallel_layout"].replace("tL", "L")
    with pytest.raises(AssertionError, match="31 ?must match num_layers 32"):
        _transformer_config(TransformerConfig, torch, args, bf16=True)


# --- DeepSpeed -------------------------------------------------------------------------------------

class _DataParallel:
    """The ``mpu`` DeepSpeedConfig asks for the data-parallel world size."""

    def __init__(self, size):
        self.size = size

    def get_data_parallel_world_size(self):
        return self.size


def _deepspeed_config(monkeypatch, cfg, data):
    _quiet_import("deepspeed")
    import deepspeed.runtime.config as ds_config
    # DeepSpeedConfig reads the rank from an initialised deepspeed.comm (else it assumes world 1);
    # the data-parallel size comes from the mpu, so give it rank 0 without a process group.
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda: 0)
    return ds_config.DeepSpeedConfig(json.loads(json.dumps(cfg)), mpu=_DataParallel(data))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_deepspeed_json_is_read_by_deepspeed(case, monkeypatch):
    _, _, _, training, lay = case
    out = _export(case, "deepspeed")
    assert json.loads(out.text) == out.settings
    cfg = _deepspeed_config(monkeypatch, out.settings, lay.dp * lay.ep)
    assert cfg.train_batch_size == training.global_batch
    assert cfg.train_micro_batch_size_per_gpu == lay.mbs
    assert cfg.gradient_accumulation_steps == microbatches(lay, training)
    assert cfg.zero_optimization_stage == lay.zero
    assert cfg.bfloat16_config.enabled == (training.precision == "bf16")
    assert cfg.tensor_parallel_config.autotp_size == (lay.tp if lay.tp > 1 else 0)
    if lay.pp > 1:
        assert cfg.pipeline["stages"] == lay.pp


def test_deepspeed_refuses_the_wrong_data_parallel_size(monkeypatch):
    """The read-back is a real check: DeepSpeed refuses the batch triple on a dp that ignores ep."""
    case = CASES[1]  # ep=2
    out = _export(case, "deepspeed")
    with pytest.raises(AssertionError, match="train_batch_size"):
        _deepspeed_config(monkeypatch, out.settings, case[4].dp)


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


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_nemo_overrides_build_the_configs_bridge_subclasses(case):
    torch, TransformerConfig, DDPConfig, OptimizerConfig = _megatron_core()
    _, model, _, training, lay = case
    out = _export(case, "nemo")
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
    assert set(groups["model"]) <= _field_names(TransformerConfig)
    # A recipe supplies the model's shape; these overrides then set the layout on it.
    cfg = _transformer_config(TransformerConfig, torch, groups["model"], bf16=True)
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


# --- caveats and bad input -------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", EXPORT_FORMATS)
def test_every_output_states_that_dp_excludes_ep(fmt):
    out = _export(CASES[1], fmt)
    assert any("excludes ep=2" in c and "dp*ep=4" in c for c in out.caveats)
    assert any("excludes ep=2" in line for line in out.notes)  # stderr / --caveats of the CLI
    if fmt not in ("megatron", "nemo"):  # argument lists hold only the arguments
        assert "excludes ep=2" in out.text  # in the file itself, not only beside it


def test_what_has_no_equivalent_is_said_not_dropped():
    gpipe = CASES[2]
    assert any("gpipe has no Megatron equivalent" in c for c in _export(gpipe, "megatron").caveats)
    assert any("sp=false" in c for c in _export(gpipe, "torchtitan").caveats)  # tp=8 without sp
    ds = _export(gpipe, "deepspeed").caveats
    assert any("ZeRO stage 0 or 1 only" in c for c in ds) and any("'gpipe' has no equivalent" in c for c in ds)
    moe = _export(CASES[1], "deepspeed").caveats
    assert any("ep_size=2" in c for c in moe) and any("Ulysses" in c for c in moe)
    z0_ep = _export(CASES[4], "torchtitan")
    assert z0_ep.settings["parallelism"]["data_parallel_shard_degree"] == 2
    assert any("zero=0 with ep=2" in c for c in z0_ep.caveats)
    assert any("measured on CPU ranks" in c for c in z0_ep.caveats)
    z0_tp = _export(CASES[5], "torchtitan")
    assert z0_tp.settings["parallelism"]["data_parallel_shard_degree"] == 8
    assert any("DDP runs only without other parallelism" in c for c in z0_tp.caveats)


def test_bad_format_and_layout_name_the_field():
    _, model, cluster, training, lay = CASES[0]
    with pytest.raises(SpecError, match=r"^format='yaml' is not an export format \(one of torchtitan, "):
        export_layout(lay, model=model, cluster=cluster, training=training, format="yaml")
    with pytest.raises(LayoutError, match=r"=48 does not equal the device count 32"):
        export_layout(lay.with_(tp=3), model=model, cluster=cluster, training=training, format="megatron")


# --- CLI, API and dashboard on a stored sweep (seeded through the store, no Ray) -------------------

@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    from api import store
    from api.ranking import service as rankings
    from api.spec import SweepSpec
    from api.sweeps import service as sweeps_service
    from tests.helpers.dashboard_seed import SPEC, seed_sweep

    url = f"sqlite:///{tmp_path_factory.mktemp('export') / 'meshtune.db'}"
    engine, sessions = store.open_store(url)
    sid = seed_sweep(sessions, n_trials=8, name="export sweep")
    with store.session_scope(sessions) as session:  # queued: no trial has completed
        empty = sweeps_service.create_sweep(session, spec=SweepSpec.model_validate(SPEC | {"name": "empty"}),
                                            owner="alice").id
    with sessions() as session:
        rows = rankings.ranking(session, sweep_id=sid).rows
    yield {"url": url, "sid": sid, "empty": empty, "rows": rows}
    engine.dispose()


@pytest.fixture(scope="module")
def export_client(stored):
    from fastapi.testclient import TestClient

    from api.main import create_app
    from api.settings import Settings

    with TestClient(create_app(Settings(database_url=stored["url"]), run_engine=False)) as c:
        yield c


def service_header(notes):
    """The lines the service puts before tuner.export_layout's own notes (sweep, rank, how sure)."""
    notes = list(notes)
    return tuple(notes[:next(i for i, line in enumerate(notes) if line.startswith("meshtune layout "))])


def _expected(stored, rank, fmt, header=()):
    """What tuner.export_layout writes for the ranked row (the service adds only the header)."""
    from api.spec import SweepSpec
    from tests.helpers.dashboard_seed import SPEC

    problem = SweepSpec.model_validate(SPEC).to_problem()
    model, cluster, training = problem.model, problem.cluster, problem.training
    row = stored["rows"][rank - 1]
    return export_layout(Layout(**row.layout), model=model, cluster=cluster, training=training, format=fmt,
                         header=header)


@pytest.mark.parametrize("fmt", EXPORT_FORMATS)
def test_api_exports_a_ranked_layout_by_rank_or_key(export_client, stored, fmt):
    sid, rows = stored["sid"], stored["rows"]
    assert len(rows) >= 2
    r = export_client.get(f"/api/sweeps/{sid}/export", params={"format": fmt})
    assert r.status_code == 200, r.text
    notes = json.loads(r.headers["x-meshtune-notes"])
    header = service_header(notes)
    assert header[0].startswith(f"sweep {sid} (export sweep), rank 1 of {len(rows)}") and "simulated" in header[0]
    # Exactly what tuner.export_layout writes with the service's header; the notes are its own.
    want = _expected(stored, 1, fmt, header)
    assert r.text == want.text and notes == list(want.notes)
    assert r.headers["content-type"].startswith(want.media_type)
    assert f"rank-1-{want.filename}" in r.headers["content-disposition"]
    by_key = export_client.get(f"/api/sweeps/{sid}/export", params={"format": fmt, "layout": rows[1].layout_key})
    by_rank = export_client.get(f"/api/sweeps/{sid}/export", params={"format": fmt, "rank": 2})
    assert by_key.status_code == by_rank.status_code == 200 and by_key.text == by_rank.text != r.text


@pytest.mark.parametrize(("query", "status", "line"), [
    ({"format": "yaml"}, 422, "format='yaml' is not an export format (one of torchtitan, torchtitan-launch, megatron, megatron-launch, deepspeed, nemo)"),
    ({"format": "nemo", "rank": 99}, 404, "rank=99 is not in sweep {sid}'s ranking"),
    ({"format": "nemo", "layout": "tp9"}, 404, "layout='tp9' is not a measured layout of sweep {sid}"),
    ({"format": "nemo", "rank": 1, "layout": "tp9"}, 422, "rank=1 and layout='tp9': give one of them, not both"),
    ({"format": "megatron", "sweep": "empty"}, 409, "sweep {empty} has no completed trial to export"),
    ({"format": "megatron", "sweep": 424242}, 404, "sweep 424242 does not exist"),
])
def test_api_bad_export_is_one_line(export_client, stored, query, status, line):
    query = dict(query)
    sweep = query.pop("sweep", "sid")
    sid = stored[sweep] if isinstance(sweep, str) else sweep
    r = export_client.get(f"/api/sweeps/{sid}/export", params=query)
    assert r.status_code == status
    assert r.json()["detail"].startswith(line.format(sid=sid, empty=stored["empty"]))


def test_cli_export_prints_writes_and_refuses_with_exit_2(stored, export_client, monkeypatch, capsys, tmp_path):
    from api.cli import main

    monkeypatch.setenv("MESHTUNE_DATABASE_URL", stored["url"])
    sid = stored["sid"]
    assert main(["export", str(sid), "--format", "megatron"]) == 0
    printed = capsys.readouterr()
    answer = export_client.get(f"/api/sweeps/{sid}/export", params={"format": "megatron"})
    assert printed.out == answer.text  # only the arguments on stdout
    assert printed.err.splitlines() == json.loads(answer.headers["x-meshtune-notes"])  # notes on stderr
    out = tmp_path / "ds.json"
    assert main(["export", str(sid), "--layout", stored["rows"][1].layout_key, "--format", "deepspeed",
                 "--out", str(out)]) == 0
    assert json.loads(out.read_text())["train_batch_size"] == 64
    assert f"wrote {out}" in capsys.readouterr().err
    for argv, line in (
        (["--format", "toml"], "format='toml' is not an export format"),
        (["--rank", "0", "--format", "nemo"], "rank must be a positive integer, got 0"),
        (["--rank", "50", "--format", "nemo"], f"rank=50 is not in sweep {sid}'s ranking"),
    ):
        assert main(["export", str(sid), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"meshtune export: error: {line}") and err.count("\n") == 1, err
    assert main(["export", str(stored["empty"]), "--format", "nemo"]) == 2
    assert f"sweep {stored['empty']} has no completed trial to export" in capsys.readouterr().err


def test_dashboard_ranked_rows_link_each_format(export_client, stored):
    import html
    import re

    sid, rows = stored["sid"], stored["rows"]
    page = export_client.get(f"/sweeps/{sid}")
    assert page.status_code == 200
    links = [html.unescape(h) for h in re.findall(r'href="(/sweeps/\d+/export\?[^"]+)"', page.text)]
    for row in rows:
        for fmt in EXPORT_FORMATS:
            assert f"/sweeps/{sid}/export?format={fmt}&layout={row.layout_key}" in links
    got = export_client.get(links[0])
    assert got.status_code == 200 and "attachment" in got.headers["content-disposition"]
    assert got.text == export_client.get(f"/api/sweeps/{sid}/export", params={"format": "torchtitan"}).text
    bad = export_client.get(f"/sweeps/{sid}/export", params={"format": "xml", "layout": rows[0].layout_key})
    assert bad.status_code == 422 and bad.text.startswith("format='xml' is not an export format")


def test_exports_follow_the_read_rule(stored):
    """With reads behind a token: the API wants the bearer token, the dashboard link the cookie."""
    from fastapi.testclient import TestClient

    from api.dashboard.router import COOKIE
    from api.main import create_app
    from api.settings import Settings

    settings = Settings(database_url=stored["url"], api_tokens={"alice": "tok-export"}, read_requires_auth=True)
    sid, key = stored["sid"], stored["rows"][0].layout_key
    with TestClient(create_app(settings, run_engine=False)) as c:
        assert c.get(f"/api/sweeps/{sid}/export", params={"format": "nemo"}).status_code == 401
        ok = c.get(f"/api/sweeps/{sid}/export", params={"format": "nemo"},
                   headers={"Authorization": "Bearer tok-export"})
        assert ok.status_code == 200
        assert c.get(f"/sweeps/{sid}/export", params={"format": "nemo", "layout": key}).status_code == 401
        c.cookies.set(COOKIE, "tok-export")
        assert c.get(f"/sweeps/{sid}/export", params={"format": "nemo", "layout": key}).text == ok.text


# --- pasteable: the README's shell line, the launch scripts ------------------------------------------

README = Path(__file__).resolve().parents[3] / "README.md"


def _meshtune_on_path(tmp_path):
    """A ``meshtune`` command running this tree's CLI, first on PATH (as the installed entry point)."""
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "meshtune"
    exe.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m api.cli \"$@\"\n")
    exe.chmod(0o755)
    root = str(Path(__file__).resolve().parents[3])
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _bash(script, env, cwd):
    import subprocess

    done = subprocess.run(["bash", "-c", script], env=env, cwd=cwd, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    return done


def test_the_readme_line_gives_pretrain_gpt_the_exported_argv(stored, tmp_path):
    """The README's own shell line, run by bash, yields exactly the exported arguments (quoting of
    the pipeline layout's | included), with the header and caveats on stderr, none on stdout."""
    line = next(x.strip() for x in README.read_text().splitlines() if x.strip().startswith('eval "LAYOUT_ARGS=('))
    assert stored["sid"] == 1 and "meshtune export 1 " in line
    env = _meshtune_on_path(tmp_path) | {"MESHTUNE_DATABASE_URL": stored["url"]}
    done = _bash(line + '\nprintf "%s\\0" "${LAYOUT_ARGS[@]}"', env, tmp_path)
    got = done.stdout.decode().split("\0")[:-1]
    want = _expected(stored, 1, "megatron")
    assert got == want.settings
    assert any("|" in w for w in got)  # a word that needed quoting went through
    assert "caveat: meshtune's dp=" in done.stderr.decode()


def _stub_torchrun(tmp_path):
    """A ``torchrun`` on PATH that records its argv (NUL-separated) and environment."""
    import os

    bin_dir = tmp_path / "stub"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text('#!/usr/bin/env bash\nprintf "%s\\0" "$@" > "$ARGV_OUT"\nenv > "$ENV_OUT"\n')
    (bin_dir / "torchrun").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "ARGV_OUT": str(tmp_path / "argv"),
            "ENV_OUT": str(tmp_path / "env")}


def test_megatron_launch_runs_torchrun_on_the_layouts_world(tmp_path):
    _, model, cluster, training, lay = CASES[0]  # 4 nodes x 8, tp=2: Megatron-LM asks CUDA_DEVICE_MAX_CONNECTIONS=1
    out = _export(CASES[0], "megatron-launch")
    argv = _export(CASES[0], "megatron").settings
    script = tmp_path / "train.sh"
    script.write_text(out.text)
    env = _stub_torchrun(tmp_path) | {"NODE_RANK": "3", "MASTER_ADDR": "10.0.0.7", "MEGATRON_LM": "/opt/Megatron-LM"}
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    _bash(f"bash {shlex.quote(str(script))} --log-interval 1", env, tmp_path)
    got = (tmp_path / "argv").read_text().split("\0")[:-1]
    assert got == ["--nnodes", "4", "--nproc-per-node", "8", "--node-rank", "3", "--master-addr", "10.0.0.7",
                   "--master-port", "29500", "/opt/Megatron-LM/pretrain_gpt.py", *argv, "--train-iters", "100",
                   "--lr", f"{training.lr:g}", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                   str(model.vocab - 1), "--log-interval", "1"]
    assert cluster.nodes * cluster.devices_per_node == lay.world_size
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in (tmp_path / "env").read_text().splitlines()
    assert out.text.startswith("#!/usr/bin/env bash\n# meshtune layout ") and "# caveat: " in out.text


def test_torchtitan_launch_writes_the_job_config_and_flavour_and_runs_torchtitan(tmp_path):
    config, _ = _titan()
    case = ("mistral", _hf("mistral-7b"), H100x32, GB64, Layout(tp=4, dp=8, zero=1))  # a registered flavour
    out, toml = _export(case, "torchtitan-launch"), _export(case, "torchtitan")
    script, where = tmp_path / "titan.sh", tmp_path / "configs"
    where.mkdir()
    script.write_text(out.text)
    env = _stub_torchrun(tmp_path) | {"CONFIG_DIR": str(where)}
    _bash(f"bash {shlex.quote(str(script))} --training.steps 10", env, tmp_path)
    job_file = where / toml.filename
    assert job_file.read_text() == toml.text and (where / "meshtune_flavor.py").read_text() == toml.files["meshtune_flavor.py"]
    got = (tmp_path / "argv").read_text().split("\0")[:-1]
    assert got[-6:] == ["-m", "torchtitan.train", "--job.config_file", str(job_file), "--training.steps", "10"]
    pythonpath = next(x for x in (tmp_path / "env").read_text().splitlines() if x.startswith("PYTHONPATH="))
    assert pythonpath.removeprefix("PYTHONPATH=").split(":")[0] == str(where)
    job = config.ConfigManager().parse_args(["--job.config_file", str(job_file)])
    _, args = titan_model_of(job, where)
    assert (args.dim, args.n_layers, args.rope_theta) == (4096, 32, 10_000.0)


# --- which layout, and how sure ------------------------------------------------------------------------

def _row(rank, n, median, low, high, layout):
    return SimpleNamespace(rank=rank, n=n, median=median, low=low, high=high, layout=layout.__dict__ | {},
                           layout_key=layout.key)


def test_the_header_names_the_tied_layouts_or_a_single_run():
    from api.export.service import how_sure

    a, b, c = Layout(dp=8), Layout(tp=2, dp=4), Layout(pp=2, dp=4)
    rows = [_row(1, 3, 100, 95, 105, a), _row(2, 3, 98, 94, 103, b), _row(3, 1, 60, 55, 65, c)]
    lines = how_sure(rows[0], rows, sweep_id=7)
    assert lines[0] == "tied with 1 other layout (95% intervals overlap, so measurement cannot order them): #2 tp2 dp4"
    assert lines[-1].startswith("another ranked layout: meshtune export 7 --rank N, or --layout KEY|SHORT")
    once = how_sure(rows[2], rows, sweep_id=7)
    assert once[0].startswith("measured once: this rank rests on a single run (re-measure it")
    alone = [_row(1, 1, 100, None, None, a)]
    assert "has no interval" in how_sure(alone[0], alone, sweep_id=7)[0]


def test_cli_layout_by_short_form_caveats_file_and_companion_module(stored, monkeypatch, capsys, tmp_path):
    from api.cli import main
    from api.format import layout_text

    monkeypatch.setenv("MESHTUNE_DATABASE_URL", stored["url"])
    sid, row = stored["sid"], stored["rows"][1]
    assert main(["export", str(sid), "--rank", "2", "--format", "megatron"]) == 0
    by_rank = capsys.readouterr()
    caveats = tmp_path / "caveats.txt"
    assert main(["export", str(sid), "--layout", layout_text(row.layout), "--format", "megatron",
                 "--caveats", str(caveats)]) == 0
    by_short = capsys.readouterr()
    assert by_short.out == by_rank.out and by_short.err == "" and caveats.read_text() == by_rank.err
    assert f"rank 2 of {len(stored['rows'])}" in caveats.read_text()
    job = tmp_path / "job.toml"
    assert main(["export", str(sid), "--format", "torchtitan", "--out", str(job)]) == 0
    err = capsys.readouterr().err
    assert (tmp_path / "meshtune_flavor.py").is_file() and f"wrote {job} and {tmp_path / 'meshtune_flavor.py'}" in err
    assert main(["export", str(sid), "--layout", "dp99 z9", "--format", "nemo"]) == 2
    assert "layout='dp99 z9' is not a measured layout" in capsys.readouterr().err


# --- re-run at size --------------------------------------------------------------------------------

def test_run_trial_takes_nodes_and_devices_per_node_for_any_preset(capsys):
    from api.cli import main

    argv = ["run-trial", "--model", "llama3-8b", "--cluster", "h100-sxm", "--layout", "tp=8,dp=2",
            "--global-batch", "64", "--backend", "simulate", "--json"]
    assert main(argv) == 2  # 16 ranks on the preset's one node
    assert "does not equal the device count 8" in capsys.readouterr().err
    assert main([*argv, "--nodes", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["status"] == "completed" and result["simulated"]
    assert main([*argv[:-1], "--nodes", "4", "--devices-per-node", "4", "--layout", "tp=4,dp=4"]) == 0
    assert "(4 x 4)" in capsys.readouterr().out
    for option, value in (("--nodes", "2.5"), ("--nodes", "0"), ("--devices-per-node", "-8")):
        assert main([*argv, option, value]) == 2
        err = capsys.readouterr().err
        assert err == f"meshtune run-trial: error: {option} must be a positive integer, got '{value}'\n", err
