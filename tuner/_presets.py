"""Named presets of models and clusters (each with its primary source), and the builders that make a
spec from a preset name, a mapping of a preset plus overrides, or a Hugging Face config
(``model_spec``, ``cluster_spec``, ``training_spec``)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any, TypeVar

from tuner._errors import SpecError, UnknownPresetError, require_positive_int, require_positive_number
from tuner._specs import ClusterSpec, GiB, ModelSpec, TrainingSpec

MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        # CPU-sized shapes for tests and the embedded default.
        ModelSpec("tiny", layers=4, hidden=64, heads=4, kv_heads=2, ffn=192, vocab=256, seq_len=64),
        ModelSpec("tiny-moe", layers=4, hidden=64, heads=4, kv_heads=2, ffn=192, vocab=256, seq_len=64,
                  experts=4, top_k=2, expert_ffn=96),
        ModelSpec("small", layers=8, hidden=256, heads=8, kv_heads=4, ffn=768, vocab=1024, seq_len=256),
        # Llama 3.2 1B (Meta model card): a 1B-class shape for single-node GPU measurements.
        ModelSpec("llama3-1b", layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256,
                  seq_len=2048, tied_embeddings=True),
        # Llama 3 herd (Dubey et al. 2024, Table 3).
        ModelSpec("llama3-8b", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256,
                  seq_len=8192),
        ModelSpec("llama3-70b", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256,
                  seq_len=8192),
        ModelSpec("llama3-405b", layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256,
                  seq_len=8192),
        # GPT-3 175B (Brown et al. 2020, Table 2.1); vocab padded as Megatron does.
        ModelSpec("gpt3-175b", layers=96, hidden=12288, heads=96, kv_heads=96, ffn=49152, vocab=51200,
                  seq_len=2048, tied_embeddings=True, mlp="gelu"),
        # BLOOM-176B (BigScience 2022).
        ModelSpec("bloom-176b", layers=70, hidden=14336, heads=112, kv_heads=112, ffn=57344, vocab=250880,
                  seq_len=2048, tied_embeddings=True, mlp="gelu"),
        # Mixtral 8x7B (Jiang et al. 2024).
        ModelSpec("mixtral-8x7b", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000,
                  seq_len=4096, experts=8, top_k=2, expert_ffn=14336),
    )
}

# One 8-GPU node each unless said otherwise. Bandwidths per device, one direction (half the
# datasheets' bidirectional NVLink/Infinity Fabric figures). The network is a deployment choice, not
# a device's: the presets assume one NIC per GPU of the rate given (the vendors' reference systems).
# Override any of it, and set price_per_device_hour, per sweep: {preset: h100-sxm, nodes: 16, ...}.
CLUSTER_PRESETS: dict[str, ClusterSpec] = {
    c.name: c
    for c in (
        # A100 SXM 40GB (NVIDIA A100 datasheet, 2020): 312 TFLOP/s bf16 dense, NVLink3 600 GB/s, HDR 200 Gb/s.
        ClusterSpec("a100-40g", nodes=1, devices_per_node=8, device_memory=40 * GiB, peak_flops=312e12,
                    intra_node_bandwidth=300e9, inter_node_bandwidth=25e9),
        # A100 SXM 80GB: 312 TFLOP/s bf16 dense, NVLink3 600 GB/s bidirectional, HDR 200 Gb/s per GPU.
        ClusterSpec("a100-80g", nodes=1, devices_per_node=8, device_memory=80 * GiB, peak_flops=312e12,
                    intra_node_bandwidth=300e9, inter_node_bandwidth=25e9),
        # H100 SXM: 989 TFLOP/s bf16 dense, NVLink4 900 GB/s bidirectional, NDR 400 Gb/s per GPU.
        ClusterSpec("h100-sxm", nodes=1, devices_per_node=8, device_memory=80 * GiB, peak_flops=989e12,
                    intra_node_bandwidth=450e9, inter_node_bandwidth=50e9),
        # H100 PCIe (NVIDIA H100 datasheet): 756 TFLOP/s bf16 dense, 80 GB; GPUs meet over PCIe Gen5 x16
        # (128 GB/s bidirectional; the NVLink bridge joins pairs only), 200 Gb/s per GPU.
        ClusterSpec("h100-pcie", nodes=1, devices_per_node=8, device_memory=80 * GiB, peak_flops=756e12,
                    intra_node_bandwidth=64e9, inter_node_bandwidth=25e9, intra_node_latency=1e-5),
        # H200 SXM (NVIDIA H200 datasheet): H100 compute (989 TFLOP/s bf16 dense) with 141 GB HBM3e,
        # NVLink4 900 GB/s bidirectional, NDR 400 Gb/s per GPU.
        ClusterSpec("h200", nodes=1, devices_per_node=8, device_memory=141 * 10**9, peak_flops=989e12,
                    intra_node_bandwidth=450e9, inter_node_bandwidth=50e9),
        # HGX B200 (NVIDIA HGX B200 datasheet): 2.25 PFLOP/s bf16 dense (4.5 sparse), 180 GB HBM3e,
        # NVLink5 1.8 TB/s bidirectional, ConnectX-7 400 Gb/s per GPU.
        ClusterSpec("b200", nodes=1, devices_per_node=8, device_memory=180 * 10**9, peak_flops=2.25e15,
                    intra_node_bandwidth=900e9, inter_node_bandwidth=50e9),
        # GB200 NVL72 (NVIDIA GB200 NVL72 datasheet): 72 Blackwell GPUs in one NVLink domain over 18
        # compute trays of 4; 2.5 PFLOP/s bf16 dense per GPU (360 PFLOP/s sparse per rack), 186 GB HBM3e
        # (13.4 TB per rack), NVLink5 1.8 TB/s bidirectional per GPU across the whole rack, 400 Gb/s per GPU.
        ClusterSpec("gb200-nvl72", nodes=18, devices_per_node=4, device_memory=186 * 10**9, peak_flops=2.5e15,
                    intra_node_bandwidth=900e9, inter_node_bandwidth=50e9, fast_domain_devices=72,
                    fast_domain_bandwidth=900e9, fast_domain_latency=7e-6),
        # AMD Instinct MI300X (AMD MI300X datasheet): 1307.4 TFLOP/s bf16 dense, 192 GB HBM3, 7 Infinity
        # Fabric links of 128 GB/s bidirectional (448 GB/s per direction to the 7 peers), 400 Gb/s per GPU.
        ClusterSpec("mi300x", nodes=1, devices_per_node=8, device_memory=192 * GiB, peak_flops=1307.4e12,
                    intra_node_bandwidth=448e9, inter_node_bandwidth=50e9, intra_node_latency=8e-6),
        # NVIDIA L40S (L40S datasheet): 362 TFLOP/s bf16 dense (733 sparse), 48 GB GDDR6, no NVLink:
        # PCIe Gen4 x16 (64 GB/s bidirectional), 200 Gb/s per GPU.
        ClusterSpec("l40s", nodes=1, devices_per_node=8, device_memory=48 * GiB, peak_flops=362e12,
                    intra_node_bandwidth=32e9, inter_node_bandwidth=25e9, intra_node_latency=1e-5),
        # CPU processes on one host talking over gloo (the embedded default and CI).
        ClusterSpec("cpu-local", nodes=1, devices_per_node=4, device_memory=4 * GiB, peak_flops=5e10,
                    intra_node_bandwidth=5e9, inter_node_bandwidth=5e9, intra_node_latency=5e-5,
                    inter_node_latency=5e-5, device_kind="cpu"),
    )
}

_T = TypeVar("_T")


def _build(cls: type[_T], section: str, value: Any, presets: Mapping[str, _T], *,
           also_known: tuple[str, ...] = ()) -> _T:
    """A spec from a preset name, or a mapping with an optional ``preset`` key plus overrides;
    ``also_known``: the section's other fields, converted before (listed in an unknown field's error)."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        value = {"preset": value}
    if not isinstance(value, Mapping):
        raise SpecError(f"{section} must be a preset name or a mapping, got {value!r}")
    data = dict(value)
    base: dict[str, Any] = {}
    preset = data.pop("preset", None)
    if preset is not None:
        if not isinstance(preset, str):
            several = " (device types are compared by `meshtune plan --cluster a,b` or /api/plan/devices)" if (
                section == "cluster" and isinstance(preset, (list, tuple))) else ""
            raise SpecError(f"{section}.preset must be a preset name, got {preset!r}{several}")
        if preset not in presets:
            raise UnknownPresetError(
                f"{section}.preset={preset!r} is not a known preset (known: {', '.join(sorted(presets))})"
                + (HF_HINT if section == "model" and _looks_like_path(preset) else "")
            )
        base = dataclasses.asdict(presets[preset])  # type: ignore[call-overload]
        if base.get("head_dim") and base["head_dim"] * base["heads"] == base["hidden"]:
            del base["head_dim"]  # derived, not explicit: an override of hidden/heads re-derives it
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - fields)
    if unknown:
        known = ", ".join(sorted(fields | set(also_known)))
        raise SpecError(f"{section}.{unknown[0]} is not a known field (known: {known})")
    base.update(data)
    if "name" in fields and "name" not in base:
        base["name"] = "custom"
    try:
        return cls(**base)
    except TypeError as exc:  # missing required fields
        raise SpecError(f"{section}: {exc}") from None


