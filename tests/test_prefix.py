"""Prompt prefixes kept for reuse in the batch engine: a later request that opens with a kept prompt's tokens reads
its keys and values where they are kept, prefills only the rest, and gets the tokens it gets alone; the kept prompts
stay within their bytes and make way for a KV budget; load --local takes the switch and refuses it where it cannot
apply."""
import json
import random

import pytest
import torch

from engine.model.cpu_kernels import optional_kernel
from engine.model.lean import CACHE_ROOM, OpeningLayer, cache_layer_kinds, new_cache, room_for
from engine.run.batch import BatchEngine
from engine.run.prefix import BLOCK, Prefixes
from engine.spec import GenConfig
from engine.store.db import Store
from engine.switches.quant import quantize
from commands import run_engine

MIB = 2**20
# a prompt of several blocks, a second that shares its first two blocks and then differs
OPENING = "Tell me a story about a lighthouse keeper who finds a message in a bottle on a stormy night " * 2


def sampled(prompt: str, seed: int = 7, tokens: int = 10, kv_dtype: str = "auto") -> GenConfig:
    return GenConfig(prompt=prompt, max_new_tokens=tokens, ignore_eos=True, temperature=1.0, seed=seed,
                     kv_dtype=kv_dtype)


def one_by_one(engine: BatchEngine, cfgs: list[GenConfig]) -> list:
    """Each request submitted once the one before it has finished, so that every later one can find it kept."""
    seqs = []
    for cfg in cfgs:
        seqs.append(engine.submit(cfg))
        engine.run()
    return seqs


@pytest.fixture(scope="module")
def int8_dyn(tiny_lm):
    return quantize(tiny_lm, "int8-dyn")


@pytest.mark.parametrize("level", ["int8-dyn", "fp32"])
def test_a_repeated_prompt_prefills_its_last_token_alone_and_gets_the_tokens_it_gets_alone(tiny_lm, int8_dyn, level,
                                                                                          calibration):
    lm = int8_dyn if level == "int8-dyn" else tiny_lm
    plain = one_by_one(BatchEngine(lm, max_batch=2, calibration=calibration), [sampled(OPENING)])[0]
    engine = BatchEngine(lm, max_batch=2, calibration=calibration, prefix_cache_bytes=64 * MIB)
    first, again = one_by_one(engine, [sampled(OPENING), sampled(OPENING)])
    n = len(first.prompt_ids)
    assert (first.reused, again.reused) == (0, n - 1)
    assert again.steps[0]["kind"] == "prefill" and again.steps[0]["n_input"] == 1
    assert again.steps[0]["context_len"] == n and again.result["prefix_reused_tokens"] == n - 1
    # its one token was a decode step's row: one position written
    assert again.steps[0]["kv_write_bytes"] == engine.shape.kv_bytes_per_token
    # the reused positions hold what the request computes alone: its sampled tokens are the same
    assert again.token_ids == first.token_ids == plain.token_ids
    assert (engine.prefixes.hits, engine.prefixes.reused_tokens, len(engine.prefixes)) == (1, n - 1, 1)
    assert engine.prefixes.bytes == n * engine.shape.kv_bytes_per_token


