"""The benchmarks' figures under load: the highest load that holds a target, and a planned figure's error."""
import importlib
import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def bench_common():
    spec = importlib.util.spec_from_file_location("bench_common", BENCH / "common.py")  # bench/ stays off sys.path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def level(concurrency: int, ttft_p90: float | None, tpot_p90: float | None, failed: int = 0, status: str = "ok") -> dict:
    return {"concurrency": concurrency, "status": status, "failed": failed,
            "ttft_ms": {"p50": ttft_p90, "p90": ttft_p90}, "tpot_ms": {"p50": tpot_p90, "p90": tpot_p90}}


def test_the_highest_holding_level_is_the_last_before_the_first_failure():
    highest = bench_common().highest_holding
    same = lambda x: x  # noqa: E731 (measured again, a level gives what it gave)
    assert highest([1, 2, 4, 8, 16], lambda x: x <= 4, same) == 4
    assert highest([1, 2, 4, 8], lambda x: x != 2, same) == 1  # a later level that holds again does not count
    assert highest([1, 2], lambda x: x > 5, same) is None
    assert highest([], lambda x: True, same) is None


def test_a_level_that_fails_once_and_holds_measured_again_does_not_end_the_search():
    highest = bench_common().highest_holding
    # (concurrency, held?) as a sweep measured them: concurrency 2 failed once, in a burst of other work
    first = [(1, True), (2, False), (4, True), (8, True), (16, False)]
    again = {2: (2, True), 16: (16, False)}
    measured = []

    def once_more(level):
        measured.append(level[0])
        return again[level[0]]
    best = highest(first, lambda level: level[1], once_more)
    assert best == (8, True)
    assert measured == [2, 16]  # only the failing levels were measured again
    assert highest([(1, False), (2, True)], lambda level: level[1], lambda level: (1, False)) is None


def test_a_planned_figure_s_error_is_against_the_measured_one():
    error = bench_common().error_pct
    assert error(125.0, 100.0) == "+25%"
    assert error(50.0, 100.0) == "-50%"
    assert error(None, 100.0) == "-"
    assert error(10.0, None) == "-"
    assert error(10.0, 0.0) == "-"


def test_batching_s_highest_load_holds_both_p90_targets_and_every_request(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    batching = importlib.import_module("batching")
    same = lambda lv: lv  # noqa: E731 (measured again, a level gives what it gave)
    levels = [level(1, 200, 40), level(2, 400, 60), level(4, 900, 99), level(8, 1400, 80), level(16, 300, 50)]
    assert batching.highest_load(levels, same) == 4
    assert batching.highest_load([level(1, 200, 140)], same) == 0  # per token too slow at once
    assert batching.highest_load([level(1, 200, 40), level(2, 200, 40, failed=1)], same) == 1  # a failed request
    assert batching.highest_load([level(1, 200, 40), level(2, None, None, status="error")], same) == 1
    # one noisy first token at concurrency 2, within the target when measured again
    noisy = [level(1, 200, 40), level(2, 1300, 60), level(4, 900, 99), level(8, 1400, 80)]
    again = {2: level(2, 420, 60), 8: level(8, 1350, 85)}
    assert batching.highest_load(noisy, lambda lv: again[lv["concurrency"]]) == 4
