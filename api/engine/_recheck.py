"""How far a sweep trusts what it inherited: earlier sweeps' fits weighed by the evidence behind them,
then re-checked against the sweep's own first measurements.

Weighing: an inherited fit's uncertainty is its held-out error widened to a new layout's predictive
spread, s * sqrt(1 + p / n) (Seber & Lee, Linear Regression Analysis, 2nd ed., 2003, Sec. 5.3).
Re-checking: over the first ``RECHECK_TRIALS`` search measurements, sum((log(predicted / measured) /
sd)^2) is chi-square while the inherited model holds; beyond the 1 - ``RECHECK_ALPHA`` quantile the
inherited learning is dropped.

The design: docs/engine.md#re-checking-what-was-inherited.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from api.engine import _calibrate as cal

EVIDENCE_N0 = cal.MIN_JUDGED  # a fit on as many measurements as it takes to judge one keeps half its pull
RECHECK_TRIALS = 5  # the sweep's first measurements an inherited model is tested on
RECHECK_ALPHA = 0.001  # the chance of dropping an inherited model that holds, per part
TIME_SD_FLOOR = cal.FIT_LOG_SIGMA  # step times: the misfit a fit allows one measurement
MEMORY_SD_FLOOR = 0.10  # peaks: the memory error assumed before any peak (api.engine._model.MEMORY_SIGMA)


def predictive_sd(sigma: float | None, n: int, p: int, floor: float) -> float:
    """A new layout's spread under a fit with held-out error ``sigma`` on n measurements of p parts."""
    s = max(float(sigma) if sigma is not None and math.isfinite(sigma) else floor, floor)
    return s * math.sqrt(1.0 + max(p, 1) / max(n, 1))


def weigh(earlier: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``earlier`` (api.engine._learned) with the uncertainty of each accepted fit recorded
    (``calibration["evidence"]``) and an inherited memory model's error widened to it: what
    SweepModel.inherit takes."""
    out = []
    for e in earlier:
        e = copy.deepcopy(e)
        c = e["calibration"]
        evidence: dict[str, Any] = {}
        t = c.get("time") or {}
        if t.get("accepted"):
            n = int(t.get("n") or 0)
            sigma = t.get("loo_rms_log_error") if t.get("loo_rms_log_error") is not None else t.get("prior_rms_log_error")
            evidence["time"] = {"n": n, "sd": predictive_sd(sigma, n, len(t.get("fitted") or ()), TIME_SD_FLOOR)}
        m = c.get("memory") or {}
        if m.get("accepted"):
            n = int(m.get("n") or 0)
            sd = predictive_sd(c.get("memory_sigma"), n, len(cal.MEMORY_PARTS), MEMORY_SD_FLOOR)
            c["memory_sigma"] = sd  # the headroom an inherited memory model leaves grows as its evidence shrinks
            evidence["memory"] = {"n": n, "sd": sd}
        c["evidence"] = evidence
        out.append(e)
    return out


def source(earlier: list[dict[str, Any]], part: str, weights: np.ndarray | None) -> tuple[int, dict[str, Any]] | None:
    """(sweep id, evidence) of the earlier sweep whose ``part`` ("time", "memory") fit is ``weights``
    (the per-step constant, which is never inherited, left out), or None."""
    if weights is None:
        return None
    names = cal.TIME_PARTS if part == "time" else cal.MEMORY_PARTS
    upto = len(names) - 1 if part == "time" else len(names)
    for e in earlier:
        c = e["calibration"]
        fit, ev = c.get(part) or {}, (c.get("evidence") or {}).get(part)
        if ev and fit.get("accepted"):
            w = np.array([fit["weights"][k] for k in names])
            if np.allclose(w[:upto], np.asarray(weights)[:upto], rtol=1e-9, atol=0.0):
                return e["sweep_id"], ev
    return None


def contradicted(predicted: Sequence[float], measured: Sequence[float], sd: float,
                 lower: Sequence[bool] | None = None) -> tuple[int, float] | None:
    """The first k at which the first k (predicted, measured) pairs reject the model (chi-square:
    docs/engine.md#re-checking-what-was-inherited), with the geometric mean of predicted / measured
    over them; None while they agree. ``lower[i]``: measured[i] is a lower bound (an OOM), counted
    only when under-predicted."""
    from scipy.stats import chi2

    q, logs = 0.0, []
    for i, (p, y) in enumerate(zip(predicted, measured, strict=True)):
        if p <= 0 or y <= 0:
            continue
        r = math.log(p / y)
        if lower is not None and lower[i]:
            r = min(r, 0.0)
        q += (r / sd) ** 2
        logs.append(r)
        if q > float(chi2.ppf(1.0 - RECHECK_ALPHA, len(logs))):
            return len(logs), math.exp(sum(logs) / len(logs))
    return None
