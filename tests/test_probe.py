"""The probe's fit: a served engine's step as the planner's device and efficiency. Figures the planner itself makes
from a known setup come back as that setup; a probe through the load tools against a small real server whose
batched step time is known (tests/probe_server.py, on load_server.py) recovers that step; figures the fit cannot
read as physics are refused in one sentence."""
import math
from dataclasses import replace
from pathlib import Path

import pytest

from engine.measure.distances import BUCKETS
from engine.plan import capacity as cap
from engine.plan import planner
from engine.plan import probe
from engine.plan import simulate as sim
from engine.plan.probe import Decode, Figures, Prefill, ProbeError
from engine.serve import probe as served_probe
from engine.store.db import Store

from test_served import ScriptServers

SERVER = Path(__file__).with_name("probe_server.py")
MODEL = planner.resolve_model("default")


def known(bandwidth=20.0, tflops=0.2, fixed_ms=6.0, per_sequence_ms=1.5, decode=1.0, attention=0.04):
    """A setup as the fit builds one, with known physics."""
    memory = 2 * 2**30 + MODEL.params * 2 + planner.RESERVE_BYTES
    peak = tflops * max(decode, 1.0)
    return planner.Setup(model=MODEL, gpu=probe.device("known", bandwidth, peak, memory, attention), weights="bf16",
                         kv_dtype="bf16", efficiency=probe.efficiency(fixed_ms, per_sequence_ms, decode * tflops / peak,
                                                                      tflops / peak))


def figures_of(setup, admission_ms=4.0, cached=0.0, reported=True):
    """What a probe of `setup` would measure, made by the planner's own forward."""
    prefills = tuple(Prefill(p, cached, admission_ms + probe.prefill_forward(setup, Prefill(p, cached, 1.0))["total"])
                     for p in (90.0, 600.0))
    decodes = tuple(Decode(b, 106.0, probe.decode_step(setup, b, 106.0)["total"]) for b in (1, 8))
    return Figures(prefills, decodes, admission_ms if reported else None)


def close(a, b, rel=1e-6):
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-9)


@pytest.mark.parametrize("cached", [0.0, 16.0])
def test_planner_made_figures_fit_back_to_their_setup(cached):
    truth = known()
    fitted = probe.fit(figures_of(truth, cached=cached), MODEL, "bfloat16", bandwidth_gbps=20.0)
    got, want = fitted.summary(), {"bandwidth_gbps": 20.0, "prefill_gflops": 200.0, "decode_gflops": 200.0,
                                   "attention_gflops": 40.0, "step_fixed_ms": 6.0, "per_sequence_ms": 1.5,
                                   "admission_ms": 4.0}
    assert all(close(got[k], v) for k, v in want.items()), got
    assert fitted.notes == ()
    for batch, context in ((3, 40), (32, 700)):  # steps the probe never timed
        assert close(probe.decode_step(fitted.setup, batch, context)["total"],
                     probe.decode_step(truth, batch, context)["total"])


def test_buckets_stay_honest():
    """Weights at the calibrated bandwidth are memory, the products compute, the fixed cost and host work time."""
    fitted = probe.fit(figures_of(known()), MODEL, "bf16", bandwidth_gbps=20.0)
    step = probe.decode_step(fitted.setup, 4, 100)
    assert close(step["memory"], step["_bytes"] / 20.0 / 1e6)
    assert close(step["time"], 6.0 + 4 * 1.5)
    assert close(step["compute"], (step["_flops"] - step["_attention_flops"]) / 0.2e9
                 + step["_attention_flops"] / 0.04e9)
    assert step["physical"] == 0 and step["decision"] == 0


def test_a_step_shorter_than_the_calibrated_read_raises_the_bandwidth_and_leaves_no_fixed_cost():
    truth = known(bandwidth=40.0, fixed_ms=0.0)
    fitted = probe.fit(figures_of(truth), MODEL, "bf16", bandwidth_gbps=20.0)
    s = fitted.summary()
    assert close(s["bandwidth_gbps"], 40.0, 1e-4) and abs(s["step_fixed_ms"]) < 1e-9  # a linear solve's rounding
    assert close(s["per_sequence_ms"], 1.5, 1e-4) and "40.0 GB/s" in fitted.describe()


