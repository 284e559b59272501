"""Nightly regression detection: one layout's throughput tonight against its history.

The documented test (``compare_layout``), with the history given per night (one list of repeats for
each previous night):

1. Work on ``log(tokens/s)``: throughput noise is multiplicative, and a difference of mean logs is
   the log of a ratio of geometric means, so "12% slower" is a symmetric, scale-free statement.
2. Nights differ by more than the repeats of one night do (a node's thermals, the neighbours on the
   fabric, a different allocation), so the unit of replication is the night, not the repeat. Model
   ``log x[j, i] = mu + d_j + e_ji`` with a night offset ``d_j ~ N(0, tau^2)`` and repeat noise
   ``e_ji ~ N(0, sigma^2)`` (a one-way random-effects model). Tonight's mean ``y_0`` and each past
   night's mean ``y_j`` then vary by ``tau^2 + sigma^2/n``: the test compares ``y_0`` with the mean
   ``Y`` of the ``k`` past nightly means, scaled by the spread ``s_B`` of those means (which holds
   both the night-to-night and the within-night variance), Student's prediction interval for a new
   observation (Student 1908, Biometrika 6:1-25; e.g. Hahn & Meeker 1991, Statistical Intervals,
   Sec. 4.6):  ``t = (y_0 - Y) / sqrt(s_B^2 / k + v_0)``  on ``k - 1`` degrees of freedom, where
   ``v_0``, the variance of tonight's mean, is ``s_B^2`` plus, when tonight has fewer repeats than
   the past nights, the within-night variance's share of the difference, ``sigma^2 (1/n_0 -
   mean_j 1/n_j)`` (``sigma^2`` pooled over the nights' repeats; more repeats tonight are not
   credited). With equal repeat counts every night ``v_0 = s_B^2`` and the test is exact; unequal
   counts make it conservative. The interval ``exp((y_0 - Y) +- t_q se)`` is the one reported on the ratio
   ``tonight / history``.
3. Bonferroni over the layouts compared in one night: each layout is tested at ``alpha / m``, so the
   chance of any false alarm in a night of ``m`` layouts stays <= ``alpha`` (Dunn 1961, JASA 56:52-64).
4. A layout is flagged only when it is beyond noise (its interval excludes 1, i.e. p < alpha/m) AND
   beyond the minimum effect size (``|ratio - 1| >= min_effect`` at the point estimate). A drop is a
   ``regression``, a rise an ``improvement``; both are reported.
5. Fewer than ``min_repeats`` measurements tonight, or fewer than ``min_history_nights`` nights of
   history -> ``insufficient`` (never flagged): one night cannot tell a slow night from a slowdown.
   With ``min_history_nights=1`` a single past night is compared repeat against repeat (step 6).
6. A history given as one flat list (the repeats without their nights) cannot measure the
   night-to-night variation; it is compared by Student's two-sample pooled t-test on the logs,
   which treats every repeat as independent and therefore over-alarms when nights differ by more
   than repeats do (tests/test_regression.py measures by how much). Callers should pass nights.

Measured by simulation (10 layouts a night, 3 repeats, 7 past nights, alpha = 5%, no min_effect):
with nights offset by 5% and repeats by 1%, nights with any false alarm were 4.5% (4,000 nights)
for the nightly-means test and 79% for the pooled test; with no night offset and 3% repeat noise,
4.7% and 4.7%. Power, same 5%/1% noise, one layout slower: a 30% drop flagged in 92% of nights, a
20% drop in 50% (tonight's own night offset is part of the noise); with 3% night and 3% repeat
noise, 20% drops were flagged in 85%. Fewer past nights cost power: with 3 nights (2 degrees of
freedom) a 30% drop was flagged in 16%. Unequal repeat counts measured 1-5% false alarms.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from tuner._errors import SpecError

Verdict = Literal["regression", "improvement", "unchanged", "insufficient"]


@dataclass(frozen=True)
class RegressionPolicy:
    """How sure and how large a change must be before anyone is alerted."""

    alpha: float = 0.05  # family-wise false-alarm rate per night (Bonferroni over layouts)
    min_effect: float = 0.05  # smallest relative change worth an alert (0.05 = 5% of tokens/s)
    min_repeats: int = 2  # measurements needed on each side to estimate noise at all
    history_nights: int = 7  # previous fires of the schedule that form the history
    min_history_nights: int = 2  # past nights needed to measure night-to-night variation (>= 1)

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha < 1.0:
            raise SpecError(f"regression.alpha must be in (0, 1), got {self.alpha!r}")
        if not 0.0 <= self.min_effect < 1.0:
            raise SpecError(f"regression.min_effect must be in [0, 1), got {self.min_effect!r}")
        if isinstance(self.min_repeats, bool) or not isinstance(self.min_repeats, int) or self.min_repeats < 2:
            raise SpecError(f"regression.min_repeats must be an integer >= 2, got {self.min_repeats!r}")
        if isinstance(self.history_nights, bool) or not isinstance(self.history_nights, int) or self.history_nights < 1:
            raise SpecError(f"regression.history_nights must be a positive integer, got {self.history_nights!r}")
        if (isinstance(self.min_history_nights, bool) or not isinstance(self.min_history_nights, int)
                or self.min_history_nights < 1):
            raise SpecError(
                f"regression.min_history_nights must be a positive integer, got {self.min_history_nights!r}"
            )


@dataclass(frozen=True)
class LayoutComparison:
    """The verdict on one layout, with everything an alert needs to be believed."""

    layout: str
    verdict: Verdict
    tonight_n: int
    history_n: int
    tonight_median: float | None
    history_median: float | None
    ratio: float | None  # tonight / history (geometric means); 0.88 = 12% slower
    ratio_low: float | None  # confidence interval on ratio at level 1 - alpha/m
    ratio_high: float | None
    p_value: float | None
    confidence: float | None  # the interval's level, 1 - alpha/m
    reason: str
    history_nights: int | None = None  # past nights compared with (None: history given without nights)
    method: str = "nightly-means"  # "nightly-means" or "pooled-repeats" (see the module docstring)

    @property
    def change(self) -> float | None:
        """Relative change of tokens/s, e.g. -0.12 for a 12% drop."""
        return None if self.ratio is None else self.ratio - 1.0

    @property
    def flagged(self) -> bool:
        return self.verdict in ("regression", "improvement")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "change": self.change, "flagged": self.flagged}


def _median(values: Sequence[float]) -> float:
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else 0.5 * (s[mid - 1] + s[mid])


def _mean_var(values: Sequence[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    return mean, sum((v - mean) ** 2 for v in values) / (n - 1)


def log_ratio_t_test(
    tonight: Sequence[float], history: Sequence[float], *, confidence: float
) -> tuple[float, float, float, float]:
    """(ratio, low, high, p) of the pooled two-sample t-test on log values; Student 1908, Biometrika 6."""
    from scipy import stats  # local: keeps ``import tuner`` light

    a = [math.log(v) for v in tonight]
    b = [math.log(v) for v in history]
    mean_a, var_a = _mean_var(a)
    mean_b, var_b = _mean_var(b)
    diff = mean_a - mean_b
    df = len(a) + len(b) - 2
    pooled = ((len(a) - 1) * var_a + (len(b) - 1) * var_b) / df
    se2 = pooled * (1.0 / len(a) + 1.0 / len(b))
    if se2 <= 0.0:  # both sides without spread (e.g. a deterministic backend): the limit of the test
        ratio = math.exp(diff)
        return ratio, ratio, ratio, (1.0 if diff == 0.0 else 0.0)
    se = math.sqrt(se2)
    t = diff / se
    p = float(2.0 * stats.t.sf(abs(t), df))
    half = float(stats.t.ppf(0.5 + confidence / 2.0, df)) * se
    return math.exp(diff), math.exp(diff - half), math.exp(diff + half), p


def nightly_means_test(
    tonight: Sequence[float], nights: Sequence[Sequence[float]], *, confidence: float
) -> tuple[float, float, float, float]:
    """(ratio, low, high, p) of tonight's mean log against the past nightly mean logs: Student's
    prediction interval with the nightly means' variance (module docstring, step 2). Needs >= 2 nights."""
    from scipy import stats  # local: keeps ``import tuner`` light

    assert len(nights) >= 2 and len(tonight) >= 1
    now = [math.log(v) for v in tonight]
    past = [[math.log(v) for v in night] for night in nights]
    k = len(past)
    y0 = sum(now) / len(now)
    means = [sum(n) / len(n) for n in past]
    big_y, s_b2 = _mean_var(means)
    # Within-night variance pooled over every night with repeats (tonight included).
    groups = [g for g in [now, *past] if len(g) >= 2]
    df_w = sum(len(g) - 1 for g in groups)
    sigma2 = sum(_mean_var(g)[1] * (len(g) - 1) for g in groups) / df_w if df_w else 0.0
    inv_n = sum(1.0 / len(n) for n in past) / k
    # Fewer repeats tonight than before add their share of the repeat noise; more repeats are not
    # credited (subtracting a variance estimated on other degrees of freedom than s_B^2 measured
    # 6-7% false alarms at a nominal 5%), so unequal counts only make the test conservative.
    v0 = s_b2 + max(0.0, sigma2 * (1.0 / len(now) - inv_n))
    diff = y0 - big_y
    se2 = s_b2 / k + v0
    if se2 <= 0.0:  # no spread anywhere (e.g. a deterministic backend): the limit of the test
        ratio = math.exp(diff)
        return ratio, ratio, ratio, (1.0 if diff == 0.0 else 0.0)
    se, df = math.sqrt(se2), k - 1
    p = float(2.0 * stats.t.sf(abs(diff) / se, df))
    half = float(stats.t.ppf(0.5 + confidence / 2.0, df)) * se
    return math.exp(diff), math.exp(diff - half), math.exp(diff + half), p


