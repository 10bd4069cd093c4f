"""The decode loop on a tiny random Llama: exactness, sampling, streaming, cancellation, bad input."""
import pytest
import torch

from engine.run import generate
from engine.run.generate import Generation, GenConfig, GenerationError
from engine.run.step import select_token
from engine.run.text import TextStream, prompt_ids
from engine.model.loader import tiny_model

PROMPTS = ["Hello there", "def add(a, b):", "The weather today is"]


def generate_ids(lm, prompt, calibration, **kw):
    gen = Generation(lm, GenConfig(prompt, raw=True, **kw), calibration=calibration, telemetry=False)
    return gen.run()["token_ids"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_kv_on_equals_kv_off_equals_transformers_generate(tiny_lm, calibration, prompt):
    on = generate_ids(tiny_lm, prompt, calibration, max_new_tokens=12)
    off = generate_ids(tiny_lm, prompt, calibration, max_new_tokens=12, kv_cache=False)
    ids = torch.tensor([prompt_ids(tiny_lm, prompt, raw=True)])
    hf = tiny_model(lean_forward=False).model.generate(ids, max_new_tokens=12, do_sample=False,
                                                       min_new_tokens=0)[0, ids.shape[1]:]
    assert on == off
    assert on == hf.tolist()[: len(on)]


def test_sampling_is_reproducible_with_a_seed(tiny_lm, calibration):
    a = generate_ids(tiny_lm, "Once upon", calibration, max_new_tokens=10, temperature=1.0, seed=7)
    b = generate_ids(tiny_lm, "Once upon", calibration, max_new_tokens=10, temperature=1.0, seed=7)
    c = generate_ids(tiny_lm, "Once upon", calibration, max_new_tokens=10, temperature=1.0, seed=8)
    assert a == b
    assert a != c


def test_top_k_one_is_greedy(tiny_lm, calibration):
    greedy = generate_ids(tiny_lm, "Once upon", calibration, max_new_tokens=8)
    topk = generate_ids(tiny_lm, "Once upon", calibration, max_new_tokens=8, temperature=0.7, top_k=1, seed=1)
    assert greedy == topk


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    cfg = GenConfig("x", temperature=1.0, top_p=0.7)
    gen = torch.Generator().manual_seed(0)
    picks = {select_token(logits, cfg, gen) for _ in range(300)}
    assert picks == {0, 1}


def test_stream_events_tile_the_run(tiny_lm, calibration, store):
    gen = Generation(tiny_lm, GenConfig("Tell me", raw=True, max_new_tokens=16), store=store, calibration=calibration)
    events = list(gen)
    result = gen.result
    assert len(events) == result["n_new_tokens"] == len(gen.steps)
    times = [e.t_ms for e in events]
    assert times == sorted(times)
    assert result["total_ms"] == pytest.approx(sum(s["wall_ms"] for s in gen.steps), rel=1e-9)
    assert "".join(e.piece for e in events) == result["text"]
    row = store.run(result["run_id"])
    assert row["status"] == "ok" and row["n_new_tokens"] == len(events)
    assert len(store.tokens(result["run_id"])) == len(events)
    assert len(store.steps(result["run_id"])) == len(events)


def test_each_step_reaches_the_journal_at_once_and_the_database_at_the_end(tiny_lm, calibration, store):
    from engine.store import journal

    gen = Generation(tiny_lm, GenConfig("Tell me", raw=True, max_new_tokens=12, ignore_eos=True), store=store,
                     calibration=calibration)
    it = iter(gen)
    for _ in range(5):
        next(it)
    path = journal.journal_path(store.path, gen.run_id)
    kept = journal.read(path)
    assert [t["token_id"] for t in kept["tokens"]] == gen.token_ids[:5]
    assert len(kept["steps"]) == 5 and kept["text"] == gen.text
    assert not journal.owner_gone(path)  # the live run holds it
    assert store.tokens(gen.run_id).empty  # no database write while the run goes on
    list(it)
    assert len(store.tokens(gen.run_id)) == 12 and len(store.steps(gen.run_id)) == 12
    assert not path.exists()


def test_closing_the_stream_records_a_cancelled_run(tiny_lm, calibration, store):
    gen = Generation(tiny_lm, GenConfig("Tell me", raw=True, max_new_tokens=50), store=store, calibration=calibration)
    it = iter(gen)
    for _ in range(3):
        next(it)
    it.close()
    row = store.run(gen.run_id)
    assert row["status"] == "cancelled"
    assert row["n_new_tokens"] == 3
    assert len(store.tokens(gen.run_id)) == 3


def test_an_engine_failure_is_a_recorded_error_run(tiny_lm, calibration, store, monkeypatch):
    gen = Generation(tiny_lm, GenConfig("Tell me", raw=True, max_new_tokens=5), store=store, calibration=calibration)

    def broken(*a, **k):
        raise RuntimeError("simulated kernel failure")

    # set in the instance's own dict, so the undo removes it rather than leaving a bound method of this model
    # there (a shallow copy, as an early-exit draft makes, would then call this model's forward)
    monkeypatch.setitem(vars(tiny_lm.model), "forward", broken)
    with pytest.raises(RuntimeError):
        gen.run()
    row = store.run(gen.run_id)
    assert row["status"] == "error"
    assert "simulated kernel failure" in row["error"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt="   "), "empty"),
    (dict(prompt="hi", max_new_tokens=0), "max_new_tokens"),
    (dict(prompt="hi", max_new_tokens=100000), "max_new_tokens"),
    (dict(prompt="hi", temperature=-1), "temperature"),
    (dict(prompt="hi", temperature=float("nan")), "temperature"),
    (dict(prompt="hi", temperature=float("inf")), "temperature"),
    (dict(prompt="hi", top_p=0), "top_p"),
    (dict(prompt="hi", top_p=float("nan")), "top_p"),
    (dict(prompt="hi", seed=2**64), "seed"),
    (dict(prompt="hi", seed=-1), "seed"),
    (dict(prompt="hi", speculative_k=0), "draft length"),
    (dict(prompt="bad \udcff bytes"), "UTF-8"),
    (dict(prompt="hi", max_new_tokens=2.5), "max_new_tokens"),
    (dict(prompt="hi " * 400, max_new_tokens=200), "context"),
])
def test_bad_input_is_one_sentence_and_records_nothing(tiny_lm, calibration, store, kwargs, message):
    with pytest.raises(GenerationError, match=message):
        Generation(tiny_lm, GenConfig(raw=True, **kwargs), store=store, calibration=calibration)
    assert store.runs().empty


