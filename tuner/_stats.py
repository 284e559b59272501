"""Ranking statistics over measurements: median + 95% interval, ties, pooled noise, Pareto front,
prediction error. Pure functions: no database, no torch (the time model's calibration is
api/engine/_calibrate.py).

Short real runs are noisy, so a ranking shows each layout's median and a 95% interval and marks
layouts whose intervals overlap as tied. The host's run-to-run noise is pooled over every repeated
layout of a sweep (pooled variance of log throughput, Student's t on its degrees of freedom), so a
layout measured once gets an interval too; ``noise_warning`` says when that noise is too high for a
ranking. Why: docs/tuner.md, "Ranking statistics".
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

CONFIDENCE = 0.95
# Above this pooled run-to-run spread (log sigma ~ relative), two layouts closer than ~2.8 sigma
# (t x sqrt(2) x sigma for single runs) cannot be told apart: the ranking of close layouts is noise.
NOISY_SIGMA = 0.05


@dataclass(frozen=True)
class PooledNoise:
    sigma: float  # of log throughput (~ relative spread)
    dof: int  # sum over repeated layouts of (n - 1)
    layouts: int  # how many layouts had >= 2 measurements


def pooled_noise(groups: Mapping[str, Sequence[float]]) -> PooledNoise | None:
    """The pooled run-to-run spread of log values over every group with >= 2 positive values."""
    ss, dof, used = 0.0, 0, 0
    for values in groups.values():
        vals = [math.log(v) for v in values if v is not None and math.isfinite(v) and v > 0]
        if len(vals) >= 2:
            ss += statistics.variance(vals) * (len(vals) - 1)
            dof += len(vals) - 1
            used += 1
    if dof == 0:
        return None
    return PooledNoise(math.sqrt(ss / dof), dof, used)


def noise_warning(noise: PooledNoise | None) -> str | None:
    """One line when the host's measured noise is too high for the ranking to be trusted."""
    if noise is None or noise.sigma <= NOISY_SIGMA:
        return None
    return (f"host noise too high to trust the ranking: repeats of one layout spread by {noise.sigma:.1%} "
            f"(pooled over {noise.layouts} layouts, {noise.dof} degrees of freedom; above {NOISY_SIGMA:.0%}); "
            f"layouts closer than ~{2.8 * noise.sigma:.0%} cannot be told apart")


@dataclass(frozen=True)
class Interval:
    """Median of ``n`` measurements and a 95% interval. With n < 2 the interval is UNKNOWN
    (``low``/``high`` None): one run says nothing about its noise, so it can never be separated
    from another layout (``overlaps`` is True) — a tie is never decided by a single noisy run."""

    n: int
    median: float
    low: float | None
    high: float | None

    @property
    def known(self) -> bool:
        return self.low is not None and self.high is not None

    def overlaps(self, other: Interval) -> bool:
        if not (self.known and other.known):
            return True
        assert self.low is not None and self.high is not None and other.low is not None and other.high is not None
        return self.low <= other.high and other.low <= self.high


def interval(values: Sequence[float], *, confidence: float = CONFIDENCE,
             pooled: PooledNoise | None = None) -> Interval:
    """Median and a Student-t interval of the mean (Student 1908) of the LOG values, mapped back and
    widened to contain the median. Throughput is a positive ratio quantity: on the log scale the
    interval is multiplicative (median x/÷ factor) and can never go below zero, which a linear
    interval of 2 noisy runs does. Non-positive values fall back to the linear interval.

    With the 3-5 repeats a sweep affords, t is the honest choice (a bootstrap of 3 values has only
    10 distinct resamples and under-covers). n < 2: the interval is unknown (None bounds)."""
    vals = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not vals:
        raise ValueError("interval() needs at least one finite value")
    med = statistics.median(vals)
    if pooled is not None and all(v > 0 for v in vals):  # the host's pooled noise, any n
        t = t_quantile(0.5 + confidence / 2, pooled.dof)
        mean = statistics.fmean(math.log(v) for v in vals)
        half = t * pooled.sigma / math.sqrt(len(vals))
        return Interval(len(vals), med, min(math.exp(mean - half), med), max(math.exp(mean + half), med))
    if len(vals) < 2:
        return Interval(len(vals), med, None, None)
    t = t_quantile(0.5 + confidence / 2, len(vals) - 1)
    if all(v > 0 for v in vals):
        logs = [math.log(v) for v in vals]
        mean = statistics.fmean(logs)
        half = t * statistics.stdev(logs) / math.sqrt(len(logs))
        return Interval(len(vals), med, min(math.exp(mean - half), med), max(math.exp(mean + half), med))
    mean = statistics.fmean(vals)
    half = t * statistics.stdev(vals) / math.sqrt(len(vals))
    return Interval(len(vals), med, min(mean - half, med), max(mean + half, med))