@pytest.mark.parametrize("level,kv", [("int8-dyn", "auto"), ("fp32", "auto"), ("int8-dyn", "bf16"), ("fp32", "fp16")])
def test_an_arrival_that_finds_its_prompt_kept_joins_the_running_decode_s_forward(tiny_lm, int8_dyn, level, kv,
                                                                                  calibration, monkeypatch):
    """In a cache of float32 or of half precision alike (the kernels widen it as they read it)."""
    if optional_kernel() is None:
        pytest.skip("the C++ extension cannot be built here")
    lm = int8_dyn if level == "int8-dyn" else tiny_lm
    other = sampled("Name three rivers in Europe", seed=3, kv_dtype=kv)
    engine = BatchEngine(lm, max_batch=2, calibration=calibration, prefix_cache_bytes=64 * MIB, kv_dtype=kv)
    first = one_by_one(engine, [sampled(OPENING, kv_dtype=kv)])[0]
    running = engine.submit(other)
    engine.step()  # its prefill
    forwards = []
    for name in ("decode_batch", "prefill_batch", "forward"):
        real = getattr(type(lm.model), name)
        monkeypatch.setattr(type(lm.model), name, lambda self, *a, real=real, name=name, **k: (
            forwards.append(name), real(self, *a, **k))[1])
    again = engine.submit(sampled(OPENING, kv_dtype=kv))
    engine.step()
    assert forwards == ["decode_batch"]  # its last prompt token and the running sequence's next, in one forward
    monkeypatch.undo()
    engine.run()
    n = len(again.prompt_ids)
    assert again.steps[0]["kind"] == "prefill" and again.steps[0]["n_input"] == 1 and again.steps[0]["batch"] == 2
    assert again.steps[0]["context_len"] == n and again.steps[0]["kv_write_bytes"] == engine.shape.kv_bytes_per_token
    assert running.steps[1]["batch"] == 2
    # the other prompt found the chat template's opening kept as well: alone, it finds the same
    reference = BatchEngine(lm, max_batch=2, calibration=calibration, prefix_cache_bytes=64 * MIB, kv_dtype=kv)
    alone = one_by_one(reference, [sampled(OPENING, kv_dtype=kv), other])[1]
    assert running.reused == alone.reused > 0
    assert again.token_ids == first.token_ids and running.token_ids == alone.token_ids
    assert first.result["kv_dtype"] == ("fp32" if kv == "auto" else kv)
    for seq in (again, running):
        total = seq.result["total_ms"]
        assert sum(seq.result["distances_ms"].values()) == pytest.approx(total, rel=1e-6, abs=1e-3)


@pytest.mark.parametrize("level,kv", [("int8-dyn", torch.bfloat16), ("fp32", None), ("int4-dyn", torch.float16)])
@pytest.mark.parametrize("opening,batch", [(31, 1), (30, 2), (31, 5)])
def test_a_step_over_a_kept_opening_read_where_it_is_gives_the_logits_of_a_copy_to_the_bit(tiny_lm, level, kv, opening,
                                                                                          batch):
    """decode_batch over caches that read a kept prompt's positions where the store keeps them gives, step after step,
    the logits of caches that hold a copy: one or two sequences and several (the kernels' two ways through attention),
    an odd opening and an even one (the values' sums take positions in pairs, one pair across from the opening to the
    sequence's own), past the room a sequence's own positions start with. A forward other than the decode step takes
    such a cache whole first, and continues as the copy does."""
    if optional_kernel() is None:
        pytest.skip("the C++ extension cannot be built here")
    lm = tiny_lm if level == "fp32" else quantize(tiny_lm, level)
    ids = lm.tokenizer(OPENING)["input_ids"]
    kinds = cache_layer_kinds(lm.config)
    kept = new_cache(kinds)
    with torch.inference_mode():
        lm.model(input_ids=torch.tensor([ids[:opening]]), cache=kept, use_cache=True, kv_dtype=kv)
    prefixes = Prefixes(64 * MIB, 1)
    prefixes.keep(ids[:opening], kept)
    shared, copied = [new_cache(kinds) for _ in range(batch)], [new_cache(kinds) for _ in range(batch)]
    for b, (one, other) in enumerate(zip(shared, copied)):
        found = prefixes.opening(ids[:opening + 1 + b])
        assert prefixes.reuse(ids[:opening + 1 + b], one, found) == found == (tuple(ids[:opening]), opening)
        assert prefixes.reuse(ids[:opening + 1 + b], other) == (None, opening)
    assert all(type(layer) is OpeningLayer for layer in shared[0].layers)
    assert not any(type(layer) is OpeningLayer for layer in copied[0].layers)
    tokens, positions = [ids[opening + b] for b in range(batch)], [opening] * batch
    for step in range(room_for(opening + 1) - opening + 3):  # past the room its own positions start with
        out = lm.model.decode_batch(tokens, positions, shared, kv)
        assert torch.equal(out.logits, lm.model.decode_batch(tokens, positions, copied, kv).logits), step
        tokens, positions = out.logits.argmax(-1).tolist(), [p + 1 for p in positions]
    with torch.inference_mode():
        ahead = [lm.model(input_ids=torch.tensor([tokens[:1] * 3]), cache=cache[0], use_cache=True, kv_dtype=kv).logits
                 for cache in (shared, copied)]
    assert torch.equal(*ahead) and type(shared[0].layers[0]) is not OpeningLayer
    with pytest.raises(RuntimeError, match="unshared"):
        OpeningLayer(*prefixes.entries[tuple(ids[:opening])][0]).update(None, None)


