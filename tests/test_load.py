"""Load sweeps at request rates against a small real server whose service time is known
(tests/load_server.py): schedules, traces, goodput, Little's law, deadlines, a dying server, bad input."""
import json
import math
from pathlib import Path

import numpy as np
import pytest

from engine.cli.main import main
from engine.serve import arrivals
from engine.measure.arrivals import schedule
from engine.serve import records as served_store
from engine.serve.load import Sweep, SweepConfig

from test_served import ScriptServers
from commands import run_engine

SERVER = Path(__file__).with_name("load_server.py")
SHIPPED_TRACE = Path(__file__).resolve().parents[1] / "data" / "traces" / "chat_and_documents.jsonl"


@pytest.fixture
def known_server():
    """start(slots, step_s, die_after=None, extra=()) -> URL of a server that serves `slots` requests at once, one
    chunk per step; extra are more of its options (its prefill time per token, a log of the prompts)."""
    servers = ScriptServers(SERVER)

    def start(slots=1, step_s=0.02, die_after=None, extra=()):
        return servers.start(slots, step_s, *([die_after] if die_after is not None else []), *extra)

    yield start
    servers.close()


def rate_config(url, rates, **kw):
    kw.setdefault("requests", 8)
    kw.setdefault("output_tokens", 4)
    kw.setdefault("input_tokens", 12)
    return SweepConfig(url, rates=rates, poll_s=kw.pop("poll_s", 0.2), **kw)


def test_arrival_schedule_keeps_its_rate_and_burstiness_and_repeats_with_its_seed():
    first = schedule(4000, 4.0, 1.0, np.random.default_rng(7))
    assert first == schedule(4000, 4.0, 1.0, np.random.default_rng(7))
    assert first != schedule(4000, 4.0, 1.0, np.random.default_rng(8))
    assert first[-1] == pytest.approx(1000.0)  # the last arrives at n / rate, as vllm bench serve scales it
    for burstiness in (1.0, 0.25, 4.0):
        gaps = np.diff([0.0, *schedule(4000, 4.0, burstiness, np.random.default_rng(1))])
        assert gaps.mean() == pytest.approx(0.25, rel=1e-9)
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)


def test_a_rate_sweep_with_a_fixed_seed_sends_the_same_schedule_twice(known_server, store):
    url = known_server(slots=4, step_s=0.005)
    runs = []
    for _ in range(2):
        summary = Sweep(rate_config(url, [6.0], seed=11, length_spread=0.5, output_tokens=6), store).run()
        rows = served_store.sweep_requests(store, summary["sweep_id"]).sort_values("idx")
        runs.append((np.diff(rows["scheduled_ms"].to_numpy()), list(rows["prompt_name"]),
                     list(rows["n_output_tokens"])))
    assert np.allclose(runs[0][0], runs[1][0], atol=1e-3) and runs[0][1:] == runs[1][1:]
    assert len(set(runs[0][2])) > 1 and all(3 <= n <= 9 for n in runs[0][2])  # 6 +- 50 %, each exactly served


def test_goodput_and_throughput_follow_a_server_of_known_service_time(known_server, store):
    url = known_server(slots=1, step_s=0.02)
    slo = {"ttft_ms": 400.0, "e2e_ms": 4000.0}
    # nearly even gaps (burstiness 50), so the light level never queues: gaps of about 1 s against 0.2 s of service
    summary = Sweep(rate_config(url, [1.0, 25.0], requests=16, output_tokens=10, slo=slo, burstiness=50.0),
                    store).run()
    light, heavy = summary["levels"]
    service_s = light["e2e_ms"]["p50"] / 1e3  # one request alone on the server
    assert light["completed"] == heavy["completed"] == 16
    # far below saturation every request is good: goodput is the throughput
    assert light["attainment"] == 1.0 and light["goodput_requests_per_s"] == pytest.approx(light["requests_per_s"])
    # far above it the single slot serves back to back: throughput is one request per service time
    assert heavy["requests_per_s"] * service_s == pytest.approx(1.0, rel=0.3)
    assert heavy["attainment"] < 0.5 and heavy["metric_attainment"]["ttft_ms"] < heavy["metric_attainment"]["e2e_ms"]
    assert heavy["good"] == round(heavy["attainment"] * 16)
    # queued in the server, not the client (the client's own lag is threads waking on a busy machine)
    assert heavy["waiting_max"] >= 1 and heavy["client_queue_ms"]["p50"] < heavy["ttft_ms"]["p50"] / 2
    stored = served_store.sweep_requests(store, summary["sweep_id"])
    assert stored["good"].sum() == light["good"] + heavy["good"]
    samples = served_store.sweep_samples(store, summary["sweep_id"])
    assert set(samples["level"]) == {0, 1} and samples["waiting"].max() >= 1


