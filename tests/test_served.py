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

from engine import OPENMP_WAIT_VARIABLES
from engine.serve import client as served
from engine.serve import scrape as server_metrics
from engine.serve import split as served_split
from engine.serve import records as served_store
from engine.serve.load import Sweep, SweepConfig, load_prompts, parse_concurrency
from engine.serve.client import ServedError, ServedRun, ServedRunError
from engine.spec import GenConfig, RunSpec
from engine.serve.metrics import request_metrics
from engine.measure.distances import BUCKETS
from engine.serve.vllm import free_port
from commands import run_engine

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


class ScriptServers:
    """Test servers run from `script` on free ports: start(*args) -> the URL of one that takes connections;
    close() kills every one started."""

    def __init__(self, script):
        self.script, self.procs = script, []

    def launch(self, *args) -> tuple[str, subprocess.Popen]:
        """The URL of a new server and its process (for a test that ends it)."""
        port = free_port()
        proc = subprocess.Popen([sys.executable, str(self.script), str(port), *map(str, args)])
        self.procs.append(proc)
        wait_for_port(port, proc)
        return f"http://127.0.0.1:{port}", proc

    def start(self, *args) -> str:
        return self.launch(*args)[0]

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait(timeout=30)


@pytest.fixture
def stream_server():
    """start(mode, delay) -> (URL, process) of tests/stream_server.py."""
    servers = ScriptServers(SERVER)
    yield lambda mode="ok", delay=0.01: servers.launch(mode, delay)
    servers.close()


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


VLLM_PAGE = """# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 3.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1504.0
vllm:prompt_tokens_total{engine="1",model_name="m"} 6.0
# HELP vllm:prompt_tokens_created Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_created gauge
vllm:prompt_tokens_created{engine="0",model_name="m"} 1.796402076315736e+09
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 2.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 2.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 9.5
"""


def test_a_scrape_of_some_families_reads_them_as_the_whole_page_does():
    whole = server_metrics.parse(VLLM_PAGE)
    assert whole["vllm:prompt_tokens"] == 1510 and whole["vllm:e2e_request_latency_seconds"]["sum"] == 9.5
    for families in (["vllm:num_requests_waiting"], ["vllm:prompt_tokens"], ["vllm:num_requests_waiting",
                                                                               "vllm:prompt_tokens", "vllm:absent"]):
        assert server_metrics.parse(VLLM_PAGE, families) == {f: whole[f] for f in families if f in whole}


def test_closed_port_is_one_sentence_and_exit_code_2(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServedError, match="Nothing answers at"):
        served.list_models(url)
    out = run_engine("generate", "--endpoint", url, "--prompt", "hi", "--db", tmp_path / "x.duckdb", timeout=300)
    assert out.returncode == 2 and "Nothing answers at" in out.stderr and "Traceback" not in out.stderr
    out = run_engine("generate", "--endpoint", url, "--prompt", "hi", "--speculative", "jacobi",
                  "--db", tmp_path / "x.duckdb", timeout=300)
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
        out = run_engine("load", "--endpoint", "http://127.0.0.1:9", *args, "--db", tmp_path / "x.duckdb", timeout=300)
        assert out.returncode == 2 and out.stderr.startswith("error: ") and "Traceback" not in out.stderr


def cli(capsys, *args) -> tuple[int, str]:
    """(exit code, stderr) of the command line run in this process; its signal handlers are put back after."""
    import signal

    from engine.cli.main import main

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = main(list(args))
    except SystemExit as exc:
        code = exc.code
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    return code, capsys.readouterr().err


def test_a_server_that_streams_forever_is_read_only_to_the_run_budget(stream_server, store):
    url, _ = stream_server("forever", delay=0.01)
    run = served_run(url, store, max_new_tokens=20)
    list(run)
    assert run.status == "ok" and run.result["stop_reason"] == "length"
    assert 20 <= len(run.token_ids) <= 21  # the chunk that reached the budget is the last one read
    assert store.run(run.run_id)["n_new_tokens"] == len(store.tokens(run.run_id)) == len(run.token_ids)


def test_a_dripping_server_is_cut_at_the_deadline_and_its_tokens_kept(stream_server, store, capsys):
    url, _ = stream_server("forever", delay=4.0)
    code, err = cli(capsys, "generate", "--endpoint", url, "--prompt", "Hi", "--max-new-tokens", "20",
                    "--timeout", "8", "--deadline", "10", "--db", str(store.path))
    assert code == 1 and "did not finish within the run's deadline of 10 s, so the run was cut short" in err
    assert "Traceback" not in err
    row = store.run(1)
    assert row["status"] == "interrupted" and 2 <= row["n_new_tokens"] == len(store.tokens(1)) <= 4
    # without --deadline the run may take the stall timer plus a second per token of its budget
    assert RunSpec(GenConfig("x", max_new_tokens=20), backend="served", endpoint=url, timeout_s=8).deadline == 28


