"""One decode step: propose guesses, run the target forward, accept, crop the cache.

decode_step() is the hot path and nothing else: no text, no accounting, no database. It returns an
Outcome with the tokens the target approved and the time each phase began."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.measure import hardware
from engine.switches import speculative
from engine.model.cpu_kernels import optional_kernel
from engine.switches.drafters import Drafter, Tree, crop_cache
from engine.store.rows import Outcome
from engine.spec import GenConfig


@dataclass
class DecodeState:
    """What carries over from step to step."""
    ids: list[int]  # prompt and emitted tokens
    pending: list[int]  # tokens the next forward must take in
    cache: object | None  # the KV cache, None when it is off
    kv_dtype: torch.dtype | None  # a KV-cache precision apart from the weights', for the lean forward


def sampling_probs(logits: torch.Tensor, cfg: GenConfig) -> torch.Tensor:
    """The distribution sampling draws from: temperature, then top-k and top-p filtering."""
    logits = logits / cfg.temperature
    if cfg.top_k:
        kth = torch.topk(logits, min(cfg.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs >= cfg.top_p  # keep the token whose mass crosses p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return torch.softmax(logits, dim=-1)


def select_token(logits: torch.Tensor, cfg: GenConfig, generator: torch.Generator | None) -> int:
    """Greedy argmax, or a sample after temperature, top-k and top-p filtering."""
    if cfg.temperature == 0:
        kernel = optional_kernel() if logits.is_cpu and logits.dtype == torch.float32 and logits.dim() == 1 else None
        return kernel.argmax(logits) if kernel is not None else int(torch.argmax(logits))
    return int(torch.multinomial(sampling_probs(logits, cfg), 1, generator=generator))


def select_tokens(logits: torch.Tensor, cfgs: list[GenConfig], generators: list) -> list[int]:
    """select_token for each row of logits [rows, vocabulary] with its own config and generator: the greedy rows'
    argmax in one call of the kernels where they run (the same picks, a row's Python call cost as much as its
    search)."""
    kernel = optional_kernel() if logits.is_cpu and logits.dtype == torch.float32 and logits.dim() == 2 else None
    greedy = [i for i, cfg in enumerate(cfgs) if cfg.temperature == 0]
    picks = {}
    if kernel is not None and greedy:  # all rows as they lie where all are greedy: no copy of the ones taken
        picks = dict(zip(greedy, kernel.argmax_rows(logits if len(greedy) == len(cfgs) else logits[greedy])))
    return [picks[i] if i in picks else select_token(logits[i], cfg, generator)
            for i, (cfg, generator) in enumerate(zip(cfgs, generators))]


def tree_inputs(tree: Tree, n_pending: int, last_position: int, device) -> dict:
    """Positions and visibility for a forward over the pending tokens (causal among themselves)
    followed by a tree of guesses."""
    size = n_pending + len(tree.tokens)
    visible = torch.zeros(size, size, dtype=torch.bool)
    visible[:, :n_pending] = torch.ones(size, n_pending, dtype=torch.bool).tril()
    visible[n_pending:, :n_pending] = True
    visible[n_pending:, n_pending:] = tree.visible
    positions = list(range(last_position - n_pending + 1, last_position + 1)) + [last_position + o for o in tree.offsets]
    return {"position_ids": torch.tensor([positions], device=device), "attention_mask": visible.to(device)}


def accept(logits: torch.Tensor, drafts: list[int], tree: Tree | None, drafter: Drafter, cfg: GenConfig,
           generator) -> tuple[list[int], int]:
    """(tokens to emit, how many extra input tokens keep their cache entries) after a forward."""
    if not drafts:
        return [select_token(logits[-1], cfg, generator)], 0
    if cfg.temperature > 0:  # speculative sampling keeps the target's distribution
        target = torch.stack([sampling_probs(row, cfg) for row in logits])
        emitted = speculative.sample_accept(target, drafter.draft_probs, drafts, generator)
        return emitted, len(emitted) - 1
    predicted = logits.argmax(dim=-1).tolist()
    if tree:
        emitted, path = speculative.tree_accept(predicted, tree)
        kept = len(path) if path == list(range(len(path))) else 0
    else:
        emitted = speculative.greedy_accept(predicted, drafts)
        kept = len(emitted) - 1
    drafter.observe(predicted, len(emitted) - 1)
    return emitted, kept


@torch.inference_mode()
def decode_step(lm, state: DecodeState, cfg: GenConfig, drafter: Drafter | None, k: int, generator,
                step_start: int) -> Outcome:
    """Propose up to k guesses (k 0: none), run one forward over the pending tokens and the guesses,
    keep what the target approves, and drop the cache entries of guesses it rejected."""
    past = len(state.ids) - len(state.pending)
    t_draft = time.perf_counter_ns()
    sample = (lambda lg: sampling_probs(lg, cfg)) if cfg.temperature > 0 else None
    proposal = drafter.propose(state.ids, k, sample, generator) if drafter and k > 0 else []
    tree = proposal if isinstance(proposal, Tree) else None
    drafts = tree.tokens if tree else proposal
    t_upload = time.perf_counter_ns()
    inputs = torch.tensor([state.pending + drafts], device=lm.device)
    extra = tree_inputs(tree, len(state.pending), len(state.ids) - 1, lm.device) if tree else {}
    if state.kv_dtype is not None:
        extra["kv_dtype"] = state.kv_dtype
    t_forward = time.perf_counter_ns()
    out = lm.model(input_ids=inputs, cache=state.cache, use_cache=cfg.kv_cache, logits_to_keep=len(drafts) + 1,
                   **extra)
    hardware.sync(lm.device)
    t_sync = time.perf_counter_ns()
    logits = out.logits[0]
    if logits.dtype != torch.float32 or not logits.is_cpu:  # each call costs tens of us after a step's weights
        logits = logits.float().cpu()
    t_select = time.perf_counter_ns()
    emitted, kept = accept(logits, drafts, tree, drafter, cfg, generator)
    if cfg.kv_cache and drafts:  # drop the cache entries of guesses not kept
        crop_cache(state.cache, past + len(state.pending) + kept)
    t_host = time.perf_counter_ns()
    return Outcome(n_input=len(inputs[0]), past=past, drafted=len(drafts),
                   accepted=len(emitted) - 1 if drafts else 0, emitted=emitted,
                   marks=(step_start, t_draft, t_upload, t_forward, t_sync, t_select, t_host),
                   kv_bytes=getattr(out, "kv_bytes", None))
