"""Exports train the model that was tuned: for every supported architecture (the published configs
of examples/hf), each framework's export builds the Hugging Face model, property by property, and
with the same parameter count; what a framework cannot express is a caveat naming it, or (torchtitan)
a refusal naming it.

- Megatron-LM: the exported arguments are parsed by Megatron-LM's own parser, ``validate_args`` and
  ``core_transformer_config_from_args`` when Megatron-LM is importable (it is not on PyPI: set
  ``MEGATRON_LM`` to a checkout, e.g. of tag core_v0.16.1), else megatron-core's TransformerConfig
  is built from the parsed values as Megatron-LM copies them (tests/helpers/frameworks.py). Each field is
  compared with what ``transformers`` reads from the config.json, and megatron-core's GPTModel,
  built on the meta device with the layer specs Megatron-LM's gpt_builders.py picks, holds as many
  parameters as ``AutoModelForCausalLM.from_config`` does.
- torchtitan 0.2: the job config's [model] names a shipped flavour, or a flavour its module
  registers, whose model arguments equal the config's, and whose model (meta device) holds the same
  parameters; the architectures torchtitan has no model for are refused with the reason.
- Megatron-Bridge: the recipe of the architecture; DeepSpeed: the config.json itself.
Also: the defaults meshtune assumes for keys a config.json omits are transformers' own, and the
Hugging Face config of a built-in spec builds the same parameter count.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import types
import warnings
from pathlib import Path

import pytest

from tests.helpers.frameworks import (
    megatron_core_values,
    megatron_flags,
    quiet_import,
    titan_model_of,
    titan_train_spec,
    torchtitan_config,
)
from tests.helpers.hf import hf_param_count
from tuner import (
    MODEL_PRESETS,
    Layout,
    SpecError,
    TrainingSpec,
    cluster_spec,
    export_layout,
    load_hf_config,
    model_from_hf_config,
)
from tuner._export_model import HF_DEFAULTS, trained_model
from tuner._export_titan import TITAN_FLAVOURS
from tuner._hf import text_config

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings(r"ignore::UserWarning:megatron\.core\..*")

HF = Path(__file__).resolve().parents[2] / "examples" / "hf"
H100x32 = cluster_spec({"preset": "h100-sxm", "nodes": 4})
GB64 = TrainingSpec(global_batch=64)
# model_type -> (published config, a layout on 4 x 8 H100 that splits what the model has).
ARCHS = {
    "llama": ("llama3.1-8b", Layout(tp=2, pp=2, dp=8, zero=1)),
    "mistral": ("mistral-7b", Layout(tp=4, dp=8)),
    "qwen2": ("qwen2.5-7b", Layout(tp=4, dp=8, zero=1)),
    "qwen3": ("qwen3-8b", Layout(tp=2, pp=2, dp=8, zero=1)),
    "mixtral": ("mixtral-8x7b", Layout(tp=2, ep=8, dp=2, zero=1, sp=True)),
    "qwen2_moe": ("qwen1.5-moe-a2.7b", Layout(tp=2, ep=4, dp=4, zero=3)),
    "qwen3_moe": ("qwen3-30b-a3b", Layout(tp=4, ep=8, zero=1)),
    "gemma2": ("gemma-2-9b", Layout(tp=4, dp=8)),
    "gemma3_text": ("gemma-3-1b", Layout(dp=32)),
}
TYPES = sorted(ARCHS)


def _config(mt):
    return load_hf_config(HF / f"{ARCHS[mt][0]}.json")


def _model(mt):
    return model_from_hf_config(_config(mt), name=ARCHS[mt][0], seq_len=4096)


def _export(mt, fmt):
    return export_layout(ARCHS[mt][1], model=_model(mt), cluster=H100x32, training=GB64, format=fmt)


def reference(config):
    """What transformers itself reads from ``config`` (its config class, defaults included)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoConfig.for_model(**text_config(config))
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    rope = rope.get("full_attention", rope)  # Gemma 3: per layer type
    if not rope:  # transformers 4.x
        rope = {"rope_theta": hf.rope_theta, **(hf.rope_scaling or {})}
    mt = hf.model_type
    moe = mt in ("mixtral", "qwen2_moe", "qwen3_moe")
    return {
        "model_type": mt, "rope_theta": float(rope["rope_theta"]),
        "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"} if rope.get("rope_type", "default")
        != "default" else None,
        "eps": hf.rms_norm_eps, "attention_dropout": hf.attention_dropout, "init_std": hf.initializer_range,
        "heads": hf.num_attention_heads, "groups": hf.num_key_value_heads,
        "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        "ffn": hf.intermediate_size, "vocab": hf.vocab_size, "tied": hf.tie_word_embeddings, "layers": hf.num_hidden_layers,
        "hidden": hf.hidden_size,
        "experts": (getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None)) if moe else None,
        "top_k": hf.num_experts_per_tok if moe else None,
        "expert_ffn": (hf.intermediate_size if mt == "mixtral" else hf.moe_intermediate_size) if moe else None,
        "aux_loss": hf.router_aux_loss_coef if moe else None,
        "renorm": (mt == "mixtral" or hf.norm_topk_prob) if moe else None,
        "shared_ffn": getattr(hf, "shared_expert_intermediate_size", 0) or 0,
    }