def test_decode_products_faster_than_the_prefill_s_are_a_rate_not_negative_host_work():
    truth = known(per_sequence_ms=0.0, decode=1.6)
    fitted = probe.fit(figures_of(truth), MODEL, "bf16", bandwidth_gbps=20.0)
    s = fitted.summary()
    assert close(s["decode_gflops"], 320.0) and close(s["prefill_gflops"], 200.0) and s["per_sequence_ms"] == 0.0
    assert any("faster per FLOP" in note for note in fitted.notes)


def test_without_the_server_s_own_times_the_admission_delay_is_taken_as_zero_and_said():
    fitted = probe.fit(figures_of(known(), admission_ms=0.0, reported=False), MODEL, "bf16", bandwidth_gbps=20.0)
    assert close(fitted.summary()["attention_gflops"], 40.0) and fitted.admission_ms == 0.0
    assert any("taken as 0" in note for note in fitted.notes)


def test_attention_no_dearer_than_the_products_falls_back_to_one_rate():
    """A longer prompt that costs less per FLOP than the products' rate allows: one rate for both, the admission
    delay what the prefills leave."""
    truth = known(attention=None)
    f = figures_of(truth, admission_ms=4.0)
    faster = Figures((f.prefills[0], replace(f.prefills[1], ttft_ms=f.prefills[1].ttft_ms - 100.0)), f.decodes, 4.0)
    fitted = probe.fit(faster, MODEL, "bf16", bandwidth_gbps=20.0)
    s = fitted.summary()
    assert close(s["attention_gflops"], s["prefill_gflops"]) and s["prefill_gflops"] > 200.0
    assert any("products' rate" in note for note in fitted.notes)
    first = fitted.admission_ms + probe.prefill_forward(fitted.setup, f.prefills[0])["total"]
    assert close(first, f.prefills[0].ttft_ms)


def test_the_fitted_setup_runs_the_simulation_with_its_admission_delay():
    """At a rate with no queue the first token comes the admission delay and one prefill forward after sending."""
    fitted = probe.fit(figures_of(known(), admission_ms=30.0), MODEL, "bf16", bandwidth_gbps=20.0)
    setup = replace(fitted.setup, prompt_tokens=90, new_tokens=8)
    scheduler = sim.Scheduler(max_num_seqs=128, max_batched_tokens=2048, memory_utilization=1.0,
                              admission_ms=fitted.admission_ms)
    level = cap.at_rate(setup, sim.Workload(requests=4, rate=0.01, prompt_tokens=90, new_tokens=8, seed=1),
                        scheduler, {"ttft_ms": 1e4}, q=50)
    prefill = probe.prefill_forward(setup, Prefill(90, 0, 1.0))["total"]
    assert close(level["ttft_ms_p50"], 30.0 + prefill, 1e-9)
    assert close(level["tpot_ms_p50"], probe.decode_step(setup, 1, 95)["total"], 1e-3)
    assert level["distances_ms_per_token"]["time"] > 0 and set(level["distances_ms_per_token"]) == set(BUCKETS)


def bad(prefills=((90, 100.0), (600, 300.0)), decodes=((1, 40.0), (8, 60.0))):
    return Figures(tuple(Prefill(p, 0, t) for p, t in prefills), tuple(Decode(b, 100, t) for b, t in decodes))