def test_sequences_that_open_with_a_kept_prompt_read_it_where_it_is_kept_and_never_write_into_it(int8_dyn,
                                                                                                 calibration):
    """Every running sequence that reuses a kept prompt attends over the store's own keys and values, not a copy each,
    and holds only its own positions; the kept entry is left as it was, and each sequence's tokens are the ones it
    gets alone."""
    if optional_kernel() is None:
        pytest.skip("the C++ extension cannot be built here")
    engine = BatchEngine(int8_dyn, max_batch=4, calibration=calibration, prefix_cache_bytes=64 * MIB)
    first = one_by_one(engine, [sampled(OPENING)])[0]
    (entry,) = engine.prefixes.entries.values()
    before = [(keys.clone(), values.clone()) for keys, values in entry]
    three = [engine.submit(sampled(OPENING)) for _ in range(3)]
    engine.step()  # admitted, their last prompt tokens through one decode forward
    for seq in three:
        assert seq.reused == len(seq.prompt_ids) - 1
        for layer, (keys, values) in zip(seq.cache.layers, entry):
            assert type(layer) is OpeningLayer and layer.get_seq_length() == len(seq.prompt_ids)
            assert (layer.shared_keys.data_ptr(), layer.shared_values.data_ptr()) == (keys.data_ptr(),
                                                                                    values.data_ptr())
            assert layer.keys.shape[2] == layer.values.shape[2] == 1
    engine.run()
    assert all(seq.status == "ok" and seq.token_ids == first.token_ids for seq in three)
    assert all(torch.equal(keys, k) and torch.equal(values, v) for (keys, values), (k, v) in zip(entry, before))


def test_a_prompt_whose_chunks_leave_its_last_token_finishes_its_prefill_in_a_decode_forward(int8_dyn, calibration):
    if optional_kernel() is None:
        pytest.skip("the C++ extension cannot be built here")
    cfg = sampled(OPENING)
    n = len(BatchEngine(int8_dyn, calibration=calibration).check(cfg))
    alone = one_by_one(BatchEngine(int8_dyn, max_batch=2, calibration=calibration), [cfg])[0]
    engine = BatchEngine(int8_dyn, max_batch=2, calibration=calibration, prefill_chunk=n - 1)
    seq = one_by_one(engine, [cfg])[0]
    first = seq.steps[0]
    # its row counts the whole prompt, both forwards' time and the bytes the estimate gives for both
    assert (first["kind"], first["n_input"], first["context_len"], first["batch"]) == ("prefill", n, n, 1)
    assert first["kv_write_bytes"] == n * engine.shape.kv_bytes_per_token
    assert len(engine.batch_sizes) == len(seq.token_ids)  # every token came out of a decode forward, the first too
    assert seq.token_ids == alone.token_ids
    assert sum(seq.result["distances_ms"].values()) == pytest.approx(seq.result["total_ms"], rel=1e-6, abs=1e-3)


def test_a_prompt_that_shares_an_opening_reuses_it_block_by_block_then_token_by_token(int8_dyn, calibration):
    engine = BatchEngine(int8_dyn, max_batch=2, calibration=calibration, prefix_cache_bytes=64 * MIB)
    other = OPENING + "Then tell me another about a baker."
    kept, longer = one_by_one(engine, [sampled(OPENING), sampled(other, seed=3)])
    shared = next(i for i, (a, b) in enumerate(zip(kept.prompt_ids, longer.prompt_ids)) if a != b)
    assert shared > BLOCK and shared % BLOCK  # past whole blocks, then token by token
    assert longer.reused == shared and longer.steps[0]["n_input"] == len(longer.prompt_ids) - shared
    alone = one_by_one(BatchEngine(int8_dyn, max_batch=2, calibration=calibration), [sampled(other, seed=3)])[0]
    assert longer.token_ids == alone.token_ids
    assert len(engine.prefixes) == 2  # it is kept as well: its tail is its own