def test_defaults_for_omitted_keys_are_transformers_own():
    for mt, defaults in HF_DEFAULTS.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf = transformers.AutoConfig.for_model(mt)
        ref = reference({"model_type": mt, **hf.to_dict()})
        assert defaults["rope_theta"] == ref["rope_theta"], mt
        assert defaults["rms_norm_eps"] == hf.rms_norm_eps, mt
        for key in ("router_aux_loss_coef", "norm_topk_prob", "sliding_window", "query_pre_attn_scalar",
                    "attn_logit_softcapping", "final_logit_softcapping"):
            if key in defaults:
                assert getattr(hf, key) == defaults[key], (mt, key)
        assert hf.attention_dropout == 0.0 and hf.initializer_range == 0.02, mt


def test_an_omitted_key_takes_the_architecture_default():
    """Mistral's config.json has no attention_dropout, Mixtral's omitted rope_theta would be 1e6."""
    cfg = {k: v for k, v in _config("mixtral").items() if k not in ("rope_theta", "router_aux_loss_coef")}
    tm = trained_model(model_from_hf_config(cfg, name="m"))
    ref = reference(cfg)
    assert (tm.rope_theta, tm.aux_loss_coef) == (ref["rope_theta"], ref["aux_loss"]) == (1e6, 0.001)


# --- Megatron-LM -----------------------------------------------------------------------------------

def megatron_lm():
    """Megatron-LM's megatron.training.arguments (a checkout on sys.path or in MEGATRON_LM), else
    None. Its package __init__ imports the whole trainer (Transformer Engine, Triton, datasets): the
    arguments module is loaded under a bare package holding the three names its utils import."""
    if os.environ.get("MEGATRON_LM") and os.environ["MEGATRON_LM"] not in sys.path:
        sys.path.insert(0, os.environ["MEGATRON_LM"])
    quiet_import("megatron.core")
    if "megatron.training.arguments" in sys.modules:
        return sys.modules["megatron.training.arguments"]
    spec = importlib.util.find_spec("megatron.training")
    if spec is None:
        return None
    pkg = types.ModuleType("megatron.training")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["megatron.training"] = pkg
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.training.global_vars as global_vars
        for name in ("get_args", "get_timers", "get_adlr_autoresume"):
            setattr(pkg, name, getattr(global_vars, name))
        import megatron.training.arguments as arguments
    return arguments


# What a CPU without Transformer Engine needs beside the export (the export is for GPUs), and what
# pretrain_gpt.py needs beyond the model: the data and tokenizer of a smoke run, iterations, lr.
CPU_ONLY = ["--no-rope-fusion", "--transformer-impl", "local"]


