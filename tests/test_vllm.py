"""A real vLLM (CPU build, .venv-vllm) serving the default model: started once per test session,
its greedy stream checked token for token against the local engine, a 2-level load sweep, /metrics."""
import os

import httpx2
import pytest

from engine.serve import client as served
from engine.serve import records as served_store
from engine.serve import scrape as server_metrics
from engine.run.generate import Generation, GenConfig
from engine.run.open import open_run
from engine.spec import RunSpec
from engine.serve.load import Sweep, SweepConfig, load_prompts
from engine.serve.client import ServedError
from engine.measure.distances import BUCKETS
from engine.serve.vllm import VLLM_VENV, VLLMServer

pytestmark = [pytest.mark.vllm, pytest.mark.integration]
KEY_ENV = "TOKENPATH_TEST_VLLM_KEY"
PROMPT = "Name three primary colours."
# the first start compiles the model's graphs: minutes on two busy cores
START_TIMEOUT_S = 1500


@pytest.fixture(scope="session")
def vllm_url(tmp_path_factory):
    if not (VLLM_VENV / "bin" / "python").exists():
        pytest.fail(f"vLLM's venv {VLLM_VENV} is missing: run `make vllm` (make test builds it first).")
    os.environ[KEY_ENV] = "tokenpath-test-key"
    # fp32 on the server, as in the local engine, so greedy decoding can agree token for token; without graph
    # compilation (optimization level 0), which costs a minute of two cores at every start and changes no token
    server = VLLMServer(dtype="float32", api_key=os.environ[KEY_ENV], extra_args=["--optimization-level", "0"],
                        log_path=tmp_path_factory.mktemp("vllm") / "server.log")
    try:
        yield server.start(timeout_s=START_TIMEOUT_S)
    finally:
        server.stop()


def test_greedy_stream_equals_the_local_engine(vllm_url, default_lm, calibration, store):
    local = Generation(default_lm, GenConfig(PROMPT, max_new_tokens=24), calibration=calibration, telemetry=False)
    expected = local.run()["token_ids"]
    run = open_run(RunSpec(gen=GenConfig(PROMPT, max_new_tokens=24), backend="served", endpoint=vllm_url,
                           api_key_env=KEY_ENV), store)
    events = list(run)
    result = run.result
    assert result["token_source"] == "server" and result["token_ids"] == expected
    assert sum(len(e.token_ids) for e in events) == result["n_new_tokens"] == len(expected)
    # vLLM's own figures for this one request split the run; the buckets add up to the client's E2E
    assert result["server"]["requests"] == 1 and result["server"]["decode_ms"] > 0
    tokens = store.tokens(run.run_id)
    total = tokens[["physical_ms", "time_ms", "decision_ms", "server_work_ms"]].sum().sum()
    assert total == pytest.approx(result["e2e_ms"])
    provenance = result["provenance"]
    assert provenance["server_work"]["source"] == "server" and provenance["memory"]["source"] == "none"
    assert store.run(run.run_id)["backend"] == "served"


def test_missing_key_and_unknown_model_are_refused(vllm_url):
    with pytest.raises(ServedError, match=r"HTTP 401"):
        served.list_models(vllm_url)
    with pytest.raises(ServedError, match="has no model 'no-such-model'"):
        open_run(RunSpec(gen=GenConfig(PROMPT, max_new_tokens=4), backend="served", endpoint=vllm_url,
                         served_model="no-such-model", api_key_env=KEY_ENV))


def test_metrics_carry_vllms_histograms_and_gauges(vllm_url):
    snapshot = server_metrics.scrape(vllm_url)
    assert server_metrics.is_vllm(snapshot)
    for family in [*server_metrics.VLLM_HISTOGRAMS.values(), *server_metrics.VLLM_GAUGES.values()]:
        assert family in snapshot, family
    text = httpx2.get(f"{vllm_url}/metrics", timeout=30).text
    assert "vllm:time_to_first_token_seconds_bucket" in text
    whole = server_metrics.parse(text)
    for families in (server_metrics.VLLM_GAUGES.values(), server_metrics.VLLM_COUNTERS.values()):
        assert server_metrics.parse(text, families) == {f: whole[f] for f in families if f in whole}


def test_two_level_load_sweep_is_stored(vllm_url, store):
    cfg = SweepConfig(vllm_url, [1, 2], 2, 8, load_prompts("summary"), api_key_env=KEY_ENV, poll_s=0.5)
    summary = Sweep(cfg, store).run()
    assert summary["status"] == "ok" and [lv["completed"] for lv in summary["levels"]] == [2, 2]
    for level in summary["levels"]:
        assert level["server"]["requests"] == 2  # vLLM counted the same requests the client sent
        assert level["ttft_ms"]["p50"] > 0 and level["output_tokens_per_s"] > 0
    requests = served_store.sweep_requests(store, summary["sweep_id"])
    assert len(requests) == 4 and set(requests["status"]) == {"ok"} and set(requests["token_source"]) == {"server"}
    assert not served_store.sweep_samples(store, summary["sweep_id"]).empty
    assert set(BUCKETS) <= {c.removesuffix("_ms") for c in store.tokens(0).columns}
