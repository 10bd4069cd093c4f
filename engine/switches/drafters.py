"""The drafters of speculative decoding: what proposes the guesses that one target forward checks.

Each is a Drafter: propose() returns a chain of tokens or a Tree of guesses; attach() and observe()
are no-ops unless the drafter shares the target's cache or learns from its predictions."""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch
from transformers import DynamicCache

from engine.errors import UserError
from engine.model.loader import LoadedModel
from engine.switches.names import MAX_K  # noqa: F401 (kept here for the decode loop and the pages)

MAX_WINDOW = 16
MAX_GUESSES = 16


class SpeculativeError(UserError):
    """A speculative setting that cannot run."""


class Drafter:
    """What a speculative method gives the decode loop."""

    name = ""

    def propose(self, ids: list[int], k: int, sample=None, generator=None) -> "list[int] | Tree":
        """Up to k guessed tokens after `ids` (a chain), or a Tree of guesses. With `sample`
        (logits -> probabilities) a drafter that samples keeps its distributions in draft_probs."""
        return []

    def attach(self, cache, kv_dtype=None) -> None:
        """Called with the target's KV cache before the first step (a drafter that shares it)."""

    def observe(self, predicted: list[int], accepted: int) -> None:
        """Called after each verification with the target's greedy predictions for every input
        position after the pending token, and how many guesses were accepted."""


class PromptLookup(Drafter):
    """Drafts the continuation of the latest earlier match of the sequence's last n tokens
    (n from max_ngram down to 1): no second model, free guesses wherever the output copies text."""

    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 3):
        if max_ngram < 1:
            raise SpeculativeError(f"The n-gram size must be at least 1, not {max_ngram}.")
        self.max_ngram = max_ngram

    def propose(self, ids: list[int], k: int, sample=None, generator=None) -> list[int]:
        for n in range(min(self.max_ngram, len(ids) - 1), 0, -1):
            tail = ids[-n:]
            for start in range(len(ids) - n - 1, -1, -1):
                if ids[start:start + n] == tail:
                    return ids[start + n:start + n + k]
        return []


class Jacobi(Drafter):
    """Jacobi decoding: the target's own predictions for the positions after the accepted ones, from
    the previous verification, are the next guesses (a fixed-point iteration with no second model);
    positions never predicted yet are guessed as a repeat of the last token. At worst it is greedy
    with one token per forward."""

    name = "jacobi"

    def __init__(self):
        self.guesses: list[int] = []

    def propose(self, ids: list[int], k: int, sample=None, generator=None) -> list[int]:
        guesses = self.guesses[:k]
        return guesses + [ids[-1]] * (k - len(guesses))

    def observe(self, predicted: list[int], accepted: int) -> None:
        """predicted[i]: the target's token after the pending token and drafts[:i]."""
        self.guesses = predicted[accepted + 1:]


@dataclass
class Tree:
    """Guesses that are not one chain: extra input tokens placed after the pending ones, each at a
    position `offsets[i]` past the last pending token, seeing the pending tokens and the extra
    tokens `visible[i]` marks. `branches` are the chains to verify, as lists of indices into
    `tokens`, each continuing the pending tokens."""
    tokens: list[int]
    offsets: list[int]
    visible: torch.Tensor
    branches: list[list[int]]


class Lookahead(Drafter):
    """Lookahead decoding (Fu et al., 2024), greedy. Each step's forward carries, beside the pending
    tokens, a lookahead branch: a window of W columns and N-1 levels of guesses, where each column
    is a Jacobi trajectory (level l, column i sits i + l positions ahead and sees level 0 up to
    column i and its own column below it). The target's outputs on the last level complete one
    n-gram per column; the n-grams go into a pool keyed by their first token, and the levels shift
    up with those outputs as the new last level. Also in the same forward, a verification branch:
    up to G pooled n-grams that start with the last token, each checked as a chain; the longest
    agreeing one is emitted. The pool starts with the prompt's n-grams and takes in the output's."""

    name = "lookahead"

    def __init__(self, window: int = 4, ngram: int = 3, guesses: int = 4):
        if not 1 <= window <= MAX_WINDOW or not 2 <= ngram <= 6 or not 1 <= guesses <= MAX_GUESSES:
            raise SpeculativeError(f"Lookahead needs a window of 1-{MAX_WINDOW}, an n-gram size of 2-6 and 1-"
                                   f"{MAX_GUESSES} guesses, not W={window}, N={ngram}, G={guesses}.")
        self.w, self.n, self.g = window, ngram, guesses
        self.levels: list[list[int]] = []
        self.pool: dict[int, dict[tuple, None]] = {}  # first token -> continuations, oldest first
        self.pooled_upto = 0  # ids before this index have had their n-grams pooled

    def _remember(self, gram: tuple) -> None:
        continuations = self.pool.setdefault(gram[0], {})
        continuations.pop(gram[1:], None)
        continuations[gram[1:]] = None

    def propose(self, ids: list[int], k: int, sample=None, generator=None) -> Tree:
        for end in range(max(self.pooled_upto, self.n), len(ids) + 1):
            self._remember(tuple(ids[end - self.n:end]))
        self.pooled_upto = len(ids) + 1
        if not self.levels:  # start from tokens of the text so far, each column shifted by one
            self.levels = [[ids[(i + level) % len(ids)] for i in range(self.w)] for level in range(self.n - 1)]
        tokens, offsets = [], []
        for level, row in enumerate(self.levels):
            tokens += row
            offsets += [1 + i + level for i in range(self.w)]
        size = len(tokens)
        guesses = list(self.pool.get(ids[-1], {}))[-self.g:]
        for guess in guesses:
            tokens += guess
            offsets += list(range(1, len(guess) + 1))
        visible = torch.zeros(len(tokens), len(tokens), dtype=torch.bool)
        for level in range(self.n - 1):
            for i in range(self.w):
                at = level * self.w + i
                visible[at, :i + 1] = True  # level 0 up to this column
                visible[at, [lv * self.w + i for lv in range(1, level + 1)]] = True  # this column below
        branches = []
        for g, guess in enumerate(guesses):
            start = size + g * (self.n - 1)
            branch = list(range(start, start + len(guess)))
            for j, at in enumerate(branch):
                visible[at, branch[:j + 1]] = True
            branches.append(branch)
        return Tree(tokens, offsets, visible, branches)

    def observe(self, predicted: list[int], accepted: int) -> None:
        """predicted[1 + i]: the target's token after extra token i (its own context)."""
        last = (self.n - 2) * self.w
        outputs = [predicted[1 + last + i] for i in range(self.w)]
        for i in range(self.w):
            self._remember(tuple(row[i] for row in self.levels) + (outputs[i],))
        self.levels = self.levels[1:] + [outputs]