def megatron_config(out, layout, model, monkeypatch):
    """(TransformerConfig, Megatron-LM args namespace or the parsed flags) of an export."""
    import torch
    from megatron.core.transformer import TransformerConfig

    arguments = megatron_lm()
    fallback = megatron_core_values(megatron_flags(out.settings), torch)
    kw = {k: v for k, v in fallback.items() if k in {f.name for f in dataclasses.fields(TransformerConfig)}}
    kw |= {"params_dtype": torch.bfloat16, "pipeline_dtype": torch.bfloat16, "apply_rope_fusion": False}
    kw["num_query_groups"] = kw.get("num_query_groups") if fallback.get("group_query_attention") else None
    built = TransformerConfig(**kw)
    if arguments is None:
        return built, fallback
    argv = [*out.settings, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(model.vocab - 1),
            "--train-iters", "10", "--lr", "3e-4", *CPU_ONLY]
    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    args = parser.parse_args(argv)
    args.rank, args.world_size = 0, layout.world_size
    from tuner._export_job import export_job
    from tuner._export_megatron import megatron_env

    for name, value in megatron_env(export_job(layout, model, H100x32, GB64)).items():
        monkeypatch.setenv(name, value)  # what megatron-launch exports
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 9)  # an H100 (validate_args asks CUDA)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        arguments.validate_args(args, {})
        cfg = arguments.core_transformer_config_from_args(args)
    # The fallback mapping is Megatron-LM's: checked wherever Megatron-LM is there to check it.
    for f in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
              "layernorm_epsilon", "attention_dropout", "hidden_dropout", "init_method_std", "qk_layernorm",
              "add_qkv_bias", "add_bias_linear", "gated_linear_unit", "num_moe_experts", "moe_router_topk",
              "moe_ffn_hidden_size", "moe_router_pre_softmax", "moe_shared_expert_intermediate_size",
              "moe_shared_expert_gate", "layernorm_zero_centered_gamma", "normalization"):
        assert getattr(cfg, f) == getattr(built, f), f
    return cfg, vars(args)


@pytest.fixture(scope="module")
def megatron_world(tmp_path_factory):
    """One gloo rank and megatron-core's model-parallel state of size 1, to build a GPTModel."""
    quiet_import("megatron.core")
    import torch.distributed as dist
    from megatron.core import parallel_state

    own = not dist.is_initialized()
    if own:
        store = tmp_path_factory.mktemp("megatron") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    if own:
        dist.destroy_process_group()


def megatron_params(cfg, args):
    """Parameters of the GPTModel Megatron-LM builds (gpt_builders.py: the decoder block spec for
    MoE, the layer spec otherwise; here the local, non-TE modules, same parameter shapes), whole:
    one rank of every parallelism, on the meta device."""
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    one = dataclasses.replace(
        cfg, tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
        expert_model_parallel_size=1, expert_tensor_parallel_size=1, sequence_parallel=False,
        pipeline_model_parallel_layout=None, virtual_pipeline_model_parallel_size=None, use_cpu_initialization=True,
        perform_initialization=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        transformer_impl="local",
        # No parameters in these: (1 + w) and persistent norms are Transformer Engine's only; all-to-all opens a CUDA stream.
        layernorm_zero_centered_gamma=False, persist_layer_norm=False, moe_token_dispatcher_type="allgather")
    if one.num_moe_experts:
        spec = get_gpt_decoder_block_spec(one, use_transformer_engine=False, normalization=one.normalization)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=one.qk_layernorm, normalization=one.normalization)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = GPTModel(config=one, transformer_layer_spec=spec, vocab_size=args["padded_vocab_size"],
                         max_sequence_length=args["max_position_embeddings"],
                         share_embeddings_and_output_weights=not args.get("untie_embeddings_and_output_weights"),
                         position_embedding_type=args["position_embedding_type"], rotary_base=args["rotary_base"],
                         rope_scaling=bool(args.get("use_rope_scaling")))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("mt", TYPES)