def _clean(values: Iterable[float]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(v) and v > 0]


def _nights(history: Iterable[float] | Iterable[Iterable[float]]) -> tuple[list[float], list[list[float]] | None]:
    """(all history values, the values per night or None when the history is one flat list)."""
    items = list(history)
    if not any(isinstance(x, Iterable) and not isinstance(x, (str, bytes)) for x in items):
        return _clean(items), None
    nights = [_clean(n) for n in items]
    nights = [n for n in nights if n]
    return [v for n in nights for v in n], nights


def compare_layout(
    layout: str,
    tonight: Iterable[float],
    history: Iterable[float] | Iterable[Iterable[float]],
    *,
    policy: RegressionPolicy | None = None,
    tests: int = 1,
) -> LayoutComparison:
    """Compare tonight's tokens/s repeats of ``layout`` with its history (see the module docstring).

    ``history`` is one list of repeats per past night (the documented test), or one flat list of
    repeats whose nights are unknown (the pooled fallback). ``tests`` is the number of layouts
    compared this night (Bonferroni divisor).
    """
    policy = policy or RegressionPolicy()
    assert tests >= 1
    now = _clean(tonight)
    past, nights = _nights(history)
    k = None if nights is None else len(nights)
    med_now = _median(now) if now else None
    med_past = _median(past) if past else None
    method = "pooled-repeats" if nights is None or k == 1 else "nightly-means"

    def insufficient(reason: str) -> LayoutComparison:
        return LayoutComparison(layout, "insufficient", len(now), len(past), med_now, med_past, None, None, None,
                                None, None, reason, k, method)

    if len(now) < policy.min_repeats:
        return insufficient(f"needs >= {policy.min_repeats} measurements tonight, has {len(now)}")
    if k is not None and k < policy.min_history_nights:
        return insufficient(f"needs >= {policy.min_history_nights} nights of history to tell a slow night "
                            f"from a slowdown, has {k}")
    if method == "pooled-repeats" and len(past) < policy.min_repeats:
        return insufficient(f"needs >= {policy.min_repeats} measurements in history, has {len(past)}")
    alpha = policy.alpha / tests
    if method == "nightly-means":
        ratio, low, high, p = nightly_means_test(now, nights, confidence=1.0 - alpha)  # type: ignore[arg-type]
    else:
        ratio, low, high, p = log_ratio_t_test(now, past, confidence=1.0 - alpha)
    beyond_noise = p < alpha and not (low <= 1.0 <= high)
    big_enough = abs(ratio - 1.0) >= policy.min_effect
    pct = f"{(ratio - 1.0) * 100:+.1f}% [{(low - 1.0) * 100:+.1f}%, {(high - 1.0) * 100:+.1f}%]"
    basis = f"vs {k} nightly means" if method == "nightly-means" else "vs pooled repeats"
    if beyond_noise and big_enough:
        verdict: Verdict = "regression" if ratio < 1.0 else "improvement"
        reason = f"tokens/s {pct} {basis} at {1 - alpha:.3g} confidence, p={p:.2g}"
    elif not beyond_noise:
        verdict = "unchanged"
        reason = f"tokens/s {pct} {basis}: within noise (p={p:.2g} >= {alpha:.2g})"
    else:
        verdict = "unchanged"
        reason = f"tokens/s {pct} {basis}: beyond noise but below the {policy.min_effect:.0%} minimum effect"
    return LayoutComparison(
        layout, verdict, len(now), len(past), med_now, med_past, ratio, low, high, p, 1.0 - alpha, reason, k, method
    )