def test_littles_law_holds_on_a_measured_level(known_server, store):
    url = known_server(slots=2, step_s=0.03)
    summary = Sweep(rate_config(url, [5.0], requests=30, output_tokens=8, poll_s=0.03), store).run()
    level = summary["levels"][0]
    arrival_rate = level["completed"] / level["wall_s"]
    # the in-flight count sampled by the poller against rate x mean time in the system
    assert level["in_flight_mean"] == pytest.approx(arrival_rate * level["e2e_mean_ms"] / 1e3, rel=0.25)


def test_max_concurrency_holds_requests_in_the_client_and_records_the_wait(known_server, store):
    url = known_server(slots=4, step_s=0.03)
    summary = Sweep(rate_config(url, [20.0], requests=12, output_tokens=6, max_concurrency=1), store).run()
    level = summary["levels"][0]
    assert level["completed"] == 12 and level["client_queue_ms"]["p90"] > 100
    assert level["ttft_ms"]["p90"] < level["client_queue_ms"]["p90"]  # TTFT counts from the send, as vLLM's


def test_a_missed_deadline_is_recorded_as_such(known_server, store):
    url = known_server(slots=1, step_s=0.1)
    summary = Sweep(SweepConfig(url, [1], requests=2, output_tokens=20, input_tokens=5, deadline_s=0.6,
                                slo={"e2e_ms": 10000.0}), store).run()
    level = summary["levels"][0]
    assert level["deadline_missed"] == 2 and level["failed"] == 2 and level["attainment"] == 0.0
    rows = served_store.sweep_requests(store, summary["sweep_id"])
    assert set(rows["status"]) == {"deadline"} and rows["error"].str.contains("0.6 s deadline").all()


def test_warmup_requests_are_stored_apart_and_left_out_of_the_figures(known_server, store):
    url = known_server(slots=2, step_s=0.005)
    summary = Sweep(SweepConfig(url, [2], requests=3, output_tokens=3, input_tokens=5, warmup=2), store).run()
    assert summary["levels"][0]["completed"] == 3
    assert len(served_store.sweep_requests(store, summary["sweep_id"])) == 3
    raw = store.query("SELECT warmup, count(*) AS n FROM requests WHERE sweep_id = ? GROUP BY warmup",
                      [summary["sweep_id"]])
    assert dict(zip(raw["warmup"], raw["n"])) == {True: 2, False: 3}


def test_a_trace_is_replayed_at_its_own_timing_or_scaled_to_a_rate(known_server, store, tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"t_s": t, "input_tokens": 6, "output_tokens": n}) + "\n"
                             for t, n in ((0, 2), (0.4, 3), (0.8, 2), (1.2, 4))))
    url = known_server(slots=4, step_s=0.005)
    rows = arrivals.read_trace(trace)
    own = Sweep(SweepConfig(url, trace=rows), store).run()
    scaled = Sweep(SweepConfig(url, trace=rows, rates=[20.0]), store).run()
    assert own["levels"][0]["rate"] == pytest.approx(3 / 1.2) and own["levels"][0]["arrival"] == "trace"
    for summary, gap_ms in ((own, 400.0), (scaled, 50.0)):
        stored = served_store.sweep_requests(store, summary["sweep_id"]).sort_values("idx")
        assert np.diff(stored["scheduled_ms"]) == pytest.approx([gap_ms] * 3, abs=1.0)
        assert list(stored["n_output_tokens"]) == [2, 3, 2, 4]


def test_the_shipped_trace_mixes_short_chats_and_long_documents():
    rows = arrivals.read_trace(SHIPPED_TRACE)
    long_docs = [r for r in rows if r["input_tokens"] >= 600]
    chats = [r for r in rows if r["input_tokens"] < 300]
    assert len(rows) == len(long_docs) + len(chats) and 0.1 < len(long_docs) / len(rows) < 0.35
    assert 0.3 < arrivals.trace_rate(rows) < 1.0


