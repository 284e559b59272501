"""Nightly regression detection: one layout's throughput tonight against its history.

The documented test (``compare_layout``):

1. Work on ``log(tokens/s)``: throughput noise is multiplicative, and a difference of mean logs is
   the log of a ratio of geometric means, so "12% slower" is a symmetric, scale-free statement.
2. Student's two-sample t-test with pooled variance (Student 1908, Biometrika 6:1-25) between
   tonight's repeats and the pooled repeats of the previous nights. The null hypothesis is "nothing
   changed", under which both samples share one variance, so the pooled test has exactly its nominal
   false-alarm rate for log-normal noise. Welch's unequal-variance test was tried first and rejected:
   with 3 repeats against 9 its Satterthwaite approximation measured 1.0% false alarms at a nominal
   0.5% (20,000 simulated nulls), doubling the alarm rate where Bonferroni needs it smallest. The
   t interval on the mean-log difference, exponentiated, is the interval on the ratio
   ``tonight / history`` reported with every verdict.
3. Bonferroni over the layouts compared in one night: each layout is tested at ``alpha / m``, so the
   chance of any false alarm in a night of ``m`` layouts stays <= ``alpha`` (Dunn 1961, JASA 56:52-64).
4. A layout is flagged only when it is beyond noise (its interval excludes 1, i.e. p < alpha/m) AND
   beyond the minimum effect size (``|ratio - 1| >= min_effect`` at the point estimate). A drop is a
   ``regression``, a rise an ``improvement``; both are reported.
5. Fewer than ``min_repeats`` measurements on either side -> ``insufficient`` (never flagged): one
   run cannot tell a slowdown from noise.

Known limitation (documented, by design): the history pools repeats across nights, so slow
night-to-night drift is treated as within-run noise; ``min_effect`` is the guard against flagging it.
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

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha < 1.0:
            raise SpecError(f"regression.alpha must be in (0, 1), got {self.alpha!r}")
        if not 0.0 <= self.min_effect < 1.0:
            raise SpecError(f"regression.min_effect must be in [0, 1), got {self.min_effect!r}")
        if isinstance(self.min_repeats, bool) or not isinstance(self.min_repeats, int) or self.min_repeats < 2:
            raise SpecError(f"regression.min_repeats must be an integer >= 2, got {self.min_repeats!r}")
        if isinstance(self.history_nights, bool) or not isinstance(self.history_nights, int) or self.history_nights < 1:
            raise SpecError(f"regression.history_nights must be a positive integer, got {self.history_nights!r}")


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


def compare_layout(
    layout: str,
    tonight: Iterable[float],
    history: Iterable[float],
    *,
    policy: RegressionPolicy | None = None,
    tests: int = 1,
) -> LayoutComparison:
    """Compare tonight's tokens/s repeats of ``layout`` with its history (see the module docstring).

    ``tests`` is the number of layouts compared this night (Bonferroni divisor).
    """
    policy = policy or RegressionPolicy()
    assert tests >= 1
    now = [float(v) for v in tonight if v is not None and math.isfinite(v) and v > 0]
    past = [float(v) for v in history if v is not None and math.isfinite(v) and v > 0]
    med_now = _median(now) if now else None
    med_past = _median(past) if past else None
    if len(now) < policy.min_repeats or len(past) < policy.min_repeats:
        return LayoutComparison(
            layout, "insufficient", len(now), len(past), med_now, med_past, None, None, None, None, None,
            f"needs >= {policy.min_repeats} measurements tonight and in history, "
            f"has {len(now)} and {len(past)}",
        )
    alpha = policy.alpha / tests
    ratio, low, high, p = log_ratio_t_test(now, past, confidence=1.0 - alpha)
    beyond_noise = p < alpha and not (low <= 1.0 <= high)
    big_enough = abs(ratio - 1.0) >= policy.min_effect
    pct = f"{(ratio - 1.0) * 100:+.1f}% [{(low - 1.0) * 100:+.1f}%, {(high - 1.0) * 100:+.1f}%]"
    if beyond_noise and big_enough:
        verdict: Verdict = "regression" if ratio < 1.0 else "improvement"
        reason = f"tokens/s {pct} at {1 - alpha:.3g} confidence, p={p:.2g}"
    elif not beyond_noise:
        verdict = "unchanged"
        reason = f"tokens/s {pct}: within noise (p={p:.2g} >= {alpha:.2g})"
    else:
        verdict = "unchanged"
        reason = f"tokens/s {pct}: beyond noise but below the {policy.min_effect:.0%} minimum effect"
    return LayoutComparison(
        layout, verdict, len(now), len(past), med_now, med_past, ratio, low, high, p, 1.0 - alpha, reason
    )


def compare_night(
    tonight: Mapping[str, Sequence[float]],
    history: Mapping[str, Sequence[float]],
    *,
    policy: RegressionPolicy | None = None,
) -> list[LayoutComparison]:
    """Every layout measured tonight against its history, Bonferroni over the layouts that have both."""
    policy = policy or RegressionPolicy()
    testable = [k for k in tonight if len(tonight[k]) >= policy.min_repeats and len(history.get(k, ())) >= policy.min_repeats]
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
