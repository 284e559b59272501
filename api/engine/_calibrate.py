"""Calibration that must earn its place: fit what the measurements support, keep it only when it
ranks held-out layouts at least as well as the prior.

Time: the analytical model's step time of a layout splits into parts (``tuner.estimate_time``'s
breakdown). The calibrated step time is a weighted sum of those parts plus a constant,

    step = w_compute * (compute + bubble) + w_comm * (tp + cp + ep collectives)
           + w_dp * exposed gradient traffic + w_p2p * pipeline sends + c (seconds per step),

i.e. one scale per resource (compute, link bandwidth by collective family) and a fixed per-step
latency (optimiser step, launch overheads: what dominates a tiny CPU run). A part is fitted only
when the samples support it (it is >= 2% of the predicted step in at least two samples and there are
two more samples than fitted parameters); the fit is least squares on relative error with a ridge
pull towards the prior weights, so a few samples move it only as far as they must. This replaces
fitting tuner.CalibrationFactors by Nelder-Mead, which on 8 CPU layouts drove compute efficiency to
0.009 and turned a +0.76 rank correlation into +0.07 (issue 13): nothing judged the fit on layouts it
had not seen.

Judgement: leave-one-out. Each sample's step time is predicted by the fit to the others, and the
Spearman rank correlation (Spearman 1904) of those held-out predictions with the measurements is
compared with the prior's (which saw none of them). A fit that ranks worse is refused: the sweep
keeps the prior (or the calibration inherited from earlier sweeps on the cluster, whichever ranks
better). The figures are stored with the calibration and shown by ``meshtune show`` and the dashboard.

Memory: the same form over the memory model's parts (model states, activations, overhead), fitted to
measured peaks, judged by held-out rms log error; an OOM is a lower bound (the layout needs more than
the device has, or than the bytes it reported), enforced on the fit.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np

from tuner._stats import PooledNoise, noise_warning

TIME_PARTS = ("compute", "comm", "dp", "p2p", "latency")
MEMORY_PARTS = ("states", "activations", "overhead")
SUPPORT_SHARE = 0.02
RIDGE = 0.05  # pull of each weight towards its prior, relative to one sample's squared relative error
MIN_JUDGED = 4  # below this a held-out rank correlation means nothing: the prior stays


def time_parts(breakdown: dict[str, float]) -> list[float]:
    """The analytical step time's parts as TIME_PARTS (latency: 1 second, weighted by c)."""
    b = breakdown
    return [b["compute"] + b["pp_bubble"], b["tp_comm"] + b["cp_comm"] + b["ep_comm"], b["dp_comm_exposed"],
            b["pp_p2p"], 1.0]


def memory_parts(mem) -> list[float]:
    return [float(mem.params + mem.grads + mem.optimizer + mem.buffers), float(mem.activations),
            float(mem.overhead)]


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties); nan when either side is constant."""
    if len(a) < 2:
        return float("nan")
    ra, rb = _ranks(a), _ranks(b)
    if np.std(ra) == 0 or np.std(rb) == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def _ranks(x: Sequence[float]) -> np.ndarray:
    x = np.asarray(x, dtype=float)
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x), dtype=float)
    for v in np.unique(x):  # ties share their average rank
        idx = x == v
        ranks[idx] = ranks[idx].mean()
    return ranks


def fit_weights(parts: np.ndarray, y: np.ndarray, prior: np.ndarray, free: Sequence[int],
                lower: np.ndarray | None = None) -> np.ndarray:
    """Weights minimising sum((parts @ w / y - 1)^2) + RIDGE * sum(((w_k - prior_k) * scale_k)^2)
    over the ``free`` columns (the others stay at ``prior``), with w >= ``lower`` (default 0);
    scale_k is column k's typical share of y, so the ridge is in units of relative error."""
    from scipy.optimize import lsq_linear

    w = prior.astype(float).copy()
    free = list(free)
    if not free or len(y) == 0:
        return w
    rel = parts / y[:, None]
    fixed = [k for k in range(parts.shape[1]) if k not in free]
    target = 1.0 - rel[:, fixed] @ w[fixed] if fixed else np.ones(len(y))
    scale = np.maximum(np.median(np.abs(rel[:, free]), axis=0), 1e-12)
    a = np.vstack([rel[:, free], math.sqrt(RIDGE) * np.diag(scale)])
    b = np.concatenate([target, math.sqrt(RIDGE) * scale * prior[free]])
    lo = np.zeros(len(free)) if lower is None else lower[free]
    res = lsq_linear(a, b, bounds=(lo, np.full(len(free), np.inf)))
    w[free] = res.x
    return w


