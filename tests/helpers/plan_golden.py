"""Golden plans: a few problems whose every plan entry (feasible and infeasible, in order) and
rejection count was recorded from the planner at 3c80b8e, before it was restructured for speed
(tests/tuner/test_plan_golden.py compares today's plans with them, benchmarks/bench_plan.py at its sizes).

Each entry is reduced to one line of every number ``PlannedLayout.to_dict`` reports (layout key,
micro-batches, placement, each memory part, each time figure and breakdown part, floats as
``float.hex``), the lines are hashed, and the first entries are kept whole so that a difference can
be read. A change of the model itself (a formula, the "fits" rule, a preset's figures) changes
them on purpose: rewrite the file then, and say why in the commit:

    PYTHONPATH=$PWD python -m tests.helpers.plan_golden --write   # tests/data/plan_golden.json

(This file was written with the tuner of 3c80b8e first on the path: ``git archive 3c80b8e tuner``.)
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from tuner import CalibrationFactors, Problem, SearchSpace, cluster_spec, model_spec, plan, training_spec

PATH = Path(__file__).resolve().parents[1] / "data" / "plan_golden.json"
KEPT_WHOLE = 1  # leading entries of each list kept as to_dict() (a readable difference)

# A MoE with a gated shared expert, dense layers, q/k/v biases and kv_heads below most tp degrees;
# a dense model with explicit head_dim, q/k norms, sandwich norms, GeGLU and tied embeddings.
_MOE = {"name": "moe-shapes", "layers": 6, "hidden": 512, "heads": 8, "kv_heads": 2, "ffn": 1536, "vocab": 4096,
        "seq_len": 1024, "experts": 8, "top_k": 2, "expert_ffn": 256, "shared_expert_ffn": 512,
        "shared_expert_gate": True, "dense_layers": [0], "qkv_bias": True}
_DENSE = {"name": "dense-shapes", "layers": 10, "hidden": 1024, "heads": 16, "kv_heads": 4, "ffn": 4096,
          "vocab": 32000, "seq_len": 32768, "head_dim": 128, "qk_norm": True, "norms_per_layer": 4, "mlp": "geglu",
          "tied_embeddings": True}

# name -> (model, cluster, training, plan options); the suite plans all but the benchmark's sizes.
PROBLEMS: dict[str, tuple[Any, Any, dict[str, Any], dict[str, Any]]] = {
    "tiny-cpu": ("tiny", "cpu-local", {"global_batch": 16}, {}),
    "tiny-moe-cpu-fp32": ("tiny-moe", {"preset": "cpu-local", "nodes": 2}, {"global_batch": 32, "precision": "fp32"},
                          {}),
    "llama3-8b-h100x4": ("llama3-8b", {"preset": "h100-sxm", "nodes": 4},
                         {"global_batch_tokens": 4 * 2**20, "critical_batch_tokens": 2 * 2**20}, {}),
    "mixtral-h100x2": ("mixtral-8x7b", {"preset": "h100-sxm", "nodes": 2}, {"global_batch": 256}, {}),
    "llama3-70b-nvl72": ("llama3-70b", "gb200-nvl72", {"global_batch": 576}, {"space": {"mbs": [1, 2]}}),
    "moe-shapes-a100": (_MOE, {"preset": "a100-40g", "nodes": 2}, {"global_batch": 64}, {}),
    "dense-shapes-mi300x": (_DENSE, {"preset": "mi300x", "nodes": 3}, {"global_batch": 96}, {}),
    # plan's options: tp across nodes allowed, another placement order, fitted factors, a capped space
    "gpt3-options": ("gpt3-175b", {"preset": "a100-80g", "nodes": 16}, {"global_batch": 1536},
                     {"allow_tp_across_nodes": True, "order": ("tp", "cp", "pp", "ep", "dp"),
                      "factors": {"compute_efficiency": 0.45, "dp_overlap": 0.5, "tp_overlap": 0.25,
                                  "latency_scale": 2.0},
                      "space": {"max_layouts": 700, "mbs": [1, 2, 3], "vpp": [2, 3]}}),
    # The benchmark's problems (benchmarks/bench_plan.py): 16,384, 131,072 and 1,048,576 H100s
    # (2,048, 16,384 and 131,072 nodes of 8), 16M-token batches.
    **{f"llama3-405b-h100x{n}": ("llama3-405b", {"preset": "h100-sxm", "nodes": n},
                                 {"global_batch_tokens": 16 * 2**20}, {}) for n in (2048, 16384, 131072)},
}


def problem(name: str) -> tuple[Problem, dict[str, Any]]:
    """The named problem (its ``space`` option in it) and the rest of plan's options."""
    m, c, t, opts = PROBLEMS[name]
    model = model_spec(m)
    opts = dict(opts)
    if "factors" in opts:
        opts["factors"] = CalibrationFactors(**opts["factors"])
    space = SearchSpace.from_mapping(opts.pop("space", None))
    return Problem(model=model, cluster=cluster_spec(c), training=training_spec(t, seq_len=model.seq_len),
                   space=space), opts


def entry_line(e: Any) -> str:
    """Every number ``PlannedLayout.to_dict`` reports of ``e``, floats exactly."""
    mem, tm, pl = e.memory, e.time, e.placement

    def h(x: float) -> str:
        return float(x).hex()

    return " ".join([
        e.layout.key, str(e.microbatches), pl.summary, ",".join(pl.order), ",".join(map(str, pl.mesh_shape)),
        ",".join(str(v) for v in mem.to_dict().values()),
        ",".join(h(v) for v in (tm.step_time_s, tm.tokens_per_s, tm.tokens_per_s_per_device, tm.mfu, tm.hfu,
                                tm.useful_tokens_per_s)),
        ",".join(f"{k}={h(v)}" for k, v in tm.breakdown.items()),
    ])


def summary(result: Any) -> dict[str, Any]:
    """The plan's counts, a hash of every entry line per list, and the first entries whole."""
    out: dict[str, Any] = {
        "feasible": len(result.entries), "infeasible": len(result.infeasible),
        "rejected": dict(sorted(result.rejected.items())), "twins": result.twins,
    }
    for name, entries in (("entries", result.entries), ("infeasible_entries", result.infeasible)):
        digest = hashlib.sha256()
        for e in entries:
            digest.update(entry_line(e).encode() + b"\n")
        out[f"{name}_sha256"] = digest.hexdigest()
        out[f"{name}_first"] = [e.to_dict() for e in entries[:KEPT_WHOLE]]
    return out


def compute(name: str) -> dict[str, Any]:
    prob, opts = problem(name)
    return summary(plan(problem=prob, **opts))


def load() -> dict[str, Any]:
    return json.loads(PATH.read_text())


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.helpers.plan_golden --write")
    PATH.parent.mkdir(exist_ok=True)
    data = {name: compute(name) for name in PROBLEMS}
    PATH.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    for name, s in data.items():
        print(f"{name}: {s['feasible']:,} feasible, {s['infeasible']:,} infeasible, rejected {sum(s['rejected'].values()):,}")