@functools.lru_cache(maxsize=256)
def t_quantile(q: float, dof: int) -> float:
    from scipy.stats import t

    return float(t.ppf(q, dof))


@dataclass(frozen=True)
class RankedLayout:
    rank: int  # 1 = best
    key: str
    interval: Interval
    tie_group: int  # rows whose intervals overlap the group leader's share its number
    tied_with_best: bool


def rank(groups: Mapping[str, Sequence[float]], *, higher_is_better: bool = True,
         pool: bool = True) -> list[RankedLayout]:
    """Rank measurement groups (layout key -> values) by median; a row joins the tie group of the
    leader above it when their intervals overlap, otherwise it leads a new group. Intervals use the
    noise pooled over all the groups' repeats (``pool``); a row with an unknown interval (one
    measurement and no repeat anywhere to pool) overlaps everything: it is never ranked as separated."""
    noise = pooled_noise(groups) if pool else None
    intervals = {k: interval(v, pooled=noise) for k, v in groups.items() if any(x is not None for x in v)}
    sign = -1.0 if higher_is_better else 1.0
    order = sorted(intervals, key=lambda k: (sign * intervals[k].median, k))
    out: list[RankedLayout] = []
    group, leader = 0, None
    for i, key in enumerate(order):
        iv = intervals[key]
        if leader is None or not iv.overlaps(intervals[leader]):
            group, leader = group + 1, key
        out.append(RankedLayout(i + 1, key, iv, group, iv.overlaps(intervals[order[0]])))
    return out


# How a ranked layout compares with the best one, for display. ``tied_with_best`` (above) answers
# "can measurement separate it from the best?" and is True for an unknown interval, so that a single
# run is never declared slower; shown as "tied" it would put a layout measured once at 68 tok/s
# next to a best of 606 as its equal. A display therefore tells the two apart: "tied" needs two
# known, overlapping intervals; a layout with no interval (or a best with none) is NOT_COMPARABLE.
# The rule reads the intervals, not n: once single runs get an interval (a pooled noise estimate),
# they become comparable with no change here.
BEST, TIED, SLOWER, NOT_COMPARABLE = "best", "tied", "slower", "not comparable"


def versus_best(row: Interval, best: Interval, *, is_best: bool) -> str:
    """BEST for the ranking's first row, TIED when both intervals are known and overlap, SLOWER when
    both are known and apart (ranks are by median, so "apart" below the best is slower), else
    NOT_COMPARABLE (one of the two layouts has no interval: measured once)."""
    if is_best:
        return BEST
    if not (row.known and best.known):
        return NOT_COMPARABLE
    return TIED if row.overlaps(best) else SLOWER


def pareto_front(points: Sequence[tuple[str, float, float]]) -> list[str]:
    """Keys of (key, throughput, memory) points that no other point dominates (higher-or-equal
    throughput and lower-or-equal memory, one strictly), sorted by memory. O(n log n): sweep by
    memory ascending (throughput descending on ties) keeping the best throughput seen."""
    front: list[str] = []
    best = -math.inf
    ordered = sorted(points, key=lambda p: (p[2], -p[1], p[0]))
    for i, (key, thr, mem) in enumerate(ordered):
        if thr > best:
            front.append(key)
            best = thr
        elif thr == best and front and ordered[i - 1][1:] == (thr, mem) and ordered[i - 1][0] in front:
            front.append(key)  # an exact duplicate of a front point is not dominated either
    return front


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured; None when either is missing or measured is 0."""
    if predicted is None or measured is None or not measured:
        return None
    return (predicted - measured) / measured


def median_of(values: list[Any]) -> float | None:
    """The median of the values that are not None (None when there are none)."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2
