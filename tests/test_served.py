"""The served-run client against real local processes: a closed port, a plain HTTP server, a small
streaming server killed or stalled mid-stream; the bucket split and the metric definitions."""
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import duckdb
import pytest

from engine.serve import client as served
from engine.serve import split as served_split
from engine.serve import records as served_store
from engine.serve.load import Sweep, SweepConfig, load_prompts, parse_concurrency
from engine.serve.client import ServedError, ServedRun, ServedRunError
from engine.run.spec import GenConfig, RunSpec
from engine.serve.metrics import request_metrics
from engine.measure.distances import BUCKETS
from engine.serve.vllm import free_port

SERVER = Path(__file__).with_name("stream_server.py")


def wait_for_port(port, proc, timeout=60):
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the test server exited"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError("the test server did not start")


@pytest.fixture
def stream_server():
    procs = []

    def start(mode="ok", delay=0.01):
        port = free_port()
        proc = subprocess.Popen([sys.executable, str(SERVER), str(port), mode, str(delay)])
        procs.append(proc)
        wait_for_port(port, proc)
        return f"http://127.0.0.1:{port}", proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait(timeout=30)


def served_run(url, store=None, *, prompt="Say something.", max_new_tokens=8, temperature=0.0, **fields):
    """A served run of a RunSpec, as open_run makes it."""
    gen = GenConfig(prompt, max_new_tokens=max_new_tokens, temperature=temperature)
    return ServedRun(RunSpec(gen=gen, backend="served", endpoint=url, **fields), store)


