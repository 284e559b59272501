"""The ``surrogate`` proposer: the analytical model as the prior, the sweep's measurements as data.

Why not only TPE: TPE samples each knob independently (Bergstra et al. 2011) and most of its asks
are projected onto valid layouts, so it learns little per trial, and it ignores failures; against
truths that differ from meshtune's model it did no better than random in its first 20 trials
(issue 13). Here the model is:

    log tokens/s(layout) = log prior(layout) + r(layout),

``prior`` is the calibrated analytical prediction (api.engine._model.Problem) and ``r`` a Gaussian
process over the layout features (log2 degrees, ZeRO level, micro-batch size, recompute, schedule;
``_space._features`` scaled to [0, 1]) fitted to the measured residuals (Rasmussen & Williams 2006,
Alg. 2.1; Matern 5/2 kernel, constant mean = the mean residual, length-scale and signal variance
chosen by marginal likelihood on a small grid). Residuals inherited from earlier sweeps on the same
cluster join as data with extra noise (each sweep's own mean removed: only the shape transfers).

Each proposal is the enumerated, unseen layout with the largest expected improvement (Jones et al.
1998) over the best measured one, times the probability that it fits in memory under the memory
model's measured error (constrained EI, Gardner et al. 2014), times the probability that it does not
fail like the crashed/timed-out layouts near it. Only layouts the memory model predicts to fit are
candidates. Everything is a deterministic function of the measurements (ties broken by the seed), so
a resume proposes what the first run would have.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from api.engine._space import LayoutSpace, _features, knob_values
from tuner import Layout

HEADROOM_Z = 1.645  # as api.engine._model.HEADROOM_Z (not imported: _model imports this module's users)
NOISE_SIGMA = 0.03  # default run-to-run noise of log tokens/s before the sweep measures its own
TRANSFER_SIGMA = 0.08  # extra noise of a residual measured on another model or sweep
LENGTH_SCALES = (0.2, 0.35, 0.6, 1.0)
SIGNAL_SIGMAS = (0.05, 0.12, 0.25)
FAIL_LENGTH = 0.15


def _phi(z: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


def _cdf(z: np.ndarray) -> np.ndarray:
    from scipy.special import ndtr

    return ndtr(z)


def _matern52(d: np.ndarray, length: float) -> np.ndarray:
    r = math.sqrt(5.0) * d / length
    return (1.0 + r + r * r / 3.0) * np.exp(-r)


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

    def scaled(self, layout: Layout) -> np.ndarray:
        dp = self.space.devices / max(1, layout.tp * layout.pp * layout.cp * layout.ep)
        return np.clip((np.array(_features(knob_values(layout), dp)) - self.lo) / self.span, -0.5, 1.5)

    # --- data ------------------------------------------------------------------------------------

    def tell(self, layout: Layout, handle: Any, *, values: Sequence[float] | None, violation: float,
             status: str | None = None) -> None:
        i = self.space.index.get(layout.key)
        if i is None:
            return
        if status in ("crash", "nan", "timeout") or values is None:
            self.failed.add(i)  # infeasible with its cost: lowers the proposals around it
        elif violation <= 0 and values and values[0] and values[0] > 0:
            self.obs.setdefault(i, []).append(math.log(values[0]))
        # oom / pruned: the memory model learns it (Problem.observe), which removes such layouts

    # --- the posterior -----------------------------------------------------------------------------

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
        d_xx = np.sqrt(((xs[:, None, :] - xs[None, :, :]) ** 2).sum(-1))
        best = None
        for length in LENGTH_SCALES:
            base = _matern52(d_xx, length)
            for sig in SIGNAL_SIGMAS:
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
        d_cx = np.sqrt(((self.x[cand][:, None, :] - xs[None, :, :]) ** 2).sum(-1))
        k_cx = sig * sig * _matern52(d_cx, length)
        mu = mean + k_cx @ alpha
        v = np.linalg.solve(chol, k_cx.T)
        var = np.maximum(sig * sig - (v * v).sum(0), 1e-12)
        return mu, np.sqrt(var)

    def _fail_probability(self, cand: np.ndarray) -> np.ndarray:
        if not self.failed:
            return np.zeros(len(cand))
        f = self.x[sorted(self.failed)]
        d = np.sqrt(((self.x[cand][:, None, :] - f[None, :, :]) ** 2).sum(-1))
        return 1.0 - np.prod(1.0 - 0.9 * np.exp(-d / FAIL_LENGTH), axis=1)

    # --- proposing ---------------------------------------------------------------------------------

    def scores(self, exclude: set[str]) -> tuple[np.ndarray, np.ndarray]:
        """(candidate indices, acquisition) over the unseen layouts the memory model lets run."""
        prior = self.problem.prior_log_tokens()
        margin, sigma = self.problem.memory_margin()
        unseen = np.isfinite(prior)
        for key in exclude:
            i = self.space.index.get(key)
            if i is not None:
                unseen[i] = False
        # The warm start's headroom everywhere: only layouts that fit with HEADROOM_Z memory errors
        # to spare (an OOM costs a start-up and teaches less than a measurement); if none is left,
        # those that fit at all.
        cand = np.flatnonzero(unseen & (margin >= HEADROOM_Z * sigma))
        if not len(cand):
            cand = np.flatnonzero(unseen & (margin >= 0))
        if not len(cand):
            return cand, np.zeros(0)
        mu_r, sd = self.posterior(cand, prior)
        mu = prior[cand] + mu_r
        measured = [float(np.mean(v)) for v in self.obs.values()]
        if measured:
            z = (mu - max(measured)) / sd
            ei = sd * (z * _cdf(z) + _phi(z))
        else:  # nothing measured yet: the prior's favourite first
            ei = np.exp(mu - mu.max())
        p_fit = _cdf(margin[cand] / max(sigma, 1e-6))
        return cand, ei * p_fit * (1.0 - self._fail_probability(cand))

    def propose(self, exclude: set[str]) -> tuple[Layout, Any] | None:
        cand, score = self.scores(exclude)
        if not len(cand):
            return None
        best = np.lexsort((self.tie[cand], score))[-1]
        return self.space.layouts[int(cand[best])], None
