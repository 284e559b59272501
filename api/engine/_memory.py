"""What a sweep's measured peaks and OOMs teach its memory model, layout by layout (never one scale).

The analytical memory model's parts (api.engine._calibrate.MEMORY_PARTS), weighted as fitted to the
measured peaks, give a base prediction; a Gaussian process over the layout features models the rest,
r = log(true peak / base) (Rasmussen & Williams 2006, Alg. 2.1; the surrogate's Matern 5/2 GP, its
mean the measured peaks' average residual). A measured peak is an observation of r with the spread
of one layout's peak between runs, so a layout that ran at X is predicted near X. An OOM is a lower
bound: where the posterior falls below it, it joins as an observation at the bound, so what the
layout shares with its neighbours is raised with it, less with distance; and, per part, every layout
that needs at least as much of each part (states, activations, overhead) as an OOMed one is predicted
not to fit. The posterior sd at a layout is its headroom: small next to measured peaks, the prior
spread (``MEMORY_SIGMA`` or more, by marginal likelihood) far from them, never below ``LAYOUT_SIGMA``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from api.engine._surrogate import _distances, _gp

# Memory error assumed far from any measured peak: the spread of the memory model against the
# workers' measured peaks in tests/tuner/test_tuner_memory.py is within 10%; allocator fragmentation and
# communicator buffers on a real cluster add to it. The GP's prior spread (its sd far from measured
# layouts) is chosen from SIGNAL_SIGMAS by marginal likelihood, never below it: peaks that agree
# with each other say little of layouts unlike them (a floor of 2% launched twice the OOMs on the
# roofline truth of benchmarks/bench_search.py).
MEMORY_SIGMA = 0.10
SIGNAL_SIGMAS = (MEMORY_SIGMA, 0.2, 0.4, 0.8)
# What a layout's peak differs from its neighbours' by, that no feature sees (which tensors happen
# to be live together, allocator rounding): added to the GP's sd at every unmeasured layout, so one
# next to measured peaks is still launched with some headroom (fewer OOMs on the generated worlds).
LAYOUT_SIGMA = 0.03
MEMORY_NOISE = 0.01  # log spread of one layout's measured peak between runs
OOM_EXTRA = 0.02  # an OOM needed at least its bound: counted a little above it
BOUND_ROUNDS = 3  # OOM bounds the posterior still violates join as observations, this many rounds


@dataclass
class LocalMemory:
    """The GP over log(true / base) memory, fitted to peaks (``x``, base, peak) and OOM bounds
    (``x``, base, need, parts) of layouts with ``dim`` scaled features and ``n_parts`` memory parts.
    ``query`` gives its mean and sd at scaled layout features."""

    dim: int
    n_parts: int
    peaks: list[tuple[np.ndarray, float, float]] = field(default_factory=list)
    ooms: list[tuple[np.ndarray, float, float, np.ndarray]] = field(default_factory=list)

    def __post_init__(self) -> None:
        ys = np.array([np.log(peak / max(base, 1.0)) for _, base, peak in self.peaks])
        self.mean = float(np.mean(ys)) if len(ys) else 0.0
        self.xs = np.array([x for x, _, _ in self.peaks]).reshape(len(ys), self.dim)
        self.ys, self.noise = ys, np.full(len(ys), MEMORY_NOISE ** 2)
        self.oom_parts = np.array([p for *_, p in self.ooms]).reshape(len(self.ooms), self.n_parts)
        if not self.ooms:
            return
        xo = np.array([x for x, *_ in self.ooms])
        bound = np.array([np.log(need / max(base, 1.0)) for _, base, need, _ in self.ooms]) + OOM_EXTRA
        active = np.zeros(len(bound), bool)
        for _ in range(BOUND_ROUNDS):  # only the bounds the posterior does not already respect pull
            mu, _ = self._posterior(xo, active, xo, bound)
            short = ~active & (mu < bound - 1e-9)
            if not short.any():
                break
            active |= short
        self.xs = np.vstack([self.xs, xo[active]])
        self.ys = np.concatenate([self.ys, bound[active]])
        self.noise = np.concatenate([self.noise, np.full(int(active.sum()), MEMORY_NOISE ** 2)])

    def _posterior(self, xo: np.ndarray, active: np.ndarray, xc: np.ndarray,
                   bound: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        xs = np.vstack([self.xs, xo[active]])
        ys = np.concatenate([self.ys, bound[active]])
        if not len(ys):
            return np.full(len(xc), self.mean), np.full(len(xc), MEMORY_SIGMA)
        noise = np.full(len(ys), MEMORY_NOISE ** 2)
        return _gp(xs, ys, noise, xc, self.mean, SIGNAL_SIGMAS)

    def query(self, xc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Posterior mean and sd of log(true peak / base) at scaled features ``xc`` (rows)."""
        if not len(self.ys):
            return np.full(len(xc), self.mean), np.full(len(xc), MEMORY_SIGMA)
        mu, sd = _gp(self.xs, self.ys, self.noise, xc, self.mean, SIGNAL_SIGMAS)
        n_peaks = len(self.peaks)
        measured = (_distances(xc, self.xs[:n_peaks]).min(axis=1) < 1e-9 if n_peaks
                    else np.zeros(len(xc), bool))  # a measured peak is that layout's own
        return mu, np.where(measured, sd, np.sqrt(sd * sd + LAYOUT_SIGMA ** 2))

    def dominated(self, parts: np.ndarray) -> np.ndarray:
        """Rows of ``parts`` (memory parts per layout) that need at least as much of every part as
        some OOMed layout: each part is at least what ran out of memory, so the whole is too."""
        if not len(self.oom_parts):
            return np.zeros(len(parts), bool)
        ge = parts[:, None, :] >= self.oom_parts[None, :, :] * (1.0 - 1e-9)
        return ge.all(axis=2).any(axis=1)
