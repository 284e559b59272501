"""The workload contract (workers/workload.py): the built-in model cut to it computes exactly what
the built-in path computes; the README's example workload meets it and trains; a ``workload`` that
does not import or does not meet the contract, or a layout it does not declare, is one line naming
the field and value (CLI exit 2, HTTP 422) before anything is stored or launched. Single process."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from api.cli import main
from tests.helpers.readme import README, readme_example
from tuner import Capabilities, Layout, LayoutError, check_supported, model_spec, training_spec


@pytest.fixture
def example(tmp_path, monkeypatch):
    where, spec = readme_example(tmp_path)
    monkeypatch.syspath_prepend(str(where))
    yield spec
    sys.modules.pop("my_model", None)



CUT_SHAPES = {
    "tiny": "tiny",
    "geglu-qk-norm": {"preset": "tiny", "mlp": "geglu", "qk_norm": True},
    "moe-shared-expert": {"preset": "tiny-moe", "shared_expert_ffn": 32, "shared_expert_gate": True},
}


@pytest.mark.parametrize("shape", list(CUT_SHAPES))
def test_builtin_cut_to_the_contract_computes_what_the_builtin_path_computes(shape):
    from tuner import Capabilities as Caps
    from workers.parallelize import block_tp_plan
    from workers.workload import WorkloadModel, builtin_parts
    from workers.workload_registry import build_model

    spec = model_spec(CUT_SHAPES[shape])
    training = training_spec({"global_batch": 2, "seed": 7}, seq_len=spec.seq_len)
    native = build_model(spec, training, torch.device("cpu"))
    torch.manual_seed(training.seed)
    generic = WorkloadModel(builtin_parts(spec, training), spec, Caps(workload="cut", cp=False, ep=False))
    tokens = torch.randint(0, spec.vocab, (2, spec.seq_len), generator=torch.Generator().manual_seed(0))
    a, b = native(tokens), generic(tokens)
    assert torch.equal(a, b)
    a.square().mean().backward()
    b.square().mean().backward()
    grads = dict(generic.named_parameters())
    for name, p in native.named_parameters():
        assert torch.equal(p.grad, grads[name].grad), name
    # The cut's plan names the block's real modules, and the built-in plan's module-level entries.
    plan = builtin_parts(spec, training).tp_plan
    block = native.layers["0"]
    assert all(block.get_submodule(key) is not None for key in plan), sorted(plan)
    native_plan = block_tp_plan(True, block.feed_forward.w3 is not None, moe=spec.is_moe, qk_norm=spec.qk_norm,
                                shared_expert=block.shared_expert is not None)
    leaves = {k for k in native_plan if k not in ("attention", "feed_forward")} - (
        {"feed_forward.w1", "feed_forward.w2", "feed_forward.w3"} if spec.is_moe else set())
    assert leaves <= set(plan), sorted(leaves - set(plan))


def test_readme_example_meets_the_contract_and_its_spec_validates(example):
    from api.spec import SweepSpec
    from workers.workload_registry import check_workload

    spec = SweepSpec.model_validate(example)
    problem = spec.to_problem()
    model, training = problem.model, problem.training
    caps = check_workload(spec.workload, model, training)
    assert caps.workload == "my_model" and not caps.cp and not caps.ep
    assert [lay.key for lay in spec.listed_layouts()]  # every listed layout realisable
    space = spec.to_problem().space
    assert space.cp == (1,) and space.ep == (1,)  # narrowed to what the workload declares
    with pytest.raises(ValueError, match=r"search\.layouts\[0\]\.cp: workload 'my_model' does not support cp"):
        SweepSpec.model_validate({**example, "search": {"layouts": [{"cp": 2, "dp": 2}]}}).listed_layouts()
    from tuner import cluster_spec
    from workers import TrialRequest
    from workers.train import reference_losses

    request = TrialRequest(model=model, cluster=cluster_spec("cpu-local"), training=training, layout=Layout(),
                           workload=spec.workload)
    losses, norms = reference_losses(request, steps=2)
    assert losses[1] < losses[0] and all(n > 0 for n in norms)


def test_capabilities_are_plain_data_the_tuner_checks():
    caps = Capabilities(workload="w", tp=False, ac=("none", "full"))
    tiny = model_spec("tiny")
    with pytest.raises(LayoutError, match=r"workload 'w' does not support tp \(tp=2\)"):
        check_supported(Layout(tp=2, dp=2), tiny, caps)
    with pytest.raises(LayoutError, match=r"does not support ac='selective'"):
        check_supported(Layout(dp=4, ac="selective"), tiny, caps)
    check_supported(Layout(dp=4, ac="full"), tiny, caps)
    assert caps.space_limits() == {"tp": (1,), "sp": (False,), "ac": ("none", "full")}
    with pytest.raises(LayoutError, match="cannot keep k/v projections whole"):
        check_supported(Layout(tp=4), tiny, Capabilities(workload="w", replicated_kv=False))


BAD = {"nosuch_mod:WORKLOAD": "cannot import module 'nosuch_mod'",
       "json:nothing": "module 'json' has no attribute 'nothing'",
       "json:dumps": "is a function, not a workers.workload.Workload",
       "not a path": "is not 'builtin', 'hf' nor an importable 'module:attr' path"}


def _sweep_file(home: Path, **over) -> Path:
    data = {"model": "tiny", "cluster": "cpu-local", "training": {"global_batch": 8}, "backend": "simulate",
            "search": {"max_trials": 2}, **over}
    path = home / "w.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("workload", list(BAD))
def test_a_workload_that_does_not_import_or_meet_the_contract_exits_2(home, capsys, workload):
    assert main(["sweep", str(_sweep_file(home, workload=workload))]) == 2
    err = capsys.readouterr().err
    assert f"workload={workload!r}" in err and BAD[workload] in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert main(["sweeps", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total"] == 0  # nothing stored


def test_a_build_that_breaks_the_contract_is_named(home, capsys, example, tmp_path):
    (tmp_path / "my_model.py").write_text(
        (tmp_path / "my_model.py").read_text() + "\nBROKEN = Workload(name='b', build=lambda m, t: nn.Linear(2, 2))\n")
    sys.modules.pop("my_model", None)
    path = home / "b.yaml"
    path.write_text(yaml.safe_dump({**example, "workload": "my_model:BROKEN", "backend": "simulate"}))
    assert main(["sweep", str(path)]) == 2
    err = capsys.readouterr().err
    assert "workload='my_model:BROKEN': build(model, training) returned Linear, not workers.workload.Parts" in err


def test_http_refuses_a_bad_workload_with_422_naming_it(tmp_path):
    from fastapi.testclient import TestClient  # noqa: F401 - the API's own client

    from api import store
    from tests.helpers.api_client import ALICE, client_for

    url = f"sqlite:///{tmp_path / 'api.db'}"
    store.upgrade(url)
    body = {"model": "tiny", "cluster": "cpu-local", "training": {"global_batch": 8}, "backend": "simulate",
            "workload": "nosuch_mod:WORKLOAD"}
    with client_for(url) as c:
        r = c.post("/api/sweeps", json=body, headers=ALICE)
        assert r.status_code == 422, r.text
        assert r.json()["detail"].startswith("workload='nosuch_mod:WORKLOAD': cannot import module 'nosuch_mod'")
        r = c.post("/api/sweeps", json={**body, "workload": "hf", "model": "tiny"}, headers=ALICE)
        assert r.status_code == 422 and "needs model.hf_config" in r.json()["detail"], r.text
        assert c.get("/api/sweeps", headers=ALICE).json()["total"] == 0


def test_hf_workload_names_an_architecture_it_does_not_run():
    """Gemma's scaled embeddings, soft-capping and sliding layers are not what the hf workload
    realises: the spec is refused at validation, naming model_type and what is supported."""
    from api.spec import SweepSpec

    config = json.loads((README.parent / "examples" / "hf" / "gemma-2-9b.json").read_text())
    with pytest.raises(ValueError, match=r"workload='hf': model.hf_config model_type='gemma2' is not supported "
                                         r"by workload='hf' \(supported: llama, mistral"):
        SweepSpec.model_validate({"model": {"hf_config": config, "seq_len": 64}, "cluster": "cpu-local",
                                  "training": {"global_batch": 8}, "backend": "simulate", "workload": "hf"})


def test_run_trial_checks_the_workload_and_its_capabilities_before_launching(home, capsys):
    pytest.importorskip("transformers")
    moe = str(README.parent / "examples" / "hf" / "qwen3-moe-tiny.json")
    assert main(["run-trial", "--model", f"hf:{moe}", "--workload", "hf", "--layout", "tp=2,dp=2",
                 "--backend", "simulate"]) == 2
    assert capsys.readouterr().err.strip() == "meshtune run-trial: error: workload 'hf' does not support tp (tp=2)"
    assert main(["run-trial", "--workload", "nosuch_mod:W", "--layout", "dp=4", "--backend", "simulate"]) == 2
    assert "workload='nosuch_mod:W': cannot import module 'nosuch_mod'" in capsys.readouterr().err


def test_plan_of_a_spec_enumerates_only_what_its_workload_realises(home, capsys, example):
    def cps(data: dict) -> set[int]:
        path = home / "plan.yaml"
        path.write_text(yaml.safe_dump({k: data[k] for k in ("model", "cluster", "training", "workload") if k in data}))
        assert main(["plan", str(path), "--json"]) == 0
        return {e["layout"]["cp"] for e in json.loads(capsys.readouterr().out)["entries"]}

    assert cps({k: v for k, v in example.items() if k != "workload"}) > {1}  # the built-in model would run cp
    assert cps(example) == {1}  # the README example declares cp=False
