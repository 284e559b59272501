"""Calibration that must earn its place: fit what the measurements support, keep it only when it
ranks held-out layouts at least as well as the prior.

Time: step = w_compute (compute + bubble) + w_comm (tp/cp/ep collectives) + w_dp (exposed gradient
traffic) + w_p2p (pipeline sends) + c, a part fitted only where the samples support it, in log space
around the prior weights (``fit_weights``). Judged by leave-one-out Spearman (Spearman 1904) against
the prior; a rescale it refuses is kept when its held-out step times are ``RESCALE_GAIN`` closer.
Memory: the same form over the memory model's parts, fitted to measured peaks, judged by held-out rms
log error (OOMs are lower bounds for api.engine._memory, never fitted).
The design: docs/engine.md#calibration.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np

from tuner import PooledNoise, noise_warning

TIME_PARTS = ("compute", "comm", "dp", "p2p", "latency")
MEMORY_PARTS = ("states", "activations", "overhead")
SUPPORT_SHARE = 0.02
FIT_LOG_SIGMA = 0.10  # misfit of the weighted parts to one measurement, log units
LOG_WEIGHT_SIGMA = 1.0  # prior sd of log(w / prior w): e times faster or slower than modelled is 1 sd
LOG_WEIGHT_BOUND = 100.0  # no fitted weight moves further than this factor from its prior
CONST_SIGMA = 0.2  # prior sd of the per-step constant, as a share of the median measurement
MIN_JUDGED = 4  # below this a held-out rank correlation means nothing: the prior stays
RESCALE_GAIN = math.log(2.0)  # rms log error a fit that only rescales must gain: held-out steps 2x closer


def time_parts(breakdown: dict[str, float]) -> list[float]:
    """The analytical step time's parts as TIME_PARTS (latency: 1 second, weighted by c)."""
    b = breakdown
    return [b["compute"] + b["pp_bubble"], b["tp_comm"] + b["cp_comm"] + b["ep_comm"], b["dp_comm_exposed"],
            b["pp_p2p"], 1.0]


# The surrogate's finer split (api.engine._surrogate): one part per program that a real cluster runs
# at its own efficiency. Data-parallel traffic is a different collective program per ZeRO level (one
# all-reduce; reduce-scatter; + all-gather of parameters: Rajbhandari et al. 2020, Sec. 5) and, under
# pipelining, per micro-batch rather than once per step, overlapped differently: each gets its own weight.
PROGRAM_PARTS = ("compute", "pp_bubble", "tp_comm", "cp_comm", "ep_comm",
                 *(f"dp_z{z}_{'pp' if pp else 'nopp'}" for z in range(4) for pp in (False, True)), "pp_p2p", "latency")
PROGRAM_OF = {"compute": "compute", "pp_bubble": "compute", "tp_comm": "comm", "cp_comm": "comm",
              "ep_comm": "comm", "pp_p2p": "p2p", "latency": "latency",
              **{f"dp_z{z}_{pp}": "dp" for z in range(4) for pp in ("pp", "nopp")}}


