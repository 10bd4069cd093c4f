"""Two settings measured over repeats: the ratio of their speeds with a 95% interval, and what it supports.

The interval is Welch's t interval on the difference of mean log values (scipy), turned into a ratio of
geometric means; where it includes 1 the verdict is "no measurable difference", whatever the ratio."""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

from scipy import stats

LEVEL = 0.95
NO_DIFFERENCE = "no measurable difference"


@dataclass(frozen=True)
class Comparison:
    """candidate / baseline for a figure where higher is better (tokens per second)."""
    ratio: float
    low: float | None  # the 95% interval; None with fewer than two repeats in an arm
    high: float | None
    n_baseline: int
    n_candidate: int

    @property
    def measurable(self) -> bool:
        """True when the interval excludes 1: the repeats support a difference."""
        return self.low is not None and (self.low > 1 or self.high < 1)

    @property
    def verdict(self) -> str:
        if self.low is None:
            return "single runs: no interval, so no difference can be claimed"
        if not self.measurable:
            return NO_DIFFERENCE
        return "faster" if self.ratio > 1 else "slower"

    def text(self) -> str:
        """'1.32x (95% interval 1.20-1.45, 3 vs 3 repeats): faster'."""
        span = f"95% interval {self.low:.2f}-{self.high:.2f}, " if self.low is not None else ""
        return f"{self.ratio:.2f}x ({span}{self.n_candidate} vs {self.n_baseline} repeats): {self.verdict}"


def compare(baseline: list[float], candidate: list[float]) -> Comparison:
    """The ratio candidate/baseline of the geometric means of positive measurements, with its 95% interval."""
    a, b = [math.log(v) for v in usable(baseline)], [math.log(v) for v in usable(candidate)]
    if not a or not b:
        raise ValueError("each arm needs at least one positive measurement")
    ratio = math.exp(sum(b) / len(b) - sum(a) / len(a))
    if len(a) < 2 or len(b) < 2:
        return Comparison(ratio, None, None, len(a), len(b))
    if max(a) == min(a) and max(b) == min(b):  # no spread at all: the ratio is exact
        return Comparison(ratio, ratio, ratio, len(a), len(b))
    with warnings.catch_warnings():  # one arm without spread is fine for Welch's test; scipy warns of it all the same
        warnings.filterwarnings("ignore", "Precision loss occurred", RuntimeWarning)
        interval = stats.ttest_ind(b, a, equal_var=False).confidence_interval(LEVEL)
    return Comparison(ratio, math.exp(interval.low), math.exp(interval.high), len(a), len(b))


def usable(values) -> list[float]:
    """The positive, finite measurements among values (a missing figure arrives as None or NaN)."""
    return [float(v) for v in values if v is not None and math.isfinite(v) and v > 0]


def interleaved(arms: list, repeats: int) -> list:
    """The order to run arms in: A B A B ..., so a drift of the machine falls on every arm alike."""
    return [arm for _ in range(repeats) for arm in arms]
