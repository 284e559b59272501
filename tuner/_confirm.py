"""Short runs against long runs: does a sweep's ranking hold when its leading layouts run longer?

A confirm run (api/engine/_confirm.py) measures a sweep's top K for N steps; this module compares
the two, pure functions over per-step throughputs: Spearman's rank correlation of the short- and
long-run medians with a percentile-bootstrap interval (``compare``), whether the short-run winner
is the long-run best (``p_best``), and each layout's drift between the first and the last tenth of
its long run (``drift``). The statistics and why: docs/tuner.md, "Confirm runs".
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from tuner._stats import CONFIDENCE, t_quantile

BOOTSTRAP = 2000  # resamples: the 2.5/97.5 percentiles of a 2,000-draw bootstrap move < 0.01 in rho


@dataclass(frozen=True)
class Drift:
    """Last tenth of a long run against its first tenth (``steps`` each): the relative change of
    throughput (geometric means) with its 95% interval; ``drifted`` None when there is no interval."""

    steps: int
    first: float  # tokens/s per device, geometric mean of the first tenth
    last: float
    change: float  # last / first - 1
    low: float | None
    high: float | None
    drifted: bool | None


def tenth(n: int) -> int:
    """Steps in a tenth of an ``n``-step run (at least one)."""
    return max(1, round(n / 10))


def drift(values: Sequence[float]) -> Drift | None:
    """``values``: a long run's per-step throughputs in step order (None with fewer than 2)."""
    vals = [float(v) for v in values if v is not None and math.isfinite(v) and v > 0]
    if len(vals) < 2:
        return None
    k = min(tenth(len(vals)), len(vals) // 2)
    first, last = [math.log(v) for v in vals[:k]], [math.log(v) for v in vals[-k:]]
    diff = statistics.fmean(last) - statistics.fmean(first)
    low = high = drifted = None
    if k >= 2:
        va, vb = statistics.variance(first) / k, statistics.variance(last) / k
        se = math.sqrt(va + vb)
        if se > 0:
            dof = (va + vb) ** 2 / ((va ** 2 + vb ** 2) / (k - 1))  # Welch-Satterthwaite
            t = t_quantile(0.5 + CONFIDENCE / 2, max(1, round(dof)))
            low, high = math.expm1(diff - t * se), math.expm1(diff + t * se)
        else:
            low = high = math.expm1(diff)
        drifted = not (low <= 0.0 <= high)
    return Drift(k, math.exp(statistics.fmean(first)), math.exp(statistics.fmean(last)), math.expm1(diff),
                 low, high, drifted)


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rho of two equally long sequences (average ranks for ties); None below 2 values or
    when one side is constant."""
    if len(a) != len(b):
        raise ValueError(f"spearman needs sequences of one length, got {len(a)} and {len(b)}")
    if len(a) < 2:
        return None
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    sa = math.sqrt(sum((x - ma) ** 2 for x in ra))
    sb = math.sqrt(sum((y - mb) ** 2 for y in rb))
    if sa == 0 or sb == 0:
        return None
    return sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True)) / (sa * sb)


def _ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


@dataclass(frozen=True)
class Comparison:
    """The short-run order against the long-run order of the confirmed layouts (index order = the
    short-run ranking's). ``long_low``/``long_high``: each long-run median's 95% bootstrap interval."""

    n: int
    rho: float | None
    rho_low: float | None
    rho_high: float | None
    long_median: list[float]
    long_low: list[float]
    long_high: list[float]
    long_best: int  # index of the best long-run median
    winner_kept: bool
    p_best: float  # share of resamples in which the short-run #1 is the long-run best


def compare(short_median: Sequence[float], short_steps: Sequence[Sequence[float]],
            long_steps: Sequence[Sequence[float]], *, resamples: int = BOOTSTRAP, seed: int = 0) -> Comparison:
    """``short_median``: the ranking's medians, best first; ``short_steps`` / ``long_steps``: every
    measured step's throughput of each layout in the short runs and in its long run (same order)."""
    n = len(short_median)
    if not n or len(short_steps) != n or len(long_steps) != n or any(not s for s in long_steps):
        raise ValueError("compare needs, for every confirmed layout, its short-run median and its long run's steps")
    long_median = [statistics.median(s) for s in long_steps]
    rho = spearman(short_median, long_median)
    rng = random.Random(seed)
    rhos: list[float] = []
    boots: list[list[float]] = [[] for _ in range(n)]
    wins = 0
    for _ in range(resamples):
        short = [statistics.median(rng.choices(s, k=len(s))) if s else m
                 for s, m in zip(short_steps, short_median, strict=True)]
        long = [statistics.median(rng.choices(s, k=len(s))) for s in long_steps]
        for i, v in enumerate(long):
            boots[i].append(v)
        wins += long[0] >= max(long)
        r = spearman(short, long)
        if r is not None:
            rhos.append(r)
    low, high = (_percentile(rhos, 0.5 - CONFIDENCE / 2), _percentile(rhos, 0.5 + CONFIDENCE / 2)) if rhos else (None, None)
    best = max(range(n), key=lambda i: (long_median[i], -i))
    return Comparison(
        n=n, rho=rho, rho_low=low, rho_high=high, long_median=long_median,
        long_low=[_percentile(b, 0.5 - CONFIDENCE / 2) for b in boots],
        long_high=[_percentile(b, 0.5 + CONFIDENCE / 2) for b in boots],
        long_best=best, winner_kept=best == 0, p_best=wins / resamples,
    )


def _percentile(values: list[float], q: float) -> float:
    """The q-quantile (linear interpolation between order statistics)."""
    vals = sorted(values)
    pos = q * (len(vals) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)