def test_kept_prompts_stay_within_their_bytes_least_recently_used_first_out(int8_dyn, calibration):
    prompts = ["Name three rivers in Europe", "Write a haiku about a kettle that sings", "Count the stars tonight"]
    measure = BatchEngine(int8_dyn, calibration=calibration)
    per_position = measure.shape.kv_bytes_per_token
    n = [len(measure.check(sampled(p))) for p in prompts]
    room = (max(n[0], n[1]) + n[2]) * per_position  # the last two at most, never all three
    assert sum(n) * per_position > room
    engine = BatchEngine(int8_dyn, max_batch=2, calibration=calibration, prefix_cache_bytes=room)
    one_by_one(engine, [sampled(p) for p in prompts])
    kept = list(engine.prefixes.entries)
    assert kept == [tuple(measure.check(sampled(p))) for p in prompts[1:]]
    assert engine.prefixes.bytes == (n[1] + n[2]) * per_position <= room
    assert all(entry in kept for entry in engine.prefixes.index.values())  # nothing points at the one let go
    again = one_by_one(engine, [sampled(prompts[2])])[0]
    assert again.reused == len(again.prompt_ids) - 1


def test_kept_prompts_make_way_for_running_sequences_under_a_kv_budget(int8_dyn, calibration):
    per_position = BatchEngine(int8_dyn, calibration=calibration).shape.kv_bytes_per_token
    engine = BatchEngine(int8_dyn, max_batch=2, calibration=calibration, prefix_cache_bytes=64 * MIB,
                         kv_budget_bytes=2 * CACHE_ROOM * per_position)
    one_by_one(engine, [sampled("Count the stars")])
    assert len(engine.prefixes) == 1
    pair = [engine.submit(sampled(p)) for p in ("Name three rivers in Europe", "Write a haiku about a kettle")]
    engine.run()
    # the two ran side by side, in the whole budget: the kept prompt was let go rather than either waiting
    assert [s.status for s in pair] == ["ok", "ok"] and all(s.result["batch_max"] == 2 for s in pair)
    assert len(engine.prefixes) == 0 and engine.prefixes.bytes == 0


def cache_bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def test_sequences_reading_a_kept_prompt_count_it_once_under_a_kv_budget(int8_dyn, calibration):
    """Four repeats of a kept prompt, decoding past their first room, in a budget that holds the prompt once and each
    one's own room: counting it in every sequence, only three would fit. They run together to the end, each cache's
    own storage what the count says and every tensor of the caches and the kept prompts within the budget, and decode
    as the prompt did alone."""
    if optional_kernel() is None:
        pytest.skip("the C++ extension cannot be built here")
    per_position = BatchEngine(int8_dyn, calibration=calibration).shape.kv_bytes_per_token
    n = len(BatchEngine(int8_dyn, calibration=calibration).check(sampled(OPENING)))
    tokens = CACHE_ROOM + 10 - n  # each grows its room once
    budget = (n + 4 * (2 * CACHE_ROOM - (n - 1))) * per_position  # each reads all but the prompt's last position
    assert 3 * 2 * CACHE_ROOM * per_position <= budget < 4 * 2 * CACHE_ROOM * per_position
    engine = BatchEngine(int8_dyn, max_batch=4, calibration=calibration, prefix_cache_bytes=64 * MIB,
                         kv_budget_bytes=budget)
    first = one_by_one(engine, [sampled(OPENING, tokens=tokens)])[0]
    kept = list(engine.prefixes.entries)
    repeats = [engine.submit(sampled(OPENING, tokens=tokens)) for _ in range(4)]
    while engine.step():
        assert list(engine.prefixes.entries) == kept and engine.reserved_bytes + engine.prefixes.bytes <= budget
        for seq in engine.running:
            layers = seq.cache.layers
            assert seq.opening == kept[0] and all(type(layer) is OpeningLayer for layer in layers)
            assert cache_bytes(t for layer in layers for t in (layer.keys, layer.values)) == \
                (seq.held - seq.reused) * per_position
        assert kv_memory(engine) <= budget
    assert all(s.result["batch_max"] == 4 and s.reused == n - 1 and s.preemptions == 0 for s in repeats)
    assert all(s.token_ids == first.token_ids for s in repeats)


