"""The memory model learns locally and both ways: a cluster whose memory is twice or half what the
model predicts still leads the default search to its best layout, without stopping early; an OOM
raises what the layout and its neighbours are predicted to need, never every prediction."""

from __future__ import annotations

import pytest

import tuner
from api import store
from api.engine import SweepModel, SweepRunner
from api.settings import Settings
from api.spec import SweepSpec
from api.sweeps import service as svc
from benchmarks.truth_backend import TruthBackend
from benchmarks.truths.roofline import Roofline

# 2,664 valid layouts of llama3-8b on one node of 8 H100; 1,223 fit as the model predicts memory.
PROBLEM = {"model": "llama3-8b", "cluster": {"preset": "h100-sxm", "nodes": 1},
           "training": {"global_batch_tokens": 1048576}}


class MemoryOff(Roofline):
    """The roofline truth's step times; memory ``factor`` x the memory model's prediction (the
    misspecification under test), an OOM reported as CUDA reports it: the failing allocation only."""

    def __init__(self, factor: float) -> None:
        self.factor, self.name = factor, f"memory-x{factor:g}"

    def memory(self, layout, model, cluster, training) -> float:
        return self.factor * tuner.estimate_memory(layout, model=model, cluster=cluster, training=training).total


class CudaStyle(TruthBackend):
    """An OOM as CUDA reports it: what was in use when an allocation failed (99% of the device) and
    that allocation (half of what was still to come), never the peak."""

    def run(self, request):
        result = super().run(request)
        if result.status == "oom":
            in_use = int(0.99 * request.cluster.device_memory)
            result.error.bytes_requested = max(1, (result.peak_memory_bytes - in_use) // 2)
            result.peak_memory_bytes = in_use
        return result


def _truth_best(truth) -> tuple[dict[str, float], float]:
    problem = SweepSpec.model_validate(PROBLEM).to_problem()
    model, cluster, training = problem.model, problem.cluster, problem.training
    tokens = training.global_batch * model.seq_len / cluster.devices
    tps = {}
    for lay in tuner.enumerate_layouts(problem=tuner.Problem(model=model, cluster=cluster,
                                                             training=training)).valid:
        a = truth.answer(lay, model, cluster, training)
        if a.step_s is not None:
            tps[lay.key] = tokens / a.step_s
    return tps, max(tps.values())


@pytest.mark.parametrize("factor", [2.0, 0.5])
def test_memory_twice_or_half_the_model_still_reaches_the_best(tmp_path, factor):
    truth = MemoryOff(factor)
    tps, best = _truth_best(truth)
    url = f"sqlite:///{tmp_path / 'm.db'}"
    engine, sessions = store.open_store(url)
    settings = Settings(database_url=url, home=tmp_path, max_concurrent_trials=1)
    spec = SweepSpec.model_validate({**PROBLEM, "name": f"x{factor:g}", "backend": "simulate",
                                     "search": {"max_trials": 50}})
    with sessions() as s:
        sweep_id = svc.create_sweep(s, spec=spec, owner="t").id
    SweepRunner(settings, sessions=sessions, backend_factory=lambda spec: CudaStyle(truth)).run_sweep(sweep_id)
    with sessions() as s:
        rows = [t for t in store.all_trials(s, sweep_id=sweep_id) if t.phase == "search"]
    engine.dispose()
    measured = [tps.get(t.layout_key, 0.0) for t in rows if t.status == "completed"]
    launched = [t for t in rows if t.status != "pruned"]
    reached = next((n for n, t in enumerate(launched, 1) if tps.get(t.layout_key, 0.0) >= 0.98 * best
                    and t.status == "completed"), None)
    print(f"x{factor}: {len(rows)} search rows, {len(launched)} launched, reached at {reached}, "
          f"{sum(t.status == 'oom' for t in rows)} oom, best {max(measured) / best:.3f}")
    assert len(rows) == 50  # ran to max_trials: no silent early stop
    assert max(measured) >= 0.98 * best


TINY = {"model": "tiny", "cluster": "cpu-local", "training": {"global_batch": 16}}


class MixedSigns(Roofline):
    """Model states at 0.3x, activations at 4x what the model predicts (overhead as predicted): on a
    device where the model says three layouts fit, none of them does, and eight others do."""

    name = "mixed-signs"

    def memory(self, layout, model, cluster, training) -> float:
        m = tuner.estimate_memory(layout, model=model, cluster=cluster, training=training)
        return 0.3 * (m.params + m.grads + m.optimizer + m.buffers) + 4.0 * m.activations + m.overhead


@pytest.mark.parametrize("sampler", ["random", "tpe", "surrogate"])
def test_when_nothing_left_is_predicted_to_fit_the_likeliest_layouts_run(tmp_path, sampler):
    """Once the layouts predicted to fit have run out of memory, the model predicts that nothing
    left fits: the search goes on with the layouts most likely to fit. Before, the OOM scaled the
    whole model and every later proposal of every sampler was recorded as pruned, none launched."""
    problem = SweepSpec.model_validate(TINY).to_problem()
    model, cluster, training = problem.model, problem.cluster, problem.training
    layouts = tuner.enumerate_layouts(problem=tuner.Problem(model=model, cluster=cluster,
                                                            training=training)).valid
    peaks = sorted(tuner.estimate_memory(x, model=model, cluster=cluster, training=training).total for x in layouts)
    cap = peaks[2]  # three layouts fit as the model predicts memory
    cluster_spec = {"preset": "cpu-local", "device_memory": cap}
    truth = MixedSigns()
    problem = SweepModel.from_spec(SweepSpec.model_validate({**TINY, "cluster": cluster_spec}))
    doomed = {lay.key for lay in problem.space.layouts if problem.predict(lay).fits}
    assert len(doomed) == 3 and not any(truth.memory(lay, model, cluster, training) <= cap
                                        for lay in problem.space.layouts if lay.key in doomed)
    url = f"sqlite:///{tmp_path / 'f.db'}"
    engine, sessions = store.open_store(url)
    settings = Settings(database_url=url, home=tmp_path, max_concurrent_trials=1)
    spec = SweepSpec.model_validate({**TINY, "cluster": cluster_spec, "name": sampler, "backend": "simulate", "search": {
        "sampler": sampler, "max_trials": 12, "warm_start_top_k": 3, "remeasure_top_k": 0}})
    with sessions() as s:
        sweep_id = svc.create_sweep(s, spec=spec, owner="t").id
    SweepRunner(settings, sessions=sessions, backend_factory=lambda spec: CudaStyle(truth)).run_sweep(sweep_id)
    with sessions() as s:
        rows = sorted(store.all_trials(s, sweep_id=sweep_id), key=lambda t: t.number)
    engine.dispose()
    assert rows[0].layout_key in doomed and rows[0].status == "oom"
    assert len(rows) == 12  # went on to max_trials
    assert sum(t.status == "completed" for t in rows) >= 4  # and found what fits