def test_endpoint_accepts_v1_and_refuses_credentials_in_the_url():
    assert served.api_root("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    assert served.api_root("https://example.org") == "https://example.org"
    for bad in ("127.0.0.1:8000", "ftp://x", "http://user:secret@127.0.0.1:8000", "http://h:8000/v1?key=1", ""):
        with pytest.raises(ServedError):
            served.api_root(bad)


def test_chunk_buckets_sum_to_each_gap_with_and_without_server_figures():
    gaps = [120.0, 30.0, 35.0, 0.5]
    server = {"requests": 1.0, "queue_ms": 10.0, "prefill_ms": 80.0, "decode_ms": 60.0}
    spec = {**server, "drafts": 2.0, "draft_tokens": 8.0, "accepted_tokens": 5.0}
    for srv, fractions in ((None, None), (server, None), (server, {"memory": 0.7, "compute": 0.3}), (spec, None)):
        rows = served_split.chunk_buckets(gaps, 2.0, srv, fractions)
        for gap, row in zip(gaps, rows):
            parts = [row[f"{b}_ms"] or 0.0 for b in BUCKETS]
            unsplit = row["server_work_ms"] if row["memory_ms"] is None else 0.0
            assert sum(parts) + unsplit == pytest.approx(gap)
        assert rows[0]["physical_ms"] == 2.0 and all(r["physical_ms"] == 0 for r in rows[1:])
        assert (rows[0]["memory_ms"] is None) == (fractions is None)  # no GPU named: never an invented split
    rows = served_split.chunk_buckets(gaps, 2.0, spec)
    assert rows[0]["decision_ms"] == 0 and rows[1]["decision_ms"] > 0
    assert served_split.speculative_waste(spec) == pytest.approx(3 / 10)
    assert served_split.chunk_buckets(gaps, 2.0, server)[0]["time_ms"] == pytest.approx(120 - 2 - 80)


def test_request_metrics_follow_vllm_bench_serve():
    # three chunks, the second carrying two tokens: ITL has two gaps, TPOT divides by three
    m = request_metrics([100.0, 130.0, 190.0], [1, 2, 1])
    assert m["ttft_ms"] == 100 and m["e2e_ms"] == 190 and m["itl_ms"] == [30.0, 60.0]
    assert m["n_output_tokens"] == 4 and m["tpot_ms"] == pytest.approx(90 / 3)
    assert request_metrics([100.0, 130.0], [1, 1], usage_tokens=5)["tpot_ms"] == pytest.approx(30 / 4)


def test_closed_port_is_one_sentence_and_exit_code_2(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServedError, match="Nothing answers at"):
        served.list_models(url)
    out = subprocess.run([sys.executable, "-m", "engine", "generate", "--endpoint", url, "--prompt", "hi",
                          "--db", str(tmp_path / "x.duckdb")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "Nothing answers at" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "engine", "generate", "--endpoint", url, "--prompt", "hi", "--spec",
                          "jacobi", "--db", str(tmp_path / "x.duckdb")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert out.stderr == ("error: A served run cannot honour speculative decoding: leave it out, or run it on the "
                          "local engine.\n")


def test_unresolvable_host_is_one_sentence():
    with pytest.raises(ServedError, match="Nothing answers at"):
        served.list_models("http://tokenpath-no-such-host.invalid:8000", timeout_s=20)


def test_plain_http_server_is_not_openai_compatible(tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, proc)
        with pytest.raises(ServedError, match="not an OpenAI-compatible API"):
            served_run(f"http://127.0.0.1:{port}", prompt="hi", max_new_tokens=4)
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_unknown_model_and_missing_key_are_one_sentence(stream_server, monkeypatch):
    url, _ = stream_server("key")
    with pytest.raises(ServedError, match=r"refused the request with no API key \(HTTP 401\)"):
        served.list_models(url)
    monkeypatch.setenv("TP_TEST_KEY", "sesame")
    assert served.list_models(url, "TP_TEST_KEY") == ["SmolLM2-135M-Instruct"]
    with pytest.raises(ServedError, match="has no model 'gpt-9'; it serves: SmolLM2-135M-Instruct"):
        served_run(url, served_model="gpt-9", prompt="hi", max_new_tokens=4, api_key_env="TP_TEST_KEY")
    with pytest.raises(ServedError, match="TP_UNSET_KEY named for the API key is not set"):
        served.list_models(url, "TP_UNSET_KEY")


def test_stream_without_token_ids_is_counted_by_the_tokenizer_and_stored(stream_server, store, monkeypatch):
    url, _ = stream_server("key")
    monkeypatch.setenv("TP_TEST_KEY", "sesame")
    run = served_run(url, store, prompt="Say something.", max_new_tokens=8,
                          api_key_env="TP_TEST_KEY")
    events = list(run)
    assert len(events) == 8 and run.status == "ok"
    result = run.result
    assert result["text"].startswith("The quick brown fox") and result["token_source"] == "tokenizer"
    assert result["n_new_tokens"] == 8 and result["provenance"]["server_work"]["source"] == "client"
    tokens, row = store.tokens(run.run_id), store.run(run.run_id)
    assert row["backend"] == "served" and row["endpoint"] == url and row["server_model"] == "SmolLM2-135M-Instruct"
    assert json.loads(row["provenance"])["memory"]["source"] == "none"
    total = tokens[[f"{b}_ms" for b in BUCKETS if b not in ("memory", "compute")] + ["server_work_ms"]].sum().sum()
    assert total == pytest.approx(result["e2e_ms"])
    assert tokens["memory_ms"].isna().all()
    # the key itself is nowhere in the database
    con = duckdb.connect(str(store.path), read_only=True)
    dump = json.dumps([con.execute(f"SELECT * FROM {t}").fetchall() for t in ("runs", "steps", "tokens")], default=str)
    con.close()
    assert "sesame" not in dump and "TP_TEST_KEY" in dump


def test_a_named_gpu_splits_server_work_with_the_planner(stream_server, store):
    url, _ = stream_server("ok")
    with pytest.raises(ServedError, match="Unknown GPU"):
        served_run(url, prompt="Hi.", max_new_tokens=4, gpu="no-such-gpu")
    run = served_run(url, store, prompt="Hi.", max_new_tokens=6, gpu="h100-80gb-sxm")
    list(run)
    tokens = store.tokens(run.run_id)
    # later chunks are all server work here (no /metrics), so every one of them gets a memory share
    assert tokens["memory_ms"].notna().all() and (tokens["memory_ms"].iloc[1:] > 0).all()
    assert tokens[[f"{b}_ms" for b in BUCKETS]].sum().sum() == pytest.approx(run.result["e2e_ms"])
    assert run.result["provenance"]["memory"]["source"] == "estimate"


def test_server_killed_mid_stream_is_recorded_interrupted_with_its_tokens(stream_server, store):
    url, proc = stream_server("ok", delay=0.3)
    run = served_run(url, store, prompt="Say something.", max_new_tokens=16)
    got = [next(run), next(run)]
    proc.kill()
    with pytest.raises(ServedRunError, match="closed the connection in the middle of the stream"):
        got += list(run)
    row = store.run(run.run_id)
    assert row["status"] == "interrupted" and row["n_new_tokens"] == len(got) >= 2
    assert len(store.tokens(run.run_id)) == len(run.token_ids) >= 2


def test_stalled_stream_is_cut_after_the_timeout_and_recorded(stream_server, store):
    url, _ = stream_server("stall")
    run = served_run(url, store, prompt="Say something.", max_new_tokens=8, timeout_s=10)
    with pytest.raises(ServedRunError, match="sent no token for 10 s"):
        list(run)
    row = store.run(run.run_id)
    assert row["status"] == "interrupted" and row["n_new_tokens"] == 2


def test_closing_early_cancels_and_records(stream_server, store):
    url, _ = stream_server("ok", delay=0.2)
    run = served_run(url, store, prompt="Say something.", max_new_tokens=16)
    next(run)
    run.close()
    assert run.status == "cancelled" and store.run(run.run_id)["status"] == "cancelled"


def test_load_sweep_stores_every_request_and_stop_keeps_what_finished(stream_server, store, tmp_path):
    url, _ = stream_server("ok", delay=0.05)
    prompts = load_prompts("summary")
    progress = tmp_path / "progress.json"
    summary = Sweep(SweepConfig(url, parse_concurrency("1,2"), 3, 6, prompts), store, progress).run()
    assert summary["status"] == "ok" and [lv["completed"] for lv in summary["levels"]] == [3, 3]
    assert json.loads(progress.read_text())["done"] == 6
    requests = served_store.sweep_requests(store, summary["sweep_id"])
    assert len(requests) == 6 and set(requests["token_source"]) == {"tokenizer"}
    assert (requests["n_output_tokens"] == 6).all()

    slow, _ = stream_server("ok", delay=0.4)
    sweep = Sweep(SweepConfig(slow, [1], 20, 6, prompts), store)

    def stop_after_the_first():
        deadline = time.monotonic() + 120
        while sweep.done < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        sweep.stop()

    threading.Thread(target=stop_after_the_first).start()
    summary = sweep.run()
    assert summary["status"] == "stopped"
    kept = served_store.sweep_requests(store, summary["sweep_id"])
    assert 1 <= (kept["status"] == "ok").sum() < 20 and len(kept) < 20
    assert served_store.sweeps(store).iloc[0]["status"] == "stopped"


def test_load_command_bad_input_is_exit_code_2(tmp_path):
    for args in (["--concurrency", "1,x"], ["--requests", "0"], ["--prompts", str(tmp_path / "none.txt")]):
        out = subprocess.run([sys.executable, "-m", "engine", "load", "--endpoint", "http://127.0.0.1:9", *args,
                              "--db", str(tmp_path / "x.duckdb")], capture_output=True, text=True, timeout=300,
                             env={**os.environ})
        assert out.returncode == 2 and out.stderr.startswith("error: ") and "Traceback" not in out.stderr
