"""The Serving page through Streamlit's AppTest: bad addresses read as one sentence, a sweep starts
in a subprocess that stores its requests, and a stored sweep draws its table and plots."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from engine.serve import records as served_store
from engine.serve.load import Sweep, SweepConfig, load_prompts
from engine.store.db import Store
from engine.serve.vllm import free_port

from test_served import wait_for_port

SERVER = Path(__file__).with_name("stream_server.py")


@pytest.fixture
def stream_url():
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SERVER), str(port), "ok", "0.02"])
    wait_for_port(port, proc)
    yield f"http://127.0.0.1:{port}"
    proc.kill()
    proc.wait(timeout=30)


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
    assert not at.error
    process = at.session_state["load"]["process"]
    assert process.wait(timeout=600) == 0
    folder = at.session_state["load"]["progress"].parent
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

