"""The continuous-batching simulation against closed forms (M/D/1, Little's law, a batch-B step), its
repeatability, preemption when KV memory runs out, and the sums its five buckets must keep."""
import math
from dataclasses import replace

import numpy as np
import pytest

from engine.measure.distances import BUCKETS
from engine.plan import planner
from engine.plan import simulate as sim
from engine.plan.planner import PlanError
from engine.serve.load import SweepConfig, level_items


def setup(**kw):
    return planner.Setup(model=planner.resolve_model("llama-3.1-8b"), gpu=planner.get_gpu("h100-80gb-sxm"), **kw)


def test_arrivals_keep_the_rate_and_the_gamma_spread():
    t = sim.arrival_times(20000, 4.0, burstiness=0.25, seed=3)
    gaps = np.diff(t)
    assert t[-1] == pytest.approx(20000 / 4.0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(0.25), rel=0.05)  # CV = 1 / sqrt(burstiness)
    assert np.all(sim.arrival_times(5, math.inf) == 0)


@pytest.mark.parametrize("rate", [0, -1.0, float("nan")])
def test_a_rate_that_is_not_positive_is_refused(rate):
    with pytest.raises(PlanError):
        sim.simulate(setup(), sim.Workload(requests=4, rate=rate))


def test_a_fixed_seed_gives_the_same_schedule_and_results_twice():
    w = sim.Workload(requests=60, rate=30.0, burstiness=0.5, prompt_tokens=200, new_tokens=40, length_spread=0.5,
                     seed=7)
    a, b = sim.simulate(setup(), w), sim.simulate(setup(), w)
    assert a == b
    assert sim.simulate(setup(), replace(w, seed=8))["requests"] != a["requests"]


def test_a_simulated_level_replays_the_traffic_of_the_same_level_of_a_load_sweep():
    rates = [0.5, 2.0, 2.0]
    cfg = SweepConfig("http://127.0.0.1:9", rates=rates, requests=12, input_tokens=40, output_tokens=20,
                      length_spread=0.5, burstiness=0.5, seed=5)
    seen = []
    for index, rate in enumerate(rates):
        items = level_items(cfg, {"kind": "rate", "rate": rate, "arrival": "gamma"}, index)
        sent, prompts, outputs = sim.traffic(sim.Workload(requests=12, rate=rate, burstiness=0.5, prompt_tokens=40,
                                                          new_tokens=20, length_spread=0.5, seed=5, level=index))
        assert sent.tolist() == [item.offset_s for item in items]
        assert prompts.tolist() == [item.input_tokens for item in items]
        assert outputs.tolist() == [item.max_tokens for item in items]
        seen.append(sent.tolist())
    assert seen[1] != seen[2]  # each level its own arrivals, even at the same rate


def test_one_request_at_a_time_waits_as_an_md1_queue_says():
    """max_num_seqs 1 and fixed lengths make a single deterministic server: Pollaczek-Khinchine's mean wait
    W = rho x S / (2 (1 - rho)) with rho = rate x S."""
    s, one_at_a_time = setup(), sim.Scheduler(max_num_seqs=1)
    service = sim.simulate(s, sim.Workload(requests=1, prompt_tokens=64, new_tokens=3), one_at_a_time)
    service_s = service["requests"][0]["e2e_ms"] / 1e3
    rate = 0.6 / service_s
    level = sim.simulate(s, sim.Workload(requests=20000, rate=rate, prompt_tokens=64, new_tokens=3, seed=1),
                         one_at_a_time)
    waits = [r["e2e_ms"] / 1e3 - service_s for r in level["requests"]]
    rho = rate * service_s
    assert min(waits) == pytest.approx(0, abs=1e-9)
    assert np.mean(waits) == pytest.approx(rho * service_s / (2 * (1 - rho)), rel=0.05)


def test_littles_law_holds_between_steps_and_requests():
    """The time-averaged batch (counted step by step) = the request rate x the time a request spends in steps."""
    level = sim.simulate(setup(), sim.Workload(requests=300, rate=40.0, prompt_tokens=300, new_tokens=60,
                                               length_spread=0.8, seed=2))
    s = level["summary"]
    in_steps_ms = [r["in_steps_ms"] for r in level["requests"]]
    assert s["mean_batch"] * s["busy_fraction"] == pytest.approx(s["requests_per_s"] * np.mean(in_steps_ms) / 1e3,
                                                                 rel=1e-9)
    assert s["mean_in_system"] > s["mean_batch"] * s["busy_fraction"]  # some time is spent queued


def test_offline_throughput_is_the_batch_over_the_planners_batch_step():
    """Every request waiting at once, short prompts and long outputs: the scheduler settles at its sequence limit
    and the output rate is that batch over the planner's step at batch B (the prefills and the context's growth
    are a small share)."""
    s = setup(prompt_tokens=16, new_tokens=2000)
    level = sim.simulate(s, sim.Workload(requests=64, prompt_tokens=16, new_tokens=2000), sim.Scheduler(max_num_seqs=64))
    step = planner.plan(replace(s, batch=64))["decode_ms_per_token"]
    assert level["summary"]["output_tokens_per_s"] == pytest.approx(64 * 1e3 / step, rel=0.03)
    assert level["summary"]["mean_batch"] == pytest.approx(64, rel=0.02)