def test_megatron_export_builds_the_hf_model(mt, megatron_world, monkeypatch):
    model, lay = _model(mt), ARCHS[mt][1]
    ref = reference(_config(mt))
    out = _export(mt, "megatron")
    cfg, args = megatron_config(out, lay, model, monkeypatch)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.kv_channels) == (
        ref["layers"], ref["hidden"], ref["heads"], ref["head_dim"])
    assert (cfg.num_query_groups or cfg.num_attention_heads) == ref["groups"]
    assert args["rotary_base"] == ref["rope_theta"] and args["position_embedding_type"] == "rope"
    scaling = ref["rope_scaling"]
    assert bool(args.get("use_rope_scaling")) == bool(scaling and scaling["rope_type"] == "llama3")
    if args.get("use_rope_scaling"):
        assert args["rope_scaling_factor"] == scaling["factor"] == 8.0
        assert (scaling["low_freq_factor"], scaling["high_freq_factor"],
                scaling["original_max_position_embeddings"]) == (1.0, 4.0, 8192)  # megatron-core's fixed ones
    assert cfg.layernorm_epsilon == ref["eps"] and cfg.normalization == "RMSNorm"
    assert cfg.attention_dropout == ref["attention_dropout"] and cfg.hidden_dropout == 0.0
    assert cfg.init_method_std == ref["init_std"]
    assert args["padded_vocab_size"] == ref["vocab"]
    assert bool(args.get("untie_embeddings_and_output_weights")) == (not ref["tied"])
    assert cfg.qk_layernorm == model.qk_norm and cfg.add_qkv_bias == model.qkv_bias
    if ref["experts"]:
        assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (
            ref["experts"], ref["top_k"], ref["expert_ffn"])
        coeff = cfg.moe_aux_loss_coeff
        assert (coeff[0] if isinstance(coeff, list) else coeff) == ref["aux_loss"] > 0
        assert "aux_loss" in cfg.moe_router_load_balancing_type
        assert cfg.moe_router_pre_softmax == (not ref["renorm"])  # softmax before top-k, not renormalised
        assert (cfg.moe_shared_expert_intermediate_size or 0) == ref["shared_ffn"]
    else:
        assert cfg.ffn_hidden_size == ref["ffn"] and not cfg.num_moe_experts
    hf_count = hf_param_count(_config(mt))
    built = megatron_params(cfg, args)
    if mt.startswith("gemma"):  # pretrain_gpt.py builds no sandwich norms: named, and the only difference
        assert built == hf_count - 2 * model.hidden * model.layers
        said = " ".join(out.caveats)
        for prop in ("norms_per_layer", "embedding scale", "mlp=geglu: Megatron-LM's --quick-geglu"):
            assert prop in said, prop
        assert ("attn_logit_softcapping=50.0" in said) == (mt == "gemma2")
        assert ("rope_local_base_freq (RoPE base of the sliding-window layers)=10000" in said) == (mt == "gemma3_text")
        assert cfg.layernorm_zero_centered_gamma  # Gemma's (1 + w) RMSNorm
    else:
        assert built == hf_count, (built, hf_count)


def test_a_non_default_megatron_property_reaches_the_config(monkeypatch):
    """Mixtral's router_aux_loss_coef 0.02 (the issue's case) and rope_theta 1e6, not megatron's defaults."""
    out = _export("mixtral", "megatron")
    cfg, args = megatron_config(out, ARCHS["mixtral"][1], _model("mixtral"), monkeypatch)
    coeff = cfg.moe_aux_loss_coeff
    assert (coeff[0] if isinstance(coeff, list) else coeff) == 0.02 and args["rotary_base"] == 1_000_000


# --- torchtitan ------------------------------------------------------------------------------------

