"""The memory model against what the workers' tensors hold (issue 12): on 4 CPU ranks, for layouts
that cover each part, parameters, gradients and optimizer state bytes must be exact and the saved
activations of every layer within 10% of the model's (workers/memory_probe.py measures them)."""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks

from tuner import Layout, cluster_spec, estimate_memory, model_spec, training_spec
from tuner._memory import mesh_memory
from workers import TrialRequest

ACTIVATION_TOLERANCE = 0.10

# The fewest runs that cover each part: DDP-style replication, FSDP sharding (its gather buffers
# apart), TP sharding; fp32 so each part's dtype is unambiguous.
GRID = [Layout(dp=4), Layout(dp=4, zero=3), Layout(tp=2, dp=2)]


def _probe(rank: int, world: int, request: TrialRequest) -> dict:
    from workers.memory_probe import probe

    return probe(request, torch.device("cpu"))


@pytest.fixture(scope="module")
def measured() -> dict[str, tuple[Layout, list[dict]]]:
    model, cluster = model_spec("tiny"), cluster_spec("cpu-local")
    training = training_spec({"global_batch": 8, "precision": "fp32"})
    out = {}
    for layout in GRID:
        req = TrialRequest(model=model, cluster=cluster, training=training, layout=layout)
        out[layout.key] = (layout, run_ranks(4, _probe, req, timeout_s=300))
    return out


@pytest.mark.parametrize("layout", GRID, ids=lambda lay: lay.key)
def test_model_states_are_exact(measured, layout: Layout) -> None:
    model, cluster = model_spec("tiny"), cluster_spec("cpu-local")
    training = training_spec({"global_batch": 8, "precision": "fp32"})
    est = estimate_memory(layout, model=model, cluster=cluster, training=training)
    for rank in measured[layout.key][1]:
        assert (rank["params"], rank["grads"], rank["optimizer"]) == (est.params, est.grads, est.optimizer)


@pytest.mark.parametrize("layout", GRID, ids=lambda lay: lay.key)
def test_saved_activations_per_layer_within_10_percent(measured, layout: Layout) -> None:
    model, cluster = model_spec("tiny"), cluster_spec("cpu-local")
    training = training_spec({"global_batch": 8, "precision": "fp32"})
    mm = mesh_memory(model, cluster, training, layout.tp, layout.cp, layout.ep, layout.dp, layout.pp, layout.vpp)
    per_layer = mm.act[layout.ac, layout.sp][0] * layout.mbs
    for rank in measured[layout.key][1]:
        for i, got in rank["activations"].items():
            assert abs(got / per_layer - 1) <= ACTIVATION_TOLERANCE, (layout.key, i, got, per_layer)
