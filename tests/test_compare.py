"""Differences stated with their uncertainty: a known difference is found, two identical arms are called
"no measurable difference" at the interval's rate, single runs claim nothing, and arms interleave."""
import random
import warnings

import pytest

from engine.measure.compare import NO_DIFFERENCE, compare, interleaved


def arm(rng, mean, spread, n):
    """n speeds around mean with the relative spread of runs on a busy machine."""
    return [mean * rng.lognormvariate(0, spread) for _ in range(n)]


def test_a_known_difference_is_called_a_difference():
    rng = random.Random(1)
    result = compare(arm(rng, 20.0, 0.05, 5), arm(rng, 26.0, 0.05, 5))
    assert result.measurable and result.verdict == "faster"
    assert result.low < 1.3 < result.high and result.low > 1
    slower = compare(arm(rng, 20.0, 0.05, 5), arm(rng, 15.0, 0.05, 5))
    assert slower.verdict == "slower" and slower.high < 1


def test_identical_arms_are_no_measurable_difference_at_the_stated_rate():
    rng = random.Random(2)
    trials = 2000
    called = sum(compare(arm(rng, 20.0, 0.15, 3), arm(rng, 20.0, 0.15, 3)).measurable for _ in range(trials))
    # a 95% interval excludes the true ratio 1 in 5% of trials: 100 of 2000, binomial sd about 10
    assert 60 <= called <= 140
    assert compare([20.0, 21.0, 19.5], [20.2, 20.9, 19.4]).verdict == NO_DIFFERENCE


def test_a_small_true_difference_within_the_noise_is_not_claimed():
    rng = random.Random(3)
    result = compare(arm(rng, 20.0, 0.2, 3), arm(rng, 22.0, 0.2, 3))  # 1.1x inside 20% noise
    assert result.low < 1 < result.high and result.verdict == NO_DIFFERENCE
    assert "no measurable difference" in result.text() and "95% interval" in result.text()


def test_single_runs_give_a_ratio_but_no_interval_and_no_claim():
    result = compare([20.0], [30.0])
    assert result.ratio == pytest.approx(1.5) and result.low is None and not result.measurable
    assert "no difference can be claimed" in result.text()


def test_arms_run_interleaved():
    assert interleaved(["A", "B"], 3) == ["A", "B", "A", "B", "A", "B"]


def test_an_arm_without_spread_gets_an_interval_and_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = compare([2, 2], [8, 4])  # the highest load each of two rounds held: integers repeat
    assert result.low < result.ratio < result.high and result.ratio == pytest.approx(32 ** 0.5 / 2)