def prefilled(lm, ids: list[int]):
    cache = new_cache(cache_layer_kinds(lm.config))
    with torch.inference_mode():
        lm.model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
    return cache


def test_a_kept_prompt_that_caches_read_is_not_let_go(int8_dyn):
    prefixes = Prefixes(3 * BLOCK, 1)
    for start in (0, BLOCK):
        ids = list(range(100 + start, 100 + start + BLOCK))
        prefixes.keep(ids, prefilled(int8_dyn, ids))
    older, newer = list(prefixes.entries)
    assert prefixes.evict({older}) and list(prefixes.entries) == [older]
    assert not prefixes.evict({older}) and list(prefixes.entries) == [older]
    # a prompt that fits only if the one read made way is not kept
    ids = list(range(500, 500 + 3 * BLOCK))
    prefixes.keep(ids, prefilled(int8_dyn, ids), in_use=lambda: {older})
    assert list(prefixes.entries) == [older] and prefixes.bytes == BLOCK
    prefixes.keep(ids, prefilled(int8_dyn, ids))
    assert list(prefixes.entries) == [tuple(ids)]


def test_a_kept_prompt_kept_again_once_a_longer_one_that_took_its_openings_has_gone_is_found_and_counted_once(
        int8_dyn):
    prefixes = Prefixes(64 * MIB, 1)
    short = list(range(100, 100 + BLOCK))
    long = short + list(range(300, 300 + BLOCK))
    for ids in (short, long):
        prefixes.keep(ids, prefilled(int8_dyn, ids))
    assert prefixes.evict({tuple(short)}) and prefixes.opening(short + [7]) == (None, 0)  # the longer one held them
    prefixes.keep(short, prefilled(int8_dyn, short))
    assert prefixes.bytes == BLOCK and prefixes.opening(short + [7]) == (tuple(short), BLOCK)


def test_a_repeat_whose_whole_life_and_the_kept_prompt_outgrow_the_budget_copies_it_and_finishes(int8_dyn,
                                                                                                  calibration):
    """A budget of exactly one sequence's most room: reading the kept prompt where it is kept, the repeat could not
    let it go as it grows, and would not fit alone; so it takes a copy, and the prompt makes way for its growth."""
    if optional_kernel() is None:
        pytest.skip("the C++ extension cannot be built here")
    per_position = BatchEngine(int8_dyn, calibration=calibration).shape.kv_bytes_per_token
    n = len(BatchEngine(int8_dyn, calibration=calibration).check(sampled(OPENING)))
    tokens = CACHE_ROOM + 10 - n
    engine = BatchEngine(int8_dyn, max_batch=2, calibration=calibration, prefix_cache_bytes=64 * MIB,
                         kv_budget_bytes=2 * CACHE_ROOM * per_position)
    first = one_by_one(engine, [sampled(OPENING, tokens=4)])[0]  # short: growing, it would let the prompt go
    assert len(engine.prefixes) == 1
    again = engine.submit(sampled(OPENING, tokens=tokens))
    engine.step()
    assert again.opening is None and again.reused == n - 1
    engine.run()
    assert again.status == "ok" and again.preemptions == 0 and again.token_ids[:4] == first.token_ids
    assert len(engine.prefixes) == 0


def test_the_default_model_reuses_a_repeated_prompt_through_its_fast_paths(default_lm, calibration):
    if optional_kernel() is None:
        pytest.skip("the C++ extension cannot be built here")
    lm = quantize(default_lm, "int8-dyn")
    prompt = "Explain in two sentences why the sky is blue."
    engine = BatchEngine(lm, max_batch=4, calibration=calibration, prefix_cache_bytes=64 * MIB)
    first = one_by_one(engine, [sampled(prompt, tokens=16)])[0]
    # three at once find it kept: their last prompt tokens go through one decode forward, then decode together
    three = [engine.submit(sampled(prompt, seed=7, tokens=16)) for _ in range(3)]
    engine.step()
    assert all(type(s.cache.layers[0]) is OpeningLayer for s in three)  # each reads the kept prompt where it is
    engine.run()
    assert all(s.reused == len(s.prompt_ids) - 1 and s.token_ids == first.token_ids for s in three)
    for seq in three:
        total = seq.result["total_ms"]
        assert sum(seq.result["distances_ms"].values()) == pytest.approx(total, rel=1e-6, abs=1e-3)


