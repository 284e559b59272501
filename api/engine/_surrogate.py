"""The ``surrogate`` proposer (the default sampler): the analytical model's *parts* as the prior,
the sweep's measurements as data.

A layout's log tokens/s per device is log(T / sum_k w_k parts_k) + r: ``w`` fitted in log space
around the weights in force (MAP with its Laplace covariance, MacKay 1992), ``r`` a Gaussian process
over the layout features (Rasmussen & Williams 2006, Alg. 2.1). Each proposal is the unseen layout
with the largest expected improvement (Jones et al. 1998) times its probability of fitting in memory
(constrained EI, Gardner et al. 2014) and of not failing like its failed neighbours; deterministic
in the measurements, so a resume proposes what the first run would have.
The design: docs/engine.md#surrogate-proposer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from api.engine import _calibrate as cal
from api.engine._space import LayoutSpace, _features, knob_values
from tuner import Layout

NOISE_SIGMA = 0.03  # default run-to-run noise of log tokens/s before the sweep measures its own
TRANSFER_SIGMA = 0.08  # extra noise of a residual measured on another model or sweep
LENGTH_SCALES = (0.2, 0.35, 0.6, 1.0)
SIGNAL_SIGMAS = (0.05, 0.12, 0.25)
FAIL_LENGTH = 0.15
WEIGHT_SIGMA = 2.0  # prior sd of log(w_k / w0_k): an overlap can hide a collective almost wholly (w -> 0)
FIT_SIGMA = 0.05  # what the weights alone leave unexplained, per layout (the GP models the rest)
THETA_BOUNDS = (-6.0, 3.0)  # a weight between 1/400 and 20 times the one in force
CANDIDATE_MARGIN_Z = 1.0  # candidates: predicted to fit by this many (local) memory errors, if any do
TRANSFER_W_SIGMA = 0.3  # extra sd of a per-program weight fitted on another model of the cluster
LATENCY_SIGMA = 0.2  # prior sd of the per-step constant, as a share of the median measured step
# The weights' share of a candidate's sd in the acquisition, at most: with few measurements an
# unpinned program weight (prior sd WEIGHT_SIGMA) gives layouts the prior ranks last an sd near 1,
# and expected improvement spent a third of a 60-trial sweep on them (benchmarks/bench_search.py).
EXPLORE_W_SD = 0.15
# Every LOCAL_EVERY-th proposal is the best-scoring one a knob away from the LOCAL_TOP measured layouts
# the posterior ranks first (a Hamming trust region around the incumbent: Wan et al. 2021, CASMOPOLITAN,
# ICML): the model's ranking is global and its errors are shared by a layout and its neighbours, so
# a one-knob change of the leader (another ZeRO level, micro-batch size or schedule) is where the
# measurements say least and the gain most often lies (benchmarks/bench_search.py).
LOCAL_EVERY = 2
LOCAL_TOP = 2
LOCAL_MARGIN_Z = 0.5  # a local turn's candidates: predicted to fit by this many memory errors


def _phi(z: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


def _cdf(z: np.ndarray) -> np.ndarray:
    from scipy.special import ndtr

    return ndtr(z)


def _matern52(d: np.ndarray, length: float) -> np.ndarray:
    r = math.sqrt(5.0) * d / length
    return (1.0 + r + r * r / 3.0) * np.exp(-r)


def _distances(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Euclidean distances between the rows of ``a`` and ``b`` (without an (a, b, d) temporary:
    a memory GP queries every layout of a 16,000-layout space)."""
    d2 = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2.0 * (a @ b.T)
    return np.sqrt(np.maximum(d2, 0.0))


