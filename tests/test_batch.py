"""Batching: sequences decoded together give each one the tokens it gets alone, join and leave between
steps, wait for the KV budget or are preempted and recomputed when it runs out, and are each a recorded run
whose buckets sum to its own time."""
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from engine.errors import UserError
from engine.model.cpu_kernels import optional_kernel
from engine.model.lean import CACHE_ROOM, cache_layer_kinds, new_cache, room_for
from engine.model.loader import tiny_model
from engine.run.batch import BatchEngine, BatchError
from engine.run.generate import Generation
from engine.run.local import LocalEngine
from engine.spec import GenConfig
from engine.store import journal
from engine.store.db import Store
from engine.switches.quant import quantize
from commands import run_engine, start_engine

PROMPTS = ["Count the stars", "Name three rivers in Europe and say which is longest",
           "Hi", "Write a haiku about a kettle that sings in the morning before anyone wakes"]
EXACT_LEVELS = ["fp32", "int8-wo", "int8-dyn", "int4-dyn"]


def greedy(prompt: str, tokens: int = 12, **settings) -> GenConfig:
    return GenConfig(prompt=prompt, max_new_tokens=tokens, ignore_eos=True, **settings)


def sampled(prompt: str, tokens: int, seed: int) -> GenConfig:
    """A request that samples with its own seed: the tiny random model's greedy text repeats one token, its
    samples differ from request to request, so each sequence's text is its own."""
    return greedy(prompt, tokens, temperature=1.0, seed=seed)


def alone(lm, cfg: GenConfig, calibration) -> list[int]:
    return Generation(lm, cfg, calibration=calibration, telemetry=False).run()["token_ids"]


def batched(lm, cfgs: list[GenConfig], calibration, **engine_settings) -> list:
    engine = BatchEngine(lm, max_batch=len(cfgs), calibration=calibration, **engine_settings)
    seqs = [engine.submit(cfg) for cfg in cfgs]
    engine.run()
    return seqs


@pytest.fixture(scope="module")
def levels(tiny_lm):
    return {name: tiny_lm if name == "fp32" else quantize(tiny_lm, name) for name in EXACT_LEVELS + ["int4-wo"]}


@torch.inference_mode()
def _lockstep_logits(lm, prompts: list[str], steps: int, kv_dtype=None) -> tuple[float, int | None]:
    """Teacher-forced: each sequence's logits from one batched forward per step against its own forward alone.
    (largest difference, first step where a greedy token differs or None)."""
    ids = [lm.tokenizer(p)["input_ids"] for p in prompts]
    pairs = [(DynamicCache(config=lm.config), DynamicCache(config=lm.config)) for _ in prompts]
    last = []
    for seq, (a, b) in zip(ids, pairs):
        for cache in (a, b):
            out = lm.model(input_ids=torch.tensor([seq]), cache=cache, use_cache=True, kv_dtype=kv_dtype)
        last.append(int(out.logits[0, -1].argmax()))
    worst, diverged = 0.0, None
    for step in range(steps):
        positions = [len(seq) + step for seq in ids]
        together = lm.model.decode_batch(last, positions, [a for a, _ in pairs], kv_dtype).logits
        for i, (_, b) in enumerate(pairs):
            own = lm.model(input_ids=torch.tensor([[last[i]]]), cache=b, use_cache=True, kv_dtype=kv_dtype).logits[0, -1]
            worst = max(worst, float((together[i] - own).abs().max()))
            if diverged is None and int(together[i].argmax()) != int(own.argmax()):
                diverged = step
        last = [int(row.argmax()) for row in together]
    return worst, diverged


@pytest.mark.parametrize("level", EXACT_LEVELS)
def test_every_sequence_in_a_batch_gets_the_logits_it_gets_alone_to_the_bit(levels, level, calibration):
    """The kernels' rows do not depend on the rows beside them: each sequence's logits in a batch of ragged
    lengths equal its own forward's, step after step, and the engine emits the tokens a run alone emits."""
    if optional_kernel() is None:
        pytest.skip("the C++ extension cannot be built here")
    worst, diverged = _lockstep_logits(levels[level], PROMPTS, 6)
    assert worst == 0.0, f"logits differ by up to {worst:g}; greedy tokens first differ at step {diverged}"
    cfgs = [sampled(p, 10 + 3 * i, i) for i, p in enumerate(PROMPTS)]  # ragged: they leave at different steps
    seqs = batched(levels[level], cfgs, calibration)
    for cfg, seq in zip(cfgs, seqs):
        assert seq.status == "ok" and seq.token_ids == alone(levels[level], cfg, calibration), cfg.prompt
    assert max(s["batch"] for seq in seqs for s in seq.steps) == len(PROMPTS)


@pytest.mark.parametrize("level,kv_dtype", [("fp32", torch.bfloat16), ("int8-dyn", torch.float16),
                                            ("int4-dyn", torch.bfloat16)])
def test_a_half_precision_cache_gives_every_sequence_in_a_batch_its_own_logits_to_the_bit(levels, level, kv_dtype,
                                                                                         calibration):
    """The kernels keep the cache in half precision and attend over it in float32, in a batch as alone."""
    if optional_kernel() is None:
        pytest.skip("the C++ extension cannot be built here")
    worst, diverged = _lockstep_logits(levels[level], PROMPTS, 6, kv_dtype)
    assert worst == 0.0, f"logits differ by up to {worst:g}; greedy tokens first differ at step {diverged}"
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[kv_dtype]
    cfgs = [replace(sampled(p, 10 + 3 * i, i), kv_dtype=name) for i, p in enumerate(PROMPTS)]
    for cfg, seq in zip(cfgs, batched(levels[level], cfgs, calibration, kv_dtype=name)):
        assert seq.status == "ok" and seq.token_ids == alone(levels[level], cfg, calibration), cfg.prompt


