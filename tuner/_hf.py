"""A ModelSpec from a Hugging Face ``config.json``: read from a local file, a directory holding one,
or a model directory of the local Hugging Face cache (never a network lookup).

The mapping follows each architecture's ``transformers`` implementation, so ``ModelSpec.params``
equals the parameter count of ``AutoModelForCausalLM.from_config(config)`` (tests/tuner/test_hf_config.py
instantiates every architecture on the meta device and compares). What a config.json does not hold
is ``seq_len`` (the training sequence length, not ``max_position_embeddings``): it is given
alongside, or defaults to ``DEFAULT_SEQ_LEN`` capped by ``max_position_embeddings``. Nothing that
changes no parameter count and no FLOP of a dense causal attention is mapped (RoPE scaling, sliding
windows, logit soft-capping: the time model counts every attention as full causal, an upper bound
for Mistral's and Gemma's windowed layers); the workload that rebuilds the model from
``ModelSpec.hf_config`` (the config's canonical JSON) runs them as the config says.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tuner._errors import SpecError
from tuner._specs import ModelSpec

DEFAULT_SEQ_LEN = 4096

# model_type -> per-architecture defaults of transformers' config class (used only when the
# config.json omits the key), and the features its modeling file hard-codes.
_ARCH: dict[str, dict[str, Any]] = {
    "llama": {"kv_heads": None, "tied": False},
    "mistral": {"kv_heads": 8, "tied": False},
    "qwen2": {"kv_heads": 32, "tied": False, "qkv_bias": True},
    "qwen3": {"kv_heads": 32, "tied": False, "qk_norm": True, "head_dim": 128},
    "gemma2": {"kv_heads": 4, "tied": True, "norms": 4, "head_dim": 256, "act": "gelu_pytorch_tanh"},
    "gemma3_text": {"kv_heads": 4, "tied": True, "norms": 4, "qk_norm": True, "head_dim": 256,
                    "act": "gelu_pytorch_tanh"},
    "mixtral": {"kv_heads": 8, "tied": False, "moe": "mixtral"},
    "qwen2_moe": {"kv_heads": 16, "tied": False, "moe": "qwen", "qkv_bias_key": True},
    "qwen3_moe": {"kv_heads": 4, "tied": False, "moe": "qwen", "qk_norm": True},
}
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma3_text", "mixtral",
                         "qwen2_moe", "qwen3_moe")
_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu": "geglu",
                "gelu_new": "geglu"}
SPEC_KEYS_BESIDE = ("name", "seq_len")  # what a spec may set next to hf_config (the rest is the file's)


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache as huggingface_hub resolves it: HF_HUB_CACHE, else HF_HOME/hub,
    else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub. An empty variable is unset,
    and an empty or relative XDG_CACHE_HOME is ignored (the XDG Base Directory rule), so the cache is
    never looked for under the current directory."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    cache = xdg if xdg and os.path.isabs(xdg) else "~/.cache"
    home = os.environ.get("HF_HOME") or os.path.join(cache, "huggingface")
    return Path(home).expanduser() / "hub"


def _snapshot_config(repo_dir: Path) -> Path | None:
    """config.json of a cache repo directory (models--ORG--NAME): the snapshot refs/main names,
    else the only (or newest) snapshot holding one."""
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        cand = repo_dir / "snapshots" / ref.read_text(encoding="utf-8").strip() / "config.json"
        if cand.is_file():
            return cand
    snaps = sorted((p for p in (repo_dir / "snapshots").glob("*/config.json") if p.is_file()),
                   key=lambda p: p.stat().st_mtime)
    return snaps[-1] if snaps else None


def resolve_hf_config_path(path: str | os.PathLike[str], *, field: str = "model.hf_config") -> Path:
    """The config.json that ``path`` means: the file itself, ``path/config.json``, a cache repo
    directory's snapshot, or (when no such local path exists) a repo id ``ORG/NAME`` looked up in the
    local hub cache only."""
    p = Path(path).expanduser()
    if p.is_file():
        return p
    if p.is_dir():
        if (p / "config.json").is_file():
            return p / "config.json"
        snap = _snapshot_config(p)
        if snap is not None:
            return snap
        raise SpecError(f"{field}={str(path)!r}: the directory holds no config.json")
    parts = str(path).strip("/").split("/")
    if len(parts) == 2 and all(parts) and not p.suffix:
        repo = hub_cache_dir() / f"models--{parts[0]}--{parts[1]}"
        snap = _snapshot_config(repo) if repo.is_dir() else None
        if snap is not None:
            return snap
        raise SpecError(f"{field}={str(path)!r}: no such file, and no {repo}/snapshots/*/config.json in the local "
                        f"Hugging Face cache (meshtune never downloads: fetch it first, e.g. `hf download {path} "
                        f"config.json`)")
    raise SpecError(f"{field}={str(path)!r}: no such file or directory")


def load_hf_config(path: str | os.PathLike[str], *, field: str = "model.hf_config") -> dict[str, Any]:
    """The mapping of a local config.json (see ``resolve_hf_config_path``); SpecError naming the
    field and the path for a missing or unreadable file or invalid JSON."""
    p = resolve_hf_config_path(path, field=field)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{field}={str(path)!r}: cannot read {p} ({exc.__class__.__name__}: {exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(f"{field}={str(path)!r}: invalid JSON in {p}: {exc.msg} (line {exc.lineno}, "
                        f"column {exc.colno})") from None
    if not isinstance(data, dict):
        raise SpecError(f"{field}={str(path)!r}: {p} must hold a JSON object, got {type(data).__name__}")
    return data


def hf_model_name(path: str | os.PathLike[str], config: Mapping[str, Any]) -> str:
    """A readable model name: the cache repo id (ORG/NAME), the file's stem, else the directory's."""
    p = Path(path).expanduser()
    for part in reversed(p.resolve().parts if p.exists() else p.parts):
        if part.startswith("models--"):
            return part.removeprefix("models--").replace("--", "/")
    if len(str(path).strip("/").split("/")) == 2 and not p.exists():
        return str(path).strip("/")
    if p.is_file() and p.stem != "config":
        return p.stem
    name = (p.parent if p.is_file() else p).name
    return name or str(config.get("model_type", "hf-model"))


def _int(config: Mapping[str, Any], key: str, default: Any = None, *, field: str, minimum: int = 1) -> int:
    value = config.get(key, default)
    if value is None:
        raise SpecError(f"{field}: config.json has no {key!r} (model_type {config.get('model_type')!r})")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(f"{field}: {key} must be an integer >= {minimum}, got {value!r}")
    return value


def _bool(config: Mapping[str, Any], key: str, default: bool, *, field: str) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise SpecError(f"{field}: {key} must be true or false, got {value!r}")
    return value


def text_config(config: Mapping[str, Any], *, field: str = "model.hf_config") -> dict[str, Any]:
    """The decoder's own config: a multimodal Gemma 3 (``model_type: gemma3``) nests it in
    ``text_config``; every other supported config is its own."""
    if not isinstance(config, Mapping):
        raise SpecError(f"{field} must be a config.json object, got {type(config).__name__}")
    mt = config.get("model_type")
    if mt == "gemma3":
        inner = config.get("text_config")
        if not isinstance(inner, Mapping):
            raise SpecError(f"{field}: model_type 'gemma3' needs a 'text_config' object (the decoder's config)")
        return {"model_type": "gemma3_text", **inner}
    return dict(config)


def model_from_hf_config(config: Mapping[str, Any], *, name: str, seq_len: int | None = None,
                         field: str = "model.hf_config") -> ModelSpec:
    """The ModelSpec of a Hugging Face config (see the module docstring). ``hf_config`` holds the
    canonical JSON of the decoder's config (a multimodal Gemma 3's ``text_config``)."""
    cfg = text_config(config, field=field)
    mt = cfg.get("model_type")
    if mt not in _ARCH:
        raise SpecError(f"{field}: model_type={mt!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    arch = _ARCH[mt]
    for key in ("attention_bias", "mlp_bias"):  # o_proj/MLP biases: no ModelSpec field models them
        if _bool(cfg, key, False, field=field):
            raise SpecError(f"{field}: {key}=true is not supported for model_type {mt!r}")
    heads = _int(cfg, "num_attention_heads", field=field)
    hidden = _int(cfg, "hidden_size", field=field)
    kv_heads = _int(cfg, "num_key_value_heads", arch["kv_heads"] or heads, field=field)
    # transformers: an explicit (non-null) head_dim wins, else the class default, else hidden // heads.
    head_dim = cfg.get("head_dim") or arch.get("head_dim") or 0
    if head_dim:
        head_dim = _int({"head_dim": head_dim}, "head_dim", field=field)
    act_key = "hidden_activation" if mt.startswith("gemma") else "hidden_act"
    act = cfg.get(act_key) or cfg.get("hidden_act") or arch.get("act", "silu")
    if act not in _ACTIVATIONS:
        raise SpecError(f"{field}: {act_key}={act!r} is not supported (supported: {', '.join(_ACTIVATIONS)})")
    layers = _int(cfg, "num_hidden_layers", field=field)
    max_pos = cfg.get("max_position_embeddings")
    if seq_len is None:
        seq_len = min(DEFAULT_SEQ_LEN, max_pos) if isinstance(max_pos, int) and max_pos > 0 else DEFAULT_SEQ_LEN
    spec: dict[str, Any] = dict(
        name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
        vocab=_int(cfg, "vocab_size", field=field), seq_len=seq_len,
        tied_embeddings=_bool(cfg, "tie_word_embeddings", arch["tied"], field=field),
        mlp=_ACTIVATIONS[act], head_dim=head_dim,
        qkv_bias=_bool(cfg, "qkv_bias", True, field=field) if arch.get("qkv_bias_key") else arch.get("qkv_bias", False),
        qk_norm=arch.get("qk_norm", False), norms_per_layer=arch.get("norms", 2),
        hf_config=json.dumps(cfg, sort_keys=True),
    )
    moe = arch.get("moe")
    if moe == "mixtral":
        ffn = _int(cfg, "intermediate_size", field=field)
        spec.update(ffn=ffn, experts=_int(cfg, "num_local_experts", field=field),
                    top_k=_int(cfg, "num_experts_per_tok", field=field), expert_ffn=ffn)
    elif moe == "qwen":
        experts = _int(cfg, "num_experts", field=field)
        step = _int(cfg, "decoder_sparse_step", 1, field=field)
        only = cfg.get("mlp_only_layers") or []
        if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
            raise SpecError(f"{field}: mlp_only_layers must be a list of layer indices, got {only!r}")
        # transformers' rule (Qwen2MoeDecoderLayer): sparse iff not listed and (i + 1) % step == 0.
        dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
        spec.update(ffn=_int(cfg, "intermediate_size", field=field), experts=experts,
                    top_k=_int(cfg, "num_experts_per_tok", field=field),
                    expert_ffn=_int(cfg, "moe_intermediate_size", field=field), dense_layers=dense)
        if mt == "qwen2_moe":
            spec.update(shared_expert_ffn=_int(cfg, "shared_expert_intermediate_size", field=field),
                        shared_expert_gate=True)
    else:
        spec.update(ffn=_int(cfg, "intermediate_size", field=field))
    try:
        return ModelSpec(**spec)
    except SpecError as exc:
        raise SpecError(f"{field} ({mt}): {exc}") from None


def model_from_hf_source(source: Any, *, name: str | None = None, seq_len: int | None = None,
                         allow_path: bool = True, field: str = "model.hf_config") -> ModelSpec:
    """A ModelSpec from a config object (a mapping) or, when ``allow_path``, a local path."""
    if isinstance(source, Mapping):
        return model_from_hf_config(source, name=name or str(source.get("_name_or_path") or source.get(
            "model_type") or "hf-model"), seq_len=seq_len, field=field)
    if isinstance(source, (str, os.PathLike)) and not isinstance(source, bool):
        if not allow_path:
            raise SpecError(f"{field}: a path is not accepted here (the server reads no files it is named): "
                            f"send the config.json object itself")
        if not str(source):
            raise SpecError(f"{field} must be a path to a config.json, got ''")
        config = load_hf_config(source, field=field)
        return model_from_hf_config(config, name=name or hf_model_name(source, config), seq_len=seq_len, field=field)
    what = "a path to a config.json or a config object" if allow_path else "a config object (config.json's content)"
    raise SpecError(f"{field} must be {what}, got {type(source).__name__}")


def inline_hf_config(model: Any, *, base_dir: str | os.PathLike[str] | None = None,
                     field: str = "model.hf_config") -> Any:
    """``model`` with a config.json path in ``hf_config`` replaced by the config object itself (and
    ``name`` defaulted from the path), so that what is submitted or stored needs no file. A relative
    path is looked up in ``base_dir`` (a spec file's directory) first, then from the working
    directory, then as a repo id in the local Hugging Face cache. Anything else is unchanged."""
    if not isinstance(model, Mapping) or not isinstance(model.get("hf_config"), (str, os.PathLike)):
        return model
    given = str(model["hf_config"])
    if base_dir is not None and not Path(given).expanduser().is_absolute() and (Path(base_dir) / given).exists():
        given = str(Path(base_dir) / given)
    config = load_hf_config(given, field=field)
    out = {k: v for k, v in model.items() if k != "hf_config"}
    out.setdefault("name", hf_model_name(given, config))
    return {"hf_config": config, **out}


def model_arg(text: str, *, option: str = "--model") -> Any:
    """The CLI's ``--model`` value: a preset name as given, or ``hf:PATH`` (a config.json, a
    directory, or a repo id in the local Hugging Face cache) as ``{hf_config: <config>, name}``.
    The one parser of ``--model`` for plan, run-trial and sweep."""
    if not text.startswith("hf:"):
        return text
    path = text.removeprefix("hf:")
    if not path:
        raise SpecError(f"{option}={text!r}: give a config.json path after 'hf:' (e.g. hf:examples/hf/llama3.1-8b.json)")
    model = inline_hf_config({"hf_config": path}, field=option)
    model_from_hf_config(model["hf_config"], name=model["name"], field=option)  # errors name the option
    return model
