"""`capacity` against a small real server of known service time: the rate it finds lies below the
server's service rate, the levels are stored, Little's law gives the users, bad input is refused."""
import json

import pytest

from engine.cli.main import main
from engine.serve import records as served_store
from engine.measure.slo import overlapped
from engine.serve.capacity import answer, describe, find_edge, limiting_metric
from engine.serve.load import Sweep, SweepConfig
from engine.store.db import Store

from test_load import known_server  # noqa: F401 (the fixture)


def test_the_search_doubles_until_a_level_fails_then_bisects_towards_the_edge():
    tried = []

    def level(rate):
        tried.append(rate)
        return {"status": "error" if rate > 100 else "ok", "error": "it stopped answering", "rate": rate}

    good, bad, error = find_edge(level, lambda lv: lv["rate"] <= 3.0, 1.0, steps=3)
    assert tried == [1.0, 2.0, 4.0, 3.0, 3.5, 3.25] and (good["rate"], bad["rate"], error) == (3.0, 3.25, None)
    good, bad, error = find_edge(level, lambda lv: True, 50.0, steps=3)  # a level that breaks ends the search
    assert (good["rate"], bad, error) == (100.0, None, "the level at 200 req/s broke: it stopped answering")
    tried.clear()
    assert find_edge(level, lambda lv: True, 1.0, steps=3, stopped=lambda: True)[0]["rate"] == 1.0 and tried == [1.0]
    tried.clear()  # halving stops above the slowest rate a level may take
    good, bad, error = find_edge(level, lambda lv: False, 0.04, steps=3)
    assert tried == [0.04, 0.02, 0.01] and good is None and bad["rate"] == 0.01


def test_halving_stops_at_a_failing_level_whose_requests_each_ran_alone():
    tried = []

    def level(rate):  # requests overlap above 1 request/s; no rate holds
        tried.append(rate)
        return {"status": "ok", "rate": rate, "overlapped": rate > 1.0, "metric_attainment": {"ttft_ms": 0.0}}

    good, bad, error = find_edge(level, lambda lv: False, 8.0, steps=3)
    assert tried == [8.0, 4.0, 2.0, 1.0] and good is None and bad["rate"] == 1.0 and error is None
    out = answer(good, bad, attainment=0.9, think_time_s=0.0, slo={"ttft_ms": 1.0})
    assert out["failed_alone"] and describe(out).startswith("capacity: none for 90% of requests within ttft_ms 1: at 1 ")


def test_requests_overlap_when_one_is_sent_before_an_earlier_one_ended():
    assert overlapped([(0, 10), (10, 20), (25, 30)]) is False  # each sent as the one before ended, or later
    assert overlapped([(0, 100), (10, 20), (50, 60)]) is True  # the third overlaps the first, not the second
    assert overlapped([(30, 40), (0, 35)]) is True and overlapped([]) is None


@pytest.mark.slow  # thousands of tokens, draws or requests: long even on a quiet machine
def test_capacity_of_a_one_slot_server_lies_below_its_service_rate(known_server, tmp_path, capsys):  # noqa: F811
    url = known_server(slots=1, step_s=0.02)
    db = tmp_path / "runs.duckdb"
    alone = Sweep(SweepConfig(url, [1], requests=4, output_tokens=6, input_tokens=8, warmup=1), Store(db)).run()
    service_s = alone["levels"][0]["e2e_ms"]["p50"] / 1e3
    slo = f"e2e_ms={3 * service_s * 1e3:.0f}"
    code = main(["capacity", "--endpoint", url, "--slo", slo, "--attainment", "0.9", "--think-time", "2",
                 "--duration", "2", "--requests", "12", "--output-tokens", "6", "--input-tokens", "8",
                 "--start-rate", f"{0.25 / service_s:.3f}", "--steps", "2", "--burstiness", "4", "--db", str(db),
                 "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["status"] == "ok"
    rate = out["capacity_requests_per_s"]
    # one slot serves one request per service time at most: no rate far above the fastest departures it managed
    # holds (the margin is the service time drifting with the shared machine's load between levels); an M/D/1
    # queue still meets 3x the service time at half that rate
    served = max(lv["departures_per_s"] or 0 for lv in out["levels"])
    assert 0.3 / service_s <= rate <= 1.35 * served
    assert out["first_failing_rate"] > rate and out["limiting_metric"] in ("e2e_ms", "throughput")
    assert out["users"] == pytest.approx(rate * (out["response_time_s"] + 2.0))
    stored = served_store.sweeps(Store(db)).iloc[0]
    assert stored["kind"] == "capacity" and json.loads(stored["result"])["capacity_requests_per_s"] == rate
    assert len(json.loads(stored["levels"])) == len(out["levels"]) >= 3


def test_the_first_metric_to_fail_is_the_one_fewest_requests_met():
    ok = {"status": "ok", "rate": 1.0, "requests_per_s": 0.9, "output_tokens_per_s": 9.0, "goodput_requests_per_s": 0.9,
          "attainment": 1.0, "e2e_mean_ms": 500.0, "client_queue_ms": {"mean": 100.0}}
    bad = {"status": "ok", "rate": 2.0, "metric_attainment": {"ttft_ms": 0.4, "tpot_ms": 0.95}}
    result = answer(ok, bad, attainment=0.9, think_time_s=3.0, slo={"ttft_ms": 500, "tpot_ms": 50})
    assert result["limiting_metric"] == "ttft_ms" and result["users"] == pytest.approx(1.0 * (0.6 + 3.0))
    assert limiting_metric({"status": "broken"}) == "server"
    behind = {"status": "ok", "kept_up": False, "metric_attainment": {"e2e_ms": 1.0}}
    assert limiting_metric(behind, 0.9) == "throughput"
    assert answer(None, bad, attainment=0.9, think_time_s=0, slo={})["capacity_requests_per_s"] is None


@pytest.mark.parametrize("args, words", [
    (["--slo", "ttft_ms=0"], "positive"), (["--slo", "speed=3"], "Unknown SLO metric"),
    (["--slo", "ttft_ms=500", "--attainment", "1.5"], "--attainment"),
    (["--slo", "ttft_ms=500", "--think-time", "-1"], "--think-time"),
    (["--slo", "ttft_ms=500", "--start-rate", "0"], "from 0.01"),
    (["--slo", "ttft_ms=500", "--duration", "nan"], "--duration"),
])
def test_bad_capacity_input_is_one_sentence_and_exit_2(args, words, tmp_path, capsys):
    code = main(["capacity", "--endpoint", "http://127.0.0.1:9", *args, "--db", str(tmp_path / "x.duckdb")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and words in err and err.count("\n") == 1