def test_load_local_takes_the_prefix_cache_and_refuses_it_where_it_cannot_apply(tiny_folder, tmp_path):
    db = tmp_path / "t.duckdb"
    common = ["load", "--local", "--model", str(tiny_folder), "--concurrency", "2", "--requests", "4",
              "--max-new-tokens", "3", "--db", str(db), "--json"]
    done = run_engine(*common, "--prefix-cache-mb", "8")
    assert done.returncode == 0, done.stderr
    store = Store(db)
    runs = store.query("SELECT config, metrics FROM runs ORDER BY run_id")
    assert all(json.loads(c)["prefix_cache_bytes"] == 8 * MIB for c in runs["config"])
    reused = [json.loads(m)["prefix_reused_tokens"] for m in runs["metrics"]]
    assert reused[0] == 0 and max(reused) > 0  # the later ones open as the first did
    sweep = json.loads(store.query("SELECT config FROM load_sweeps")["config"].iloc[0])
    assert sweep["prefix_cache_mb"] == 8  # --from-sweep makes it again with the same cache
    said = "--prefix-cache-mb must be a positive number of MiB"
    for bad in ("0", "nan", "-4", "1e-9"):  # 1e-9 MiB is no byte at all
        refused = run_engine(*common, "--prefix-cache-mb", bad)
        assert refused.returncode == 2 and said in refused.stderr and "Traceback" not in refused.stderr
    served = run_engine("load", "--endpoint", "http://127.0.0.1:9", "--prefix-cache-mb", "8", "--db", str(db))
    assert served.returncode == 2 and "server keeps its own" in served.stderr


def test_kept_prompts_stay_while_an_arrival_waits_that_letting_them_go_would_not_admit(int8_dyn, calibration):
    per_position = BatchEngine(int8_dyn, calibration=calibration).shape.kv_bytes_per_token
    short = "Hi"
    n_short = len(BatchEngine(int8_dyn, calibration=calibration).check(sampled(short)))
    engine = BatchEngine(int8_dyn, max_batch=3, calibration=calibration, prefix_cache_bytes=64 * MIB,
                         kv_budget_bytes=(2 * CACHE_ROOM + n_short) * per_position)
    one_by_one(engine, [sampled(short, tokens=2)])
    kept = list(engine.prefixes.entries)
    three = [engine.submit(sampled(f"Name three rivers in Europe, number {i}", tokens=4)) for i in range(3)]
    engine.step()
    # two run in the budget beside the kept prompt; the third would not fit even without it, so it stays
    assert (len(engine.running), len(engine.queued)) == (2, 1) and list(engine.prefixes.entries) == kept
    engine.run()
    assert [s.status for s in three] == ["ok"] * 3


def test_under_a_budget_that_preempts_kept_prompts_never_crowd_it_and_every_sequence_decodes_as_alone(
        int8_dyn, calibration):
    prompts = ["Name three rivers in Europe and say which is longest", "Count the stars", "Hi",
               "Write a haiku about a kettle that sings in the morning before anyone wakes"]
    per_position = BatchEngine(int8_dyn, calibration=calibration).shape.kv_bytes_per_token
    budget = 3 * CACHE_ROOM * per_position
    engine = BatchEngine(int8_dyn, max_batch=4, calibration=calibration, prefix_cache_bytes=64 * MIB,
                         kv_budget_bytes=budget)
    seqs = [engine.submit(sampled(p, seed=i, tokens=150 + 10 * i)) for i, p in enumerate(prompts)]
    while engine.step():
        assert engine.reserved_bytes + engine.prefixes.bytes <= budget
    assert engine.preemptions >= 2
    plain = BatchEngine(int8_dyn, max_batch=1, calibration=calibration)
    for seq in seqs:
        assert len([s for s in seq.steps if s["kind"] == "recompute"]) == seq.preemptions
        assert seq.status == "ok" and seq.token_ids == one_by_one(plain, [seq.cfg])[0].token_ids