class DraftModel(Drafter):
    """Greedy drafts from a smaller model that shares the target's tokenizer, with its own KV cache
    kept in step with the accepted tokens."""

    name = "draft"

    def __init__(self, draft: LoadedModel):
        self.lm = draft
        self.cache = DynamicCache(config=draft.config)
        self.cached_ids: list[int] = []  # the tokens the draft cache holds entries for

    @torch.inference_mode()
    def propose(self, ids: list[int], k: int, sample=None, generator=None) -> list[int]:
        """k greedy drafts, or k drafts sampled from sample(logits) (their distributions are kept in
        draft_probs for speculative sampling)."""
        keep = 0
        for a, b in zip(self.cached_ids, ids):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(ids) - 1)  # always feed at least the last token to get its logits
        crop_cache(self.cache, keep)
        drafts = self._draft(ids[keep:], k, self.cache, sample, generator)
        self.cached_ids = ids + drafts[:-1]
        return drafts

    def _draft(self, feed: list[int], k: int, cache, sample, generator, **extra) -> list[int]:
        drafts: list[int] = []
        self.draft_probs = []
        for _ in range(k):
            out = self.lm.model(input_ids=torch.tensor([feed], device=self.lm.device), cache=cache,
                                use_cache=True, logits_to_keep=1, **extra)
            logits = out.logits[0, -1].float().cpu()
            if sample is None:
                token = int(logits.argmax())
            else:
                probs = sample(logits)
                token = int(torch.multinomial(probs, 1, generator=generator))
                self.draft_probs.append(probs)
            drafts.append(token)
            feed = [token]
        return drafts


class EarlyExitDraft(DraftModel):
    """The target's first layers, its final norm and head as the draft (self-speculation). Attached
    to the target's KV cache, it drafts on top of the entries the target has already written for
    those layers, so it never re-reads the tokens accepted while it was not drafting (after a pause
    of the adaptive setting, a catch-up of up to 128 tokens); its own entries are removed after."""

    def __init__(self, draft: LoadedModel, layers: int):
        super().__init__(draft)
        self.layers = layers
        self.shared = None
        self.extra: dict = {}

    def attach(self, cache, kv_dtype=None) -> None:
        self.shared = cache
        self.extra = {"kv_dtype": kv_dtype} if kv_dtype is not None else {}

    @torch.inference_mode()
    def propose(self, ids: list[int], k: int, sample=None, generator=None) -> list[int]:
        start = self.shared.get_seq_length() if self.shared is not None else len(ids)
        if start >= len(ids):  # no cache to share, or it holds the last token already
            return super().propose(ids, k, sample, generator)
        drafts = self._draft(ids[start:], k, self.shared, sample, generator, **self.extra)
        for layer in self.shared.layers[:self.layers]:
            layer.crop(start - layer.get_seq_length())
        return drafts


def crop_cache(cache, keep: int) -> None:
    """Keep the first `keep` positions of a transformers cache (its crop takes how many to drop)."""
    drop = cache.get_seq_length() - keep
    if drop > 0:
        cache.crop(-drop)


def _shallow(module: torch.nn.Module) -> torch.nn.Module:
    """A copy that shares the module's tensors but has its own list of children to replace."""
    twin = copy.copy(module)
    twin._modules = dict(module._modules)
    return twin


def early_exit(lm: LoadedModel, layers: int) -> LoadedModel:
    """The target's first `layers` decoder layers with its final norm and head, sharing its weights."""
    total = lm.config.num_hidden_layers
    if not 1 <= layers < total:
        raise SpeculativeError(f"An early-exit draft needs between 1 and {total - 1} layers, not {layers}.")
    model, inner = _shallow(lm.model), _shallow(lm.model.model)
    model.config = copy.deepcopy(lm.model.config)
    model.config.num_hidden_layers = layers
    inner.layers = torch.nn.ModuleList(list(lm.model.model.layers)[:layers])
    inner.config = model.config
    model.model = inner
    return replace(lm, name=f"{lm.name} (first {layers} layers)", model=model)


def same_tokenizer(a, b) -> bool:
    return a.get_vocab() == b.get_vocab()