def test_a_server_that_dies_mid_sweep_keeps_the_levels_before_and_marks_the_broken_one(known_server, tmp_path):
    url = known_server(slots=2, step_s=0.01, die_after=5)
    db = tmp_path / "runs.duckdb"
    out = run_engine("load", "--endpoint", url, "--concurrency", "1,2", "--requests", "4", "--output-tokens", "3",
                  "--input-tokens", "5", "--db", db)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "ended early: level 2 (2 at once) broke: Nothing answers" in out.stderr and "failed" in out.stderr
    from engine.store.db import Store

    sweep = served_store.sweeps(Store(db)).iloc[0]
    levels = json.loads(sweep["levels"])
    assert sweep["status"] == "error" and [lv["status"] for lv in levels] == ["ok", "broken"]
    assert levels[0]["completed"] == 4 and levels[1]["completed"] + levels[1]["failed"] == 4


def test_a_sweep_where_every_request_failed_says_so_and_exits_non_zero(known_server, tmp_path, capsys):
    url = known_server(slots=1, step_s=0.01)
    # every request is cut by its deadline before the first token: the server stays up, nothing succeeds
    code = main(["load", "--endpoint", url, "--concurrency", "1", "--requests", "2", "--output-tokens", "200",
                 "--input-tokens", "5", "--deadline", "0.005", "--db", str(tmp_path / "x.duckdb")])
    err = capsys.readouterr().err
    assert code == 1 and "none of its 2 requests succeeded" in err and "sweep 1 finished" in err


BAD = [
    (["--rate", "0"], "from 0.01 to 1000"), (["--rate", "-1"], "from 0.01"), (["--rate", "nan"], "from 0.01"),
    (["--rate", "1e-10"], "from 0.01"), (["--rate", "1e-300"], "from 0.01"),
    (["--rate", "1,x"], "not a request rate"), (["--rate", "1", "--concurrency", "2"], "not both"),
    (["--rate", "1", "--burstiness", "0"], "--burstiness"), (["--rate", "1", "--slo", "ttft=5"], "Unknown SLO metric"),
    (["--rate", "1", "--slo", "ttft_ms=abc"], "must be a number"), (["--rate", "1", "--slo", "ttft_ms"], "metric=milliseconds"),
    (["--rate", "1", "--timeout", "0"], "stall timeout"), (["--rate", "1", "--timeout", "nan"], "stall timeout"),
    (["--rate", "1", "--length-spread", "1.5"], "--length-spread"), (["--rate", "1", "--temperature", "nan"], "temperature"),
    (["--rate", "1", "--max-concurrency", "0"], "--max-concurrency"), (["--rate", "1", "--seed", "-1"], "--seed"),
]


def test_bad_load_input_is_one_sentence_exit_2_and_nothing_stored(known_server, tmp_path, capsys):
    url = known_server(slots=1, step_s=0.01)
    db = tmp_path / "x.duckdb"
    traces = {"malformed": "{not json\n", "empty": "\n\n", "unsorted": '{"t_s": 2, "input_tokens": 4, "output_tokens": 2}\n'
              '{"t_s": 1, "input_tokens": 4, "output_tokens": 2}\n', "shape": '{"t_s": 0, "output_tokens": 2}\n',
              "huge": '{"t_s": 0, "input_tokens": 4, "output_tokens": 2}\n' * (arrivals.MAX_REQUESTS + 1)}
    cases = list(BAD)
    for name, text in traces.items():
        (tmp_path / f"{name}.jsonl").write_text(text)
        cases.append((["--trace", str(tmp_path / f"{name}.jsonl")], "trace"))
    (tmp_path / "folder").mkdir()
    notes = tmp_path / "notes.txt"  # a file of the user's own, the database say: never written over
    notes.write_text('{"status": "mine"}')
    cases += [(["--rate", "1", "--progress", str(tmp_path / "folder")], "progress file"),
              (["--rate", "1", "--progress", str(tmp_path / "no" / "such" / "p.json")], "progress file"),
              (["--rate", "1", "--progress", str(notes)], "not a sweep's progress file"),
              (["--rate", "1", "--progress", str(db)], "is the database")]
    for args, words in cases:
        code = main(["load", "--endpoint", url, "--input-tokens", "4", *args, "--db", str(db)])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("error: ") and words in err and err.count("\n") == 1, (args, err)
    assert notes.read_text() == '{"status": "mine"}'
    if db.exists():
        from engine.store.db import Store

        assert served_store.sweeps(Store(db)).empty
