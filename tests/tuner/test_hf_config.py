"""A model from a Hugging Face config.json: ModelSpec.params equals the transformers
implementation's own count (built on the meta device) for every supported architecture, at the
published shapes and at shrunken ones; the built-in model builds the same count; configs are read
from files, directories and the local hub cache only; the spec file, the CLI and the API take them;
bad input is one line naming the field and the value."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from api import store
from api.cli import main
from api.spec import SweepSpec
from tests.helpers.api_client import ALICE, client_for
from tests.helpers.hf import hf_param_count
from tuner import (
    Layout,
    LayoutError,
    Problem,
    SearchSpace,
    SpecError,
    check_supported,
    cluster_spec,
    enumerate_layouts,
    load_hf_config,
    load_problem,
    model_arg,
    model_from_hf_config,
    model_spec,
    to_dict,
    training_spec,
)
from tuner._hf import text_config

transformers = pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
HF = EXAMPLES / "hf"
# One published config per architecture (model_type), as shipped in examples/hf/.
PUBLISHED = {
    "llama": "llama3.1-8b.json",
    "mistral": "mistral-7b.json",
    "qwen2": "qwen2.5-7b.json",
    "qwen3": "qwen3-8b.json",
    "gemma2": "gemma-2-9b.json",
    "gemma3_text": "gemma-3-1b.json",
    "mixtral": "mixtral-8x7b.json",
    "qwen2_moe": "qwen1.5-moe-a2.7b.json",
    "qwen3_moe": "qwen3-30b-a3b.json",
}
# Activated parameters as the model cards state them (Mixtral: Jiang et al. 2024, 12.9B; the Qwen cards).
ACTIVE = {"mixtral-8x7b.json": 12.9e9, "qwen1.5-moe-a2.7b.json": 2.7e9, "qwen3-30b-a3b.json": 3.3e9}


def shrink(config: dict, **extra: object) -> dict:
    """The same architecture at a CPU size (every structural key kept), head_dim explicit and != hidden/heads."""
    out = {**copy.deepcopy(config), "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 128, "max_position_embeddings": 32,
           "head_dim": 24, **extra}
    for key, value in (("num_local_experts", 4), ("num_experts", 4), ("num_experts_per_tok", 2),
                       ("moe_intermediate_size", 32), ("shared_expert_intermediate_size", 48)):
        if key in out:
            out[key] = value
    return out


@pytest.mark.parametrize("model_type", sorted(PUBLISHED))
def test_params_equal_the_transformers_implementation(model_type: str) -> None:
    config = load_hf_config(HF / PUBLISHED[model_type])
    assert text_config(config)["model_type"] == model_type
    spec = model_from_hf_config(config, name=model_type)
    assert spec.params == hf_param_count(config)  # exact (the issue asks for 0.1%)
    small = shrink(config)
    small_spec = model_from_hf_config(small, name="small")
    assert small_spec.head_dim == 24 and small_spec.q_dim == 96 != small_spec.hidden
    assert small_spec.params == hf_param_count(small)
    # The built-in model (workers/model.py) builds the same parameters for the shape.
    from workers.model import Transformer

    assert sum(p.numel() for p in Transformer(small_spec).parameters()) == small_spec.params
    published = ACTIVE.get(PUBLISHED[model_type])
    if published:
        assert abs(spec.active_params / published - 1) < 0.02, spec.active_params


def test_shape_features_are_read_from_each_architecture() -> None:
    q3 = model_from_hf_config(load_hf_config(HF / "qwen3-30b-a3b.json"), name="q3")
    assert (q3.head_dim, q3.q_dim, q3.hidden, q3.qk_norm, q3.experts, q3.top_k, q3.expert_ffn) == \
        (128, 4096, 2048, True, 128, 8, 768)
    q2 = model_from_hf_config(load_hf_config(HF / "qwen1.5-moe-a2.7b.json"), name="q2")
    assert q2.qkv_bias and q2.shared_expert_ffn == 5632 and q2.shared_expert_gate and q2.experts == 60
    g2 = model_from_hf_config(load_hf_config(HF / "gemma-2-9b.json"), name="g2")
    assert g2.norms_per_layer == 4 and g2.mlp == "geglu" and g2.tied_embeddings and g2.head_dim == 256
    llama = model_from_hf_config(load_hf_config(HF / "llama3.1-8b.json"), name="l")
    # seq_len is the training length: min(4096, max_position_embeddings) unless given (rope_scaling: no params).
    assert llama.seq_len == 4096 and model_from_hf_config(load_hf_config(HF / "llama3-tiny.json"), name="t").seq_len == 64
    assert json.loads(llama.hf_config) == load_hf_config(HF / "llama3.1-8b.json")
    assert llama.hf_config == json.dumps(json.loads(llama.hf_config), sort_keys=True)  # canonical
    # decoder_sparse_step / mlp_only_layers: transformers' rule for which layers are dense.
    cfg = shrink(load_hf_config(HF / "qwen3-30b-a3b.json"), num_hidden_layers=6, decoder_sparse_step=2,
                 mlp_only_layers=[1])
    mixed = model_from_hf_config(cfg, name="mixed")
    assert mixed.dense_layers == (0, 1, 2, 4) and mixed.moe_layers == 2
    assert mixed.params == hf_param_count(cfg)
    from workers.model import Transformer

    assert sum(p.numel() for p in Transformer(mixed).parameters()) == mixed.params
    # A multimodal Gemma 3 config: the text decoder is what is tuned.
    g3 = load_hf_config(HF / "gemma-3-1b.json")
    wrapped = {"model_type": "gemma3", "text_config": {k: v for k, v in g3.items() if k != "model_type"},
               "vision_config": {"hidden_size": 1152}}
    assert model_from_hf_config(wrapped, name="g3").params == model_from_hf_config(g3, name="g3").params


def test_presets_are_unchanged_by_the_new_fields() -> None:
    m = model_spec("llama3-8b")
    assert (m.head_dim, m.qkv_bias, m.qk_norm, m.norms_per_layer, m.hf_config) == (128, False, False, 2, "")
    assert m.params == 8_030_261_248
    assert model_spec({"preset": "tiny", "hidden": 128}).head_dim == 32  # derived, not frozen by the preset


def test_sources_file_directory_and_local_hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = (HF / "qwen3-moe-tiny.json").read_text()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text(text)
    assert model_arg(f"hf:{tmp_path / 'mine'}")["name"] == "mine"
    snap = tmp_path / "hub" / "models--Qwen--Qwen3-30B-A3B" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(text)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    got = model_arg("hf:Qwen/Qwen3-30B-A3B")  # a repo id: the local cache only, never the network
    assert got["name"] == "Qwen/Qwen3-30B-A3B" and got["hf_config"] == json.loads(text)
    assert model_arg(f"hf:{snap.parent.parent}")["name"] == "Qwen/Qwen3-30B-A3B"  # the cache's repo directory
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # HF_HOME/hub
    assert model_arg("hf:Qwen/Qwen3-30B-A3B")["hf_config"]["model_type"] == "qwen3_moe"
    with pytest.raises(SpecError, match=r"--model='Qwen/Nope': no such file.*local Hugging Face cache.*never downloads"):
        model_arg("hf:Qwen/Nope")


def test_spec_file_path_is_relative_to_the_file_and_stored_inline() -> None:
    problem = load_problem(EXAMPLES / "hf-qwen3-moe-tiny-cpu.yaml")
    assert problem.model.name == "qwen3-moe-tiny" and problem.model.qk_norm and problem.model.seq_len == 64
    from api.cli.sweep import load_spec

    spec = load_spec(str(EXAMPLES / "hf-qwen3-moe-tiny-cpu.yaml"))
    assert isinstance(spec.model["hf_config"], dict)  # what is stored needs no file
    assert spec.to_problem().model == problem.model


def test_round_trip_through_to_dict_and_one_truth_with_the_config() -> None:
    spec = model_spec({"hf_config": load_hf_config(HF / "qwen1.5-moe-a2.7b.json"), "seq_len": 2048, "name": "q"})
    data = json.loads(json.dumps(to_dict(spec)))  # as a TrialRequest travels
    assert model_spec(data) == spec
    with pytest.raises(SpecError, match=r"^model.layers=2 disagrees with model.hf_config \(24\)"):
        model_spec({**data, "layers": 2})
    with pytest.raises(SpecError, match=r"^model.layers cannot be set beside model.hf_config.*name, seq_len$"):
        model_spec({"hf_config": str(HF / "llama3-tiny.json"), "layers": 2})


def _bad_configs(tmp_path: Path) -> list[tuple[str, str]]:
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "empty").mkdir()
    base = load_hf_config(HF / "llama3-tiny.json")
    (tmp_path / "ds.json").write_text(json.dumps({**base, "model_type": "deepseek_v3", "kv_lora_rank": 512}))
    (tmp_path / "nohidden.json").write_text(json.dumps({k: v for k, v in base.items() if k != "hidden_size"}))
    (tmp_path / "heads.json").write_text(json.dumps({**base, "num_attention_heads": "four"}))
    t = tmp_path
    return [
        (str(t / "missing.json"), f"model.hf_config='{t / 'missing.json'}': no such file or directory"),
        (str(t / "bad.json"), f"model.hf_config='{t / 'bad.json'}': invalid JSON in {t / 'bad.json'}: "
                              "Expecting property name enclosed in double quotes (line 1, column 2)"),
        (str(t / "list.json"), f"model.hf_config='{t / 'list.json'}': {t / 'list.json'} must hold a JSON object, got list"),
        (str(t / "empty"), f"model.hf_config='{t / 'empty'}': the directory holds no config.json"),
        (str(t / "ds.json"), "model.hf_config: model_type='deepseek_v3' is not supported (supported: llama, mistral, "
                             "qwen2, qwen3, gemma2, gemma3, gemma3_text, mixtral, qwen2_moe, qwen3_moe)"),
        (str(t / "nohidden.json"), "model.hf_config: config.json has no 'hidden_size' (model_type 'llama')"),
        (str(t / "heads.json"), "model.hf_config: num_attention_heads must be an integer >= 1, got 'four'"),
    ]


def test_bad_configs_are_one_line_naming_field_and_value(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for path, message in _bad_configs(tmp_path):
        with pytest.raises(SpecError) as err:
            model_spec({"hf_config": path})
        assert str(err.value) == message
        # The CLI: exit 2, the same line with the option named.
        assert main(["plan", "--model", f"hf:{path}"]) == 2
        out = capsys.readouterr()
        line = message.replace("model.hf_config", "--model", 1)
        assert out.err.strip() == f"meshtune plan: error: {line}" and "Traceback" not in out.err
    assert main(["plan", "--model", "hf:"]) == 2
    assert "--model='hf:': give a config.json path after 'hf:'" in capsys.readouterr().err


def test_the_built_in_model_refuses_what_it_cannot_split() -> None:
    q2 = model_spec({"hf_config": shrink(load_hf_config(HF / "qwen1.5-moe-a2.7b.json"))})
    cluster, training = cluster_spec("cpu-local"), training_spec({"global_batch": 8})
    with pytest.raises(LayoutError, match=r"^the built-in model realises a shared expert \(shared_expert_ffn=48\) "
                                          r"only without sp \(tp=2, sp=True\)$"):
        check_supported(Layout(tp=2, dp=2, sp=True), q2)
    check_supported(Layout(tp=2, dp=2), q2)
    enum = enumerate_layouts(problem=Problem(model=q2, cluster=cluster, training=training))
    assert any(layout.tp > 1 for layout in enum.valid) and not any(layout.sp for layout in enum.valid)
    with pytest.raises(SpecError, match=r"^space.sp=\[True\]: workload 'builtin' realises only sp in \[False\]"):
        enumerate_layouts(problem=Problem(model=q2, cluster=cluster, training=training,
                                          space=SearchSpace(sp=(True,))))
    tiny = model_spec({"hf_config": str(HF / "qwen3-moe-tiny.json")})  # qk-norm, head_dim 32: every axis
    every = enumerate_layouts(problem=Problem(model=tiny, cluster=cluster, training=training)).valid
    assert {(layout.tp > 1, layout.ep > 1) for layout in every} >= {(True, False), (False, True)}
    mixed = model_spec({"hf_config": shrink(load_hf_config(HF / "qwen3-30b-a3b.json"), mlp_only_layers=[0])})
    assert mixed.dense_layers == (0,)
    check_supported(Layout(tp=2, ep=2), mixed)  # dense layers of a MoE model: built (and tested below)
    geglu_moe = model_spec({"preset": "tiny-moe", "mlp": "geglu"})
    with pytest.raises(LayoutError, match=r"^the built-in model's experts are SwiGLU, not mlp='geglu'"):
        check_supported(Layout(dp=4), geglu_moe)


def test_cli_plan_of_a_published_config(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", f"hf:{HF / 'llama3.1-8b.json'}", "--cluster", "h100-sxm", "--nodes", "2",
            "--global-batch-tokens", str(2**20), "--top", "3", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["name"] == "llama3.1-8b" and data["model"]["layers"] == 32
    assert len(data["entries"]) == 3 and data["cluster"]["nodes"] == 2


@pytest.fixture(scope="module")
def hf_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    url = f"sqlite:///{tmp_path_factory.mktemp('api-hf') / 'api.db'}"
    store.upgrade(url)
    with client_for(url) as c:
        yield c


def test_api_takes_the_config_object_and_refuses_a_path(hf_api: TestClient) -> None:
    body = {"name": "hf", "cluster": "cpu-local", "training": {"global_batch": 8, "precision": "fp32"},
            "search": {"sampler": "random", "max_trials": 2}, "backend": "simulate",
            "model": {"hf_config": load_hf_config(HF / "qwen3-moe-tiny.json"), "name": "qwen3-moe-tiny"}}
    r = hf_api.post("/api/sweeps", json=body, headers=ALICE)
    assert r.status_code in (200, 201, 202), r.text
    path = {**body, "model": {"hf_config": str(HF / "qwen3-moe-tiny.json")}}
    r = hf_api.post("/api/sweeps", json=path, headers=ALICE)
    assert r.status_code == 422, r.text
    assert "model.hf_config: a path is not accepted here (the server reads no files it is named)" in r.text
    bad = {**body, "model": {"hf_config": {**body["model"]["hf_config"], "model_type": "deepseek_v3"}}}
    r = hf_api.post("/api/sweeps", json=bad, headers=ALICE)
    assert r.status_code == 422 and "model_type='deepseek_v3' is not supported" in r.text
    with pytest.raises(ValueError, match="a path is not accepted"):
        SweepSpec.model_validate(path)


# --- the built-in model on the new shapes trains like its single-process reference (4 CPU ranks) ---

NUMERICS_RTOL = 1e-5  # fp32: only the reduction order changes (tests/workers/test_workers_numerics.py's reasoning)
NUMERICS_STEPS = 3
# Each shape under a layout that exercises its new parts in the built-in model, four cases in one
# 4-rank spawn (~2 min on 2 busy cores): q/k/v biases under ReplicatedKV (tp=4 > kv_heads=2) with the
# gated shared expert split by TP; qk-norm under TP+SP with ReplicatedKV; qk-norm with expert TP + EP
# and a dense layer in a MoE model; Gemma's sandwich norms and GeGLU under TP+SP with ZeRO-3. (Gemma
# ties its embeddings, which the built-in model unties across pipeline stages, workers/parallelize.py:
# costs equal, numerics not, so no pp case for it.)
NUMERICS = {
    "qwen2moe-tp4": ("qwen1.5-moe-a2.7b.json", Layout(tp=4)),
    "qwen3-tp4-sp": ("qwen3-8b.json", Layout(tp=4, sp=True)),
    # decoder_sparse_step=2: layer 0 dense, layer 1 MoE (a MoE model's dense_layers).
    "qwen3moe-tp2-ep2-acsel-dense0": ("qwen3-30b-a3b.json", Layout(tp=2, ep=2, ac="selective"),
                                      {"decoder_sparse_step": 2}),
    "gemma2-tp2-dp2-sp-zero3": ("gemma-2-9b.json", Layout(tp=2, dp=2, sp=True, zero=3)),
}


def _numerics_request(config: str, layout: Layout, extra: dict | None = None):  # noqa: ANN202
    from workers import TrialRequest

    small = shrink(load_hf_config(HF / config), max_position_embeddings=32, num_hidden_layers=2, **(extra or {}))
    return TrialRequest(
        model=model_spec({"hf_config": small, "name": config, "seq_len": 32}),
        cluster=cluster_spec({"preset": "cpu-local", "devices_per_node": layout.world_size}),
        training=training_spec({"global_batch": 8, "precision": "fp32", "lr": 1e-3, "seed": 3}),
        layout=layout, warmup_steps=1, measure_steps=NUMERICS_STEPS - 1, options={"grad_norm": True},
    )


def _train_all(rank: int, world: int, requests: dict) -> dict:
    import traceback

    from workers.train import train_trial

    out = {}
    for name, request in requests.items():
        try:
            r = train_trial(request, device=torch.device("cpu"))
            out[name] = (r.losses, r.grad_norms)
        except Exception:  # one broken layout must not hide the others
            out[name] = traceback.format_exc()[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_built_in_model_trains_the_new_shapes_like_one_process() -> None:
    from tests.helpers.dist import run_ranks
    from workers.train import reference_losses

    requests = {name: _numerics_request(*case) for name, case in NUMERICS.items()}
    for request in requests.values():  # every case is valid for the built-in model (valid means runnable)
        check_supported(request.layout, request.model)
    results = run_ranks(4, _train_all, requests, timeout_s=540)
    for name, request in requests.items():
        ref_losses, ref_norms = reference_losses(request, steps=NUMERICS_STEPS)
        # The comparison means something only if the steps differ far more than the tolerance.
        assert max(ref_losses) - min(ref_losses) > 100 * NUMERICS_RTOL * max(ref_losses), name
        for rank, per_rank in enumerate(results):
            got = per_rank[name]
            assert not isinstance(got, str), f"{name} failed on rank {rank}:\n{got}"
            assert got[0] == pytest.approx(ref_losses, rel=NUMERICS_RTOL), f"{name} losses, rank {rank}"
            assert got[1] == pytest.approx(ref_norms, rel=NUMERICS_RTOL), f"{name} gradient norms, rank {rank}"


def test_cli_sweep_model_override_from_a_config(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sweep", str(EXAMPLES / "tiny-cpu.yaml"), "--model", f"hf:{HF / 'llama3-tiny.json'}",
            "--backend", "simulate", "--max-trials", "2", "--json"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    data = json.loads(out[out.index("{"):])
    assert data["sweep"]["spec"]["model"]["name"] == "llama3-tiny"
    assert data["sweep"]["spec"]["model"]["hf_config"]["model_type"] == "llama"  # stored inline, no file
    assert main(["sweep", str(EXAMPLES / "tiny-cpu.yaml"), "--model", "hf:/nonexistent/config.json"]) == 2
    assert "--model='/nonexistent/config.json': no such file or directory" in capsys.readouterr().err


def test_api_plan_of_a_config_object(hf_api: TestClient) -> None:
    body = {"model": {"hf_config": load_hf_config(HF / "qwen3-30b-a3b.json"), "seq_len": 4096},
            "cluster": {"preset": "h100-sxm", "nodes": 4}, "training": {"global_batch_tokens": 2**22}, "top": 3}
    r = hf_api.post("/api/plan", json=body, headers=ALICE)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["model"]["experts"] == 128 and data["model"]["head_dim"] == 128 and len(data["entries"]) == 3
    r = hf_api.post("/api/plan", json={**body, "model": {"hf_config": "examples/hf/qwen3-30b-a3b.json"}}, headers=ALICE)
    assert r.status_code == 422 and "a path is not accepted here" in r.text


def test_cli_run_trial_takes_a_config_and_refuses_what_the_built_in_model_cannot_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run-trial", "--model", f"hf:{HF / 'qwen3-moe-tiny.json'}", "--layout", "tp=2,ep=2",
            "--backend", "simulate", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["simulated"] is True and data["status"] == "completed"
    q2 = tmp_path / "qwen2-moe-small.json"
    q2.write_text(json.dumps(shrink(load_hf_config(HF / "qwen1.5-moe-a2.7b.json"))))
    argv = ["run-trial", "--model", f"hf:{q2}", "--layout", "tp=2,dp=2,sp=true", "--backend", "simulate"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("the built-in model realises a shared expert (shared_expert_ffn=48) only without sp "
                        "(tp=2, sp=True)") and "\n" not in err