def program_parts(breakdown: dict[str, float], layout) -> list[float]:
    """The analytical step time's parts as PROGRAM_PARTS (latency: 1 second)."""
    b = breakdown
    dp = [b["dp_comm_exposed"] if (layout.zero == z and (layout.pp > 1) == pp) else 0.0
          for z in range(4) for pp in (False, True)]
    return [b["compute"], b["pp_bubble"], b["tp_comm"], b["cp_comm"], b["ep_comm"], *dp, b["pp_p2p"], 1.0]


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
    """MAP weights in log space around ``prior``, over the ``free`` columns (the others stay at prior).

    A column with a positive prior weight is a scale: w_k = prior_k * exp(theta_k), theta_k ~ N(0,
    LOG_WEIGHT_SIGMA^2) and bounded to a factor ``LOG_WEIGHT_BOUND`` either way; a column whose prior
    weight is 0 (the per-step constant) is linear, w_k >= max(0, ``lower``), pulled to 0 with an sd of
    CONST_SIGMA of the median measurement. The data term is the log error sum((log(parts @ w / y) /
    FIT_LOG_SIGMA)^2). Why: the earlier linear fit on relative error, bounded only by w >= 0 and with a
    ridge scaled by each column's (tiny) share, slid along nearly collinear columns of a CPU run to
    compute 5e-16 and comm 149: numbers no machine has. In log space a weight can move as far as the
    data insist, but never to zero, never past the bounds, and only a little where the data are mute."""
    from scipy.optimize import least_squares

    w = prior.astype(float).copy()
    free = list(free)
    if not free or len(y) == 0:
        return w
    scale_cols = [k for k in free if prior[k] > 0]
    lin_cols = [k for k in free if prior[k] <= 0]
    c_sd = CONST_SIGMA * float(np.median(y))
    lo_lin = np.array([max(0.0, float(lower[k])) if lower is not None else 0.0 for k in lin_cols])
    hi_lin = np.maximum(lo_lin + 1e-12, float(np.min(y)) * np.ones(len(lin_cols)))
    bound = math.log(LOG_WEIGHT_BOUND)

    def unpack(x: np.ndarray) -> np.ndarray:
        v = w.copy()
        v[scale_cols] = prior[scale_cols] * np.exp(x[: len(scale_cols)])
        v[lin_cols] = x[len(scale_cols):]
        return v

    def resid(x: np.ndarray) -> np.ndarray:
        pred = np.maximum(parts @ unpack(x), 1e-30)
        return np.concatenate([np.log(pred / y) / FIT_LOG_SIGMA, x[: len(scale_cols)] / LOG_WEIGHT_SIGMA,
                               (x[len(scale_cols):] - lo_lin) / max(c_sd, 1e-30)])

    n_s = len(scale_cols)
    prior_rows = np.diag(np.concatenate([np.full(n_s, 1.0 / LOG_WEIGHT_SIGMA),
                                         np.full(len(lin_cols), 1.0 / max(c_sd, 1e-30))]))

    def jac(x: np.ndarray) -> np.ndarray:
        # d log(parts @ w) / dx: parts_k * w_k / pred for a scale (w_k = prior_k e^x), parts_k / pred for a
        # linear column; exact, so the solver spends no residual calls on finite differences
        v = unpack(x)
        pred = np.maximum(parts @ v, 1e-30)[:, None]
        data = np.hstack([parts[:, scale_cols] * v[scale_cols], parts[:, lin_cols]]) / pred / FIT_LOG_SIGMA
        return np.vstack([data, prior_rows])

    lo = np.concatenate([np.full(n_s, -bound), lo_lin])
    hi = np.concatenate([np.full(n_s, bound), hi_lin])
    # start inside the box: trf started on a bound can stop there at once (ftol after two steps)
    x0 = np.concatenate([np.zeros(n_s), lo_lin + 0.1 * (hi_lin - lo_lin)])
    res = least_squares(resid, x0, jac=jac, bounds=(lo, hi), method="trf", x_scale="jac", max_nfev=300)
    return unpack(res.x)


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
    loo, place, rescale_only = np.empty(n), np.empty(n), True
    base_pred = parts @ base
    for i in range(n):
        keep = np.arange(n) != i
        pred = parts @ fit_weights(parts[keep], measured[keep], base, free)
        loo[i] = pred[i]
        # where the fold's fit places the held-out sample among the others
        place[i] = float((pred[keep] < pred[i]).sum()) + 0.5 * float((pred[keep] == pred[i]).sum())
        rescale_only = rescale_only and _same_order(pred, base_pred)
    # A fit that only rescales ranks as the prior: its placements are the prior's ranks (module docstring).
    loo_sp, loo_err = spearman(place if rescale_only else loo, measured), _rms_log(loo, measured)
    prior_sp = scores[base_name]
    # Equal rank correlation of the held-out predictions keeps the fit when it also predicts held-out
    # step times better (it fixed the scale); a worse rank correlation is refused. A rescale the
    # held-out predictions misjudge is kept only where it fixes a gross scale error (RESCALE_GAIN).
    raw_sp = spearman(loo, measured)
    accepted = _nz(raw_sp) > _nz(prior_sp) or (_nz(raw_sp) == _nz(prior_sp) and loo_err <= errs[base_name])
    rescaled = rescale_only and not accepted and loo_err <= errs[base_name] - RESCALE_GAIN
    accepted = accepted or rescaled
    weights = fit_weights(parts, measured, base, free) if accepted else base
    if rescaled:
        reason = (f"ranks as the prior (every fold's fit orders the layouts as it does) and predicts held-out step "
                  f"times {math.exp(errs[base_name] - loo_err):.1f}x closer")
    elif accepted:
        reason = "ranks held-out layouts at least as well as the prior"
    elif rescale_only:
        reason = (f"refused: ranks as the prior; held-out rms log error {loo_err:.2f} against its "
                  f"{errs[base_name]:.2f} (a rescale must gain more than {RESCALE_GAIN:.2f})")
    else:
        reason = f"refused: held-out Spearman {loo_sp:+.2f} < prior {prior_sp:+.2f}"
    return {**out, "accepted": bool(accepted), "weights": named(weights, TIME_PARTS), "loo_spearman": _f(loo_sp),
            "loo_rms_log_error": _f(loo_err), "rescale_only": bool(rescale_only), "reason": reason}


def _same_order(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` orders the samples exactly as ``b`` does, ties included."""
    return bool(np.array_equal(np.sign(a[:, None] - a[None, :]), np.sign(b[:, None] - b[None, :])))


def judge_memory(parts: np.ndarray, measured: np.ndarray, prior: np.ndarray, *, n_oom: int = 0) -> dict:
    """Fit memory weights to measured peaks (rows of ``parts``/``measured``), judged by held-out rms
    log error against the prior. OOMs are not fitted here: a lower bound says something of its layout
    and its neighbours (api.engine._memory), not of every layout through a weight; ``n_oom`` is
    only recorded."""
    n = len(measured)
    prior_err = _rms_log(parts @ prior, measured) if n else float("nan")
    out = {"n": n, "n_oom": n_oom, "prior_rms_log_error": _f(prior_err)}
    weights, accepted, loo_err = prior.copy(), False, float("nan")
    if n >= 3:
        free = supported(parts, measured, prior, order=(2, 0, 1))  # a constant first: CPU baselines
        if free:
            keep = [np.arange(n) != i for i in range(n)]
            loo = np.array([parts[i] @ fit_weights(parts[k], measured[k], prior, free) for i, k in enumerate(keep)])
            loo_err = _rms_log(loo, measured)
            if loo_err <= prior_err:
                weights, accepted = fit_weights(parts, measured, prior, free), True
    return {**out, "accepted": accepted, "weights": named(weights, MEMORY_PARTS), "loo_rms_log_error": _f(loo_err)}


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
                   "headroom from the uncertainty at each layout (measured peaks and OOM bounds nearby)")
    if c.get("learned_from"):
        out.append("learned from earlier sweeps on this cluster: " + ", ".join(f"#{i}" for i in c["learned_from"]))
    out += list(c.get("notes") or ())  # what the sweep dropped of what it inherited, and why
    if c.get("noise"):
        noise = PooledNoise(**c["noise"])
        out.append(noise_warning(noise) or f"host noise: repeats of one layout spread by {noise.sigma:.1%} "
                   f"(pooled over {noise.layouts} layouts)")
    return out