def test_keep_alive_comments_and_empty_chunks_are_no_progress(stream_server, store):
    url, _ = stream_server("comments", delay=0.2)
    run = served_run(url, store, timeout_s=3)
    with pytest.raises(ServedRunError, match="sent no token for 3 s, so the run was cut short"):
        list(run)
    assert store.run(run.run_id)["status"] == "error" and store.run(run.run_id)["n_new_tokens"] == 0


def test_a_load_sweep_stops_each_request_at_its_budget_its_stall_timer_and_its_deadline(stream_server, store, capsys):
    forever, _ = stream_server("forever", delay=0.01)
    summary = Sweep(SweepConfig(forever, [2], 2, 20, load_prompts("summary")), store).run()
    requests = served_store.sweep_requests(store, summary["sweep_id"]).to_dict("records")
    assert [r["status"] for r in requests] == ["ok", "ok"]
    assert all(20 <= r["n_output_tokens"] <= 21 for r in requests)  # the chunk that reached the budget is the last read

    dripping, _ = stream_server("forever", delay=4.0)  # a token every 4 s against a stall timer of 8 s
    start = time.monotonic()
    code, err = cli(capsys, "load", "--endpoint", dripping, "--concurrency", "1", "--requests", "1",
                    "--max-new-tokens", "20", "--timeout", "8", "--deadline", "10", "--db", str(store.path))
    assert time.monotonic() - start < 120 and "Traceback" not in err
    assert code == 1 and "none of its 1 requests succeeded" in err
    (request,) = served_store.sweep_requests(store, 2).to_dict("records")
    assert request["status"] == "deadline" and 2 <= request["n_output_tokens"] <= 4

    comments, _ = stream_server("comments", delay=0.2)  # keep-alive bytes, never a token
    summary = Sweep(SweepConfig(comments, [1], 1, 8, load_prompts("summary"), timeout_s=3), store).run()
    (request,) = served_store.sweep_requests(store, summary["sweep_id"]).to_dict("records")
    assert request["status"] == "error" and "sent no token for 3 s" in request["error"]


@pytest.mark.parametrize("mode, says", [("badjson", "a stream line that is not JSON"),
                                        ("badshape", "JSON that is not shaped as an OpenAI stream chunk")])
def test_a_malformed_stream_is_one_sentence_and_keeps_what_came_before(stream_server, store, capsys, mode, says):
    url, _ = stream_server(mode)
    code, err = cli(capsys, "generate", "--endpoint", url, "--prompt", "Hi", "--db", str(store.path))
    assert code == 1 and says in err and "Traceback" not in err and err.count("\n") <= 2
    row = store.run(1)
    assert row["status"] == "interrupted" and row["n_new_tokens"] == len(store.tokens(1)) == 2
    summary = Sweep(SweepConfig(url, [1], 1, 8, load_prompts("summary")), store).run()
    (request,) = served_store.sweep_requests(store, summary["sweep_id"]).to_dict("records")
    assert request["status"] == "interrupted" and says in request["error"]


def test_models_answering_once_then_failing_is_one_sentence(stream_server, store):
    says = r"rejected the request \(HTTP 500\).*while timing the round trip"
    url, _ = stream_server("modelsonce")
    run = served_run(url, store)  # a served run lists the models once; its network is its own request's
    list(run)
    assert run.status == "ok" and store.run(run.run_id)["first_byte_ms"] > 0
    url, _ = stream_server("modelsonce")
    sweep = Sweep(SweepConfig(url, [1], 1, 4, load_prompts("summary")), store)
    with pytest.raises(ServedError, match=says):
        sweep.run()


