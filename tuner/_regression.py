"""Nightly regression detection: one layout's throughput tonight against its history.

``compare_layout`` works on log tokens/s with the night as the unit of replication (a one-way
random-effects model): tonight's mean against the mean of the past nightly means, by Student's
prediction interval on ``k - 1`` degrees of freedom, Bonferroni over the layouts of one night, and
flagged only beyond both noise and ``min_effect``; too little data is ``insufficient``. A history
without its nights falls back to the pooled two-sample t-test, which over-alarms when nights differ.
``compare_night`` runs it over a night's layouts. The test, step by step, and its measured false
alarm rate and power: docs/tuner.md, "Nightly regressions".
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