def test_text_stream_never_splits_a_character(tiny_lm):
    ids = tiny_lm.tokenizer("naïve 東京 🙂 done")["input_ids"]
    stream = TextStream(tiny_lm.tokenizer)
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) == tiny_lm.tokenizer.decode(ids)
    assert not any("\ufffd" in p for p in pieces)


def test_the_tokenizers_decode_stream_gives_the_pieces_of_decoding_twice(tiny_lm):
    """A fast tokenizer's DecodeStream makes each piece in one call; decoding the pending tokens twice, the way for
    other tokenizers, makes the same pieces: on text with multi-byte characters and on random ids (lone bytes of a
    character, special tokens)."""
    import random

    tokenizer, rng = tiny_lm.tokenizer, random.Random(0)
    runs = [tokenizer("naïve 東京 🙂 done\n\n  x\t.")["input_ids"]]
    runs += [[rng.randrange(tokenizer.vocab_size) for _ in range(120)] for _ in range(10)]
    runs += [[rng.randrange(300) for _ in range(120)] for _ in range(10)]
    for ids in runs:
        fast, twice = TextStream(tokenizer), TextStream(tokenizer)
        twice.fast = None
        assert fast.fast is not None
        assert [fast.push(i) for i in ids] == [twice.push(i) for i in ids]