def model_spec(value: Any, *, allow_path: bool = True) -> ModelSpec:
    """A ModelSpec from a preset name, a mapping (optional ``preset`` + overrides), or a Hugging Face
    config: ``{hf_config: PATH or config object, seq_len?, name?}`` (tuner/_hf.py). Beside
    ``hf_config`` only ``name`` and ``seq_len`` may be given: the shape is the config's, so that the
    workload rebuilding the model from it trains what was planned. ``allow_path=False`` (the API)
    refuses a path: the server reads no file it is named."""
    # Any hf_config but "" (ModelSpec.to_dict's "not from a config") is one: an empty or wrong-typed
    # one is then named as such, not reported as missing shape fields.
    if isinstance(value, Mapping) and value.get("hf_config", "") != "":
        return _hf_model_spec(value, allow_path=allow_path)
    return _build(ModelSpec, "model", value, MODEL_PRESETS)


def _hf_model_spec(value: Mapping[str, Any], *, allow_path: bool) -> ModelSpec:
    from tuner._hf import SPEC_KEYS_BESIDE, model_from_hf_config, model_from_hf_source

    data = dict(value)
    source = data.pop("hf_config")
    extra = sorted(set(data) - set(SPEC_KEYS_BESIDE))
    name, seq_len = data.get("name"), data.get("seq_len")
    if name is not None and (not isinstance(name, str) or not name):
        raise SpecError(f"model.name must be a non-empty string, got {name!r}")
    if not extra:
        return model_from_hf_source(source, name=name, seq_len=seq_len, allow_path=allow_path)
    # Every field given: a ModelSpec written out by to_dict, whose hf_config is the canonical JSON.
    # It must be what that config says (a hand edit of a shape field would train another model).
    config = None
    if isinstance(source, str):
        try:
            config = json.loads(source)
        except ValueError:
            config = None
    if not isinstance(config, dict):
        raise SpecError(f"model.{extra[0]} cannot be set beside model.hf_config (the shape is the "
                        f"config.json's: edit the file); beside it only {', '.join(SPEC_KEYS_BESIDE)}")
    spec = _build(ModelSpec, "model", value, MODEL_PRESETS)
    derived = model_from_hf_config(config, name=spec.name, seq_len=spec.seq_len)
    for f in dataclasses.fields(ModelSpec):
        if getattr(spec, f.name) != getattr(derived, f.name):
            raise SpecError(f"model.{f.name}={getattr(spec, f.name)!r} disagrees with model.hf_config "
                            f"({getattr(derived, f.name)!r}): the shape is the config.json's")
    return spec


