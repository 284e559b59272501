"""The search benchmark's generated worlds: misspecified per part, seeded, OOMs reported as CUDA does.

No engine and no Ray: the worlds and the truth backend alone (benchmarks/truths/worlds.py,
benchmarks/truth_backend.py).
"""

from __future__ import annotations

import random
import re

import pytest

import tuner
from api.spec import SweepSpec
from benchmarks.truth_backend import TruthBackend, cuda_oom
from benchmarks.truths import registry
from benchmarks.truths.worlds import PARTS, by_name, generate, special, worlds
from workers._contract import TrialRequest

CUDA_OOM = re.compile(r"^CUDA out of memory\. Tried to allocate (\d+\.\d\d) (GiB|MiB)\. GPU 0 has a total capacity "
                      r"of (\d+\.\d\d) GiB of which (\d+\.\d\d) (GiB|MiB) is free\.")


def specs(world):
    problem = SweepSpec.model_validate(world.problem).to_problem()
    return problem.model, problem.cluster, problem.training


def test_twenty_distinct_worlds_misspecified_per_part_both_ways():
    ws = worlds()
    assert len(ws) >= 20 and len({w.name for w in ws}) == len(ws)
    assert len({tuple(sorted(w.p.factors.items())) for w in ws}) == len(ws)
    factors = [f for w in ws for f in w.p.factors.values()]
    assert min(factors) < 1 < 2 < max(factors)
    states = ("weights", "grads", "optimizer")
    # some world over-predicts its states while it under-predicts activations or logits, some the reverse
    assert any(max(w.p.factors[k] for k in states) < 1 < min(w.p.factors["activations"], w.p.factors["logits"])
               for w in ws)
    assert any(min(w.p.factors[k] for k in states) > 1 > w.p.factors["activations"] for w in ws)
    assert {w.model_name for w in ws} >= {"llama3-8b", "llama3-70b", "mixtral-8x7b"}
    assert len({w.p.gemm[0] for w in ws}) == 3


def test_a_world_is_the_same_for_its_seed_and_differs_from_another():
    a, b = generate(7), generate(7)
    assert a.p == b.p and a.problem == b.problem
    assert generate(8).p != a.p
    assert by_name("world-7").p == a.p
    with pytest.raises(ValueError, match="world-<seed>"):
        by_name("planet-7")
    with pytest.raises(ValueError, match="seed"):
        generate(-1)


def test_memory_factor_scales_its_part_only():
    w = generate(0)
    model, cluster, training = specs(w)
    lay = tuner.enumerate_layouts(problem=tuner.Problem(model=model, cluster=cluster,
                                                        training=training)).valid[0]
    parts = w.memory_parts(lay, model, cluster, training)
    assert set(PARTS) <= set(parts) and parts["optimizer"] > 0

    def world(**factors):  # no per-layout jitter, so the difference is the part alone
        return type(w)(w.name, type(w.p)(**{**w.p.__dict__, "mem_sigma": 0.0, "factors": {**w.p.factors, **factors}}))

    plain = world().memory(lay, model, cluster, training)
    more = world(optimizer=w.p.factors["optimizer"] + 1.0).memory(lay, model, cluster, training)
    assert more - plain == pytest.approx(parts["optimizer"], rel=1e-9)


def over_memory_layout(truth, model, cluster, training):
    for lay in tuner.enumerate_layouts(problem=tuner.Problem(model=model, cluster=cluster,
                                                             training=training)).valid:
        if truth.memory(lay, model, cluster, training) > 1.2 * cluster.device_memory:
            return lay
    raise AssertionError(f"{truth.name}: no layout over memory")


@pytest.mark.parametrize("name", ["world-3", "world-mem2x", "roofline"])
def test_oom_reports_the_failing_allocation_not_the_peak(name):
    truth = registry()[name] if name == "roofline" else by_name(name)
    spec = {"model": "llama3-8b", "cluster": {"preset": "h100-sxm", "nodes": 2},
                                     "training": {"global_batch_tokens": 1 << 20}} if name == "roofline" else truth.problem
    problem = SweepSpec.model_validate(spec).to_problem()
    model, cluster, training = problem.model, problem.cluster, problem.training
    lay = over_memory_layout(truth, model, cluster, training)
    peak = truth.answer(lay, model, cluster, training).peak_bytes
    req = TrialRequest(model=model, cluster=cluster, training=training, layout=lay, seed=1, trial_id=5)
    res = TruthBackend(truth, seed=3).run(req)
    assert res.status == "oom" and res.simulated
    asked = res.error.bytes_requested
    assert 0 < asked < peak - res.peak_memory_bytes  # one allocation of what was still to come
    assert res.peak_memory_bytes <= cluster.device_memory < res.peak_memory_bytes + asked
    m = CUDA_OOM.match(res.error.message)
    assert m, res.error.message
    shown = float(m.group(1)) * (1 << (30 if m.group(2) == "GiB" else 20))
    assert abs(shown - asked) <= 0.006 * (1 << 30)
    assert TruthBackend(truth, seed=3).run(req).error.bytes_requested == asked  # deterministic per seed


def test_cuda_oom_bounds_over_many_draws():
    rng = random.Random(0)
    cap = 80 * (1 << 30)
    for _ in range(500):
        peak = cap * rng.uniform(1.0001, 3.0)
        asked, in_use = cuda_oom(peak, cap, rng)
        assert in_use < cap < in_use + asked and in_use + asked < peak
    with pytest.raises(ValueError, match="fits"):
        cuda_oom(cap - 1, cap, rng)


def test_special_worlds_are_twice_and_half_the_models_memory():
    two, half = special("world-mem2x"), special("world-memhalf")
    model, cluster, training = specs(two)
    for lay in tuner.enumerate_layouts(problem=tuner.Problem(model=model, cluster=cluster,
                                                             training=training)).valid[:50]:
        pred = tuner.estimate_memory(lay, model=model, cluster=cluster, training=training).total
        assert two.memory(lay, model, cluster, training) == 2 * pred
        assert half.memory(lay, model, cluster, training) == 0.5 * pred
