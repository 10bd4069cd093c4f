"""Speculative decoding: cheap guesses proposed, then confirmed many at once by one target forward.

A drafter proposes up to K tokens after the current sequence; the target model scores the pending
token plus all drafts in one forward; greedy verification keeps the longest prefix of drafts the
target agrees with and adds the target's own next token, so the output is exactly plain greedy's.
With sampling and a draft model, speculative sampling keeps the target's distribution instead.
The KV cache is cropped back past the first rejected position."""
from __future__ import annotations

import copy
from dataclasses import replace

import torch
from transformers import DynamicCache

from .models import LoadedModel

METHODS = ("none", "prompt-lookup", "draft", "jacobi")
MAX_K = 16


class SpeculativeError(Exception):
    """A speculative setting that cannot run; the message is one sentence for the user."""


class PromptLookup:
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


class Jacobi:
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


class DraftModel:
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
        feed = ids[keep:]
        drafts: list[int] = []
        self.draft_probs = []
        for _ in range(k):
            out = self.lm.model(input_ids=torch.tensor([feed], device=self.lm.device), cache=self.cache,
                                use_cache=True, logits_to_keep=1)
            logits = out.logits[0, -1].float().cpu()
            if sample is None:
                token = int(logits.argmax())
            else:
                probs = sample(logits)
                token = int(torch.multinomial(probs, 1, generator=generator))
                self.draft_probs.append(probs)
            drafts.append(token)
            feed = [token]
        self.cached_ids = ids + drafts[:-1]
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


def make_drafter(target: LoadedModel, method: str, draft: str | None = None, max_ngram: int = 3,
                 load=None):
    """The drafter for a method: prompt lookup, or a draft model given as 'self-int8',
    'self-exit:K', or a model id or folder (loaded with `load`)."""
    if method == "prompt-lookup":
        return PromptLookup(max_ngram)
    if method == "jacobi":
        return Jacobi()
    if method != "draft":
        raise SpeculativeError(f"Unknown speculative method '{method}': use one of {', '.join(METHODS)}.")
    if not draft:
        raise SpeculativeError("The draft method needs --draft-model: self-int8, self-exit:K, or a model id or folder.")
    if draft == "self-int8":
        from .quant import variant

        return DraftModel(variant(target, "int8-dyn" if target.device.type == "cpu" else "int8-wo"))
    if draft.startswith("self-exit:"):
        try:
            layers = int(draft.split(":", 1)[1])
        except ValueError:
            raise SpeculativeError(f"'{draft}' should name a layer count, like self-exit:8.") from None
        return DraftModel(early_exit(target, layers))
    model = load(draft)
    if not same_tokenizer(model.tokenizer, target.tokenizer):
        raise SpeculativeError(f"The draft model {model.name} does not share {target.name}'s tokenizer, so its "
                               "guesses cannot be checked token by token.")
    return DraftModel(model)


def greedy_accept(logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """Tokens to emit: the drafts the target agrees with, then the target's own next token.
    logits[i] is the target's prediction after the pending token and drafts[:i]."""
    predicted = logits.argmax(dim=-1).tolist()
    emitted = []
    for draft, target in zip(drafts, predicted):
        if draft != target:
            break
        emitted.append(draft)
    emitted.append(predicted[len(emitted)])
    return emitted


def sample_accept(target: torch.Tensor, draft: list[torch.Tensor], drafts: list[int], generator=None) -> list[int]:
    """Speculative sampling: keep draft i with probability min(1, p(x)/q(x)); at the first rejection
    draw from the normalised residual max(0, p - q) and stop; if every draft is kept, draw one more
    from the target. The tokens then follow the target's distribution exactly.
    target[i] is the target's distribution after the pending token and drafts[:i]."""
    emitted = []
    for i, token in enumerate(drafts):
        p, q = target[i, token], draft[i][token]
        if torch.rand(1, generator=generator).item() * q <= p:
            emitted.append(token)
            continue
        residual = (target[i] - draft[i]).clamp(min=0)
        residual = residual if residual.sum() > 0 else target[i]
        emitted.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return emitted
    emitted.append(int(torch.multinomial(target[len(drafts)], 1, generator=generator)))
    return emitted


def next_k(k: int, drafted: int, accepted: int, adaptive: bool, k_max: int) -> int:
    """Adaptive draft length: one longer after full acceptance, one shorter after a rejection."""
    if not adaptive or not drafted:
        return k
    return min(k + 1, k_max) if accepted == drafted else max(k - 1, 1)


def expected_speedup(alpha: float, k: float, c: float) -> float | None:
    """(1 - alpha^(K+1)) / ((1 - alpha)(K c + 1)): tokens per target forward over the cost of drafting
    K tokens at c target-steps each plus one verification."""
    if k <= 0:
        return None
    if alpha >= 1:
        return (k + 1) / (k * c + 1)
    return (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1))


def summary(steps: list[dict], n_new: int) -> dict:
    """Drafted and accepted counts, acceptance alpha, tokens per target forward, draft and verify
    time, cost ratio c (one drafted token's time over one target step) and the speedup the
    formula expects from them."""
    decode = [s for s in steps if s["kind"] == "decode"]
    drafted = sum(s["drafted"] for s in decode)
    accepted = sum(s["accepted"] for s in decode)
    draft_ms = sum(s["draft_ms"] for s in decode)
    verify_ms = sum(s["forward_ms"] for s in decode)
    alpha = accepted / drafted if drafted else None
    mean_k = drafted / len(decode) if decode else 0.0
    c = (draft_ms / drafted) / (verify_ms / len(decode)) if drafted and decode else None
    return {
        "drafted": drafted, "accepted": accepted, "acceptance_rate": alpha,
        "tokens_per_target_forward": n_new / len(steps) if steps else None,
        "draft_ms": draft_ms, "verify_ms": verify_ms, "mean_k": mean_k, "cost_ratio_c": c,
        "expected_speedup": expected_speedup(alpha, mean_k, c) if alpha is not None and c is not None else None,
    }