def supported(parts: np.ndarray, y: np.ndarray, prior: np.ndarray, order: Sequence[int]) -> list[int]:
    """The columns the samples can support, in ``order`` of priority (see the module docstring)."""
    pred = np.maximum(parts @ prior, 1e-30)
    out = []
    for k in order:
        share = parts[:, k] / pred
        # the last column is a constant (per-step latency, fixed memory): always measurable
        if (k == len(prior) - 1 or int((share >= SUPPORT_SHARE).sum()) >= 2) and len(y) >= len(out) + 3:
            out.append(k)
    return out


def judge_time(parts: np.ndarray, measured: np.ndarray, priors: dict[str, np.ndarray]) -> dict:
    """Fit step-time weights and judge them against each prior by leave-one-out Spearman.

    ``priors``: name -> weight vector ("analytical", and "inherited" when earlier sweeps gave one).
    Returns the calibration's time section: chosen weights, which won, every figure."""
    n = len(measured)
    scores = {name: spearman(parts @ w, measured) for name, w in priors.items()}
    errs = {name: _rms_log(parts @ w, measured) for name, w in priors.items()}
    base_name = max(scores, key=lambda k: (_nz(scores[k]), -errs[k]))
    base = priors[base_name]
    free = supported(parts, measured, base, order=(0, 4, 1, 2, 3))
    out = {"n": n, "prior": base_name, "prior_spearman": _f(scores[base_name]), "prior_rms_log_error": _f(errs[base_name]),
           "priors": {k: {"spearman": _f(v), "rms_log_error": _f(errs[k])} for k, v in scores.items()},
           "fitted": [TIME_PARTS[k] for k in free]}
    if n < MIN_JUDGED or not free:
        return {**out, "accepted": False, "weights": named(base, TIME_PARTS), "loo_spearman": None,
                "loo_rms_log_error": None, "reason": f"{n} measurements: too few to judge a fit (need {MIN_JUDGED})"}
    loo = np.empty(n)
    for i in range(n):
        keep = np.arange(n) != i
        w = fit_weights(parts[keep], measured[keep], base, free)
        loo[i] = parts[i] @ w
    loo_sp, loo_err = spearman(loo, measured), _rms_log(loo, measured)
    # Equal rank correlation keeps the fit when it also predicts held-out step times better (it fixed
    # the scale); a worse rank correlation is always refused.
    accepted = _nz(loo_sp) > _nz(scores[base_name]) or (_nz(loo_sp) == _nz(scores[base_name]) and loo_err <= errs[base_name])
    weights = fit_weights(parts, measured, base, free) if accepted else base
    reason = "ranks held-out layouts at least as well as the prior" if accepted else (
        f"refused: held-out Spearman {loo_sp:+.2f} < prior {scores[base_name]:+.2f}")
    return {**out, "accepted": bool(accepted), "weights": named(weights, TIME_PARTS), "loo_spearman": _f(loo_sp),
            "loo_rms_log_error": _f(loo_err), "reason": reason}