SHIPPED = {"llama": ("llama3", "8B"), "qwen3": ("qwen3", "8B"), "qwen3_moe": ("qwen3", "30B-A3B"),
           "mistral": ("meshtune_llama3", "meshtune"), "mixtral": ("meshtune_qwen3", "meshtune")}
REFUSED = {"qwen2": "qkv_bias=true", "qwen2_moe": "shared_expert_ffn=5632 with a sigmoid gate",
           "gemma2": "mlp=geglu", "gemma3_text": "norms_per_layer=4"}


def _titan_args_match(args, ref, model):
    """torchtitan model arguments field by field against what transformers reads from the config."""
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads or args.n_heads, args.vocab_size) == (
        ref["hidden"], ref["layers"], ref["heads"], ref["groups"], ref["vocab"])
    assert args.norm_eps == ref["eps"] and args.rope_theta == ref["rope_theta"]
    if hasattr(args, "rope_scaling_args"):  # llama3: always Llama 3.1's scaling; factor 1 is none
        s, want = args.rope_scaling_args, ref["rope_scaling"]
        if want is None:
            assert s.scaling_factor == 1.0
        else:
            assert (s.scaling_factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings) == (
                want["factor"], want["low_freq_factor"], want["high_freq_factor"],
                want["original_max_position_embeddings"])
        assert not ref["tied"] and ref["head_dim"] == ref["hidden"] // ref["heads"]
    else:  # qwen3
        assert args.head_dim == ref["head_dim"] and args.qk_norm == model.qk_norm
        assert args.enable_weight_tying == ref["tied"] and ref["rope_scaling"] is None
        assert args.moe_enabled == bool(ref["experts"])
        if ref["experts"]:
            m = args.moe_args
            assert (m.num_experts, m.top_k, args.moe_inter_dim, m.num_shared_experts, m.score_func, m.route_norm) == (
                ref["experts"], ref["top_k"], ref["expert_ffn"], 0, "softmax", ref["renorm"])
            assert not m.score_before_experts and m.route_scale == 1.0
        else:
            assert args.hidden_dim == ref["ffn"]


@pytest.mark.parametrize("mt", TYPES)
def test_torchtitan_export_names_a_flavour_with_the_configs_arguments_or_refuses(mt, tmp_path):
    import torch

    if mt in REFUSED:
        with pytest.raises(SpecError, match=r"^format=torchtitan: no torchtitan 0\.2 model builds") as err:
            _export(mt, "torchtitan")
        assert REFUSED[mt] in str(err.value) and "\n" not in str(err.value)
        return
    out = _export(mt, "torchtitan")
    (tmp_path / "job.toml").write_text(out.text)
    for name, text in out.files.items():
        (tmp_path / name).write_text(text)
    config, _ = torchtitan_config()
    job = config.ConfigManager().parse_args(["--job.config_file", str(tmp_path / "job.toml")])
    assert (job.model.name, job.model.flavor) == SHIPPED[mt]
    assert bool(out.files) == job.model.name.startswith("meshtune_")
    model_cls, args = titan_model_of(job, tmp_path)
    ref = reference(_config(mt))
    _titan_args_match(args, ref, _model(mt))
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        built = model_cls(args)
    assert sum(p.numel() for p in built.parameters()) == hf_param_count(_config(mt))


def test_the_flavour_table_is_torchtitans():
    """Every flavour meshtune compares against is torchtitan 0.2's own, field for field, and none
    of its llama3/qwen3 flavours (debug and flex/varlen-attention variants aside) is missing."""
    for name in ("llama3", "qwen3"):
        shipped = titan_train_spec(name).model_args
        listed = {f for (n, f) in TITAN_FLAVOURS if n == name}
        assert listed == {f for f, a in shipped.items() if "debug" not in f and a.attn_type == "sdpa"}
        for flavour in listed:
            args = shipped[flavour]
            for field, want in TITAN_FLAVOURS[(name, flavour)].items():
                got = getattr(args, "rope_scaling_args" if field == "rope_scaling" else field)
                if field == "rope_scaling":
                    got = (got.scaling_factor, got.low_freq_factor, got.high_freq_factor,
                           got.original_max_position_embeddings)
                elif field == "moe_args":
                    got = {k: getattr(got, k) for k in want}
                assert got == want, (name, flavour, field)