def test_bad_addresses_timeouts_and_temperatures_are_refused_before_anything_is_sent(capsys, tmp_path):
    db = str(tmp_path / "x.duckdb")
    for url in ("http://[::1", "http://exa mple.org", "http://:80", "http://h:99999"):
        code, err = cli(capsys, "generate", "--endpoint", url, "--prompt", "Hi", "--db", db)
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (url, err)
    url = "http://127.0.0.1:9"
    for flags, says in ((["--timeout", "0"], "stall timeout"), (["--timeout", "-1"], "stall timeout"),
                        (["--timeout", "nan"], "stall timeout"), (["--deadline", "inf"], "deadline"),
                        (["--temperature", "nan"], "temperature"), (["--temperature", "inf"], "temperature")):
        code, err = cli(capsys, "generate", "--endpoint", url, "--prompt", "Hi", *flags, "--db", db)
        assert code == 2 and says in err and "Nothing answers" not in err, (flags, err)
        if flags[0] != "--deadline":
            code, err = cli(capsys, "load", "--endpoint", url, *flags, "--db", str(tmp_path / "load.duckdb"))
            assert code == 2 and says in err and "Nothing answers" not in err, (flags, err)
    assert not (tmp_path / "x.duckdb").exists()  # nothing half-written


def test_serve_vllm_refuses_ports_and_threads_out_of_range(capsys):
    for flags, says in ((["--port", "70000"], "--port"), (["--port", "-1"], "--port"), (["--port", "65536"], "--port"),
                        (["--threads", "0"], "--threads")):
        code, err = cli(capsys, "serve-vllm", *flags)
        assert code == 2 and says in err and err.count("\n") == 1, (flags, err)


def test_a_backend_refuses_what_it_cannot_honour_in_one_sentence_for_the_command_line_and_the_page(capsys, tmp_path):
    from engine.spec import GenerationError

    page_spec = RunSpec(gen=GenConfig("Hi", top_k=5), backend="served", endpoint="http://127.0.0.1:9")
    with pytest.raises(GenerationError) as refused:
        page_spec.check()
    code, err = cli(capsys, "generate", "--endpoint", "http://127.0.0.1:9", "--prompt", "Hi", "--top-k", "5",
                    "--db", str(tmp_path / "x.duckdb"))
    assert code == 2 and err == f"error: {refused.value}\n" and "top-k sampling" in err
    with pytest.raises(GenerationError, match="A local run cannot honour a server address"):
        RunSpec(gen=GenConfig("Hi"), endpoint="http://127.0.0.1:9").check()


def test_served_token_rows_made_by_the_tokenizer_are_marked_and_the_count_is_the_servers(stream_server, store):
    url, _ = stream_server("ok")
    run = served_run(url, store, max_new_tokens=6)
    list(run)
    tokens = store.tokens(run.run_id)
    assert tokens["retokenised"].all() and run.result["token_source"] == "tokenizer"
    assert store.run(run.run_id)["n_new_tokens"] == run.stream_result.usage_completion == 6
    assert run.result["provenance"]["tokens"]["source"] == "server"
    assert json.loads(store.run(run.run_id)["provenance"])["tokens"]["how"].startswith("the server's usage count")


def test_the_client_does_the_librarys_one_time_work_before_a_request_and_sends_nothing_for_it():
    """A new process's first streamed request would import the openai library's completions resources and
    inspect its parameter types on the request's own clock; make_client does that first, without a server."""
    code = ("import sys; from engine.serve import client; before = 'openai.resources.chat' in sys.modules; "
            "client.make_client('http://127.0.0.1:9'); print(before, 'openai.resources.chat' in sys.modules, "
            "'openai.resources.completions' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "True", "True"]  # nothing answers on port 9: nothing was sent there


def openmp_env_of_vllm(**env) -> dict:
    """In a fresh process with `env` for its OpenMP settings: the engine's own and vLLM's server's."""
    script = ("import json, os; from engine import OPENMP_WAIT_VARIABLES as keys; "
              "from engine.serve.vllm import server_env; "
              "print(json.dumps([{k: e[k] for k in keys if k in e} for e in (os.environ, server_env(2))]))")
    base = {k: v for k, v in os.environ.items() if k not in OPENMP_WAIT_VARIABLES
            and not k.startswith("TOKENPATH_OPENMP")}
    out = subprocess.run([sys.executable, "-c", script], env={**base, **env}, capture_output=True, text=True,
                         timeout=300, check=True)
    return dict(zip(("engine", "vllm"), json.loads(out.stdout)))


def test_vllm_runs_with_its_own_openmp_wait_not_the_engines():
    chosen = openmp_env_of_vllm()
    assert len(chosen["engine"]) == 1 and chosen["vllm"] == {}  # spin or sleep, whichever the load chose
    assert openmp_env_of_vllm(OMP_WAIT_POLICY="ACTIVE") == {"engine": {"OMP_WAIT_POLICY": "ACTIVE"},
                                                           "vllm": {"OMP_WAIT_POLICY": "ACTIVE"}}