def test_a_byte_fallback_tokenizer_s_bytes_that_stop_making_a_character_keep_the_stream_going():
    """Under a byte-fallback decoder a byte can turn a character already given back into replacement marks, and
    DecodeStream then refuses the next token (its text no longer starts with what it gave): the stream goes on
    decoding twice, with the pieces that way gives."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {**{f"<0x{b:02X}>": b for b in range(256)}, "a": 256, "<unk>": 257}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)
    ids = [0xC3, 0xA9, 0x80, 256, 256]
    fast, twice = TextStream(tokenizer), TextStream(tokenizer)
    twice.fast = None
    assert fast.fast is not None
    assert [fast.push(i) for i in ids] == [twice.push(i) for i in ids]
    assert fast.fast is None  # it met the refusal


def test_a_bf16_kv_cache_beside_fp32_weights_halves_the_cache_and_its_accounting(tiny_lm, calibration):
    runs = {}
    for kv in ("auto", "bf16"):
        gen = Generation(tiny_lm, GenConfig("Hello there", raw=True, max_new_tokens=8, ignore_eos=True, kv_dtype=kv),
                         calibration=calibration, telemetry=False)
        runs[kv] = gen.run()
    assert runs["auto"]["kv_dtype"] == "fp32" and runs["bf16"]["kv_dtype"] == "bf16"
    assert runs["bf16"]["kv_cache_bytes"] * 2 == runs["auto"]["kv_cache_bytes"] > 0
    assert runs["bf16"]["kv_bytes_per_token"] * 2 == runs["auto"]["kv_bytes_per_token"]


def test_a_separate_kv_precision_needs_the_lean_forward(calibration):
    with pytest.raises(GenerationError, match="lean forward"):
        Generation(tiny_model(lean_forward=False), GenConfig("hi", raw=True, kv_dtype="bf16"), calibration=calibration)
    with pytest.raises(GenerationError, match="KV-cache precision 'int3'"):
        Generation(tiny_model(), GenConfig("hi", raw=True, kv_dtype="int3"), calibration=calibration)


@pytest.mark.parametrize("where", ["before its rows", "between its step row and its token rows"])
def test_a_stop_while_a_step_is_being_recorded_leaves_a_consistent_run(tiny_lm, store, calibration, monkeypatch, where):
    """Ctrl-C or SIGTERM (raised as KeyboardInterrupt) may land after a step took its tokens and before
    its rows exist: the run keeps what its rows say, tokens and text alike."""
    real_account, real_columns, calls = generate.account, generate.columns, []

    def account(*args, **kwargs):
        calls.append(1)
        if where == "before its rows" and len(calls) == 5:
            raise KeyboardInterrupt
        return real_account(*args, **kwargs)

    def columns(row):
        if where != "before its rows" and len(calls) == 5 and type(row).__name__ == "TokenRow":
            raise KeyboardInterrupt
        return real_columns(row)

    monkeypatch.setattr(generate, "account", account)
    monkeypatch.setattr(generate, "columns", columns)
    gen = Generation(tiny_lm, GenConfig("Tell me", raw=True, max_new_tokens=12, ignore_eos=True), store=store,
                     calibration=calibration, telemetry=False)
    with pytest.raises(KeyboardInterrupt):
        gen.run()
    run = store.run(gen.run_id)
    tokens, steps = store.tokens(gen.run_id), store.steps(gen.run_id)
    assert run["status"] == "cancelled" and run["n_new_tokens"] == len(tokens) == steps["n_emitted"].sum() == 4
    assert list(run["token_ids"]) == list(tokens["token_id"]) == gen.token_ids
    assert run["output"] == "".join(tokens["piece"]) == gen.text


def test_objects_alive_before_a_run_are_spared_the_collector_until_the_last_run_ends(tiny_lm, calibration):
    import gc

    def gen():
        return Generation(tiny_lm, GenConfig("Once upon", raw=True, max_new_tokens=6, ignore_eos=True),
                          calibration=calibration, telemetry=False)

    assert gc.get_freeze_count() == 0
    first, second = iter(gen()), iter(gen())
    next(first)
    assert gc.get_freeze_count() > 1000  # the model's modules and tensors, the libraries
    next(second)
    list(first)  # the first run ends while the second still decodes: the freeze stays
    assert gc.get_freeze_count() > 1000
    second.close()  # a cancelled run lifts it like a finished one
    assert gc.get_freeze_count() == 0
    gen().run()
    assert gc.get_freeze_count() == 0
