"""Speculative decoding: drafts verified in one forward, output identical to plain greedy."""
import pytest
import torch
from transformers import DynamicCache, PreTrainedTokenizerFast
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from engine.run.generate import Generation, GenConfig, GenerationError
from engine.paths import workloads
from engine.model.loader import LoadedModel, tiny_model
from engine.switches.drafters import Jacobi, Lookahead, PromptLookup, SpeculativeError, Tree, crop_cache, early_exit
from engine.switches.speculative import Backoff, expected_speedup, greedy_accept, make_drafter, next_k, tree_accept


def test_prompt_lookup_continues_the_latest_match():
    lookup = PromptLookup(max_ngram=2)
    assert lookup.propose([1, 2, 3, 4, 9, 1, 2], 2) == [3, 4]
    assert lookup.propose([5, 6, 7, 5, 6, 8, 5, 6], 3) == [8, 5, 6]  # the latest match wins
    assert lookup.propose([1, 2, 3], 4) == []


def test_jacobi_guesses_the_targets_leftover_predictions():

    jacobi = Jacobi()
    assert jacobi.propose([4, 9], 3) == [9, 9, 9]
    jacobi.observe([9, 5, 6, 7], accepted=1)  # kept the first draft and the target's 5; 6 and 7 are left
    assert jacobi.propose([4, 9, 9, 5], 3) == [6, 7, 5]


def test_lookahead_lays_out_its_window_and_verifies_pooled_ngrams():
    look = Lookahead(window=2, ngram=3, guesses=2)
    tree = look.propose([5, 6, 7, 5], 4)
    # the pool holds the text's 3-grams: after 5 came (6, 7); the window starts from the text's tokens
    assert look.pool[5] == {(6, 7): None}
    assert tree.tokens == [5, 6, 6, 7] + [6, 7]
    assert tree.offsets == [1, 2, 2, 3] + [1, 2]
    v = tree.visible.int().tolist()
    assert v[0][:4] == [1, 0, 0, 0] and v[1][:4] == [1, 1, 0, 0]  # level 0: a causal row
    assert v[2][:4] == [1, 0, 1, 0] and v[3][:4] == [1, 1, 0, 1]  # level 1: level 0 up to its column, itself
    assert v[4] == [0, 0, 0, 0, 1, 0] and v[5] == [0, 0, 0, 0, 1, 1]  # the guess sees only itself
    assert tree.branches == [[4, 5]]
    # the target's outputs: after the pending token 6, after the guess 6 -> 7, then 8
    predicted = [6, 0, 0, 9, 4, 7, 8]
    emitted, path = tree_accept(predicted, tree)
    assert emitted == [6, 7, 8] and path == [4, 5]
    look.observe(predicted, len(emitted) - 1)
    assert look.levels == [[6, 7], [9, 4]]  # level 1 moved up, the last level's outputs below it
    # each column completed an n-gram: (5, 6) + 9 and (6, 7) + 4
    assert list(look.pool[5]) == [(6, 7), (6, 9)] and list(look.pool[6]) == [(7, 5), (7, 4)]


def test_tree_accept_takes_the_longest_agreeing_branch_or_the_targets_token():
    tree = Tree(tokens=[1, 2, 3, 4], offsets=[1, 2, 1, 2], visible=torch.eye(4, dtype=torch.bool),
                branches=[[0, 1], [2, 3]])
    assert tree_accept([3, 2, 9, 4, 5], tree) == ([3, 4, 5], [2, 3])
    assert tree_accept([7, 0, 0, 0, 0], tree) == ([7], [])


def test_adaptive_backoff_pauses_guessing_that_loses_and_tries_again():
    gate = Backoff(plain_first=2, first_pause=4)
    for _ in range(2):  # plain steps measure 10 ms per token
        assert not gate.allows()
        gate.record(10.0, 1, guessed=False)
    assert gate.allows()
    gate.record(15.0, 1, guessed=True)  # 5 ms lost: within half a plain step, keep guessing
    assert gate.allows()
    gate.record(16.0, 1, guessed=True)  # 11 ms lost in all: pause
    for _ in range(4):
        assert not gate.allows()
        gate.record(10.0, 1, guessed=False)
    assert gate.allows() and gate.wait == 8
    for _ in range(5):  # guesses that pay (3 tokens for 15 ms) bank savings, up to four plain steps
        gate.record(15.0, 3, guessed=True)
    assert gate.balance == pytest.approx(40.0)
    gate.record(30.0, 1, guessed=True)  # a miss after savings: still guessing
    assert gate.allows()


