"""The Serving page through Streamlit's AppTest: bad addresses read as one sentence, a sweep starts
in a subprocess that stores its requests (against a server or this machine's batching engine), a stored
sweep draws its table and plots, gives its HTML report and shows the command that makes it again."""
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from engine.serve import records as served_store
from engine.serve.load import Sweep, SweepConfig, load_prompts
from engine.store.db import Store
from engine.serve.vllm import free_port
from engine import access
from engine.paths import REPO_ROOT
from streamlit.runtime import Runtime

from test_served import wait_for_port
from commands import run_python
from test_load import known_server  # noqa: F401 (the fixture)

SERVER = Path(__file__).with_name("stream_server.py")


def start_stream_server(delay_s: float):
    """The small streaming server on a free port, a chunk every delay_s: (its address, its process)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SERVER), str(port), "ok", str(delay_s)])
    wait_for_port(port, proc)
    return f"http://127.0.0.1:{port}", proc


def served_at(delay_s: float):
    url, proc = start_stream_server(delay_s)
    yield url
    proc.kill()
    proc.wait(timeout=30)


@pytest.fixture
def stream_url():
    yield from served_at(0.02)


@pytest.fixture
def slow_stream_url():
    """A chunk every 50 ms: a request of a dozen tokens takes over half a second."""
    yield from served_at(0.05)


def open_page() -> AppTest:
    at = AppTest.from_file("../app.py", default_timeout=180)
    at.switch_page("pages/serving.py")
    return at.run()


def test_empty_database_and_bad_addresses(page_db):
    at = open_page()
    assert not at.exception and at.title[0].value == "Serving"
    assert any("No load sweep stored yet" in i.value for i in at.info)
    for address, sentence in ((f"http://127.0.0.1:{free_port()}", "Nothing answers at"),
                              ("localhost:8000", "is not a server address")):
        at.text_input[0].set_value(address)
        at.button[0].click()
        at.run()
        assert not at.exception and len(at.error) == 1 and sentence in at.error[0].value


def test_start_runs_the_sweep_in_a_subprocess_and_the_page_draws_it(page_db, stream_url):
    at = open_page()
    at.text_input[0].set_value(stream_url)
    at.text_input[3].set_value("1,2")
    at.number_input[0].set_value(2)
    at.number_input[1].set_value(5)
    at.button[0].click()
    at.run()
    assert not at.error and not at.get("json")  # the levels checked, not written on the page
    job = at.session_state["load"]
    assert job.process.wait(timeout=600) == 0
    folder = job.folder
    at.run()  # the progress panel sees the sweep ended
    assert not folder.exists()  # the sweep's folder in the temp directory went with it
    sweeps = served_store.sweeps(Store(page_db))
    assert list(sweeps["status"]) == ["ok"]
    assert len(served_store.sweep_requests(Store(page_db), sweeps["sweep_id"].iloc[0])) == 4
    at = open_page()
    assert not at.exception
    table = at.dataframe[0].value
    assert list(table["level"]) == ["1 at once", "2 at once"] and list(table["completed"]) == [2, 2]
    # per user against per GPU, the chunk gaps' distribution, ITL by position, timeline, in flight over time
    assert len(at.get("plotly_chart")) == 5
    delivery = next(d.value for d in at.dataframe if "chunks per delivery" in d.value.columns)
    assert list(delivery["level"]) == ["1 at once", "2 at once"] and (delivery["chunks per delivery"] >= 1).all()


def test_two_sweeps_share_the_per_user_per_gpu_curve(page_db, stream_url):
    store = Store(page_db)
    for levels in ([1], [1, 2]):
        Sweep(SweepConfig(stream_url, levels, 2, 4, load_prompts("summary")), store).run()
    at = open_page()
    ids = list(served_store.sweeps(store)["sweep_id"])
    at.multiselect[0].set_value(ids)
    at.run()
    assert not at.exception
    curve = json.loads(at.get("plotly_chart")[0].proto.spec)
    assert len(curve["data"]) == 2  # one line per sweep


def test_the_level_table_shows_no_none_and_the_per_user_axis_starts_at_zero(page_db, stream_url):
    Sweep(SweepConfig(stream_url, [1, 2], 2, 4, load_prompts("summary")), Store(page_db)).run()
    at = open_page()
    assert not at.exception
    table = at.dataframe[0].value
    # a concurrency sweep has no rate, and this server no /metrics: blank cells (the caption says why), never None
    assert set(table["rate"]) == {""} and set(table["server itl mean ms"]) == {""}
    assert not table.isna().any().any() and table["completed"].tolist() == [2, 2]
    assert any("A blank cell has no figure" in c.value for c in at.caption)
    delivery = next(d.value for d in at.dataframe if "chunks per delivery" in d.value.columns)
    assert set(delivery["server inter-token mean (ms)"]) == {"not published"}
    # at a glance: the compared figures, none of the empty ones; every figure behind the toggle
    glance = list(at.dataframe[0].proto.column_order)
    assert {"level", "TTFT p50 / p99", "TPOT p50 / p99", "output tokens/s"} <= set(glance) and "rate" not in glance
    assert table["TTFT p50 / p99"].tolist() == [f"{a:.1f} / {b:.1f}"
                                                for a, b in zip(table["ttft p50 ms"], table["ttft p99 ms"])]
    widget(at.toggle, "Every figure of each level").set_value(True).run()
    every = list(at.dataframe[0].proto.column_order)
    assert not at.exception and {"ttft p50 ms", "ttft p99 ms", "completed", "rate"} <= set(every)
    assert "TTFT p50 / p99" not in every
    curve = json.loads(at.get("plotly_chart")[0].proto.spec)
    assert curve["layout"]["title"]["text"] == "Tokens/s per user against tokens/s per GPU"
    assert curve["layout"]["xaxis"]["rangemode"] == curve["layout"]["yaxis"]["rangemode"] == "tozero"


def test_a_rate_sweep_with_an_slo_draws_latency_and_goodput_against_rate_and_marks_capacity(page_db, tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("load_server.py")), str(port), "1", "0.01"])
    try:
        wait_for_port(port, proc)
        from engine.serve.capacity import search

        cfg = SweepConfig(f"http://127.0.0.1:{port}", rates=[4.0], requests=6, output_tokens=4, input_tokens=5,
                          slo={"e2e_ms": 400.0}, poll_s=0.2)
        summary = search(Sweep(cfg, Store(page_db)), attainment=0.9, start_rate=4.0, steps=1)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    at = open_page()
    assert not at.exception
    table = at.dataframe[0].value
    assert table["rate"].notna().all() and table["attainment"].notna().all()
    charts = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    titles = [c["layout"].get("title", {}).get("text", "") for c in charts]
    assert titles[0] == "Latency percentiles and goodput against request rate"
    if summary["capacity_requests_per_s"]:
        assert any("capacity" in a.get("text", "") for a in charts[0]["layout"].get("annotations", []))
    assert any("capacity:" in s.value for s in at.success)
    samples = [c for c in charts if c["layout"].get("title", {}).get("text", "").startswith("Requests in flight")]
    assert {t["name"] for t in samples[0]["data"]} >= {"in flight (client)", "waiting (server queue)", "KV cache used (%)"}
    delivery = next(d.value for d in at.dataframe if "chunks per delivery" in d.value.columns)
    completed = table[table["completed"] > 0]
    assert list(delivery["level"]) == list(completed["level"]) and all(s.endswith("req/s") for s in delivery["level"])



LOCAL = "this machine (the local batching engine)"


def widget(widgets, label: str):
    return next(w for w in widgets if w.label == label)


def stored_config(db, sweep_id) -> dict:
    config = json.loads(Store(db).query("SELECT config FROM load_sweeps WHERE sweep_id = ?", [int(sweep_id)])
                        ["config"].iloc[0])
    config.pop("rtt_ms")  # measured by each sweep (none for the local engine)
    return config


def test_a_local_sweep_from_the_page_and_the_command_it_shows_make_the_same_sweep(page_db, tiny_folder, monkeypatch):
    monkeypatch.setenv("TOKENPATH_MODEL", str(tiny_folder))
    at = open_page()
    at.radio[0].set_value(LOCAL).run()
    assert not at.exception
    # a server's address, model name and key do not apply to this machine
    assert [t.label for t in at.text_input] == ["Model", "Levels", "Latency target (SLO), optional"]
    at.text_input[1].set_value("40,80")
    at.text_input[2].set_value("e2e_ms=600000")
    assert widget(at.selectbox, "Weight precision").value == "fp32"
    widget(at.selectbox, "Weight precision").set_value("int8-dyn")
    widget(at.number_input, "Max batch").set_value(2)
    widget(at.number_input, "KV-cache budget (MiB, 0 = none)").set_value(64.0)
    widget(at.number_input, "Prefix cache (MiB, 0 = off)").set_value(16.0)
    widget(at.number_input, "Requests per level").set_value(3)
    widget(at.number_input, "New tokens per request").set_value(3)
    widget(at.selectbox, "Prompts").set_value("open chat")
    widget(at.selectbox, "Levels are").set_value("arrivals per second (Poisson)")
    at.button[0].click()
    at.run()
    assert not at.exception and not at.error
    job = at.session_state["load"]
    assert job.process.wait(timeout=600) == 0, job.log.read_text()
    at.run()
    assert not job.folder.exists()
    store = Store(page_db)
    sweep = served_store.sweeps(store).iloc[0]
    assert sweep["status"] == "ok" and sweep["endpoint"] == "local"
    config = stored_config(page_db, sweep["sweep_id"])
    assert (config["rates"], config["requests"], config["max_new_tokens"], config["slo"]) == ([40.0, 80.0], 3, 3,
                                                                                            {"e2e_ms": 600000.0})
    assert (config["local"], config["model"], config["weights"], config["max_batch"], config["kv_budget_mb"],
            config["prefix_cache_mb"]) == (True, str(tiny_folder), "int8-dyn", 2, 64.0, 16.0)
    # every request is a recorded run of the local engine
    assert len(store.query("SELECT run_id FROM runs WHERE tag LIKE 'load:%'")) == 6
    at = open_page()
    assert not at.exception and len(at.dataframe[0].value) == 2
    requests = next(d.value for d in at.dataframe if "TTFT (ms)" in d.value.columns)  # in process: no network parts
    assert "connection" not in requests.columns and "physical (ms)" not in requests.columns
    assert any("in process: no network" in c.value for c in at.caption)
    command = at.code[0].value
    argv = shlex.split(command)
    assert argv[:4] == ["python", "-m", "engine", "load"] and argv[-2:] == ["--db", str(page_db)]
    assert {"--local", "--rate", "--weights", "--max-batch", "--kv-budget-mb", "--prefix-cache-mb", "--slo"} <= set(argv)
    done = run_python(*argv[1:], cwd=REPO_ROOT)  # as `python` runs it, forked by the launcher
    assert done.returncode == 0, done.stderr
    again = served_store.sweeps(store).iloc[0]["sweep_id"]
    assert again != sweep["sweep_id"] and stored_config(page_db, again) == config
    assert len(served_store.sweep_requests(store, again)) == 6


def test_a_shared_dashboard_sweeps_this_machine_with_its_own_models_only(page_db, monkeypatch):
    monkeypatch.setenv(access.TOKEN_ENV, "correct-horse-battery-staple")
    at = AppTest.from_file("../app.py", default_timeout=180)
    at.session_state["_signed_in"] = True
    at.switch_page("pages/serving.py").run()
    assert not at.exception and access.SERVED_REFUSAL in [i.value for i in at.info]
    assert not at.radio and [t.label for t in at.text_input] == ["Model", "Levels", "Latency target (SLO), optional"]
    at.text_input[0].set_value("HuggingFaceTB/SmolLM2-360M-Instruct")
    at.button[0].click()
    at.run()
    assert not at.exception and len(at.error) == 1
    assert at.error[0].value.startswith("This dashboard is shared on the network, so it runs only the project")
    assert "load" not in at.session_state


def store_a_sweep_and_one_that_completed_nothing(db, url: str) -> tuple[int, int]:
    """Two sweeps against the slow server: one whose requests all complete, then one whose every request
    misses a deadline shorter than its stream (its levels complete nothing; the newest, shown first)."""
    store = Store(db)
    done = Sweep(SweepConfig(url, [1], 2, 3, load_prompts("summary")), store).run()
    cut = Sweep(SweepConfig(url, [1, 2], 2, 12, load_prompts("summary"), deadline_s=0.15), store).run()
    assert [lv["completed"] for lv in done["levels"]] == [2] and [lv["completed"] for lv in cut["levels"]] == [0, 0]
    assert cut["status"] == "ok"  # missed deadlines are a measurement, not a broken level
    return done["sweep_id"], cut["sweep_id"]


def test_a_sweep_that_completed_one_request_and_empty_levels(page_db, stream_url):
    """A sweep stopped after its first request is drawn like any other; an empty Levels box is one sentence."""
    Sweep(SweepConfig(stream_url, [1], 1, 3, load_prompts("summary")), Store(page_db)).run()
    at = open_page()
    assert not at.exception
    delivery = next(d.value for d in at.dataframe if "chunks per delivery" in d.value.columns)
    assert list(delivery["level"]) == ["1 at once"]
    at.text_input[0].set_value(stream_url)
    at.text_input[3].set_value(" ")
    at.button[0].click()
    at.run()
    assert not at.exception and "load" not in at.session_state
    assert len(at.error) == 1 and "at least one concurrency level" in at.error[0].value


def test_a_sweep_whose_level_completed_nothing_offers_its_report_without_an_exception(page_db, slow_stream_url):
    sweeps = store_a_sweep_and_one_that_completed_nothing(page_db, slow_stream_url)
    for sweep_id in sweeps:
        at = open_page()
        at.multiselect[0].set_value([sweep_id]).run()
        assert not at.exception
        report = widget(at.get("download_button"), "Download report")
        assert f"report --load-sweep {sweep_id}" in report.help
    assert any("did not complete" in w.value for w in at.warning)


def test_a_shared_prefix_sweep_from_the_page_shows_its_cache_hits_and_each_request_s_network(page_db, known_server):  # noqa: F811
    url = known_server(slots=1, step_s=0.005)
    at = open_page()
    prefix = widget(at.number_input, "Shared prefix (tokens, 0 = none)")
    assert prefix.value == 0  # no shared preamble unless asked
    at.text_input[0].set_value(url)
    at.text_input[3].set_value("1")
    widget(at.number_input, "Requests per level").set_value(3)
    widget(at.number_input, "New tokens per request").set_value(2)
    prefix.set_value(40.5)  # a fraction is read as a whole number, and the page says so
    at.button[0].click()
    at.run()
    assert not at.exception and not at.error
    assert any("takes whole numbers: 40.5 is read as 40" in w.value for w in at.warning)
    job = at.session_state["load"]
    assert job.process.args[job.process.args.index("--shared-prefix-tokens") + 1] == "40"
    assert job.process.wait(timeout=600) == 0, job.log.read_text()
    at = open_page()
    assert not at.exception
    levels = at.dataframe[0].value
    # the later requests find the shared preamble's whole blocks in the server's prefix cache
    assert levels["prefix cache hit rate"].iloc[0] > 0 and levels["physical p50 ms"].iloc[0] > 0
    assert levels["connections reused"].iloc[0] >= 0
    requests = next(d.value for d in at.dataframe if "connection" in d.value.columns)
    assert list(requests.columns) == ["level", "request", "status", "connection", "TTFT (ms)", "E2E (ms)",
                                      "physical (ms)"]
    assert len(requests) == 3 and set(requests["connection"]) <= {"new", "reused"}
    widget(at.toggle, "All columns").set_value(True).run()
    assert not at.exception
    requests = next(d.value for d in at.dataframe if "connection" in d.value.columns)
    parts = ["connect (ms)", "TLS (ms)", "request sent (ms)", "first byte (ms)"]
    assert {"name lookup (ms)", *parts, "output tokens"} <= set(requests.columns)
    assert (requests["physical (ms)"] - requests[parts].sum(axis=1)).abs().max() < 1e-6


def test_a_bad_shared_prefix_on_the_page_is_one_sentence_and_starts_nothing(page_db):
    at = open_page()
    widget(at.number_input, "Shared prefix (tokens, 0 = none)").set_value(24)
    at.text_input[3].set_value("0,x")  # bad levels beside the prefix: refused before anything starts
    at.button[0].click()
    at.run()
    assert not at.exception and len(at.error) == 1 and "load" not in at.session_state
