"""Speculative decoding: cheap guesses proposed, then confirmed many at once by one target forward.

A drafter (engine.switches.drafters) proposes up to K tokens after the current sequence; the target model scores
the pending token plus all drafts in one forward; greedy verification keeps the longest prefix of drafts
the target agrees with and adds the target's own next token, so the output is exactly plain greedy's.
With sampling and a draft model, speculative sampling keeps the target's distribution instead. The KV
cache is cropped back past the first rejected position.

Each method is one registry entry (METHODS): how it builds its drafter, whether it also samples, and the
settings a sweep runs it with. Its name and help text are also in engine.switches.names, where the command
line reads them without importing torch; the pages read METHODS."""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.switches.drafters import (DraftModel, Drafter, EarlyExitDraft, Jacobi, Lookahead, PromptLookup, SpeculativeError, Tree,
                       early_exit, same_tokenizer)
from engine.model.lean import LeanLlama
from engine.model.loader import LoadedModel
from engine.switches.names import METHOD_HELP, SAMPLING_METHODS


@dataclass(frozen=True)
class Method:
    name: str
    help: str
    make: Callable  # (target LoadedModel, GenConfig, load(model id) -> LoadedModel) -> Drafter | None
    samples: bool = False  # also runs with temperature > 0 (speculative sampling)
    sweep: dict = field(default_factory=dict)  # GenConfig settings a sweep runs it with


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    METHODS[method.name] = method
    return method


def _lookahead(target: LoadedModel, cfg, load) -> Drafter:
    if not isinstance(target.model, LeanLlama):
        raise SpeculativeError(f"Lookahead decoding needs the lean forward, which runs Llama-architecture "
                               f"models; {target.name} is not one.")
    return Lookahead(cfg.window, cfg.max_ngram, cfg.guesses)


def _draft_model(target: LoadedModel, cfg, load) -> Drafter:
    """A draft model given as 'self-int8', 'self-exit:K', or a model id or folder (loaded with `load`)."""
    draft = cfg.draft_model
    if not draft:
        raise SpeculativeError("The draft method needs --draft-model: self-int8, self-exit:K, or a model id or folder.")
    if draft == "self-int8":
        from engine.switches.quant import variant

        return DraftModel(variant(target, "int8-dyn" if target.device.type == "cpu" else "int8-wo"))
    if draft.startswith("self-exit:"):
        try:
            layers = int(draft.split(":", 1)[1])
        except ValueError:
            raise SpeculativeError(f"'{draft}' should name a layer count, like self-exit:8.") from None
        return EarlyExitDraft(early_exit(target, layers), layers)
    model = load(draft)
    if not same_tokenizer(model.tokenizer, target.tokenizer):
        raise SpeculativeError(f"The draft model {model.name} does not share {target.name}'s tokenizer, so its "
                               "guesses cannot be checked token by token.")
    return DraftModel(model)


register(Method("none", METHOD_HELP["none"], lambda target, cfg, load: None))
register(Method("prompt-lookup", METHOD_HELP["prompt-lookup"], lambda target, cfg, load: PromptLookup(cfg.max_ngram),
                sweep=dict(speculative_k=4, adaptive=True)))
register(Method("draft", METHOD_HELP["draft"], _draft_model, samples="draft" in SAMPLING_METHODS,
                sweep=dict(draft_model="self-int8", speculative_k=3, adaptive=True)))
register(Method("lookahead", METHOD_HELP["lookahead"], _lookahead,
                sweep=dict(window=4, max_ngram=3, guesses=4, adaptive=True)))
register(Method("jacobi", METHOD_HELP["jacobi"], lambda target, cfg, load: Jacobi(),
                sweep=dict(speculative_k=4, adaptive=True)))


def method(name: str) -> Method:
    if name not in METHODS:
        raise SpeculativeError(f"Unknown speculative method '{name}': use one of {', '.join(METHODS)}.")
    return METHODS[name]


def make_drafter(target: LoadedModel, cfg, load=None) -> Drafter | None:
    """The drafter cfg.speculative asks for (None for plain decoding); `load` loads a draft model by id."""
    return method(cfg.speculative).make(target, cfg, load)


def greedy_accept(predicted: list[int], drafts: list[int]) -> list[int]:
    """Tokens to emit: the drafts the target agrees with, then the target's own next token.
    predicted[i] is the target's greedy token after the pending token and drafts[:i]."""
    emitted = []
    for draft, target in zip(drafts, predicted):
        if draft != target:
            break
        emitted.append(draft)
    emitted.append(predicted[len(emitted)])
    return emitted


def tree_accept(predicted: list[int], tree: Tree) -> tuple[list[int], list[int]]:
    """Greedy verification of every branch: (tokens to emit, the accepted extra-token indices) for
    the branch the target agrees with longest. predicted[0] is the target's token after the
    pending ones, predicted[1 + i] its token after extra token i."""
    best: list[int] = []
    for branch in tree.branches:
        kept, before = [], 0
        for at in branch:
            if tree.tokens[at] != predicted[before]:
                break
            kept.append(at)
            before = 1 + at
        if len(kept) > len(best):
            best = kept
    emitted = [tree.tokens[at] for at in best] + [predicted[1 + best[-1] if best else 0]]
    return emitted, best


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


class Backoff:
    """The adaptive setting's guard. The first decode steps run plain to measure a plain step's time
    per token; after that, every step with guesses adds to a balance the time it saved (or lost,
    negative) against plain steps emitting the same tokens. When the balance falls below minus half a
    plain step, guessing pauses (8 steps, doubling after each loss up to 128), then tries again
    from a zero balance; savings are banked up to four plain steps. So a method whose guesses do not
    land costs about half a wasted step per trial, and one that pays keeps going through its misses."""

    def __init__(self, plain_first: int = 2, first_pause: int = 8, max_pause: int = 128, bank: float = 4.0,
                 give_up: float = 0.5):
        self.pause = plain_first
        self.wait = first_pause
        self.max_pause = max_pause
        self.bank = bank
        self.plain: deque[float] = deque(maxlen=8)  # recent plain steps' ms per token
        self.balance = 0.0  # ms saved by guessing since the last pause
        self.give_up = give_up  # plain steps' worth of loss that pauses guessing

    def allows(self) -> bool:
        return self.pause == 0

    def record(self, step_ms: float, emitted: int, guessed: bool) -> None:
        if not guessed:
            self.plain.append(step_ms / max(emitted, 1))
            self.pause = max(self.pause - 1, 0)
            return
        base = statistics.median(self.plain)
        self.balance = min(self.balance + base * emitted - step_ms, self.bank * base)
        if self.balance < -self.give_up * base:
            self.pause, self.wait, self.balance = self.wait, min(2 * self.wait, self.max_pause), 0.0


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