@torch.inference_mode()
def test_an_early_exit_draft_drafts_on_the_targets_cache_and_leaves_it_as_it_was(tiny_lm):
    ids = [1, 5, 9, 4, 7, 3]
    cache = DynamicCache(config=tiny_lm.config)
    tiny_lm.model(input_ids=torch.tensor([ids[:4]]), cache=cache, use_cache=True)  # the target has seen 4 tokens
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    shared = make_drafter(tiny_lm, GenConfig("x", speculative="draft", draft_model="self-exit:1"))
    shared.attach(cache)
    assert shared.propose(ids, 3) == make_drafter(tiny_lm, GenConfig("x", speculative="draft", draft_model="self-exit:1")).propose(ids, 3)
    assert all(torch.equal(layer.keys, k) and torch.equal(layer.values, v)
               for layer, (k, v) in zip(cache.layers, before))


def test_lookahead_needs_the_lean_forward(calibration):
    with pytest.raises(GenerationError, match="lean forward"):
        Generation(tiny_model(lean_forward=False), GenConfig("hi", raw=True, speculative="lookahead"),
                   calibration=calibration)


@pytest.mark.parametrize("setting", [dict(speculative="lookahead"), dict(speculative="lookahead", kv_cache=False),
                                     dict(speculative="lookahead", window=3, max_ngram=4, guesses=2, adaptive=True)])
def test_lookahead_on_the_tiny_model_gives_greedys_tokens(tiny_lm, calibration, setting):
    prompt = "a b c a b c a b c a b"
    run = lambda **kw: Generation(tiny_lm, GenConfig(prompt, raw=True, max_new_tokens=20, ignore_eos=True, **kw),  # noqa: E731
                                  calibration=calibration, telemetry=False).run()["token_ids"]
    assert run(**setting) == run()


def test_greedy_accept_keeps_the_agreeing_prefix_and_adds_the_targets_token():
    predicted = [7, 8, 2, 5]  # the target's token after the pending one and after each draft
    assert greedy_accept(predicted, [7, 8, 9]) == [7, 8, 2]
    assert greedy_accept(predicted, [1, 8, 2]) == [7]
    assert greedy_accept(predicted, [7, 8, 2]) == [7, 8, 2, 5]


def test_adaptive_k_and_the_expected_speedup_formula():
    assert next_k(4, 4, 4, True, 16) == 5 and next_k(4, 4, 1, True, 16) == 3 and next_k(1, 1, 0, True, 16) == 1
    assert next_k(4, 4, 1, False, 16) == 4
    assert expected_speedup(0.0, 4, 0.0) == pytest.approx(1.0)
    assert expected_speedup(0.5, 2, 0.0) == pytest.approx((1 - 0.125) / 0.5)
    assert expected_speedup(0.8, 4, 0.25) == pytest.approx((1 - 0.8 ** 5) / (0.2 * 2))


def test_crop_cache_keeps_the_first_positions(tiny_lm):
    cache = DynamicCache(config=tiny_lm.config)
    with torch.inference_mode():
        tiny_lm.model(input_ids=torch.tensor([[1, 2, 3, 4, 5]]), cache=cache, use_cache=True)
    crop_cache(cache, 3)
    assert cache.get_seq_length() == 3


def test_early_exit_shares_weights_and_leaves_the_target_whole(tiny_lm):
    draft = early_exit(tiny_lm, 1)
    assert len(draft.model.model.layers) == 1 and len(tiny_lm.model.model.layers) == 2
    assert tiny_lm.config.num_hidden_layers == 2
    assert draft.model.model.layers[0].mlp.gate_up_proj.weight is tiny_lm.model.model.layers[0].mlp.gate_up_proj.weight
    with pytest.raises(SpeculativeError, match="between 1 and 1"):
        early_exit(tiny_lm, 2)


def test_a_draft_model_with_another_tokenizer_is_refused(tiny_lm):
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    other = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="[UNK]")))
    stranger = LoadedModel(name="stranger", model=tiny_lm.model, tokenizer=other, device=tiny_lm.device)
    with pytest.raises(SpeculativeError, match="tokenizer"):
        make_drafter(tiny_lm, GenConfig("x", speculative="draft", draft_model="some/model"), load=lambda _: stranger)


@pytest.mark.parametrize("kwargs, words", [
    (dict(speculative="medusa"), "Unknown speculative method"),
    (dict(speculative="prompt-lookup", temperature=0.7), "greedy"),
    (dict(speculative="prompt-lookup", speculative_k=0), "between 1 and"),
    (dict(speculative="draft"), "draft-model"),
    (dict(speculative="lookahead", window=0), "window of 1-16"),
    (dict(speculative="lookahead", max_ngram=1), "n-gram size of 2-6"),
])
def test_bad_speculative_settings_get_one_sentence(tiny_lm, calibration, kwargs, words):
    with pytest.raises(GenerationError, match=words):
        Generation(tiny_lm, GenConfig("hello", raw=True, **kwargs), calibration=calibration)