def cluster_spec(value: Any) -> ClusterSpec:
    return _build(ClusterSpec, "cluster", value, CLUSTER_PRESETS)


HF_HINT = "; a Hugging Face config.json is given as hf:PATH (--model) or model: {hf_config: PATH} (a spec)"
TOKEN_BATCH_FIELDS = ("global_batch_tokens", "critical_batch_tokens")
# The suffixes api.format.tokens_text prints ("15T", "2.1B", "4.19M"): what the tool prints, it reads.
TOKEN_SUFFIXES = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}


def _looks_like_path(name: object) -> bool:
    """A name that is a file path or a Hugging Face ORG/NAME, not a preset name."""
    return isinstance(name, str) and ("/" in name or "\\" in name or name.endswith(".json"))


def parse_token_count(field: str, text: str) -> float:
    """The number in ``15e12``, ``1T``, ``2.1B``, ``1,000T``, ``4M`` (SpecError naming ``field`` if none)."""
    clean = text.strip().replace(",", "").replace("_", "")
    scale = TOKEN_SUFFIXES.get(clean[-1:].upper(), 1.0) if clean else 1.0
    try:
        return float(clean[:-1] if scale != 1.0 else clean) * scale
    except ValueError:
        raise SpecError(f"{field}={text!r} is not a token count (a number such as 15e12, or 15T, 2.1B, 4M, "
                        "1K)") from None


def token_count(field: str, value: object) -> float:
    """A positive, finite token count, given as a number or as the text ``parse_token_count`` reads."""
    if isinstance(value, str):
        value = parse_token_count(field, value)
    require_positive_number(field, value)
    assert isinstance(value, (int, float))
    if value == float("inf") or value != value:
        raise SpecError(f"{field} must be a finite number, got {value!r}")
    return value


def training_spec(value: Any, *, seq_len: int | None = None) -> TrainingSpec:
    """A TrainingSpec from a mapping; ``global_batch_tokens`` is converted with the model's seq_len,
    ``train_tokens`` may be written as the tool prints it (``1T``)."""
    if isinstance(value, TrainingSpec):
        return value
    if not isinstance(value, Mapping):
        raise SpecError(f"training must be a mapping, got {value!r}")
    data = dict(value)
    if isinstance(data.get("train_tokens"), str):
        data["train_tokens"] = token_count("training.train_tokens", data["train_tokens"])
    for key in TOKEN_BATCH_FIELDS:
        if key in data:
            tokens = data.pop(key)
            require_positive_int(f"training.{key}", tokens)
            assert seq_len is not None, "token batch sizes need the model's seq_len"
            if tokens % seq_len:
                raise SpecError(f"training.{key}={tokens} is not a multiple of model.seq_len={seq_len}")
            data[key.removesuffix("_tokens")] = tokens // seq_len
    return _build(TrainingSpec, "training", data, {}, also_known=TOKEN_BATCH_FIELDS)