def test_where_the_summation_order_differs_batched_logits_stay_within_a_tolerance(levels):
    """PyTorch's int4 kernel (int4-wo) takes rows in blocks whose sums may depend on the batch: logits within 1e-2
    of the sequence's own, and the first step whose greedy token differs is reported."""
    worst, diverged = _lockstep_logits(levels["int4-wo"], PROMPTS, 8)
    assert worst < 1e-2, f"logits differ by up to {worst:g}; greedy tokens first differ at step {diverged}"


def test_the_default_model_decodes_the_same_tokens_in_a_batch_as_alone(default_lm, calibration):
    """Exact where the arithmetic is the same: every prompt prefilled whole, as alone (a prompt split into
    chunks attends in other shapes: see the next test)."""
    if optional_kernel() is None:
        pytest.skip("the C++ extension cannot be built here")
    # int8-dyn's products take AMX tiles for several rows where the CPU has them, its one row the vector path
    int8 = quantize(default_lm, "int8-dyn")
    for lm, kv in ((default_lm, "auto"), (quantize(default_lm, "int4-dyn"), "auto"), (int8, "auto"), (int8, "bf16")):
        worst, diverged = _lockstep_logits(lm, PROMPTS, 4, None if kv == "auto" else torch.bfloat16)
        assert worst == 0.0, f"{lm.weights}, {kv}: logits differ by up to {worst:g}, tokens first at step {diverged}"
        cfgs = [greedy(p, tokens=16, kv_dtype=kv) for p in PROMPTS]
        # all four prompts at once
        for cfg, seq in zip(cfgs, batched(lm, cfgs, calibration, prefill_chunk=4096, kv_dtype=kv)):
            assert seq.token_ids == alone(lm, cfg, calibration), (lm.weights, kv, cfg.prompt)


