"""The time calibration's judgement of a fit that only rescales the prior (api.engine._calibrate)."""

import numpy as np

from api.engine import _calibrate as cal

PRIOR = np.array([1.0, 1.0, 1.0, 1.0, 0.0])
# A real sweep (examples/tiny-cpu.yaml with max_trials 10: 4 gloo ranks on a loaded 2-core host): the
# analytical time parts (TIME_PARTS) of each layout and its measured step time (s).
REAL_CPU = [
    ([0.012553, 0.0, 0.000128986, 0.0, 1.0], 0.203336),  # dp4 mbs1
    ([0.012553, 0.0, 0.000128986, 0.0, 1.0], 0.219746),  # dp4 mbs2
    ([0.012553, 0.102574, 0.0, 0.0, 1.0], 4.80367),  # tp4
    ([0.012553, 0.0, 0.000128986, 0.0, 1.0], 0.243465),  # dp4 z1
    ([0.012553, 0.0, 0.000128986, 0.0, 1.0], 0.187168),  # dp4 z2 mbs4
    ([0.012553, 0.0, 0.000193478, 0.0, 1.0], 0.210002),  # dp4 z3 mbs4
    ([0.012553, 0.0, 0.000128986, 0.0, 1.0], 0.138328),  # dp4 mbs4
    ([0.0197731, 0.0, 4.30016e-05, 0.000265536, 1.0], 0.0933895),  # dp2 pp2 mbs4 1f1b
    ([0.0197731, 0.0, 4.30016e-05, 0.000265536, 1.0], 0.111235),  # dp2 pp2 z1 mbs4 1f1b
    ([0.0260047, 0.0, 0.0, 0.000531072, 1.0], 0.0882105),  # pp4 mbs4 1f1b
]
PARTS = np.array([p for p, _ in REAL_CPU])
MEASURED = np.array([y for _, y in REAL_CPU])


def test_a_rescale_of_the_prior_is_judged_by_the_ranks_it_gives_held_out_layouts():
    """Every fold's fit (compute x3.6-7.4, the per-step constant at its bound) orders the ten layouts
    exactly as the prior. Comparing the raw held-out predictions across folds ranked the folds'
    weights instead (-0.56 against the prior's -0.23) and refused a fit whose held-out step times
    are 1.11 log units off against the prior's 2.57."""
    out = cal.judge_time(PARTS, MEASURED, {"analytical": PRIOR})
    assert out["fitted"] == ["compute", "latency"] and out["rescale_only"]
    assert out["loo_spearman"] == out["prior_spearman"]
    assert out["loo_rms_log_error"] < out["prior_rms_log_error"] - cal.RESCALE_GAIN
    assert out["accepted"] and out["weights"]["compute"] > 2 and out["weights"]["latency"] > 0
    assert "ranks as the prior" in out["reason"]


def test_a_rescale_that_gains_less_than_a_factor_two_held_out_is_refused():
    """The same layouts on a host 5x faster: the prior is off by less, the rescale's held-out gain
    (1.12 -> 0.83 rms log error) is short of RESCALE_GAIN, and the prior stays."""
    out = cal.judge_time(PARTS, MEASURED / 5.0, {"analytical": PRIOR})
    assert out["rescale_only"] and out["loo_spearman"] == out["prior_spearman"]
    assert out["loo_rms_log_error"] < out["prior_rms_log_error"]  # better, but not by enough
    assert not out["accepted"] and out["weights"] == dict(zip(cal.TIME_PARTS, PRIOR, strict=True))
    assert "a rescale must gain more" in out["reason"]


def test_a_fit_that_reorders_is_judged_by_its_held_out_predictions():
    """Where a fold's fit orders the samples otherwise than the prior, its held-out predictions judge it."""
    rng = np.random.default_rng(0)
    parts = np.column_stack([rng.uniform(0.1, 1.0, 10), rng.uniform(0.0, 0.3, 10), np.zeros(10), np.zeros(10),
                             np.ones(10)])
    measured = 0.2 * parts[:, 0] + 4.0 * parts[:, 1] + 0.5
    out = cal.judge_time(parts, measured, {"analytical": PRIOR})
    assert not out["rescale_only"]
    assert out["accepted"] and out["loo_spearman"] > out["prior_spearman"]
    free = cal.supported(parts, measured, PRIOR, order=(0, 4, 1, 2, 3))
    held_out = [parts[i] @ cal.fit_weights(np.delete(parts, i, 0), np.delete(measured, i), PRIOR, free)
                for i in range(10)]
    assert out["loo_spearman"] == cal.spearman(held_out, measured)
