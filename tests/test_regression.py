"""The regression test's statistical properties: false-alarm rate under noise, power, the gates."""

from __future__ import annotations

import math
import random

import pytest

from tuner import SpecError
from tuner._regression import (
    RegressionPolicy,
    compare_layout,
    compare_night,
    fingerprint_diff,
    log_ratio_t_test,
)


def _noisy(rng: random.Random, center: float, sigma: float, n: int) -> list[float]:
    return [center * math.exp(rng.gauss(0.0, sigma)) for _ in range(n)]


def test_t_test_matches_scipy_on_logs() -> None:
    from scipy import stats

    a, b = [95.0, 97.0, 96.5, 94.0], [100.0, 101.5, 99.0, 100.5, 98.0]
    ratio, low, high, p = log_ratio_t_test(a, b, confidence=0.95)
    ref = stats.ttest_ind([math.log(v) for v in a], [math.log(v) for v in b], equal_var=True)
    assert p == pytest.approx(ref.pvalue, rel=1e-9)
    ci = ref.confidence_interval(0.95)
    assert (math.log(low), math.log(high)) == pytest.approx((ci.low, ci.high), rel=1e-9)
    assert low < ratio < high < 1.0


def test_false_alarm_rate_under_pure_noise_is_at_most_alpha() -> None:
    """10 layouts per night, 3 repeats, 3% noise, no change: nights with any flag <= alpha."""
    rng = random.Random(7)
    policy = RegressionPolicy(alpha=0.05, min_effect=0.0)  # no effect gate: test the statistics alone
    nights, noisy_nights = 400, 0
    for _ in range(nights):
        tonight = {f"L{i}": _noisy(rng, 1000.0 + i, 0.03, 3) for i in range(10)}
        history = {f"L{i}": _noisy(rng, 1000.0 + i, 0.03, 9) for i in range(10)}
        noisy_nights += any(c.flagged for c in compare_night(tonight, history, policy=policy))
    # Bonferroni keeps the family-wise rate <= 5%; allow binomial sampling error (sd ~1.1%).
    assert noisy_nights / nights <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / nights)


def test_twenty_percent_slowdown_is_flagged_with_its_interval() -> None:
    rng = random.Random(1)
    hits = 0
    for _ in range(100):
        c = compare_layout("tp2-dp2", _noisy(rng, 800.0, 0.03, 3), _noisy(rng, 1000.0, 0.03, 9))
        hits += c.verdict == "regression"
        if c.verdict == "regression":
            assert c.ratio_low < c.ratio < c.ratio_high < 1.0
            assert c.ratio_low < 0.8 < c.ratio_high or abs(c.ratio - 0.8) < 0.05
    assert hits >= 95  # power, measured: with 3 vs 9 repeats at 3% noise a 20% drop is almost always seen


def test_improvement_is_reported() -> None:
    c = compare_layout("x", [1200.0, 1210.0, 1195.0], [1000.0, 1004.0, 998.0, 1001.0])
    assert c.verdict == "improvement" and c.change == pytest.approx(0.2, abs=0.01)
    assert c.flagged and c.to_dict()["change"] == c.change


def test_small_but_significant_change_is_not_flagged_below_min_effect() -> None:
    c = compare_layout("x", [980.0, 981.0, 979.5], [1000.0, 1000.5, 999.5, 1000.2])
    assert c.p_value is not None and c.p_value < 0.01  # beyond noise ...
    assert c.verdict == "unchanged" and "minimum effect" in c.reason  # ... but only -2%


def test_single_measurements_are_insufficient_never_flagged() -> None:
    c = compare_layout("x", [500.0], [1000.0, 1001.0, 999.0])
    assert c.verdict == "insufficient" and not c.flagged and c.ratio is None


def test_deterministic_values_use_the_limit_of_the_test() -> None:
    assert compare_layout("x", [100.0, 100.0], [100.0, 100.0]).verdict == "unchanged"
    assert compare_layout("x", [80.0, 80.0], [100.0, 100.0]).verdict == "regression"


def test_bonferroni_widens_interval_with_more_layouts() -> None:
    one = compare_layout("x", [90.0, 93.0, 91.0], [100.0, 97.0, 99.0], tests=1)
    many = compare_layout("x", [90.0, 93.0, 91.0], [100.0, 97.0, 99.0], tests=20)
    assert many.ratio_high - many.ratio_low > one.ratio_high - one.ratio_low
    assert many.confidence < one.confidence or many.confidence > one.confidence  # level changes
    assert many.confidence == pytest.approx(1 - 0.05 / 20)


@pytest.mark.parametrize(
    "kwargs, field",
    [({"alpha": 0.0}, "alpha"), ({"min_effect": 1.5}, "min_effect"), ({"min_repeats": 1}, "min_repeats"),
     ({"history_nights": 0}, "history_nights")],
)
def test_policy_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(SpecError, match=f"regression.{field}"):
        RegressionPolicy(**kwargs)


def test_fingerprint_diff_names_nested_changes() -> None:
    before = {"torch": "2.12.0", "cuda": "12.4", "hosts": ["a", "b"], "gpu": {"driver": "550", "name": "H100"}}
    after = {"torch": "2.13.0", "cuda": "12.4", "hosts": ["a", "b"], "gpu": {"driver": "560", "name": "H100"}, "nccl": "2.21"}
    assert fingerprint_diff(before, after) == {
        "torch": {"before": "2.12.0", "after": "2.13.0"},
        "gpu.driver": {"before": "550", "after": "560"},
        "nccl": {"before": None, "after": "2.21"},
    }