@torch.inference_mode()
def test_a_prompt_prefilled_in_chunks_gets_the_logits_of_one_prefill_within_float_rounding(default_lm):
    """A chunk attends to the cache in other shapes than one whole prefill, so its sums round in another
    order: fp32 logits agree to 1e-3 (int8 activations can turn such rounding into a different token)."""
    ids = default_lm.tokenizer(PROMPTS[1])["input_ids"]
    whole = default_lm.model(input_ids=torch.tensor([ids]), cache=DynamicCache(config=default_lm.config),
                             use_cache=True).logits[0, -1]
    for split in (1, len(ids) // 2, len(ids) - 1):
        cache = DynamicCache(config=default_lm.config)
        default_lm.model(input_ids=torch.tensor([ids[:split]]), cache=cache, use_cache=True)
        part = default_lm.model(input_ids=torch.tensor([ids[split:]]), cache=cache, use_cache=True).logits[0, -1]
        torch.testing.assert_close(part, whole, rtol=0, atol=1e-3, msg=f"split at {split}")
        assert int(part.argmax()) == int(whole.argmax())


def test_sequences_join_and_leave_between_steps_and_keep_their_own_tokens(tiny_lm, calibration):
    engine = BatchEngine(tiny_lm, max_batch=3, calibration=calibration)
    first = [engine.submit(sampled(p, n, seed)) for seed, (p, n) in enumerate(zip(PROMPTS[:2], (4, 14)))]
    for _ in range(6):
        engine.step()
    assert first[0].status == "ok" and first[1].status == "decode"  # one left, one still running
    later = [engine.submit(sampled(p, 9, 10 + seed)) for seed, p in enumerate(PROMPTS[2:])]
    engine.run()
    for seq in first + later:
        assert seq.token_ids == alone(tiny_lm, seq.cfg, calibration)
    assert {1, 2, 3} <= set(engine.batch_sizes)


def test_a_cancelled_sequence_frees_its_slot_and_its_cache(tiny_lm, calibration, store):
    engine = BatchEngine(tiny_lm, store, max_batch=1, calibration=calibration)
    running, waiting = engine.submit(sampled(PROMPTS[0], 50, 1)), engine.submit(sampled(PROMPTS[1], 5, 2))
    for _ in range(4):
        engine.step()
    assert waiting.status == "queued" and running.cache is not None
    running.cancel()
    engine.step()
    assert running.status == "cancelled" and running.cache is None and engine.running == [waiting]
    engine.run()
    assert waiting.status == "ok" and waiting.token_ids == alone(tiny_lm, waiting.cfg, calibration)
    runs = store.runs(10).set_index("run_id")
    assert runs.loc[running.run_id, "status"] == "cancelled"
    assert runs.loc[running.run_id, "n_new_tokens"] == len(running.token_ids) >= 3


def real_kv_bytes(seq) -> int:
    """The bytes the tensors of a sequence's cache really occupy: their storages, the room they keep included."""
    if seq.cache is None:
        return 0
    return sum(layer.keys.untyped_storage().nbytes() + layer.values.untyped_storage().nbytes()
               for layer in seq.cache.layers if layer.is_initialized)


def stepped_within_budget(engine) -> None:
    """Run the engine to the end and write its runs, checking after every step that its count of KV bytes is what
    each cache's tensors occupy once decoded (a prefill's tensors, its positions and at most the room a decode grows
    them into, take no more than the count reserves) and never above the budget."""
    per_position = engine.shape.kv_bytes_per_token
    while engine.step():
        assert engine.reserved_bytes <= engine.kv_budget_bytes
        for seq in engine.running:
            real, held = real_kv_bytes(seq), seq.held * per_position
            if seq.phase == "decode":
                assert real in (held, seq.past * per_position) and real <= held, (seq.past, seq.held, real)
            else:
                assert real in (seq.filled * per_position, room_for(seq.filled) * per_position) and real <= held
    assert not engine.running and not engine.queued
    engine.write()


def test_an_exhausted_kv_budget_queues_arrivals_instead_of_failing_them(tiny_lm, calibration):
    per_position = BatchEngine(tiny_lm, calibration=calibration).shape.kv_bytes_per_token
    cfgs = [sampled(p, 6, seed) for seed, p in enumerate(PROMPTS)]
    engine = BatchEngine(tiny_lm, max_batch=4, calibration=calibration, kv_budget_bytes=per_position * 300)
    seqs = [engine.submit(cfg) for cfg in cfgs]
    engine.step()  # each is reserved the 128 positions of room its first decode grows its cache to: two fit
    assert engine.reserved_bytes == 2 * CACHE_ROOM * per_position and engine.running == seqs[:2]
    assert engine.queued == [seqs[2], seqs[3]]
    engine.run()
    assert all(s.status == "ok" and s.token_ids == alone(tiny_lm, s.cfg, calibration) for s in seqs)
    assert max(engine.batch_sizes) < 4 and engine.preemptions == 0
    with pytest.raises(BatchError, match="smaller than one sequence needs"):
        engine.check(greedy(PROMPTS[1], tokens=300))  # room for 384 positions at its full length


def test_a_budget_that_runs_out_mid_decode_preempts_the_newest_which_recomputes_its_own_tokens(
        tiny_lm, calibration, store):
    """Four sequences that outgrow a budget of three caches' room: the newest-admitted ones are preempted, wait,
    and are recomputed; each ends with the tokens it gets alone, its preemptions and recompute steps in its run,
    the waiting in its time distance, its buckets summing to its time, the budget never exceeded."""
    per_position = BatchEngine(tiny_lm, calibration=calibration).shape.kv_bytes_per_token
    engine = BatchEngine(tiny_lm, store, max_batch=4, calibration=calibration,
                         kv_budget_bytes=3 * CACHE_ROOM * per_position)
    seqs = [engine.submit(greedy(p, tokens=150 + 10 * i)) for i, p in enumerate(PROMPTS)]
    stepped_within_budget(engine)
    assert engine.preemptions == sum(s.preemptions for s in seqs) >= 2 and seqs[0].preemptions == 0
    for seq in seqs:
        assert seq.status == "ok" and seq.token_ids == alone(tiny_lm, seq.cfg, calibration), seq.cfg.prompt
        run = store.runs(10).set_index("run_id").loc[seq.run_id]
        steps = store.steps(seq.run_id).to_dict("records")
        recomputes = [s for s in steps if s["kind"] == "recompute"]
        assert len(recomputes) == seq.preemptions == seq.result["preemptions"]
        for step in recomputes:  # the prompt and every token so far, prefilled again; the wait before it is time
            assert step["n_input"] == step["context_len"] > len(seq.prompt_ids) and step["n_emitted"] == 1
            assert step["time_ms"] >= step["host_ms"] > 0
        if seq.preemptions:
            assert seq.result["preempted_ms"] > 0 and sum(s["time_ms"] for s in recomputes) >= seq.result["preempted_ms"]
        tokens = store.tokens(seq.run_id)
        assert list(tokens["token_id"]) == seq.token_ids
        buckets = sum(tokens[f"{b}_ms"].sum() for b in ("physical", "memory", "compute", "time", "decision"))
        assert buckets == pytest.approx(tokens["t_ms"].iloc[-1], rel=1e-9)
        assert run["total_ms"] == pytest.approx(tokens["t_ms"].iloc[-1])


def test_the_default_model_decodes_a_preempted_sequence_as_it_does_alone(default_lm, calibration):
    """Two prompts of about 110 tokens (in the chat template) outgrow their first cache room within a few dozen new
    tokens, where the budget holds two and a half: the newer is preempted, recomputed, and decodes as it does alone."""
    per_position = BatchEngine(default_lm, calibration=calibration).shape.kv_bytes_per_token
    engine = BatchEngine(default_lm, max_batch=2, calibration=calibration,
                         kv_budget_bytes=(2 * CACHE_ROOM + CACHE_ROOM // 2) * per_position)
    preamble = f"{PROMPTS[3]} " * 5
    seqs = [engine.submit(greedy(preamble + p, tokens=32)) for p in PROMPTS[1:3]]
    assert all(len(s.prompt_ids) < CACHE_ROOM < len(s.prompt_ids) + 32 for s in seqs)
    stepped_within_budget(engine)
    assert seqs[1].preemptions >= 1 and seqs[0].preemptions == 0
    for seq in seqs:
        assert seq.status == "ok" and seq.token_ids == alone(default_lm, seq.cfg, calibration), seq.cfg.prompt


@pytest.mark.slow  # thousands of tokens, draws or requests: long even on a quiet machine
def test_a_hundred_requests_against_a_cap_of_eight_finish_with_their_own_text_and_runs(tiny_lm, calibration, store):
    engine = BatchEngine(tiny_lm, store, max_batch=8, calibration=calibration)
    seqs = [engine.submit(sampled(f"{PROMPTS[i % 4]} {i}", 3 + i % 5, i)) for i in range(100)]
    engine.run()
    assert max(engine.batch_sizes) == 8 and len({s.text for s in seqs}) > 90
    _finished_with_their_own_text_and_runs(tiny_lm, seqs, store, calibration)


@pytest.mark.slow  # thousands of tokens, draws or requests: long even on a quiet machine
def test_a_hundred_requests_against_a_cap_of_eight_and_a_tight_budget_are_preempted_and_all_finish(
        tiny_lm, calibration, store):
    """Room for twelve caches of 128 positions among eight slots: when more than four sequences outgrow their
    first 128 at once, the newest are preempted and recomputed; the budget holds at every step, and every request
    ends with its own text and run."""
    per_position = BatchEngine(tiny_lm, calibration=calibration).shape.kv_bytes_per_token
    engine = BatchEngine(tiny_lm, store, max_batch=8, calibration=calibration, prefill_chunk=8 * CACHE_ROOM,
                         kv_budget_bytes=12 * CACHE_ROOM * per_position)
    preamble = f"{PROMPTS[3]} " * 6  # 123 to 137 tokens in the chat template: a few new ones pass 128 positions
    seqs = [engine.submit(sampled(f"{preamble}{PROMPTS[i % 4]} {i}", 6 + i % 15, i)) for i in range(100)]
    stepped_within_budget(engine)
    assert max(engine.batch_sizes) == 8 and engine.preemptions > 0 and len({s.text for s in seqs}) == 100
    _finished_with_their_own_text_and_runs(tiny_lm, seqs, store, calibration)


def _finished_with_their_own_text_and_runs(lm, seqs, store, calibration) -> None:
    runs = store.runs(200).set_index("run_id")
    assert len(runs) == len(seqs)
    for seq in seqs:
        assert seq.status == "ok" and seq.token_ids == alone(lm, seq.cfg, calibration)
        run = runs.loc[seq.run_id]
        assert run["status"] == "ok" and run["output"] == seq.text and run["prompt"] == seq.cfg.prompt
        assert list(store.tokens(seq.run_id)["token_id"]) == seq.token_ids


def test_each_token_carries_its_share_of_the_weights_and_the_buckets_sum_to_each_sequences_time(
        tiny_lm, calibration, store):
    one = batched(tiny_lm, [greedy(PROMPTS[0], tokens=8)], calibration)[0]
    solo = {s["context_len"]: s for s in one.steps if s["kind"] == "decode"}
    engine = BatchEngine(tiny_lm, store, max_batch=4, calibration=calibration)
    seqs = [engine.submit(greedy(PROMPTS[0], tokens=8)) for _ in range(4)]
    engine.run()
    assert 4 in engine.batch_sizes
    for seq in seqs:
        steps = store.steps(seq.run_id).to_dict("records")
        assert steps[0]["kind"] == "prefill" and steps[0]["batch"] == 1
        for step in steps[1:]:
            own = solo[step["context_len"]]
            assert step["weight_bytes"] == own["weight_bytes"] // step["batch"]
            assert step["compute_est_ms"] == pytest.approx(own["compute_est_ms"])
            if step["batch"] > 1:
                assert step["memory_est_ms"] < own["memory_est_ms"]
        tokens = store.tokens(seq.run_id)
        buckets = sum(tokens[f"{b}_ms"].sum() for b in ("physical", "memory", "compute", "time", "decision"))
        assert buckets == pytest.approx(tokens["t_ms"].iloc[-1], rel=1e-9)


def test_prompts_prefilled_in_one_forward_share_its_weights_and_their_buckets_sum_to_their_time(
        levels, calibration, store):
    """int4-dyn's products take a row at a time, so the prompts a step admits are prefilled in one forward: each
    prefill row names the sequences in it and carries its share of the weights."""
    if optional_kernel() is None:
        pytest.skip("the C++ extension cannot be built here")
    assert [name for name, lm in levels.items() if lm.model.prefills_side_by_side()] == ["int8-dyn", "int4-dyn"]
    lm = levels["int4-dyn"]
    one = batched(lm, [greedy(PROMPTS[0], tokens=4)], calibration)[0].steps[0]
    engine = BatchEngine(lm, store, max_batch=4, calibration=calibration)
    seqs = [engine.submit(greedy(PROMPTS[0], tokens=4)) for _ in range(3)]
    engine.run()
    for seq in seqs:
        first = store.steps(seq.run_id).to_dict("records")[0]
        assert first["kind"] == "prefill" and first["batch"] == 3
        assert first["weight_bytes"] == one["weight_bytes"] // 3 and first["flops"] == one["flops"]
        tokens = store.tokens(seq.run_id)
        buckets = sum(tokens[f"{b}_ms"].sum() for b in ("physical", "memory", "compute", "time", "decision"))
        assert buckets == pytest.approx(tokens["t_ms"].iloc[-1], rel=1e-9)


def test_prompts_split_into_chunks_prefilled_together_get_the_tokens_they_get_one_forward_each(levels, calibration,
                                                                                                monkeypatch):
    """A step's budget of prompt tokens splits prompts into chunks, several in one forward: the same tokens as when
    each chunk has a forward of its own."""
    if optional_kernel() is None:
        pytest.skip("the C++ extension cannot be built here")
    cfgs = [sampled(p, 6, i) for i, p in enumerate(PROMPTS)]
    lm = levels["int4-dyn"]
    apart = BatchEngine(lm, max_batch=4, calibration=calibration, prefill_chunk=5)
    apart.prefills_together = False
    runs, chunks = [], []
    prefill_batch = type(lm.model).prefill_batch
    monkeypatch.setattr(type(lm.model), "prefill_batch",
                        lambda self, parts, *a: (chunks.append(len(parts)), prefill_batch(self, parts, *a))[1])
    for engine in (apart, BatchEngine(lm, max_batch=4, calibration=calibration, prefill_chunk=5)):
        seqs = [engine.submit(cfg) for cfg in cfgs]
        engine.run()
        runs.append([seq.token_ids for seq in seqs])
    assert runs[0] == runs[1]
    assert max(chunks) > 1  # some forwards took several prompts' chunks


@torch.inference_mode()
@pytest.mark.parametrize("level", ["int4-dyn", "int8-dyn"])
def test_the_default_model_prefills_chunks_side_by_side_as_it_prefills_each_alone(default_lm, level):
    """Two whole prompts of one length (attending in one call), the second half of one whose first half is cached,
    and a last token of one prefilled in one forward (LeanLlama.prefill_batch): each chunk's logits and cache equal
    its own forward's, to the bit."""
    if optional_kernel() is None:
        pytest.skip("the C++ extension cannot be built here")
    lm = quantize(default_lm, level)
    assert lm.model.prefills_side_by_side()
    ids = [lm.tokenizer(p)["input_ids"] for p in PROMPTS[1:2] + PROMPTS[1:]]
    cached = [0, 0, len(ids[2]) // 2, len(ids[3]) - 1]
    alone, together = [], []
    for seq, before in zip(ids, cached):
        for kept in (alone, together):
            kept.append(DynamicCache(config=lm.config))
            if before:
                lm.model(input_ids=torch.tensor([seq[:before]]), cache=kept[-1], use_cache=True)
    own = [lm.model(input_ids=torch.tensor([seq[before:]]), cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
           for seq, before, cache in zip(ids, cached, alone)]
    side_by_side = lm.model.prefill_batch([seq[before:] for seq, before in zip(ids, cached)], together)
    for i, (a, b) in enumerate(zip(alone, together)):
        assert torch.equal(side_by_side[i], own[i]), f"chunk {i}"
        for layer_a, layer_b in zip(a.layers, b.layers):
            assert torch.equal(layer_a.keys, layer_b.keys) and torch.equal(layer_a.values, layer_b.values)


def test_time_waiting_to_be_admitted_is_the_time_distance(tiny_lm, calibration):
    engine = BatchEngine(tiny_lm, max_batch=1, calibration=calibration)
    now = time.perf_counter_ns()  # both clocks start together: the second is admitted after the first's last token
    first = engine.submit(greedy(PROMPTS[0], tokens=20), t_request=now)
    second = engine.submit(greedy(PROMPTS[1], tokens=4), t_request=now)
    engine.run()
    queued = second.result["queue_ms"]
    assert queued >= first.result["total_ms"]
    assert second.steps[0]["time_ms"] >= queued and second.result["ttft_ms"] >= queued


def test_the_local_engine_streams_each_request_from_another_thread(tiny_lm, calibration, store):
    engine = LocalEngine(tiny_lm, store=store, max_batch=4)
    try:
        handles = [engine.submit(p, max_new_tokens=6, ignore_eos=True, temperature=1.0, seed=i)
                   for i, p in enumerate(PROMPTS)]
        streams = [list(h) for h in handles]
        quiet = engine.submit(PROMPTS[1], max_new_tokens=6, ignore_eos=True, temperature=1.0, seed=1, stream=False)
        assert list(quiet) == [] and quiet.result["status"] == "ok"  # only its end, then its rows
        assert [row["token_id"] for row in quiet.sequence.tokens] == [e.token_id for e in streams[1]]
        assert quiet.result["ttft_ms"] == quiet.sequence.tokens[0]["t_ms"]
        cancelled = engine.submit(PROMPTS[0], max_new_tokens=400, ignore_eos=True)
        cancelled.cancel()
        assert cancelled.wait()["status"] == "cancelled"
        with pytest.raises(UserError, match="prompt is empty"):
            engine.submit("", max_new_tokens=4)
    finally:
        engine.close()
    for i, (prompt, handle, events) in enumerate(zip(PROMPTS, handles, streams)):
        assert [e.token_id for e in events] == alone(tiny_lm, sampled(prompt, 6, i), calibration)
        times = [e.t_ms for e in events]
        assert times == sorted(times) and handle.result["ttft_ms"] == times[0]
        assert store.runs(20).set_index("run_id").loc[handle.result["run_id"], "status"] == "ok"


def test_the_local_engine_spares_the_collector_what_was_alive_while_it_is_busy_and_lifts_it_when_idle(tiny_lm):
    """While the engine's thread has requests, a collection walks only what was made since they came (a full one
    in a process that keeps many results stalls a step); idle, it lifts the freeze, so that garbage goes too."""
    import gc

    engine = LocalEngine(tiny_lm, max_batch=2)
    try:
        handle = engine.submit(PROMPTS[0], max_new_tokens=40, ignore_eos=True)
        next(iter(handle))
        assert gc.get_freeze_count() > 1000  # the model's modules and tensors, the libraries
        handle.wait()
        deadline = time.monotonic() + 60
        while gc.get_freeze_count() and time.monotonic() < deadline:  # the thread goes idle after the last step
            time.sleep(0.01)
        assert gc.get_freeze_count() == 0
        engine.submit(PROMPTS[1], max_new_tokens=4, ignore_eos=True).wait()  # a later spell is spared again
    finally:
        engine.close()
    assert gc.get_freeze_count() == 0


def test_by_the_end_of_each_step_every_row_is_in_its_journal_and_every_token_in_its_stream(tiny_lm, calibration,
                                                                                           store):
    """A step hands its rows to the journals and its events to the streams together (before the next forward lets
    go of the GIL, or at its end): after step() returns nothing is held back, and a stream ends after its last
    token."""
    import queue

    engine = BatchEngine(tiny_lm, store=store, max_batch=3, calibration=calibration)
    sinks = [queue.SimpleQueue() for _ in range(3)]
    seqs = [engine.submit(sampled(p, 4 + 3 * i, i), sink=sink) for i, (p, sink) in enumerate(zip(PROMPTS, sinks))]
    streamed = [[] for _ in seqs]
    while engine.step():
        for seq, sink, got in zip(seqs, sinks, streamed):
            while not sink.empty():
                got.append(sink.get())
            assert [e.token_id for e in got if e is not None] == seq.token_ids
            assert (got[-1:] == [None]) == (seq.phase == "done")  # the end comes after the last token
            if seq.phase != "done":
                rows = journal.read(journal.journal_path(store.path, seq.run_id))
                assert [t["token_id"] for t in rows["tokens"]] == seq.token_ids
    engine.write()
    assert all(got[-1] is None and len(got) == len(seq.token_ids) + 1 for seq, got in zip(seqs, streamed))


def test_a_step_hands_over_every_token_before_it_ends_the_runs_it_finished(tiny_lm, calibration, store, monkeypatch):
    """Ending a run (its summary, its rows handed to the writer) waits until the step has emitted every sequence's
    token: a token's time is when it was handed over, not after the runs that ended before it in the step."""
    engine = BatchEngine(tiny_lm, store=store, max_batch=4, calibration=calibration)
    seqs = [engine.submit(sampled(p, 3, i)) for i, p in enumerate(PROMPTS)]
    seen, end = [], engine._end
    monkeypatch.setattr(engine, "_end", lambda seq, *a: (seen.append([len(s.token_ids) for s in seqs]), end(seq, *a)))
    engine.run()
    engine.write()
    assert seen == [[3, 3, 3, 3]] * 4 and all(s.status == "ok" for s in seqs)


def test_a_repeated_prompt_is_tokenized_once_and_the_machine_described_once(tiny_lm, store, monkeypatch):
    import engine.run.batch as batch

    tokenized, described = [], []
    monkeypatch.setattr(batch, "prompt_ids", lambda lm, prompt, raw: tokenized.append(prompt) or [7, 8, 9, len(prompt)])
    monkeypatch.setattr(batch.hardware, "hardware_summary", lambda device: described.append(device) or {"n": 1})
    engine = LocalEngine(tiny_lm, store=store, max_batch=2)
    try:
        handles = [engine.submit(p, max_new_tokens=2, ignore_eos=True) for p in [PROMPTS[0], PROMPTS[2], PROMPTS[0]]]
        results = [h.wait() for h in handles]
    finally:
        engine.close()
    assert tokenized == [PROMPTS[0], PROMPTS[2]] and len(described) == 1  # the caller's check, then the submit
    assert [r["n_prompt_tokens"] for r in results] == [4, 4, 4]
    runs = store.query("SELECT prompt, hardware FROM runs ORDER BY run_id")
    assert list(runs["prompt"]) == [PROMPTS[0], PROMPTS[2], PROMPTS[0]] and set(runs["hardware"]) == {'{"n": 1}'}


def test_the_prompts_kept_stay_bounded_while_callers_threads_submit_at_once(tiny_lm, monkeypatch, calibration):
    import engine.run.batch as batch
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(batch, "PROMPTS_KEPT", 3)
    prompts = [f"{p} {i}" for i in range(3) for p in PROMPTS]  # 12 prompts, each asked for twice
    engine = LocalEngine(tiny_lm, max_batch=4)
    try:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda p: engine.submit(p, max_new_tokens=3, ignore_eos=True).wait(), prompts * 2))
    finally:
        engine.close()
    assert all(r["status"] == "ok" for r in results) and len(engine.engine.prompts) <= 3
    assert [r["n_prompt_tokens"] for r in results] == [len(batch.prompt_ids(tiny_lm, p, False)) for p in prompts * 2]


def test_release_threads_frees_the_calling_thread_s_openmp_threads():
    """libgomp spins its threads between regions only while it manages no more threads than cores, and every thread
    that ran a region keeps its own: release_threads lets a thread give its own back."""
    import os
    import threading

    from engine.model.cpu_kernels import release_threads

    if optional_kernel() is None or not Path("/proc/self/task").is_dir():
        pytest.skip("needs the C++ kernels and Linux's /proc")
    def in_a_thread(counts: list):
        outside = torch.get_num_threads()
        torch.set_num_threads(2)  # this thread's own setting (a test worker runs with one)
        try:
            torch.ones(1 << 22).exp_()  # a parallel region: this thread's other OpenMP thread starts
            counts.append(len(os.listdir("/proc/self/task")))
            release_threads()
            counts.append(len(os.listdir("/proc/self/task")))
            torch.ones(1 << 22).exp_()  # and starts again at the next
            counts.append(len(os.listdir("/proc/self/task")))
        finally:
            torch.set_num_threads(outside)

    # the process's threads are counted: an earlier test's thread that ends meanwhile spoils one try, not three
    tries = []
    for _ in range(3):
        tries.append([])
        worker = threading.Thread(target=in_a_thread, args=(tries[-1],))
        worker.start()
        worker.join()
        started, released, again = tries[-1]
        if released == started - 1 and again == started:
            return
    pytest.fail(f"threads of the process (started, released, again), each try: {tries}")


def test_a_kernel_lets_other_python_threads_run_while_it_works():
    """The threads taking a batch's tokens run beside a forward: a thread waiting for the GIL gets it during a
    kernel call. With the switch interval at 100 s, the caller keeps the GIL between calls, so the waiting thread
    can only run inside one."""
    import queue
    import sys
    import threading

    kernel = optional_kernel()
    if kernel is None:
        pytest.skip("needs the C++ kernels")
    x, w = torch.rand(4096, 2048), torch.rand(2048)
    wake, seen, state = queue.SimpleQueue(), [], {"in_kernel": False}
    helper = threading.Thread(target=lambda: (wake.get(), seen.append(state["in_kernel"])))
    interval = sys.getswitchinterval()
    sys.setswitchinterval(100)
    try:
        helper.start()  # it waits in wake.get(), without the GIL
        wake.put(None)  # now it waits for the GIL
        for _ in range(500):
            state["in_kernel"] = True
            kernel.rms_norm(x, w, 1e-5)
            state["in_kernel"] = False
            if seen:
                break
        helper.join()
    finally:
        sys.setswitchinterval(interval)
    assert seen == [True]


def test_the_local_engine_gives_back_openmp_threads_where_they_would_idle(tiny_lm, monkeypatch):
    import threading

    import engine.run.local as local

    calls = []
    monkeypatch.setattr(local, "release_threads", lambda: calls.append(threading.current_thread().name))
    engine = LocalEngine(tiny_lm, max_batch=2)
    try:
        assert calls[0] == threading.current_thread().name  # the maker's, as the engine's thread takes the model
        engine.submit(PROMPTS[0], max_new_tokens=3, ignore_eos=True).wait()
        deadline = time.monotonic() + 60
        while calls.count("tokenpath-batch") < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        engine.close()
    assert calls.count("tokenpath-batch") >= 2  # idle at its start, and again once the request ended


def cli(*args, db: Path, model) -> subprocess.CompletedProcess:
    return run_engine("generate", "--model", model, "--db", db, "--raw", *args)


def test_one_user_s_json_has_the_batch_s_figures(tiny_folder, tmp_path):
    import json

    out = cli("--prompt", "Count the stars", "--users", "1", "--max-new-tokens", "5", "--json", db=tmp_path / "r.duckdb",
              model=tiny_folder)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["users"] == 1 and result["tokens_per_s_total"] == result["tokens_per_s_per_user"] == result["tokens_per_s"]


@pytest.mark.parametrize("users", ["1", "2"])
def test_json_with_repeat_is_one_array_of_every_run_s_object(tiny_folder, tmp_path, users):
    import json

    out = cli("--prompt", "Count the stars", "--users", users, "--repeat", "2", "--max-new-tokens", "3", "--json",
              db=tmp_path / "r.duckdb", model=tiny_folder)
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout)
    assert isinstance(results, list) and len(results) == 2 and all(r["users"] == int(users) for r in results)
    ids = [r["run_id"] for r in results] if users == "1" else [i for r in results for i in r["run_ids"]]
    assert sorted(ids) == list(range(1, 2 * int(users) + 1))


def test_batches_one_after_another_number_their_runs_without_gaps(tiny_lm, tmp_path, monkeypatch):
    """A fixed batch takes its run ids once: writes while it decodes take none ahead for runs that never come."""
    from engine.run.local import BatchRun
    from engine.spec import RunSpec

    monkeypatch.setenv("TOKENPATH_WRITE_EVERY_S", "0.01")  # a write every step or so
    store = Store(tmp_path / "r.duckdb")
    spec = RunSpec(gen=GenConfig("Count the stars", max_new_tokens=24, ignore_eos=True, raw=True), users=2)
    assert [BatchRun(tiny_lm, spec, store).run()["run_ids"] for _ in range(2)] == [[1, 2], [3, 4]]


def test_a_batch_s_rates_and_run_ends_leave_out_the_time_its_rows_wait_to_be_written(tiny_lm, tmp_path, monkeypatch):
    """A database held by another process delays the final write: the batch's tokens/s in total and each run's end
    are the decoding's, not the wait's."""
    from engine.run.local import BatchRun
    from engine.spec import RunSpec
    from engine.store.writer import Writer

    written = {}
    plain = Writer.write

    def late_write(self):
        written.setdefault("at", time.perf_counter())
        time.sleep(0.5)
        plain(self)

    monkeypatch.setattr(Writer, "write", late_write)
    store = Store(tmp_path / "r.duckdb")
    run = BatchRun(tiny_lm, RunSpec(gen=GenConfig("Count the stars", max_new_tokens=3, raw=True), users=2), store)
    before = time.perf_counter()
    result = run.run()
    assert result["wall_s"] <= written["at"] - before
    runs = store.query("SELECT epoch(finished_at) - epoch(started_at) AS s, total_ms FROM runs")
    assert len(runs) == 2 and (runs["s"] < written["at"] - before + 0.25).all()  # a late end would add 0.5


def test_a_stopped_batch_names_each_run_by_the_status_it_was_recorded_with_or_its_journal():
    from types import SimpleNamespace

    from engine.cli.main import batch_outcome

    def seq(i, status, written=True):
        return SimpleNamespace(run_id=i, status=status, recorder=SimpleNamespace(written=written))

    seqs = [seq(4, "ok"), seq(5, "cancelled"), seq(6, "ok"), seq(7, "cancelled")]
    assert batch_outcome(SimpleNamespace(sequences=seqs)) == "runs 4, 6 recorded as ok; runs 5, 7 recorded as cancelled"
    assert batch_outcome(SimpleNamespace(sequences=seqs[:1])) == "run 4 recorded as ok"
    assert batch_outcome(SimpleNamespace(sequences=[])) == "no run was recorded"
    # the database was held as the batch ended: its rows wait in the journals
    waiting = [seq(5, "ok", written=False), seq(6, "ok", written=False)]
    assert batch_outcome(SimpleNamespace(sequences=waiting)) == (
        "runs 5, 6 kept in their journals (they go into the database the next time Tokenpath opens it)")


def test_generate_with_users_records_one_run_per_sequence(tiny_folder, tmp_path):
    import json

    db = tmp_path / "runs.duckdb"
    out = cli("--prompt", "Count the stars", "--users", "3", "--max-new-tokens", "5", "--json", "--tokens", db=db,
              model=tiny_folder)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["users"] == 3 and len(result["run_ids"]) == 3 and result["tokens_per_s_total"] > 0
    assert result["tokens_per_s_per_user"] > 0
    # --tokens: every sequence's token and step rows, each with its run and user
    assert sorted({(t["run_id"], t["user"]) for t in result["tokens"]}) == sorted(
        {(s["run_id"], s["user"]) for s in result["steps"]}) == sorted(zip(result["run_ids"], range(3)))
    assert len(result["tokens"]) == sum(r["n_new_tokens"] for r in result["runs"])
    runs = Store(db).runs(10)
    assert sorted(runs["run_id"]) == sorted(result["run_ids"]) and set(runs["status"]) == {"ok"}
    assert runs.set_index("run_id").loc[result["run_ids"][0], "prompt"] == "Count the stars"


@pytest.mark.parametrize("args,says", [
    (["--users", "0"], "between 1 and 256"),
    (["--users", "257"], "between 1 and 256"),
    (["--users", "2", "--kv-budget-mb", "0.0001"], "smaller than one sequence"),
    (["--users", "2", "--kv-budget-mb", "1e308"], "--kv-budget-mb"),
    (["--users", "2", "--kv-budget-mb", "0.1", "--max-new-tokens", "300"], "smaller than one sequence"),
    (["--users", "2", "--max-new-tokens", "4000"], "context"),
    (["--users", "2", "--speculative", "prompt-lookup"], "Speculative decoding"),
    (["--users", "2", "--sparsity", "0.5"], "sparsity"),
    (["--users", "2", "--no-kv-cache"], "KV cache"),
])
def test_bad_batch_input_is_one_sentence_exit_2_and_nothing_recorded(tiny_folder, tmp_path, args, says):
    db = tmp_path / "runs.duckdb"
    out = cli("--prompt", "Count the stars", *args, db=db, model=tiny_folder)
    assert out.returncode == 2, out.stderr
    assert says in out.stderr and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not db.exists() or Store(db).runs(10).empty
    assert not db.exists() or Store(db).reserve_run_ids(1) == [1]  # no run id taken either


def test_a_kill_mid_batch_keeps_every_sequences_tokens(long_tiny_folder, tmp_path):
    import time

    db = tmp_path / "runs.duckdb"
    proc = start_engine("generate", "--model", long_tiny_folder, "--db", db, "--raw", "--prompt", "Count the stars",
                        "--users", "3", "--max-new-tokens", "4000", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, seen = time.monotonic() + 300, {}
    while time.monotonic() < deadline and proc.poll() is None:
        paths = list(journal.journal_dir(db).glob("run-*.jsonl")) if journal.journal_dir(db).is_dir() else []
        seen = {p.name: len(journal.read(p)["tokens"]) for p in paths}
        if len(seen) == 3 and min(seen.values()) >= 10:
            break
        time.sleep(0.05)
    proc.kill()
    proc.wait(timeout=60)
    assert len(seen) == 3 and min(seen.values()) >= 10, seen
    store = Store(db)  # opening it folds the journals in
    runs = store.runs(10).to_dict("records")
    assert len(runs) == 3
    for run in runs:
        assert run["status"] == "interrupted" and run["n_new_tokens"] >= 10
        assert run["n_new_tokens"] == len(store.tokens(run["run_id"]))
        assert set(store.steps(run["run_id"])["batch"]) >= {3}


@torch.inference_mode()
@pytest.mark.parametrize("kv_dtype", [None, torch.bfloat16])
@torch.inference_mode()
def test_a_rotary_embedding_that_follows_the_length_takes_each_sequence_s_own_in_a_batched_decode(kv_dtype):
    """Dynamic NTK scaling changes the frequencies past the positions the model was made for: a batched decode of a
    short and a long sequence (through the modules) gives each the logits it gets decoded alone, not the longest
    one's frequencies; to the bit where the kernels attend, as they do alone, over a float32 or a bf16 cache."""
    lm = tiny_model(positions=16, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    prompts = [[5, 6, 7], list(range(100, 124))]  # the second runs past the 16 positions
    kinds = cache_layer_kinds(lm.config)

    def prefilled(ids):
        cache = new_cache(kinds)
        lm.model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True, kv_dtype=kv_dtype)
        return cache

    alone = [lm.model(input_ids=torch.tensor([[9]]), cache=prefilled(ids), use_cache=True, kv_dtype=kv_dtype)
             .logits[0, -1] for ids in prompts]
    together = lm.model.decode_batch([9, 9], [len(ids) for ids in prompts], [prefilled(ids) for ids in prompts],
                                     kv_dtype)
    for row, own in zip(together.logits, alone):
        if optional_kernel() is not None:
            assert torch.equal(row, own)
        else:
            torch.testing.assert_close(row, own, rtol=1e-4, atol=1e-5 if kv_dtype is None else 1e-2)
