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

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
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


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_torchtitan_job_config_is_read_by_torchtitan(case, tmp_path):
    config, parallel_dims = _titan()
    _, model, _, training, lay = case
    out = _export(case, "torchtitan")
    path = tmp_path / out.filename
    path.write_text(out.text)
    job = config.ConfigManager().parse_args(["--job.config_file", str(path)])
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
    with pytest.raises(ValueError, match="not_a_field"):
        config.ConfigManager().parse_args(["--job.config_file", str(path)])


# --- Megatron-LM -----------------------------------------------------------------------------------

# Megatron-LM arguments (megatron/training/arguments.py) that are not megatron-core config fields.
MEGATRON_LM_ONLY = {
    "micro_batch_size", "global_batch_size", "seq_length", "max_position_embeddings", "group_query_attention",
    "swiglu", "untie_embeddings_and_output_weights", "num_experts", "disable_bias_linear",
    "position_embedding_type", "no_gradient_accumulation_fusion", "ckpt_format",
}


def _flags(argv):
    out, i = {}, 0
    while i < len(argv):
        assert argv[i].startswith("--"), argv[i]
        key = argv[i][2:].replace("-", "_")
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            v = argv[i + 1]
            out[key] = int(v) if v.isdigit() else v
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


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_megatron_args_build_megatron_core_configs(case):
    torch, TransformerConfig, DDPConfig, OptimizerConfig = _megatron_core()
    _, model, _, training, lay = case
    out = _export(case, "megatron")
    args = _flags(out.settings)
    body = "".join(line for line in out.text.splitlines(keepends=True) if not line.startswith("#"))
    assert shlex.split(body.replace("\\\n", " ")) == out.settings  # the text is the argv, shell-quoted
    core = _field_names(TransformerConfig) | _field_names(DDPConfig) | _field_names(OptimizerConfig)
    assert set(args) - core <= MEGATRON_LM_ONLY, set(args) - core - MEGATRON_LM_ONLY
    # Megatron-LM's validate_args: at most one way to give the virtual stages.
    assert sum(k in args for k in ("pipeline_model_parallel_layout", "num_virtual_stages_per_pipeline_rank",
                                   "num_layers_per_virtual_pipeline_stage")) <= 1
    values = dict(args)
    if args.pop("swiglu", False):  # Megatron-LM: --swiglu sets these two
        values |= {"gated_linear_unit": True, "activation_func": torch.nn.functional.silu}
    if args.get("disable_bias_linear"):
        values["add_bias_linear"] = False
    if "num_experts" in args:
        values["num_moe_experts"] = args["num_experts"]
    if args.get("no_gradient_accumulation_fusion"):
        values["gradient_accumulation_fusion"] = False
    if "moe_layer_freq" in args:  # Megatron-LM's moe_freq_type evaluates the list expression
        values["moe_layer_freq"] = ast.literal_eval(args["moe_layer_freq"])
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
BRIDGE_ONLY = {"train.micro_batch_size", "train.global_batch_size", "dataset.seq_length", "model.seq_length",
               "checkpoint.ckpt_format", "mixed_precision"}


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_nemo_overrides_build_the_configs_bridge_subclasses(case):
    torch, TransformerConfig, DDPConfig, OptimizerConfig = _megatron_core()
    _, model, _, training, lay = case
    out = _export(case, "nemo")
    assert [line for line in out.text.splitlines() if line and not line.startswith("#")] == out.settings
    groups = {"model": {}, "ddp": {}, "optimizer": {}}
    for line in out.settings:
        key, value = line.split("=", 1)
        value = {"true": True, "false": False}.get(value, value.strip('"'))
        value = int(value) if isinstance(value, str) and value.isdigit() else value
        group, _, name = key.partition(".")
        if key in BRIDGE_ONLY:
            continue
        assert group in groups, key
        groups[group][name] = value
    assert set(groups["model"]) <= _field_names(TransformerConfig)
    # A recipe supplies the model's shape; these overrides then set the layout on it.
    shape = {"num_layers": model.layers, "hidden_size": model.hidden, "num_attention_heads": model.heads,
             "num_query_groups": model.kv_heads, "ffn_hidden_size": model.ffn, "add_bias_linear": False}
    if model.is_moe:
        shape |= {"num_moe_experts": model.experts, "moe_router_topk": model.top_k,
                  "moe_ffn_hidden_size": model.expert_ffn}
    cfg = _transformer_config(TransformerConfig, torch, shape | groups["model"], bf16=True)
    assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.context_parallel_size,
            cfg.expert_model_parallel_size, cfg.sequence_parallel) == (lay.tp, lay.pp, lay.cp, lay.ep, lay.sp)
    if lay.vpp > 1:
        assert cfg.virtual_pipeline_model_parallel_size == lay.vpp
    ddp = DDPConfig(**groups["ddp"])
    assert ddp.use_distributed_optimizer == (lay.zero >= 1)
    OptimizerConfig(**groups["optimizer"])
    assert f"train.global_batch_size={training.global_batch}" in out.settings
    assert f"train.micro_batch_size={lay.mbs}" in out.settings