SEEDS = [3, 15, 16, 22]  # preempting, and finding kept prompts whole (their last tokens join a decode)
WORDS = "lighthouse keeper message bottle stormy night river kettle star haiku count name three".split()


def random_requests(rng) -> list[GenConfig]:
    """OPENING itself, prompts that open as it does, short unrelated ones; outputs short or long, greedy or sampled."""
    cfgs = []
    for _ in range(12):
        draw = rng.random()
        if draw < 0.5:
            prompt = OPENING
        elif draw < 0.8:
            prompt = OPENING + " ".join(rng.choices(WORDS, k=rng.randint(1, 8)))
        else:
            prompt = " ".join(rng.choices(WORDS, k=rng.randint(1, 5)))
        cfgs.append(GenConfig(prompt=prompt, max_new_tokens=rng.choice([rng.randint(1, 40), rng.randint(90, 150)]),
                              ignore_eos=True, temperature=rng.choice([0.0, 1.0]), seed=rng.randint(0, 5)))
    return cfgs


def kv_memory(engine: BatchEngine) -> int:
    """The bytes the running sequences' caches and the kept prompts' tensors occupy."""
    caches = [layer for s in engine.running if s.cache is not None for layer in s.cache.layers if layer.is_initialized]
    return (cache_bytes(t for layer in caches for t in (layer.keys, layer.values))
            + cache_bytes(t for pairs in engine.prefixes.entries.values() for pair in pairs for t in pair))


def mixed_run(lm, calibration, seed: int):
    """Arrivals at random steps with the prefix cache, a KV budget, prompts in chunks and cancellations; the kept and
    reserved bytes, and the bytes the caches' tensors occupy, checked against the budget after every step. (engine,
    sequences, cancelled ones)."""
    rng = random.Random(seed)
    per_position = BatchEngine(lm, calibration=calibration).shape.kv_bytes_per_token
    budget = rng.choice([3, 4]) * CACHE_ROOM * per_position
    engine = BatchEngine(lm, max_batch=rng.choice([2, 3, 4]), calibration=calibration, kv_budget_bytes=budget,
                         prefix_cache_bytes=rng.choice([1, 64]) * MIB, prefill_chunk=rng.choice([7, 16, 33, 256]))
    waiting, seqs, cancelled = random_requests(rng), [], []
    while True:
        if waiting and rng.random() < 0.3:
            seqs.append(engine.submit(waiting.pop()))
        if seqs and rng.random() < 0.01:
            cancelled.append(rng.choice(seqs))
            cancelled[-1].cancel()
        stepped = engine.step()
        assert engine.reserved_bytes + engine.prefixes.bytes <= budget
        assert kv_memory(engine) <= budget
        if not stepped and not waiting:
            return engine, seqs, cancelled


@pytest.mark.parametrize("seed", SEEDS)
def test_random_arrivals_under_every_switch_at_once_decode_each_sequence_as_alone(int8_dyn, calibration, seed):
    """Under the prefix cache, a KV budget, prompts in chunks and cancellations at once (these seeds preempt, and
    find kept prompts whole), every sequence that finishes samples the tokens it samples alone and its buckets sum to
    its time."""
    if optional_kernel() is None:
        pytest.skip("the C++ extension cannot be built here")
    engine, seqs, cancelled = mixed_run(int8_dyn, calibration, seed)
    assert engine.preemptions > 0 and any(s.steps and s.steps[0]["n_input"] == 1 for s in seqs)
    alone = BatchEngine(int8_dyn, max_batch=1, calibration=calibration)
    for seq in seqs:
        if seq in cancelled and seq.status == "cancelled":
            continue
        assert seq.status == "ok" and seq.token_ids == one_by_one(alone, [seq.cfg])[0].token_ids
        total = seq.result["total_ms"]
        assert sum(seq.result["distances_ms"].values()) == pytest.approx(total, rel=1e-6, abs=1e-3)
