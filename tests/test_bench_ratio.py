"""The benchmarks' ratio of two settings over their rounds: engine.measure.compare's ratio, 95% interval and
verdict, in the rounds' words."""
import importlib.util
from pathlib import Path

from engine.measure.compare import NO_DIFFERENCE

COMMON = Path(__file__).resolve().parent.parent / "bench" / "common.py"


def bench_common():
    spec = importlib.util.spec_from_file_location("bench_common", COMMON)  # bench/ stays off sys.path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_clear_difference_over_the_rounds_is_stated_with_its_interval():
    ratio = bench_common().ratio
    assert ratio([10.0, 10.2, 9.9, 10.1], [20.1, 19.8, 20.3, 20.0]) == \
        "2.00x (95% interval 1.95-2.04, 4 vs 4 rounds): faster"
    assert ratio([20.1, 19.8, 20.3, 20.0], [10.0, 10.2, 9.9, 10.1]).endswith(": slower")


def test_rounds_that_overlap_are_no_measurable_difference():
    text = bench_common().ratio([10.0, 12.0, 9.0], [11.0, 9.5, 12.5])
    assert text == f"1.07x (95% interval 0.77-1.47, 3 vs 3 rounds): {NO_DIFFERENCE}"


def test_one_round_gives_the_ratio_without_an_interval():
    assert bench_common().ratio([10.0], [15.0]) == \
        "1.50x (1 vs 1 rounds): single runs: no interval, so no difference can be claimed"