# --- caveats and bad input -------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", EXPORT_FORMATS)
def test_every_output_states_that_dp_excludes_ep(fmt):
    out = _export(CASES[1], fmt)
    assert any("excludes ep=2" in c and "dp*ep=4" in c for c in out.caveats)
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
    from _dashboard_seed import SPEC, seed_sweep

    from api import store
    from api.spec import SweepSpec
    from api.sweeps import service as sweeps_service

    url = f"sqlite:///{tmp_path_factory.mktemp('export') / 'meshtune.db'}"
    engine, sessions = store.open_store(url)
    sid = seed_sweep(sessions, n_trials=8, name="export sweep")
    with store.session_scope(sessions) as session:  # queued: no trial has completed
        empty = sweeps_service.create_sweep(session, spec=SweepSpec.model_validate(SPEC | {"name": "empty"}),
                                            owner="alice").id
    with sessions() as session:
        rows = sweeps_service.ranking(session, sweep_id=sid).rows
    yield {"url": url, "sid": sid, "empty": empty, "rows": rows}
    engine.dispose()


@pytest.fixture(scope="module")
def client(stored):
    from fastapi.testclient import TestClient

    from api.main import create_app
    from api.settings import Settings

    with TestClient(create_app(Settings(database_url=stored["url"]), run_engine=False)) as c:
        yield c


def _expected(stored, rank, fmt):
    """What tuner.export_layout writes for the ranked row (the service adds only the header)."""
    from _dashboard_seed import SPEC

    from api.spec import SweepSpec

    model, cluster, training = SweepSpec.model_validate(SPEC).to_problem()
    row = stored["rows"][rank - 1]
    return export_layout(Layout(**row.layout), model=model, cluster=cluster, training=training, format=fmt)


@pytest.mark.parametrize("fmt", EXPORT_FORMATS)
def test_api_exports_a_ranked_layout_by_rank_or_key(client, stored, fmt):
    sid, rows = stored["sid"], stored["rows"]
    assert len(rows) >= 2
    r = client.get(f"/api/sweeps/{sid}/export", params={"format": fmt})
    assert r.status_code == 200, r.text
    want = _expected(stored, 1, fmt)
    assert r.headers["content-type"].startswith(want.media_type)
    assert f"rank-1-{want.filename}" in r.headers["content-disposition"]
    if fmt == "deepspeed":  # the header travels in the JSON's meshtune.about
        got = json.loads(r.text)
        assert got.pop("meshtune")["caveats"] == list(want.caveats)
        assert got == {k: v for k, v in want.settings.items() if k != "meshtune"}
    else:  # the service's header line (and one naming the layouts tied with it), then what tuner.export_layout writes
        from api import format as fmt_

        tied = bool(fmt_.tied_rows(rows, rows[0]))
        assert r.text.endswith(want.text) and r.text.count("\n") == want.text.count("\n") + 1 + tied
        assert ("tied with" in r.text.splitlines()[1]) is tied
    assert f"sweep {sid} (export sweep), rank 1 of {len(rows)}" in r.text and "simulated" in r.text
    by_key = client.get(f"/api/sweeps/{sid}/export", params={"format": fmt, "layout": rows[1].layout_key})
    by_rank = client.get(f"/api/sweeps/{sid}/export", params={"format": fmt, "rank": 2})
    assert by_key.status_code == by_rank.status_code == 200 and by_key.text == by_rank.text != r.text


@pytest.mark.parametrize(("query", "status", "line"), [
    ({"format": "yaml"}, 422, "format='yaml' is not an export format (one of torchtitan, megatron, deepspeed, nemo)"),
    ({"format": "nemo", "rank": 99}, 404, "rank=99 is not in sweep {sid}'s ranking"),
    ({"format": "nemo", "layout": "tp9"}, 404, "layout='tp9' is not a measured layout of sweep {sid}"),
    ({"format": "nemo", "rank": 1, "layout": "tp9"}, 422, "rank=1 and layout='tp9': give one of them, not both"),
    ({"format": "megatron", "sweep": "empty"}, 409, "sweep {empty} has no completed trial to export"),
    ({"format": "megatron", "sweep": 424242}, 404, "sweep 424242 does not exist"),
])
def test_api_bad_export_is_one_line(client, stored, query, status, line):
    query = dict(query)
    sweep = query.pop("sweep", "sid")
    sid = stored[sweep] if isinstance(sweep, str) else sweep
    r = client.get(f"/api/sweeps/{sid}/export", params=query)
    assert r.status_code == status
    assert r.json()["detail"].startswith(line.format(sid=sid, empty=stored["empty"]))


def test_cli_export_prints_writes_and_refuses_with_exit_2(stored, client, monkeypatch, capsys, tmp_path):
    from api.cli import main

    monkeypatch.setenv("MESHTUNE_DATABASE_URL", stored["url"])
    sid = stored["sid"]
    assert main(["export", str(sid), "--format", "megatron"]) == 0
    printed = capsys.readouterr().out
    assert printed == client.get(f"/api/sweeps/{sid}/export", params={"format": "megatron"}).text
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


def test_dashboard_ranked_rows_link_each_format(client, stored):
    import html
    import re

    sid, rows = stored["sid"], stored["rows"]
    page = client.get(f"/sweeps/{sid}")
    assert page.status_code == 200
    links = [html.unescape(h) for h in re.findall(r'href="(/sweeps/\d+/export\?[^"]+)"', page.text)]
    for row in rows:
        for fmt in EXPORT_FORMATS:
            assert f"/sweeps/{sid}/export?format={fmt}&layout={row.layout_key}" in links
    got = client.get(links[0])
    assert got.status_code == 200 and "attachment" in got.headers["content-disposition"]
    assert got.text == client.get(f"/api/sweeps/{sid}/export", params={"format": "torchtitan"}).text
    bad = client.get(f"/sweeps/{sid}/export", params={"format": "xml", "layout": rows[0].layout_key})
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
