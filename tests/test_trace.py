"""Traces: stored runs and load sweeps as Chrome trace-event JSON, checked against a strict schema of the
format, against the store row by row, from a killed run's journal, at 10k tokens, in Chromium, and
refused in one sentence for bad input."""
import json
import os
import stat

import jsonschema
import pytest

from engine.measure.distances import BUCKETS, PHASES
from engine.report.trace import PHASE_TIDS, STEP_TID, TraceError, trace, trace_json
from engine.run.generate import Generation
from engine.spec import GenConfig
from engine.serve import records as served_store
from engine.serve.load import Sweep, SweepConfig, load_prompts
from engine.store.db import Store
from test_served import stream_server  # noqa: F401 (a fixture)
from commands import run_engine


# The JSON object form of the trace-event format (Google's "Trace Event Format" document), restricted to
# the phases a trace uses: complete slices (X), instants (i), counters (C) and metadata (M).
_COMMON = {"name": {"type": "string"}, "cat": {"type": "string"}, "pid": {"type": "integer"},
           "tid": {"type": "integer"}, "ts": {"type": "number", "minimum": 0}, "args": {"type": "object"}}
EVENT = {"oneOf": [
    {"type": "object", "required": ["name", "ph", "ts", "dur", "pid", "tid"], "additionalProperties": False,
     "properties": {**_COMMON, "ph": {"const": "X"}, "dur": {"type": "number", "minimum": 0}}},
    {"type": "object", "required": ["name", "ph", "ts", "s", "pid", "tid"], "additionalProperties": False,
     "properties": {**_COMMON, "ph": {"const": "i"}, "s": {"enum": ["t", "p", "g"]}}},
    {"type": "object", "required": ["name", "ph", "ts", "pid", "args"], "additionalProperties": False,
     "properties": {**_COMMON, "ph": {"const": "C"},
                    "args": {"type": "object", "minProperties": 1, "additionalProperties": {"type": "number"}}}},
    {"type": "object", "required": ["name", "ph", "pid", "args"], "additionalProperties": False,
     "properties": {**_COMMON, "ph": {"const": "M"},
                    "name": {"enum": ["process_name", "process_sort_index", "thread_name", "thread_sort_index"]},
                    "args": {"type": "object", "minProperties": 1, "maxProperties": 1,
                             "properties": {"name": {"type": "string"}, "sort_index": {"type": "integer"}}}}},
]}
SCHEMA = {"type": "object", "required": ["traceEvents"], "additionalProperties": False,
          "properties": {"traceEvents": {"type": "array", "minItems": 1, "items": EVENT},
                         "displayTimeUnit": {"enum": ["ms", "ns"]}, "otherData": {"type": "object"}}}


def valid(text: str) -> dict:
    """The trace parsed from its text (NaN and Infinity refused), checked against the schema and ordered by time."""
    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")
    obj = json.loads(text, parse_constant=refuse)
    jsonschema.validate(obj, SCHEMA)
    timed = [e["ts"] for e in obj["traceEvents"] if e["ph"] != "M"]
    assert timed == sorted(timed)
    return obj


def of(obj, ph, **match):
    return [e for e in obj["traceEvents"] if e["ph"] == ph and all(e.get(k) == v for k, v in match.items())]


def test_the_trace_of_a_tiny_run_has_exactly_its_stored_steps_and_tokens_on_one_clock(store, tiny_lm, calibration):
    cfg = GenConfig("Name a colour.", max_new_tokens=12, ignore_eos=True)
    run_id = Generation(tiny_lm, cfg, store=store, calibration=calibration).run()["run_id"]
    obj = valid(trace_json(store, [run_id]))
    steps, tokens = store.steps(run_id), store.tokens(run_id)

    slices = of(obj, "X", pid=run_id, tid=STEP_TID)
    assert [s["args"]["step"] for s in slices] == list(steps["step"])
    starts = steps["wall_ms"].cumsum().shift(fill_value=0.0)  # the steps tile the run from 0
    for s, (_, row), start in zip(slices, steps.iterrows(), starts):
        assert s["ts"] == pytest.approx(start * 1e3, abs=0.01) and s["dur"] == pytest.approx(row["wall_ms"] * 1e3, abs=0.01)
        at = s["ts"]
        for phase in PHASES:
            (piece,) = [e for e in of(obj, "X", pid=run_id, tid=PHASE_TIDS[phase]) if e["args"]["step"] == row["step"]]
            assert piece["dur"] == pytest.approx(row[f"{phase}_ms"] * 1e3, abs=0.002)
            assert piece["ts"] == pytest.approx(at, abs=0.01)
            at = piece["ts"] + piece["dur"]
        assert at == pytest.approx(s["ts"] + s["dur"], abs=0.01)

    instants = of(obj, "i", pid=run_id)
    assert [e["args"]["token_id"] for e in instants] == list(tokens["token_id"]) == list(store.run(run_id)["token_ids"])
    ends = {s["args"]["step"]: s["ts"] + s["dur"] for s in slices}
    for e, (_, row) in zip(instants, tokens.iterrows()):
        assert e["ts"] == pytest.approx(row["t_ms"] * 1e3, abs=0.01) == pytest.approx(ends[row["step"]], abs=0.01)
    counters = of(obj, "C", pid=run_id, name="buckets of each token (ms)")
    assert len(counters) == len(tokens)
    for c, (_, row) in zip(counters, tokens.iterrows()):
        assert c["args"] == pytest.approx({b: row[f"{b}_ms"] for b in BUCKETS})


