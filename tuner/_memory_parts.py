"""The memory model's prediction for every pipeline rank of a layout, part by part: what the trial page
draws beside each rank's measured memory timeline.

``estimate_memory`` (tuner/_memory.py) reports the costliest rank only; here every pp rank gets its
model states (parameters, gradients, optimiser state), the gathered buffers, its activations as one
micro-batch's worth times the micro-batches in flight (Narayanan et al. 2021 Sec. 2.2.1), the
recomputation working set, the logits (last rank) and the per-chunk constants (RoPE tables, CP masks),
and the framework overhead. Each rank's parts add up to the activations and states the memory model
composes itself (``MeshMemory.states`` / ``MeshMemory.activations``, asserted), and the costliest
rank's total is ``estimate_memory``'s (tests/workers/test_memory_timeline.py).
"""

from __future__ import annotations

import math
from typing import Any

from tuner._formulas import microbatches_in_flight
from tuner._layout import Layout, microbatches
from tuner._memory import MeshMemory
from tuner._specs import ClusterSpec, ModelSpec, TrainingSpec

PARTS = ("params", "grads", "optimizer", "buffers", "activations", "working", "logits", "constants", "overhead")


def memory_parts(layout: Layout, *, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec) -> list[dict[str, Any]]:
    """Per pp rank (rank order): predicted bytes per device by part (``PARTS``), ``activations`` being
    ``per_micro_batch`` x ``in_flight``, and ``total``. The analytical prior (no calibration)."""
    m = microbatches(layout, training)
    # A memory model of this mesh whose candidate ranks are every pp rank (the shared one costs only the
    # ranks that can be the costliest): same formulas, same realisation.
    mm = MeshMemory(model, cluster, training, tp=layout.tp, cp=layout.cp, ep=layout.ep, dp=layout.dp,
                    pp=layout.pp, vpp=layout.vpp)
    mm.ranks = tuple(range(layout.pp))
    mm.layers = [mm.rp.layers[r] for r in mm.ranks]
    states = mm.states(layout.zero, m)
    acts = mm.activations(layout.ac, layout.sp, layout.mbs, layout.schedule, m)
    layer, working, logits = mm.act[layout.ac, layout.sp]
    logits *= m if (layout.schedule == "gpipe" and layout.pp > 1) else 1
    out = []
    for r, ((p, g, o, b), total_act) in enumerate(zip(states, acts, strict=True)):
        n = mm.layers[r]
        in_flight = microbatches_in_flight(layout.schedule, layout.pp, layout.vpp, m, r)
        parts = {
            "params": p, "grads": g, "optimizer": o, "buffers": b,
            "activations": layout.mbs * layer * n * in_flight,
            "working": layout.mbs * working,
            "logits": layout.mbs * logits if r == layout.pp - 1 else 0.0,
            "constants": (mm.layer_const * n + mm.rope) * in_flight if n else mm.rope,
            "overhead": float(mm.overhead),
        }
        composed = parts["activations"] + parts["working"] + parts["logits"] + parts["constants"]
        assert math.isclose(composed, total_act, rel_tol=1e-9, abs_tol=1.0), (r, composed, total_act)
        out.append({"stage": r, "layers": n, "per_micro_batch": layout.mbs * layer * n, "in_flight": in_flight,
                    **{k: int(v) for k, v in parts.items()}, "total": int(sum(parts.values()))})
    return out