@pytest.mark.parametrize("figures, words", [
    (bad(decodes=((1, 40.0), (8, 40.0))), "no longer than at batch 1"),
    (bad(decodes=((1, 40.0), (8, 35.0))), "no longer than at batch 1"),
    (bad(prefills=((90, 100.0), (600, 90.0))), "no later than"),
    (bad(prefills=((90, 100.0),)), "two different prompt lengths"),
    (bad(prefills=((90, 100.0), (90, 120.0))), "two different prompt lengths"),
    (bad(decodes=((8, 60.0),)), "two different batch sizes"),
    (bad(decodes=((1, 0.0), (8, 60.0))), "not a positive step time"),
    (bad(prefills=((90, float("nan")), (600, 300.0))), "not a positive time"),
    (bad(decodes=((1, 40.0), (8, 40.001))), "not positive"),
])
def test_probes_the_fit_cannot_read_are_one_sentence(figures, words):
    with pytest.raises(ProbeError) as info:
        probe.fit(figures, MODEL, "bf16", bandwidth_gbps=20.0)
    message = str(info.value)
    assert words in message and message.count(". ") == 0 and message.endswith(".")


def test_a_bad_bandwidth_is_one_sentence():
    with pytest.raises(ProbeError, match="positive number of GB/s"):
        probe.fit(figures_of(known()), MODEL, "bf16", bandwidth_gbps=0)


@pytest.fixture
def batched_server():
    """start(fixed_ms, per_sequence_ms, prefill_ms_per_token) -> URL of tests/probe_server.py."""
    servers = ScriptServers(SERVER)
    yield servers.start
    servers.close()


def test_a_probe_of_a_server_with_a_known_step_recovers_it(batched_server, tmp_path):
    """Steps of 40 ms + 10 ms a sequence + 1 ms a prompt word prefilled: the probe's figures are those steps, and
    the fitted setup predicts the step at a batch and the first token at a prompt length the probe never sent.
    The server times its prefills by its own clock (as vLLM's histograms do), so those figures are exact; the
    decode steps are timed by the client, and the tolerance leaves room for a busy machine's late wake-ups."""
    fixed, per_sequence, per_word = 40.0, 10.0, 1.0
    url = batched_server(fixed, per_sequence, per_word)
    cfg = served_probe.ProbeConfig(url, input_tokens=20, long_tokens=220, output_tokens=24, batch=4, repeats=2)
    found = served_probe.measure(cfg, Store(tmp_path / "probe.duckdb"))
    figures = found["figures"]
    short, long = figures.prefills
    one, many = figures.decodes
    assert (short.prompt_tokens, long.prompt_tokens, found["prompt_tokens"]) == (20, 220, 20)  # words, as it counts
    assert short.cached_tokens == long.cached_tokens == 0  # prompts of their own: nothing shared
    assert (one.batch, many.batch) == (1, 4) and figures.admission_ms is not None and figures.admission_ms >= 0
    assert long.ttft_ms - short.ttft_ms == pytest.approx(200 * per_word, rel=0.1)
    assert short.ttft_ms - figures.admission_ms == pytest.approx(fixed + per_sequence + 20 * per_word, rel=0.2)
    assert one.step_ms == pytest.approx(fixed + per_sequence, rel=0.2)
    assert many.step_ms == pytest.approx(fixed + 4 * per_sequence, rel=0.2)
    fitted = probe.fit(figures, MODEL, "bf16", bandwidth_gbps=20.0)
    s = fitted.summary()
    for batch in (2, 8):
        assert probe.decode_step(fitted.setup, batch, 30)["total"] == pytest.approx(fixed + batch * per_sequence,
                                                                                     rel=0.25)
    prefill = probe.prefill_forward(fitted.setup, Prefill(120, 0, 1.0))["total"]
    assert prefill == pytest.approx(fixed + per_sequence + 120 * per_word, rel=0.25)
    assert s["admission_ms"] >= 0


def test_a_probe_that_asks_for_too_little_is_refused_before_sending():
    for kw, words in (({"batch": 1}, "batch"), ({"long_tokens": 32}, "longer"), ({"output_tokens": 2}, "4 output")):
        with pytest.raises(ProbeError, match=words):
            served_probe.ProbeConfig("http://127.0.0.1:9", input_tokens=64, **kw).check()