def test_telemetry_is_a_counter_track_on_the_run_clock(store, tiny_lm, calibration):
    cfg = GenConfig("Count to a thousand.", max_new_tokens=400, ignore_eos=True)
    run_id = Generation(tiny_lm, cfg, store=store, calibration=calibration).run()["run_id"]
    telemetry = store.telemetry(run_id)
    assert len(telemetry), "the run was too short for one telemetry sample"
    obj = valid(trace_json(store, [run_id]))
    memory = of(obj, "C", pid=run_id, name="resident memory (MB)")
    assert [c["ts"] for c in memory] == pytest.approx(list(telemetry["t_ms"] * 1e3), abs=0.01)
    assert [c["args"]["value"] for c in memory] == pytest.approx(list(telemetry["rss_bytes"] / 1e6))
    last_token = of(obj, "i", pid=run_id)[-1]["ts"]
    assert memory[0]["ts"] <= last_token + 200e3  # the sampler stops with the run


def _copy_run(store: Store, run_id: int) -> int:
    """A run whose steps and tokens are another's, written straight into the store."""
    run = store.run(run_id)
    copy = store.start_run(model=run["model"], device=run["device"], dtype=run["dtype"], config=json.loads(run["config"]),
                           hardware=json.loads(run["hardware"]), prompt=run["prompt"])
    rows = {table: getattr(store, table)(run_id).assign(run_id=copy).to_dict("records") for table in ("steps", "tokens")}
    store.finish_run(copy, status=run["status"], output=run["output"], batches=rows)
    return copy


@pytest.mark.slow  # thousands of tokens, draws or requests: long even on a quiet machine
def test_runs_of_12k_tokens_trace_to_a_file_perfetto_opens(tmp_path):
    """Three runs of the longest there is: one generated, two more with its rows written straight into
    the store (the trace writer reads rows, whichever process wrote them)."""
    from engine.model.loader import tiny_model

    lm = tiny_model(layers=1, positions=4200)
    store = Store(tmp_path / "runs.duckdb")
    cfg = GenConfig("Go on.", max_new_tokens=4096, ignore_eos=True, raw=True)  # the longest run there is
    generated = Generation(lm, cfg, store=store, telemetry=False).run()["run_id"]
    ids = [generated, _copy_run(store, generated), _copy_run(store, generated)]
    text = trace_json(store, ids)
    obj = valid(text)
    assert len(of(obj, "i")) == 3 * 4096
    assert len(text) < 64e6  # far under what ui.perfetto.dev loads in a browser tab


def test_a_load_sweep_has_a_track_per_request_with_each_chunk(stream_server, store):  # noqa: F811
    url, _ = stream_server("ok", delay=0.02)
    summary = Sweep(SweepConfig(url, [1, 2], 3, 5, load_prompts("summary")), store).run()
    obj = valid(trace_json(store, sweep_ids=[summary["sweep_id"]]))
    threads = of(obj, "M", name="thread_name")
    assert len(threads) == 6
    requests = store.query("SELECT * FROM requests WHERE sweep_id = ? ORDER BY concurrency, idx", [summary["sweep_id"]])
    for tid, (_, r) in enumerate(requests.iterrows(), start=1):
        first = [e for e in of(obj, "X", tid=tid) if e["name"] == "to first token"]
        assert first[0]["ts"] == pytest.approx(r["sent_ms"] * 1e3, abs=0.01)
        assert first[0]["dur"] == pytest.approx(r["ttft_ms"] * 1e3, abs=0.01)
        assert len([e for e in of(obj, "i", tid=tid) if e["name"] == "chunk"]) == len(r["chunk_ms"])
        (end,) = [e for e in of(obj, "i", tid=tid) if e["name"].startswith("end")]
        assert end["ts"] == pytest.approx((r["sent_ms"] + r["e2e_ms"]) * 1e3, abs=0.01)


