"""The real default model: exact greedy decoding, the command line, attribution that responds."""
import json
import os
import statistics

import pytest
import torch

from engine.measure.accounting import cache_nbytes, model_shape
from engine.paths import EVAL_TEXT, text_digest
from engine.run import quality
from engine.run.generate import Generation, GenConfig
from engine.run.text import prompt_ids
from engine.measure.distances import BUCKETS
from commands import run_engine

pytestmark = pytest.mark.integration
PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "List three colours of the rainbow.",
]


def run(lm, calibration, prompt, store=None, **kw):
    gen = Generation(lm, GenConfig(prompt, **kw), store=store, calibration=calibration, telemetry=False)
    gen.run()
    return gen


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_is_identical_with_and_without_cache_and_to_transformers_generate(default_lm, hf_lm, calibration,
                                                                                prompt):
    on = run(default_lm, calibration, prompt, max_new_tokens=24).token_ids
    off = run(default_lm, calibration, prompt, max_new_tokens=24, kv_cache=False).token_ids
    ids = torch.tensor([prompt_ids(default_lm, prompt, raw=False)])
    hf = hf_lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                              do_sample=False)[0, ids.shape[1]:].tolist()
    assert on == off == hf


def test_stop_string_ends_the_text_before_it(default_lm, calibration):
    full = run(default_lm, calibration, PROMPTS[2], max_new_tokens=40).text
    stop = full.split()[2]
    gen = run(default_lm, calibration, PROMPTS[2], max_new_tokens=40, stop=[stop])
    assert gen.stop_reason == "stop_string"
    assert stop not in gen.text and full.startswith(gen.text)


def test_buckets_sum_to_each_steps_wall_time_and_physical_is_near_zero(default_lm, calibration, store):
    gen = run(default_lm, calibration, PROMPTS[1], store=store, max_new_tokens=20)
    for step in gen.steps:
        total = sum(step[f"{b}_ms"] for b in BUCKETS)
        assert total == pytest.approx(step["wall_ms"], rel=0.01)
        assert all(step[f"{b}_ms"] >= 0 for b in BUCKETS)
    # on the CPU nothing crosses a link: the upload and sync phases are a few microseconds, unless the OS
    # happens to preempt the process inside one, which a busy machine does to a step now and then
    assert statistics.median(step["physical_ms"] / step["wall_ms"] for step in gen.steps) < 0.02
    stored = store.tokens(gen.run_id)
    assert sum(stored[f"{b}_ms"].sum() for b in BUCKETS) == pytest.approx(gen.result["total_ms"], rel=0.01)
    run_row = store.run(gen.run_id)
    assert run_row["memory_ms"] == pytest.approx(stored["memory_ms"].sum(), rel=1e-6)


def test_kv_accounting_equals_the_real_cache_at_several_lengths(default_lm, calibration):
    shape = model_shape(default_lm.model)
    for prompt, new in [("Hi", 1), (PROMPTS[0], 9), (PROMPTS[1] * 6, 17)]:
        gen = run(default_lm, calibration, prompt, max_new_tokens=new)
        context = len(gen.prompt_ids) + len(gen.token_ids) - 1
        assert cache_nbytes(gen.cache) == shape.kv_bytes_per_token * context == 46080 * context


def decode_steps(gen):
    return [s for s in gen.steps if s["kind"] == "decode"]


def test_without_cache_the_decision_share_grows_with_context(default_lm, calibration):
    short = run(default_lm, calibration, "Say hello.", max_new_tokens=6, kv_cache=False)
    long = run(default_lm, calibration, "Say hello. " + "The quick brown fox jumps over the lazy dog. " * 30,
               max_new_tokens=6, kv_cache=False)
    share = lambda g: sum(s["decision_ms"] for s in decode_steps(g)) / sum(s["wall_ms"] for s in decode_steps(g))  # noqa: E731
    assert share(long) > share(short) > 0
    cached = run(default_lm, calibration, "Say hello.", max_new_tokens=6)
    assert sum(s["decision_ms"] for s in cached.steps) == 0


