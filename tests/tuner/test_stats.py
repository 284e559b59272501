"""Ranking statistics: intervals, ties, Pareto front, prediction error (calibration: test_search_learning.py)."""

from __future__ import annotations

import pytest

from tuner import interval, pareto_front, rank, relative_error


def test_interval_is_student_t_on_log_values_and_contains_the_median():
    import math
    import statistics

    iv = interval([10.0, 12.0, 11.0])
    # t(0.975, 2) = 4.303 on the log values, mapped back: a multiplicative interval around the geomean
    logs = [math.log(v) for v in (10.0, 12.0, 11.0)]
    half = 4.3027 * statistics.stdev(logs) / 3**0.5
    assert iv.median == 11.0 and iv.n == 3
    assert iv.low == pytest.approx(math.exp(statistics.fmean(logs) - half), rel=1e-4)
    assert iv.high == pytest.approx(math.exp(statistics.fmean(logs) + half), rel=1e-4)
    with pytest.raises(ValueError):
        interval([])


def test_one_measurement_has_an_unknown_interval_and_is_never_separated():
    one = interval([5.0])
    assert (one.n, one.median, one.low, one.high, one.known) == (1, 5.0, None, None, False)
    # Two very noisy runs (as in the tiny CPU sweep): the interval stays positive.
    noisy = interval([1600.0, 1640.0 * 1.9])
    assert noisy.low > 0 and noisy.high > noisy.low
    # Without pooled noise (rank(pool=False)): with it, see test_search_learning.py.
    ranked = rank({"best": [100.0, 101.0, 99.0], "once": [50.0], "far": [10.0, 10.1, 9.9]}, pool=False)
    assert [r.key for r in ranked] == ["best", "once", "far"]
    assert ranked[1].tied_with_best and ranked[1].tie_group == 1  # one run cannot prove it is slower
    assert not ranked[2].tied_with_best
    # A single lucky run at the top does not separate the others from it either.
    lucky = rank({"lucky": [200.0], "a": [100.0, 101.0], "b": [10.0, 10.1]}, pool=False)
    assert all(r.tied_with_best for r in lucky)


def test_versus_best_never_calls_a_single_run_tied_and_follows_the_intervals_not_n():
    from tuner import BEST, NOT_COMPARABLE, SLOWER, TIED, Interval, versus_best

    ranked = rank({"best": [606.2, 607.0, 605.5], "close": [603.0, 606.0, 609.0], "far": [300.0, 301.0, 299.0],
                   "once": [68.5]}, pool=False)
    best = ranked[0].interval
    verdicts = {r.key: versus_best(r.interval, best, is_best=r.rank == 1) for r in ranked}
    assert verdicts == {"best": BEST, "close": TIED, "far": SLOWER, "once": NOT_COMPARABLE}
    assert ranked[3].tied_with_best  # the ranking still never *separates* a single run (README)
    # A best measured once makes every other layout not comparable, however often it was measured.
    alone = rank({"lucky": [700.0], "steady": [600.0, 601.0, 599.0]}, pool=False)
    assert versus_best(alone[1].interval, alone[0].interval, is_best=False) == NOT_COMPARABLE
    # Once a single run has an interval (e.g. from a pooled noise estimate), it is compared like any other.
    pooled = Interval(1, 68.5, 60.0, 78.0)
    assert versus_best(pooled, best, is_best=False) == SLOWER


def test_rank_marks_overlapping_intervals_as_ties():
    ranked = rank({"a": [100, 101, 99], "b": [99.5, 100.5, 98.5], "c": [80, 81, 79], "d": [79.5, 80.2, 79.9]})
    assert [r.key for r in ranked] == ["a", "b", "c", "d"]
    assert [r.tie_group for r in ranked] == [1, 1, 2, 2]
    assert [r.tied_with_best for r in ranked] == [True, True, False, False]
    lower = rank({"x": [3.0], "y": [1.0]}, higher_is_better=False)
    assert [r.key for r in lower] == ["y", "x"]


def test_pareto_front_and_relative_error():
    pts = [("fast-big", 10.0, 8.0), ("slow-small", 5.0, 2.0), ("dominated", 4.0, 3.0), ("mid", 7.0, 4.0)]
    assert pareto_front(pts) == ["slow-small", "mid", "fast-big"]
    assert relative_error(110.0, 100.0) == pytest.approx(0.1)
    assert relative_error(None, 1.0) is None and relative_error(1.0, 0.0) is None