def _gp(xs: np.ndarray, ys: np.ndarray, noise: np.ndarray, xc: np.ndarray, mean: float,
        signal_sigmas: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """GP posterior mean and sd at ``xc``; length-scale and signal sd by marginal likelihood on a grid."""
    d_xx = np.sqrt(((xs[:, None, :] - xs[None, :, :]) ** 2).sum(-1))
    best = None
    for length in LENGTH_SCALES:
        base = _matern52(d_xx, length)
        for sig in signal_sigmas:
            k = sig * sig * base + np.diag(noise) + 1e-10 * np.eye(len(ys))
            try:
                chol = np.linalg.cholesky(k)
            except np.linalg.LinAlgError:
                continue
            alpha = np.linalg.solve(chol.T, np.linalg.solve(chol, ys - mean))
            ll = -0.5 * (ys - mean) @ alpha - np.log(np.diag(chol)).sum()
            if best is None or ll > best[0]:
                best = (ll, length, sig, chol, alpha)
    assert best is not None, "a diagonal noise term keeps the kernel matrix positive definite"
    _, length, sig, chol, alpha = best
    d_cx = _distances(xc, xs)
    k_cx = sig * sig * _matern52(d_cx, length)
    mu = mean + k_cx @ alpha
    v = np.linalg.solve(chol, k_cx.T)
    return mu, np.sqrt(np.maximum(sig * sig - (v * v).sum(0), 1e-12))


class WeightFit:
    """The parametric mean: part weights fitted in log space around ``w0``, with their uncertainty.

    Parameters: theta_k = log(w_k / w0_k) for the scaled parts, and the per-step constant c >= 0
    (linear: the prior's is usually 0). ``mean``/``sd`` give log tokens/s per device of every layout."""

    def __init__(self, parts: np.ndarray, w0: np.ndarray, log_tokens: float, *, sd: np.ndarray | None = None) -> None:
        self.parts, self.log_tokens = parts, log_tokens
        self.base = np.maximum(np.asarray(w0[:-1], dtype=float), 1e-3)
        self.c0 = max(float(w0[-1]), 0.0)
        k = len(self.base)
        self.prior_sd = np.full(k, WEIGHT_SIGMA) if sd is None else np.asarray(sd, dtype=float)
        self.theta, self.c = np.zeros(k), self.c0
        self.cov = np.diag([*(self.prior_sd ** 2), 0.0])

    def weights(self) -> np.ndarray:
        return np.concatenate([self.base * np.exp(self.theta), [self.c]])

    def _step(self, rows: np.ndarray, theta: np.ndarray, c: float) -> np.ndarray:
        return self.parts[rows, :-1] @ (self.base * np.exp(theta)) + c * self.parts[rows, -1]

    def fit(self, idx: np.ndarray, y: np.ndarray) -> None:
        """MAP fit to measured log tokens/s per device ``y`` of layouts ``idx``; Laplace covariance."""
        from scipy.optimize import least_squares

        k = len(self.base)
        step_meas = np.exp(self.log_tokens - y)
        c_scale = LATENCY_SIGMA * float(np.median(step_meas))
        lo = np.array([THETA_BOUNDS[0]] * k + [0.0])
        hi = np.array([THETA_BOUNDS[1]] * k + [max(float(step_meas.min()), 1e-9)])
        # inside the box: trf started on a bound (c = 0) can stop there at once
        x0 = np.concatenate([np.clip(self.theta, lo[:k] + 1e-6, hi[:k] - 1e-6), [lo[k] + 0.1 * (hi[k] - lo[k])]])

        def resid(x: np.ndarray) -> np.ndarray:
            step = np.maximum(self._step(idx, x[:k], x[k]), 1e-30)
            return np.concatenate([(y - (self.log_tokens - np.log(step))) / FIT_SIGMA, x[:k] / self.prior_sd,
                                   [(x[k] - self.c0) / c_scale]])

        res = least_squares(resid, x0, bounds=(lo, hi), method="trf", x_scale="jac", max_nfev=200)
        self.theta, self.c = res.x[:k], float(res.x[k])
        j = res.jac
        try:
            self.cov = np.linalg.inv(j.T @ j + 1e-9 * np.eye(k + 1))
        except np.linalg.LinAlgError:  # pragma: no cover - the prior terms keep J^T J positive definite
            self.cov = np.diag([*(self.prior_sd ** 2), c_scale ** 2])

    def mean(self, rows: np.ndarray | None = None) -> np.ndarray:
        rows = np.arange(len(self.parts)) if rows is None else rows
        step = self._step(rows, self.theta, self.c)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(step > 0, self.log_tokens - np.log(np.maximum(step, 1e-30)), np.nan)

    def sd(self, rows: np.ndarray) -> np.ndarray:
        """Delta-method sd of ``mean`` from the weights' covariance: a layout leaning on a part the
        measurements have not pinned down is uncertain by about that part's share of its step."""
        w = self.base * np.exp(self.theta)
        contrib = self.parts[rows, :-1] * w
        step = np.maximum(contrib.sum(1) + self.c * self.parts[rows, -1], 1e-30)
        g = np.concatenate([contrib, self.parts[rows, -1:]], axis=1) / step[:, None]  # -d mean / d params
        return np.sqrt(np.maximum(np.einsum("ij,jk,ik->i", g, self.cov, g), 0.0))


class SurrogateProposer:
    def __init__(self, space: LayoutSpace, *, problem: Any, seed: int) -> None:
        self.space, self.problem = space, problem
        raw = space._features
        self.lo, span = raw.min(axis=0), np.ptp(raw, axis=0)
        self.span = np.where(span > 0, span, 1.0)
        self.x = (raw - self.lo) / self.span
        self.tie = np.random.default_rng(seed).random(len(space))  # seeded tie-break
        self.obs: dict[int, list[float]] = {}  # layout index -> measured log tokens/s per device
        self.failed: set[int] = set()
        self.told = 0  # outcomes told (a resume replays them: the same proposals again)
        self.fit: WeightFit | None = None

    def scaled(self, layout: Layout) -> np.ndarray:
        dp = self.space.devices / max(1, layout.tp * layout.pp * layout.cp * layout.ep)
        return np.clip((np.array(_features(knob_values(layout), dp)) - self.lo) / self.span, -0.5, 1.5)

    # --- data ------------------------------------------------------------------------------------

    def tell(self, layout: Layout, handle: Any, *, values: Sequence[float] | None, violation: float,
             status: str | None = None) -> None:
        i = self.space.index.get(layout.key)
        if i is None:
            return
        self.told += 1
        if status in ("crash", "nan", "timeout") or values is None:
            self.failed.add(i)  # infeasible with its cost: lowers the proposals around it
        elif violation <= 0 and values and values[0] and values[0] > 0:
            self.obs.setdefault(i, []).append(math.log(values[0]))
        # peaks and OOMs: the problem's memory model learns them (SweepModel.observe)

    # --- the posterior -----------------------------------------------------------------------------

    def _weights(self) -> WeightFit:
        """The parametric mean refitted to every measurement so far (cheap: 14 parameters), centred
        on the weights in force (time calibration per resource, spread over its programs), or on
        what an earlier sweep on this cluster fitted per program (``problem.inherited_programs``)."""
        parts = self.problem.program_arrays()
        time_w = dict(zip(cal.TIME_PARTS, np.asarray(self.problem.time_w, dtype=float), strict=True))
        w0 = np.array([time_w[cal.PROGRAM_OF[k]] for k in cal.PROGRAM_PARTS])
        sd = np.full(len(w0) - 1, WEIGHT_SIGMA)
        inherited = getattr(self.problem, "inherited_programs", None)
        if inherited:
            for j, k in enumerate(cal.PROGRAM_PARTS[:-1]):
                if k in inherited["weights"]:
                    w0[j] = inherited["weights"][k]
                    sd[j] = min(WEIGHT_SIGMA, math.hypot(inherited["sd"].get(k, WEIGHT_SIGMA), TRANSFER_W_SIGMA))
        log_tokens = math.log(self.problem.tokens / self.space.devices)
        fit = WeightFit(parts, w0, log_tokens, sd=sd)
        if self.obs:
            idx = np.array(sorted(self.obs))
            fit.fit(idx, np.array([float(np.mean(self.obs[i])) for i in idx]))
        self.fit = fit
        return fit

    def learned(self) -> dict[str, Any] | None:
        """What this sweep's measurements taught the per-program weights (stored with the calibration
        as "programs", inherited by later sweeps on the cluster): the weights and their sd."""
        if self.fit is None or not self.obs:
            return None
        w = self.fit.weights()
        sd = np.sqrt(np.diag(self.fit.cov))[:-1]
        return {"n": len(self.obs), "weights": {k: float(v) for k, v in zip(cal.PROGRAM_PARTS[:-1], w[:-1], strict=True)},
                "sd": {k: float(v) for k, v in zip(cal.PROGRAM_PARTS[:-1], sd, strict=True)}}

    def _data(self, prior: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        xs, ys, noise = [], [], []
        noise_sigma = getattr(self.problem, "noise_sigma", None) or NOISE_SIGMA
        for i, vals in self.obs.items():
            if np.isfinite(prior[i]):
                xs.append(self.x[i])
                ys.append(float(np.mean(vals)) - prior[i])
                noise.append(noise_sigma ** 2 / len(vals))
        own_mean = float(np.mean(ys)) if ys else 0.0
        for x, r in getattr(self.problem, "inherited_residuals", []):
            xs.append(x)
            ys.append(r + own_mean)  # inherited residuals are centred: they add shape, not level
            noise.append(noise_sigma ** 2 + TRANSFER_SIGMA ** 2)
        return np.array(xs).reshape(-1, self.x.shape[1]), np.array(ys), np.array(noise)
    def posterior(self, cand: np.ndarray, prior: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mean and standard deviation of the residual at candidate indices."""
        xs, ys, noise = self._data(prior)
        if len(ys) == 0:
            return np.zeros(len(cand)), np.full(len(cand), SIGNAL_SIGMAS[1])
        mean = float(np.mean(ys[: len(self.obs)])) if self.obs else float(np.mean(ys))
        return _gp(xs, ys, noise, self.x[cand], mean, SIGNAL_SIGMAS)

    def _fail_probability(self, cand: np.ndarray) -> np.ndarray:
        if not self.failed:
            return np.zeros(len(cand))
        f = self.x[sorted(self.failed)]
        d = np.sqrt(((self.x[cand][:, None, :] - f[None, :, :]) ** 2).sum(-1))
        return 1.0 - np.prod(1.0 - 0.9 * np.exp(-d / FAIL_LENGTH), axis=1)

    # --- proposing ---------------------------------------------------------------------------------

    def scores(self, exclude: set[str]) -> tuple[np.ndarray, np.ndarray]:
        """(candidate indices, acquisition) over the unseen layouts the memory model lets run."""
        fit = self._weights()
        prior = fit.mean()
        margin, mem_sd_all = self.problem.memory_margin()
        unseen = np.isfinite(prior)
        for key in exclude:
            i = self.space.index.get(key)
            if i is not None:
                unseen[i] = False
        # Every layout the memory model predicts to fit is a candidate, its acquisition weighted by
        # the probability that it fits (p_fit below): an OOM costs a start-up and teaches less than
        # a measurement, so a layout near the limit must promise more to be launched.
        cand = np.flatnonzero(unseen & (margin >= 0))
        if not len(cand):
            return cand, np.zeros(0)
        local, mem_sd = margin[cand], mem_sd_all[cand]  # log headroom after what nearby peaks and OOMs taught
        # The incumbent is the posterior mean's best at a measured layout, not the best noisy
        # measurement (one lucky run would end exploitation: plug-in EI, Picheny et al. 2013).
        seen = np.array(sorted(i for i in self.obs if np.isfinite(prior[i])), dtype=int)
        at_seen = prior[seen] + self.posterior(seen, prior)[0] if len(seen) else np.zeros(0)
        near = np.zeros(len(cand), bool)
        if len(seen) and self.told % LOCAL_EVERY == LOCAL_EVERY - 1:
            leaders = seen[np.argsort(-at_seen, kind="stable")[:LOCAL_TOP]]
            near = np.isin(cand, np.concatenate([self.space.neighbours(int(i)) for i in leaders]))
            near &= local >= LOCAL_MARGIN_Z * mem_sd
        keep = local >= CANDIDATE_MARGIN_Z * mem_sd
        # A local turn (when any neighbour of the leaders is left) ranges over the leaders' neighbours
        # with LOCAL_MARGIN_Z memory errors of headroom, not CANDIDATE_MARGIN_Z: next to measured peaks
        # the memory model is surest, and the best layouts often sit within a few per cent of the
        # limit; p_fit below still weighs the risk.
        select = near if near.any() else keep if keep.any() else np.ones(len(cand), bool)
        cand, local, mem_sd = cand[select], local[select], mem_sd[select]
        mu_r, sd_r = self.posterior(cand, prior)
        mu = prior[cand] + mu_r
        sd = np.sqrt(sd_r ** 2 + np.minimum(fit.sd(cand), EXPLORE_W_SD) ** 2)
        if len(seen):
            z = (mu - float(np.max(at_seen))) / sd
            ei = sd * (z * _cdf(z) + _phi(z))
        else:  # nothing measured yet: the prior's favourite first
            ei = np.exp(mu - mu.max())
        p_fit = _cdf(local / np.maximum(mem_sd, 1e-6))
        return cand, ei * p_fit * (1.0 - self._fail_probability(cand))

    def propose(self, exclude: set[str]) -> tuple[Layout, Any] | None:
        """The best candidate; when the memory model predicts that nothing left fits, the layout
        most likely to (the uncertainty is the reason to measure); None once every layout was tried."""
        cand, score = self.scores(exclude)
        if not len(cand):
            layout = self.problem.likeliest(exclude)
            return None if layout is None else (layout, None)
        best = np.lexsort((self.tie[cand], score))[-1]
        return self.space.layouts[int(cand[best])], None
