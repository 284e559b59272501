"""The Hugging Face workload (workload: hf) trains like its single-process reference on 4 CPU ranks,
and so does the README's example workload (``my_model:WORKLOAD``, its spec's listed layouts).

Shrunken Llama, Qwen3 (tied, q/k norms) and Qwen3-MoE (without ep) configs are built by
``transformers.AutoModelForCausalLM.from_config`` with random weights and laid out by meshtune:
dp, ZeRO-3, TP/SP (tp=4 > kv_heads=2 keeps k/v whole), PP (1F1B, GPipe), activation checkpointing
(full and selective). Same tolerance rule as tests/workers/test_workers_numerics.py (rtol 1e-5 on the per-step
loss and the global gradient norm over 4 fp32 steps, which only reduction order can move; a wrong
1/m, 1/dp or 1/tp factor moves the gradient norm >= 2x). All layouts run in one spawn of 4 ranks.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import traceback

import pytest
import torch

from tests.helpers.dist import run_ranks
from tests.helpers.numerics import RTOL, STEPS
from tests.helpers.readme import readme_example
from tuner import Layout, LayoutError, ModelSpec, cluster_spec, training_spec
from workers import TrialRequest

pytest.importorskip("transformers")

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128,
         "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False}
QWEN3 = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 256,
         "max_position_embeddings": 128, "tie_word_embeddings": True}  # q/k norms, head_dim != hidden/heads
QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 192, "moe_intermediate_size": 32,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True, "vocab_size": 256,
             "max_position_embeddings": 128, "tie_word_embeddings": False}


def spec_of(cfg: dict) -> ModelSpec:
    """The ModelSpec the tuner plans with (hand-written, as tuner._hf would parse it)."""
    qk_norm = cfg["model_type"].startswith("qwen3")
    return ModelSpec(f"hf-{cfg['model_type']}-shrunk", layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"],
                     heads=cfg["num_attention_heads"], kv_heads=cfg["num_key_value_heads"],
                     ffn=cfg["intermediate_size"], vocab=cfg["vocab_size"], seq_len=64,
                     experts=cfg.get("num_experts", 0), top_k=cfg.get("num_experts_per_tok", 0),
                     expert_ffn=cfg.get("moe_intermediate_size", 0), head_dim=cfg.get("head_dim", 0), qk_norm=qk_norm,
                     tied_embeddings=cfg["tie_word_embeddings"],
                     hf_config=json.dumps(cfg, sort_keys=True))


LAYOUTS = {
    "dp4-zero3-ac-selective": (LLAMA, Layout(dp=4, zero=3, ac="selective")),
    "tp2-dp2-sp": (LLAMA, Layout(tp=2, dp=2, sp=True)),
    "tp4-sp-ac-full": (LLAMA, Layout(tp=4, sp=True, ac="full")),  # tp > kv_heads: k/v kept whole
    "pp2-dp2-1f1b-zero3": (LLAMA, Layout(pp=2, dp=2, schedule="1f1b", zero=3)),
    "tp2-pp2-gpipe": (LLAMA, Layout(tp=2, pp=2, schedule="gpipe")),
    "pp2v2-dp2-interleaved-zero1": (LLAMA, Layout(pp=2, vpp=2, dp=2, schedule="interleaved", zero=1)),  # 2 chunks/rank
    # tied embeddings (a pipeline would untie them: not comparable there), q/k norms, wide heads
    "qwen3-tp2-dp2-zero2": (QWEN3, Layout(tp=2, dp=2, zero=2)),
    "qwen3moe-pp2-dp2-zero3-ac-full": (QWEN3_MOE, Layout(pp=2, dp=2, zero=3, ac="full")),
}
README_LAYOUTS = ("tp2-dp2-sp",)  # the first of its spec's search.layouts


def make_request(cfg: dict, layout: Layout) -> TrialRequest:
    return TrialRequest(
        model=spec_of(cfg),
        cluster=cluster_spec({"preset": "cpu-local", "devices_per_node": layout.world_size}),
        training=training_spec({"global_batch": 8, "precision": "fp32", "lr": 1e-3, "seed": 7}, seq_len=64),
        layout=layout, warmup_steps=1, measure_steps=STEPS - 1, options={"grad_norm": True}, workload="hf",
    )


@pytest.fixture(scope="module")
def readme_requests(tmp_path_factory) -> dict[str, TrialRequest]:
    """The README example's listed layouts as trial requests (its module importable by the ranks:
    spawned processes start with this process's sys.path)."""
    from api.spec import SweepSpec

    where, data = readme_example(tmp_path_factory.mktemp("readme-workload"))
    sys.path.insert(0, str(where))
    spec = SweepSpec.model_validate({**data, "training": {**data["training"], "lr": 1e-3, "seed": 7}})
    problem = spec.to_problem()
    model, cluster, training = problem.model, problem.cluster, problem.training
    layouts = spec.listed_layouts()[: len(README_LAYOUTS)]
    out = {f"readme-{name}": TrialRequest(model=model, cluster=cluster, training=training, layout=lay, warmup_steps=1,
                                          measure_steps=STEPS - 1, options={"grad_norm": True}, workload=spec.workload)
           for name, lay in zip(README_LAYOUTS, layouts, strict=True)}
    out["readme-reference"] = dataclasses.replace(out["readme-tp2-dp2-sp"], layout=Layout())
    return out