def test_a_rate_level_names_its_rate_and_queues_each_request_from_its_arrival(stream_server, store):  # noqa: F811
    url, _ = stream_server("ok", delay=0.02)
    cfg = SweepConfig(url, [], 4, 5, load_prompts("summary"), rates=[20.0], max_concurrency=1)
    summary = Sweep(cfg, store).run()
    obj = valid(trace_json(store, sweep_ids=[summary["sweep_id"]]))
    assert all(e["args"]["name"].startswith("20 req/s: request") for e in of(obj, "M", name="thread_name"))
    requests = served_store.sweep_requests(store, summary["sweep_id"])
    held = 0
    for tid, r in enumerate(requests.itertuples(), start=1):
        queued = [e for e in of(obj, "X", tid=tid) if e["name"].startswith("queued")]
        if r.sent_ms - r.scheduled_ms > 0:
            held += 1
            assert queued[0]["ts"] == pytest.approx(r.scheduled_ms * 1e3, abs=0.01)
            assert queued[0]["dur"] == pytest.approx((r.sent_ms - r.scheduled_ms) * 1e3, abs=0.01)
        else:
            assert not queued
    assert held  # one connection for arrivals 50 ms apart: requests wait in the client


def test_nothing_chosen_or_an_unknown_id_is_refused(store):
    with pytest.raises(TraceError, match="Nothing to trace"):
        trace(store)
    with pytest.raises(TraceError, match="Run 99 is not in"):
        trace(store, [99])
    with pytest.raises(TraceError, match="Load sweep 7 is not in"):
        trace(store, sweep_ids=[7])


def cli(*args):
    proc = run_engine("trace", *args, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def test_the_trace_command_writes_the_file_and_refuses_bad_input_in_one_sentence(store, tiny_lm, calibration, tmp_path):
    run_id = Generation(tiny_lm, GenConfig("Hi.", max_new_tokens=3), store=store, calibration=calibration).run()["run_id"]
    out = tmp_path / "run.json"
    code, stdout, stderr = cli("--run", run_id, "--out", out, "--db", store.path)
    assert code == 0 and "wrote" in stdout, stderr
    valid(out.read_text())
    refusals = [
        ("--run", 999, "--out", out, "--db", store.path),
        ("--out", out, "--db", store.path),
        ("--run", run_id, "--out", tmp_path / "missing" / "t.json", "--db", store.path),
        ("--run", run_id, "--out", tmp_path, "--db", store.path),  # a folder: the file cannot be written there
        ("--run", "0", "--out", out, "--db", store.path),
        ("--run", run_id, "--out", store.path, "--db", store.path),  # the database itself
        ("--run", run_id, "--out", tmp_path / "t.json", "--db", tmp_path / "absent.duckdb"),
    ]
    for args in refusals:
        code, _, stderr = cli(*args)
        assert code == 2 and stderr.startswith("error: ") and len(stderr.strip().splitlines()) == 1, (args, stderr)
    assert not list(tmp_path.glob("*.partial")) and not (tmp_path / "absent.duckdb").exists()
    Store(store.path).runs()  # still a database
    # something that is not a file (a pipe, /dev/stdout) is written to, not replaced by a file
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    reader = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)  # the trace of three tokens fits in the pipe's buffer
    try:
        code, _, stderr = cli("--run", run_id, "--out", pipe, "--db", store.path)
        assert code == 0, stderr
        received = b""
        while chunk := os.read(reader, 1 << 16):  # b"" once the writer has gone (or never came)
            received += chunk
    finally:
        os.close(reader)
    valid(received.decode())
    assert stat.S_ISFIFO(pipe.stat().st_mode) and not list(tmp_path.glob("*.partial"))


CHROMIUM = "/usr/bin/chromium"


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is not installed (apt-get install chromium)")
def test_chromium_parses_the_trace_and_finds_its_tracks(store, tiny_lm, calibration, tmp_path):
    from playwright.sync_api import sync_playwright

    run_id = Generation(tiny_lm, GenConfig("Hi.", max_new_tokens=4), store=store, calibration=calibration).run()["run_id"]
    text = trace_json(store, [run_id])
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page()
        page.set_content("<html><body></body></html>")
        found = page.evaluate("""text => {
            const t = JSON.parse(text);
            const names = new Set(t.traceEvents.filter(e => e.ph === 'M' && e.name === 'thread_name').map(e => e.args.name));
            const ordered = t.traceEvents.filter(e => e.ph !== 'M').every((e, i, a) => i === 0 || a[i - 1].ts <= e.ts);
            return {threads: [...names].sort(), ordered, tokens: t.traceEvents.filter(e => e.ph === 'i').length};
        }""", text)
        browser.close()
    assert found["ordered"] and found["tokens"] == 4
    assert found["threads"] == sorted(["steps and tokens", *(f"phase: {p}" for p in PHASES)])
