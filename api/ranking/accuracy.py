"""How well a sweep's model predicted what it measured: the median |error| of step time over its
ranked layouts, under the prior (the analytical model on the sweep's cluster figures, probed or
datasheet, no weight fitted to any of its measurements: held out by construction) and under the
calibration in force (fitted to them: in-sample). ``meshtune show`` and the dashboard print both.
A step-time error is predicted / measured - 1, from the medians' tokens/s (step = tokens / tokens/s).
"""

from __future__ import annotations

import statistics
from typing import Any

from api.engine import predict_under
from api.spec import SweepSpec
from tuner import Layout


def _summary(errors: list[float]) -> dict[str, float]:
    absolute = [abs(e) for e in errors]
    return {"median_abs": statistics.median(absolute), "max_abs": max(absolute)}


def step_time_errors(sweep: Any, ranking: Any) -> dict[str, Any] | None:
    """{"n", "figures": "probed"|"datasheet", "prior": {median_abs, max_abs}, "in_force": {...}} over
    the ranking's measured rows; None when nothing was measured or the spec no longer reads."""
    rows = [r for r in ranking.rows if r.tokens_per_s_per_device and r.layout and not r.simulated]
    if not rows:
        return None
    try:
        problem = SweepSpec.model_validate(sweep.spec).to_problem()
        model, cluster, training = problem.model, problem.cluster, problem.training
    except ValueError:
        return None
    probe = (sweep.calibration or {}).get("probe")
    layouts = {r.layout_key: Layout(**r.layout) for r in rows}
    prior = predict_under({"probe": probe}, layouts, model=model, cluster=cluster, training=training)
    out: dict[str, Any] = {"n": len(rows), "figures": "probed" if (probe or {}).get("figures") else "datasheet"}
    for name, predicted in (("prior", {k: v[0] for k, v in prior.items()}),
                            ("in_force", {r.layout_key: r.predicted_tokens_per_s_per_device for r in rows})):
        errors = [r.tokens_per_s_per_device / predicted[r.layout_key] - 1 for r in rows if predicted.get(r.layout_key)]
        out[name] = _summary(errors) if errors else None
    return out


def lines(sweep: Any, ranking: Any) -> list[str]:
    """The sentence ``meshtune show`` prints (empty when there is nothing to say)."""
    e = step_time_errors(sweep, ranking)
    if not e or not e["prior"]:
        return []
    text = (f"step-time prediction error over {e['n']} measured layouts: prior ({e['figures']} figures, fitted to "
            f"none of them) median |error| {e['prior']['median_abs']:.0%} (max {e['prior']['max_abs']:.0%})")
    if e["in_force"]:
        text += (f"; calibration in force (fitted to them) {e['in_force']['median_abs']:.0%} "
                 f"(max {e['in_force']['max_abs']:.0%})")
    return [text]