def judge_memory(parts: np.ndarray, measured: np.ndarray, lower_parts: np.ndarray, lower_bytes: np.ndarray,
                 prior: np.ndarray) -> dict:
    """Fit memory weights to measured peaks (rows of ``parts``/``measured``) and OOM lower bounds
    (``lower_parts``/``lower_bytes``: the layout needed more than this); judged by held-out rms log
    error against the prior. With no peak measured yet, the OOMs alone scale the prior up."""
    n = len(measured)
    prior_err = _rms_log(parts @ prior, measured) if n else float("nan")
    out = {"n": n, "n_oom": len(lower_bytes), "prior_rms_log_error": _f(prior_err)}
    weights, accepted, loo_err = prior.copy(), False, float("nan")
    if n >= 3:
        free = supported(parts, measured, prior, order=(2, 0, 1))  # a constant first: CPU baselines
        if free:
            loo = np.array([parts[i] @ _fit_mem(parts[np.arange(n) != i], measured[np.arange(n) != i],
                                                lower_parts, lower_bytes, prior, free) for i in range(n)])
            loo_err = _rms_log(loo, measured)
            if loo_err <= prior_err:
                weights, accepted = _fit_mem(parts, measured, lower_parts, lower_bytes, prior, free), True
    weights = _enforce_lower(weights, lower_parts, lower_bytes)
    return {**out, "accepted": accepted, "weights": named(weights, MEMORY_PARTS), "loo_rms_log_error": _f(loo_err)}


def _fit_mem(parts, measured, lower_parts, lower_bytes, prior, free) -> np.ndarray:
    w = fit_weights(parts, measured, prior, free)
    for _ in range(2):  # OOMs the fit still under-predicts join as rows at their bound
        short = (lower_parts @ w < lower_bytes) if len(lower_bytes) else np.zeros(0, bool)
        if not short.any():
            break
        w = fit_weights(np.vstack([parts, lower_parts[short]]), np.concatenate([measured, 1.02 * lower_bytes[short]]),
                        prior, free)
    return w


def _enforce_lower(w: np.ndarray, lower_parts: np.ndarray, lower_bytes: np.ndarray) -> np.ndarray:
    """Scale the whole model up until every OOMed layout is predicted to need at least its bound:
    the least change that stops predicting a known OOM as fitting."""
    if not len(lower_bytes):
        return w
    pred = lower_parts @ w
    need = float(np.max(lower_bytes / np.maximum(pred, 1.0)))
    return w * max(1.0, need)


def _rms_log(pred: np.ndarray, measured: np.ndarray) -> float:
    ok = (pred > 0) & (measured > 0)
    if not ok.any():
        return float("nan")
    return math.sqrt(statistics.fmean(np.log(pred[ok] / measured[ok]) ** 2))


def named(w: np.ndarray, names: Sequence[str]) -> dict[str, float]:
    return {n: float(v) for n, v in zip(names, w, strict=True)}


def _f(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def _nz(x: float | None) -> float:
    return -2.0 if x is None or not math.isfinite(x) else x


def describe(calibration: dict | None) -> list[str]:
    """What the sweep's calibration says (api.engine._calibrate): the held-out rank correlation it
    was judged by, whether it was kept, the memory model's error, what it learned from, the noise
    (`meshtune show` and the dashboard's sweep page print these lines)."""
    c = calibration or {}
    out = []
    t = c.get("time")
    if t:
        def sp(x):
            return "-" if x is None else f"{x:+.2f}"
        verdict = "kept" if t.get("accepted") else "refused, prior kept"
        out.append(f"calibration v{c.get('version', 0)} from {t.get('n')} measurements: held-out (leave-one-out) "
                   f"Spearman {sp(t.get('loo_spearman'))} vs prior ({t.get('prior')}) {sp(t.get('prior_spearman'))}"
                   f" — {verdict}; fitted " + (", ".join(f"{k}={t['weights'][k]:.3g}" for k in t.get("fitted", []))
                                             or "nothing"))
    m = c.get("memory")
    if m and (m.get("n") or m.get("n_oom")):
        err = m.get("loo_rms_log_error") if m.get("accepted") else m.get("prior_rms_log_error")
        out.append(f"memory model from {m.get('n')} peaks and {m.get('n_oom')} OOMs: error "
                   f"{'-' if err is None else f'{err:.1%}'} ({'fitted' if m.get('accepted') else 'prior'}); "
                   f"headroom from a memory error of {c.get('memory_sigma', 0):.1%}")
    if c.get("learned_from"):
        out.append("learned from earlier sweeps on this cluster: " + ", ".join(f"#{i}" for i in c["learned_from"]))
    if c.get("noise"):
        noise = PooledNoise(**c["noise"])
        out.append(noise_warning(noise) or f"host noise: repeats of one layout spread by {noise.sigma:.1%} "
                   f"(pooled over {noise.layouts} layouts)")
    return out