def _testable(tonight: Sequence[float], history: Any, policy: RegressionPolicy) -> bool:
    if len(_clean(tonight)) < policy.min_repeats:
        return False
    past, nights = _nights(history or ())
    if nights is None:
        return len(past) >= policy.min_repeats
    return len(nights) >= policy.min_history_nights and (len(nights) >= 2 or len(past) >= policy.min_repeats)


def compare_night(
    tonight: Mapping[str, Sequence[float]],
    history: Mapping[str, Sequence[float]] | Mapping[str, Sequence[Sequence[float]]],
    *,
    policy: RegressionPolicy | None = None,
) -> list[LayoutComparison]:
    """Every layout measured tonight against its history (per layout: one list of repeats per past
    night, or one flat list), Bonferroni over the layouts that can be judged."""
    policy = policy or RegressionPolicy()
    testable = [k for k in tonight if _testable(tonight[k], history.get(k, ()), policy)]
    m = max(1, len(testable))
    return [compare_layout(k, tonight[k], history.get(k, ()), policy=policy, tests=m) for k in sorted(tonight)]


def fingerprint_diff(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """What changed in the environment fingerprint: ``{key: {"before": x, "after": y}}``.

    Nested mappings are compared key by key (``{"torch": {"version": ...}}`` -> ``"torch.version"``).
    """
    out: dict[str, dict[str, Any]] = {}

    def walk(prefix: str, a: Any, b: Any) -> None:
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            for key in sorted(set(a) | set(b), key=str):
                walk(f"{prefix}.{key}" if prefix else str(key), a.get(key), b.get(key))
        elif a != b:
            out[prefix] = {"before": a, "after": b}

    walk("", dict(before), dict(after))
    return out