def _run_layouts(rank: int, world: int, requests: dict[str, TrialRequest]) -> dict[str, object]:
    from workers.train import train_trial

    out: dict[str, object] = {}
    for name, request in requests.items():
        try:
            out[name] = train_trial(request, device=torch.device("cpu"))
        except Exception:  # one broken layout must not hide the others' results
            out[name] = traceback.format_exc()[-3000:]
    return out


@pytest.fixture(scope="module")
def references(readme_requests) -> dict[str, tuple[list[float], list[float]]]:
    from workers.train import reference_losses

    refs = {cfg["model_type"]: reference_losses(make_request(cfg, Layout()), steps=STEPS) for cfg in (LLAMA, QWEN3, QWEN3_MOE)}
    refs["readme"] = reference_losses(readme_requests["readme-reference"], steps=STEPS)
    return refs


@pytest.fixture(scope="module")
def hf_four_rank_results(readme_requests) -> list[dict[str, object]]:
    requests = {k: make_request(cfg, layout) for k, (cfg, layout) in LAYOUTS.items()}
    requests.update({k: v for k, v in readme_requests.items() if k != "readme-reference"})
    return run_ranks(4, _run_layouts, requests, timeout_s=540)


def test_hf_reference_is_the_transformers_model_and_learns(references):
    """The workload's model computes what the transformers model computes, and the losses move far
    more than the tolerance (so the comparison below means something)."""
    from transformers import AutoModelForCausalLM

    from workers.workload_hf import hf_config
    from workers.workload_registry import build_model

    request = make_request(LLAMA, Layout())
    ours = build_model(request.model, request.training, torch.device("cpu"), "hf")
    torch.manual_seed(request.training.seed)
    theirs = AutoModelForCausalLM.from_config(hf_config(LLAMA, request.model), attn_implementation="sdpa",
                                              dtype=torch.float32)
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    assert torch.equal(ours(tokens), theirs(tokens).logits)
    for losses, norms in references.values():
        assert len(losses) == STEPS and all(n > 0 for n in norms)
        assert max(losses) - min(losses) > 1000 * RTOL * max(losses)


@pytest.mark.slow
@pytest.mark.timeout(600)  # the first case also runs the shared 4-rank fixture
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_hf_layout_matches_reference(name, references, hf_four_rank_results):
    cfg, layout = LAYOUTS[name]
    ref_losses, ref_norms = references[cfg["model_type"]]
    reports = [per_rank[name] for per_rank in hf_four_rank_results]
    for r in reports:
        assert not isinstance(r, str), f"{name} failed:\n{r}"
    for r in reports:
        assert r.losses == pytest.approx(ref_losses, rel=RTOL), name
        assert r.grad_norms == pytest.approx(ref_norms, rel=RTOL), name
    if layout.pp > 1:
        assert sorted({r.pp_stage for r in reports}) == list(range(layout.pp))


@pytest.mark.parametrize(("cfg", "layout", "why"), [
    (LLAMA, Layout(cp=2, dp=2), "does not support cp"),
    (QWEN3_MOE, Layout(ep=2, dp=2), "does not support ep"),
    (QWEN3_MOE, Layout(tp=2, dp=2), "does not support tp"),
])
def test_hf_refuses_what_it_cannot_realise_at_validation(cfg, layout, why):
    from tuner import realise
    from workers.workload_hf import capabilities

    request = make_request(cfg, layout)
    with pytest.raises(LayoutError, match=why):
        realise(layout, request.model, request.cluster, request.training, capabilities(request.model))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", README_LAYOUTS)
def test_readme_example_layout_matches_reference(name, readme_requests, references, hf_four_rank_results):
    ref_losses, ref_norms = references["readme"]
    assert max(ref_losses) - min(ref_losses) > 1000 * RTOL * max(ref_losses)
    for per_rank in hf_four_rank_results:
        r = per_rank[f"readme-{name}"]
        assert not isinstance(r, str), f"{name} failed:\n{r}"
        assert r.losses == pytest.approx(ref_losses, rel=RTOL), name
        assert r.grad_norms == pytest.approx(ref_norms, rel=RTOL), name