def test_a_token_s_buckets_add_up_to_its_end_to_end_time_and_queueing_is_time():
    level = sim.simulate(setup(), sim.Workload(requests=200, rate=math.inf, prompt_tokens=500, new_tokens=50))
    s = level["summary"]
    per_token = np.mean([r["e2e_ms"] / r["output_tokens"] for r in level["requests"]])
    assert sum(s["distances_ms_per_token"].values()) == pytest.approx(per_token)
    for r in level["requests"]:
        assert sum(r["buckets_ms"].values()) == pytest.approx(r["e2e_ms"])
        assert r["buckets_ms"]["time"] >= r["queued_ms"] - 1e-9
    assert max(r["queued_ms"] for r in level["requests"]) > 0  # 200 at once: some wait for the token budget


def test_when_kv_memory_runs_out_requests_are_preempted_and_still_finish_whole():
    s = setup()
    roomy = sim.simulate(s, sim.Workload(requests=40, prompt_tokens=1000, new_tokens=400))
    tight_scheduler = sim.Scheduler(memory_utilization=(16e9 + 1.5 * 2**30 + 5e8) / (80 * 2**30))
    tight = sim.simulate(s, sim.Workload(requests=40, prompt_tokens=1000, new_tokens=400), tight_scheduler)
    assert tight["summary"]["kv_tokens"] < 40 * 1400
    assert tight["summary"]["preemptions"] > 0 and roomy["summary"]["preemptions"] == 0
    assert [r["output_tokens"] for r in tight["requests"]] == [400] * 40
    assert tight["summary"]["output_tokens_per_s"] < roomy["summary"]["output_tokens_per_s"]


def test_whole_prefills_and_chunked_prefills_both_serve_every_request():
    w = sim.Workload(requests=50, rate=20.0, prompt_tokens=3000, new_tokens=30, seed=4)
    chunked = sim.simulate(setup(), w, sim.Scheduler(max_batched_tokens=2048))
    whole = sim.simulate(setup(), w, sim.Scheduler(chunked_prefill=False, max_batched_tokens=4096))
    assert chunked["summary"]["requests"] == whole["summary"]["requests"] == 50
    assert whole["summary"]["itl_ms_p99"] != chunked["summary"]["itl_ms_p99"]


def forward_ms(s, counts, contexts):
    buckets = planner.forward_buckets(s, planner.batch_work(s.model.spec, counts, contexts))
    return sum(buckets[b] for b in BUCKETS)


def test_an_engine_with_separate_prefills_runs_each_prefill_then_the_decodes_one_after_another():
    """Two requests at once, two tokens each: the first step is two prefill forwards of their own (both first
    tokens at its end), the second one decode forward of both; a fused engine prefills both in one forward."""
    s, p = setup(), 100
    work = sim.Workload(requests=2, prompt_tokens=p, new_tokens=2)
    separate = sim.simulate(s, work, sim.Scheduler(max_batched_tokens=2 * p, separate_prefills=True))["requests"]
    fused = sim.simulate(s, work, sim.Scheduler(max_batched_tokens=2 * p))["requests"]
    prefill, decode = forward_ms(s, [p], [0]), forward_ms(s, [1, 1], [p, p])
    assert [r["ttft_ms"] for r in separate] == pytest.approx([2 * prefill] * 2, rel=1e-12)
    assert [r["e2e_ms"] for r in separate] == pytest.approx([2 * prefill + decode] * 2, rel=1e-12)
    assert [r["ttft_ms"] for r in fused] == pytest.approx([forward_ms(s, [p, p], [0, 0])] * 2, rel=1e-12)


def test_a_prompt_whose_chunks_leave_its_last_token_runs_it_in_the_decode_forward_of_separate_prefills():
    """Prompts one token past the budget: a first chunk a forward of its own, then the last token a row of the
    step's decode forward, spending none of the budget, as the local engine runs it."""
    s, p = setup(), 64
    work = sim.Workload(requests=2, rate=1e9, prompt_tokens=p + 1, new_tokens=3)
    first, second = sim.simulate(s, work, sim.Scheduler(max_batched_tokens=p, separate_prefills=True))["requests"]
    chunk, last = forward_ms(s, [p], [0]), forward_ms(s, [1], [p])
    # step 2: the second's first chunk (the whole budget), then the first's last token
    assert first["ttft_ms"] == pytest.approx(chunk + chunk + last, rel=1e-6)
    # step 3: the second's last token beside the first's decode, in one forward
    assert second["ttft_ms"] == pytest.approx(2 * chunk + last + forward_ms(s, [1, 1], [p + 1, p]), rel=1e-6)


def test_separate_prefills_spend_the_token_budget_on_prefill_tokens_only():
    """A request decoding while another arrives: the newcomer's whole prompt (the budget exactly) still prefills in
    the next step, beside the decode, as the local engine's prefill chunk does."""
    s, p = setup(), 64
    work = sim.Workload(requests=2, rate=1e9, prompt_tokens=p, new_tokens=3)
    one_by_one = sim.simulate(s, replace(work, requests=1), sim.Scheduler(max_batched_tokens=p,
                                                                          separate_prefills=True))["requests"][0]
    both = sim.simulate(s, work, sim.Scheduler(max_batched_tokens=p, separate_prefills=True))["requests"]
    assert both[0]["ttft_ms"] == pytest.approx(one_by_one["ttft_ms"], rel=1e-6)
    # the second arrives a nanosecond after the first: it waits for the first's prefill, then prefills whole
    assert both[1]["ttft_ms"] == pytest.approx(2 * forward_ms(s, [p], [0]) + forward_ms(s, [1], [p]), rel=1e-6)