def test_memory_per_token_grows_with_context(default_lm, calibration):
    """The bytes a decode step moves, and their time at the calibrated bandwidth, grow with the cache it reads
    (the memory bucket itself is that time capped by the measured forward, so it is compared uncapped)."""
    short = run(default_lm, calibration, "Say hello.", max_new_tokens=8)
    long = run(default_lm, calibration, "Say hello. " + "The quick brown fox jumps over the lazy dog. " * 60,
               max_new_tokens=8)
    mean = lambda g, key: sum(s[key] for s in decode_steps(g)) / len(decode_steps(g))  # noqa: E731
    assert mean(long, "kv_read_bytes") > mean(short, "kv_read_bytes")
    assert mean(long, "memory_est_ms") > mean(short, "memory_est_ms")


def cli(*args, db):
    return run_engine(*args, env=dict(os.environ, TOKENPATH_DB=str(db)), timeout=300)


def test_cli_generate_json_and_runs(tmp_path):
    db = tmp_path / "cli.duckdb"
    out = cli("generate", "--prompt", "Name a fruit.", "--max-new-tokens", "8", "--json", "--tokens", db=db)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    for key in ("run_id", "text", "token_ids", "n_prompt_tokens", "n_new_tokens", "ttft_ms", "tpot_ms",
                "tokens_per_s", "status", "distances_ms"):
        assert key in result
    assert set(result["distances_ms"]) == set(BUCKETS)
    assert len(result["tokens"]) == result["n_new_tokens"]
    runs = cli("runs", "--json", db=db)
    assert json.loads(runs.stdout)[0]["run_id"] == result["run_id"]


@pytest.mark.parametrize("args, words", [
    (["--prompt", ""], "empty"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens"),
    (["--prompt", "hi", "--model", "./no/such/folder"], "No model folder"),
    (["--prompt", "hi " * 5000, "--max-new-tokens", "4000"], "context"),
])
def test_cli_bad_input_exits_2_with_one_sentence(tmp_path, args, words):
    out = cli("generate", *args, db=tmp_path / "cli.duckdb")
    assert out.returncode == 2
    assert words in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_cli_refuses_an_unreadable_database(tmp_path):
    bad = tmp_path / "bad.duckdb"
    bad.write_text("hello")
    out = cli("runs", db=bad)
    assert out.returncode == 2 and "not a readable DuckDB database" in out.stderr
    assert bad.read_text() == "hello"


def test_int8_moves_fewer_bytes_per_token_than_fp32(default_lm, calibration):
    from engine.switches.quant import variant

    prompt = "Describe a quiet harbour at dawn."
    fp32 = run(default_lm, calibration, prompt, max_new_tokens=8, ignore_eos=True)
    int8 = run(variant(default_lm, "int8-wo"), calibration, prompt, max_new_tokens=8, ignore_eos=True)
    mean = lambda g, key: sum(s[key] for s in decode_steps(g)) / len(decode_steps(g))  # noqa: E731
    assert mean(int8, "weight_bytes") < mean(fp32, "weight_bytes") / 3
    assert mean(int8, "memory_est_ms") < mean(fp32, "memory_est_ms")  # the bucket is capped by the measured forward


def test_cli_quality_json_is_recorded(tmp_path):
    # the shipped text's first 3,000 characters: two windows (the second cut short), a third of the whole's cost
    text = tmp_path / "eval-part.txt"
    text.write_text(EVAL_TEXT.read_text()[:3000])
    out = cli("quality", "--weights", "int4-wo", "--text", str(text), "--json", db=tmp_path / "q.duckdb")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["variant"] == "int4-wo g32" and quality.WINDOW < result["n_tokens"] < 2 * quality.WINDOW
    assert result["eval_text_sha"] == text_digest(text) != text_digest()
    assert 0 < result["kl_mean"] < 0.05 and result["top1_agreement"] > 0.9
    from engine.store.db import Store

    stored = Store(tmp_path / "q.duckdb").query("SELECT variant, perplexity FROM quality")
    assert list(stored["variant"]) == ["int4-wo g32"]