# --- Megatron-Bridge, DeepSpeed, built-in specs ----------------------------------------------------

RECIPES = {"llama": "llama31_8b", "qwen2": "qwen25_7b", "qwen3": "qwen3_8b", "qwen3_moe": "qwen3_30b_a3b",
           "gemma2": "gemma2_9b", "gemma3_text": "gemma3_1b",
           "mistral": "llama3_8b", "mixtral": "qwen3_30b_a3b", "qwen2_moe": "qwen3_30b_a3b"}  # no recipe: family's


@pytest.mark.parametrize("mt", TYPES)
def test_nemo_recipe_and_model_overrides(mt):
    out = _export(mt, "nemo")
    ref = reference(_config(mt))
    assert out.settings[:2] == ["--recipe", f"{RECIPES[mt]}_pretrain_config"]
    own = mt not in ("mistral", "mixtral", "qwen2_moe")
    assert own != any("no Megatron-Bridge 0.3 recipe" in c for c in out.caveats)
    given = dict(o.split("=", 1) for o in out.settings[2:])
    assert float(given["model.layernorm_epsilon"]) == ref["eps"]
    assert float(given["model.attention_dropout"]) == ref["attention_dropout"] == float(given["model.hidden_dropout"])
    assert int(given["model.vocab_size"]) == ref["vocab"] and given["model.should_pad_vocab"] == "false"
    assert given["model.share_embeddings_and_output_weights"] == str(ref["tied"]).lower()
    if not mt.startswith("gemma"):  # the Gemma providers hold their (local, global) RoPE bases themselves
        assert float(given["model.rotary_base"]) == ref["rope_theta"]
    if ref["experts"]:
        assert float(given["model.moe_aux_loss_coeff"]) == ref["aux_loss"]
        assert given["model.moe_router_pre_softmax"] == str(not ref["renorm"]).lower()


@pytest.mark.parametrize("mt", TYPES)
def test_deepspeed_carries_the_config_json(mt):
    out = _export(mt, "deepspeed")
    assert json.loads(out.text)["meshtune"]["hf_config"] == json.loads(_model(mt).hf_config)


@pytest.mark.parametrize("preset", ["llama3-8b", "llama3-1b", "mixtral-8x7b", "tiny-moe"])
def test_a_built_in_specs_hf_config_builds_its_parameters(preset):
    model = MODEL_PRESETS[preset]
    tm = trained_model(model)
    assert tm.source == "builtin" and tm.model_type in ("llama", "mixtral")
    assert tm.rope_theta == 500_000.0 and tm.norm_eps == 1e-5 and tm.aux_loss_coef == 0.0
    back = model_from_hf_config(tm.hf_config, name=preset, seq_len=model.seq_len)
    assert back.params == model.params
    if model.layers * model.hidden <= 32 * 4096:  # transformers on meta: cheap up to 8B
        assert hf_param_count(tm.hf_config) == model.params


def test_built_in_constants_are_the_models():
    """workers/model.py builds with the constants the exports state."""
    import torch

    from workers.model import ROPE_THETA, Transformer

    spec = dataclasses.replace(MODEL_PRESETS["tiny"], qk_norm=True)
    block = Transformer(spec).layers["0"]
    tm = trained_model(spec)
    assert tm.rope_theta == ROPE_THETA
    assert block.attention_norm.eps == tm.norm_eps and block.attention.q_norm.eps == tm.qk_norm_eps
    assert isinstance(block.attention_norm, torch.nn.RMSNorm)