def greedy(lm, calibration, prompt, **kw):
    # 16 tokens hold several verify steps of every method, rejected drafts among them (asserted below)
    gen = Generation(lm, GenConfig(prompt, max_new_tokens=16, **kw), calibration=calibration, telemetry=False)
    gen.run()
    return gen


SETTINGS = [
    dict(speculative="prompt-lookup", speculative_k=4),
    dict(speculative="prompt-lookup", speculative_k=8, adaptive=True),
    dict(speculative="draft", draft_model="self-int8", speculative_k=3),
    dict(speculative="draft", draft_model="self-exit:24", speculative_k=2, adaptive=True),
    dict(speculative="prompt-lookup", speculative_k=4, kv_cache=False),
    dict(speculative="jacobi", speculative_k=4),
    dict(speculative="jacobi", speculative_k=4, adaptive=True),
    dict(speculative="lookahead", window=4, max_ngram=3, guesses=4),
    dict(speculative="lookahead", window=2, max_ngram=4, guesses=2, kv_cache=False),
]


@pytest.mark.integration
@pytest.mark.parametrize("workload", list(workloads()))
def test_every_method_gives_plain_greedys_tokens(default_lm, calibration, workload):
    prompt = workloads()[workload]["prompt"]
    plain = greedy(default_lm, calibration, prompt).token_ids
    rejections = 0
    for setting in SETTINGS:
        gen = greedy(default_lm, calibration, prompt, **setting)
        assert gen.token_ids == plain, setting
        steps = gen.steps
        assert sum(s["n_emitted"] for s in steps) == len(plain)
        for s in steps:
            total = sum(s[f"{b}_ms"] for b in ("physical", "memory", "compute", "time", "decision"))
            assert total == pytest.approx(s["wall_ms"], rel=1e-6)
        rejected = [s for s in steps if s["drafted"] > s["accepted"]]
        assert all(s["decision_ms"] > 0 for s in rejected)
        rejections += len(rejected)
        summary = gen.result["speculative"]
        assert summary["drafted"] == sum(s["drafted"] for s in steps)
        assert summary["tokens_per_target_forward"] == pytest.approx(len(plain) / len(steps))
    assert rejections > 0  # the equality covers drafts thrown away, not only drafts kept


def second_tokens(lm, calibration, seeds, **kw):
    """The second generated token of runs seeded with each of seeds (the first one a draft can change)."""
    counts = {}
    for seed in seeds:
        gen = Generation(lm, GenConfig("Once upon", raw=True, max_new_tokens=3, ignore_eos=True, temperature=1.0,
                                       top_k=4, seed=seed, **kw), calibration=calibration, telemetry=False)
        token = gen.run()["token_ids"][1]
        counts[token] = counts.get(token, 0) + 1
    return counts


def same_distribution_p(a: dict, b: dict) -> float:
    """The chi-square test's p-value that two samples of tokens come from one distribution; tokens too rare
    for the test (under 5 expected in either sample) are pooled into one category."""
    from scipy.stats import chi2_contingency

    na, nb = sum(a.values()), sum(b.values())
    common = [t for t in set(a) | set(b) if min(na, nb) * (a.get(t, 0) + b.get(t, 0)) / (na + nb) >= 5]
    table = [[a.get(t, 0) for t in common], [b.get(t, 0) for t in common]]
    rest = [na - sum(table[0]), nb - sum(table[1])]
    if sum(rest):
        table = [row + [r] for row, r in zip(table, rest)]
    return chi2_contingency(table)[1]


@pytest.mark.slow  # hundreds of seeded runs
def test_speculative_sampling_follows_the_target_distribution(tiny_lm, calibration):
    # 300 draws each tell apart rules that break the target's distribution (checked against three wrong acceptance
    # rules: always keep the draft, redraw from the target, min(1, q/p)); every run is seeded, so the p-values
    # are the same on every run, and the seeds differ between the samples, so the samples are independent
    n = 300
    plain = second_tokens(tiny_lm, calibration, range(n))
    speculative = second_tokens(tiny_lm, calibration, range(n, 2 * n), speculative="draft", draft_model="self-exit:1",
                                speculative_k=2)
    draft_alone = second_tokens(early_exit(tiny_lm, 1), calibration, range(2 * n, 3 * n))
    # the draft's own distribution is told apart from the target's, so the test could see a wrong acceptance rule
    assert same_distribution_p(plain, draft_alone) < 1e-4
    assert same_distribution_p(plain, speculative) > 0.01
