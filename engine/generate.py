"""The instrumented decode loop: prefill, then one step per token, every phase timed.

Steps tile the run's timeline: a step begins where the previous one handed its token to the
consumer of the stream, so the time the consumer takes between tokens lands in the next step's
host phase and the per-token buckets add up to the run's end-to-end time."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import torch
from transformers import DynamicCache

from . import hardware, speculative
from .accounting import cache_nbytes, forward_work, model_shape, reduce_work
from .distances import PHASES, Roofline, attribute, split_over_tokens, sum_buckets, waste_fraction
from .lean import LeanLlama
from .metrics import run_metrics
from .models import LoadedModel, load_model
from .speculative import MAX_K, METHODS, SpeculativeError, greedy_accept, make_drafter, next_k
from .sparsity import forward_savings, sparse_layers
from .store import BUCKETS, Store

MAX_NEW_TOKENS_CAP = 4096
KV_DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Rows written while a run goes on, so a crash loses little: each write costs the model one 50-90 ms
# token on a 2-core CPU (opening the database and inserting take a core from it), so not too often.
FLUSH_EVERY_TOKENS = 256
FLUSH_EVERY_S = 10.0


class GenerationError(Exception):
    """Bad input for a generation; the message is one sentence for the user."""


@dataclass
class GenConfig:
    prompt: str
    max_new_tokens: int = 64
    kv_cache: bool = True
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    raw: bool = False
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # for benchmarks: always produce max_new_tokens
    spec: str = "none"  # speculative method (engine.speculative.METHODS)
    spec_k: int = 4  # tokens drafted per step (the starting length when adaptive)
    adaptive: bool = False
    draft_model: str | None = None  # for spec="draft": self-int8, self-exit:K, or a model id or folder
    max_ngram: int = 3  # prompt lookup: the longest n-gram matched; lookahead: the n-gram size N
    window: int = 4  # for spec="lookahead": W, the columns of the lookahead branch
    guesses: int = 4  # for spec="lookahead": G, the most n-grams verified per step
    kv_dtype: str = "auto"  # KV-cache precision: auto (the weights' compute dtype), fp32, bf16 or fp16

    def check(self) -> None:
        if not self.prompt or not self.prompt.strip():
            raise GenerationError("The prompt is empty: type something for the model to continue.")
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS_CAP:
            raise GenerationError(f"max_new_tokens must be between 1 and {MAX_NEW_TOKENS_CAP}, not {self.max_new_tokens}.")
        if self.temperature < 0:
            raise GenerationError(f"temperature must be 0 (greedy) or positive, not {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise GenerationError(f"top_p must be in (0, 1], not {self.top_p}.")
        if self.top_k < 0:
            raise GenerationError(f"top_k must be 0 (off) or positive, not {self.top_k}.")
        if self.spec not in METHODS:
            raise GenerationError(f"Unknown speculative method '{self.spec}': use one of {', '.join(METHODS)}.")
        if self.spec != "none" and not 1 <= self.spec_k <= MAX_K:
            raise GenerationError(f"The draft length K must be between 1 and {MAX_K}, not {self.spec_k}.")
        if self.kv_dtype not in KV_DTYPES:
            raise GenerationError(f"Unknown KV-cache precision '{self.kv_dtype}': use one of {', '.join(KV_DTYPES)}.")
        if self.spec not in ("none", "draft") and self.temperature != 0:
            raise GenerationError("Prompt lookup, lookahead and Jacobi decoding run greedy here: set the temperature "
                                  "to 0, or sample with a draft model.")


@dataclass
class TokenEvent:
    index: int
    token_id: int
    piece: str
    step: int
    t_ms: float
    gap_ms: float
    buckets: dict


def prompt_ids(lm: LoadedModel, prompt: str, raw: bool) -> list[int]:
    """Token ids of the prompt: chat-formatted for instruct models unless raw."""
    if not raw and lm.has_chat_template:
        text = lm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                add_generation_prompt=True)
        return lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    return lm.tokenizer(prompt)["input_ids"]


def eos_ids(lm: LoadedModel) -> set[int]:
    ids = set()
    for source in (getattr(lm.model, "generation_config", None), lm.tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update(value if isinstance(value, (list, tuple)) else [value])
    return ids


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
        return int(torch.argmax(logits))
    return int(torch.multinomial(sampling_probs(logits, cfg), 1, generator=generator))


def tree_inputs(tree: speculative.Tree, n_pending: int, last_position: int, device) -> dict:
    """Positions and visibility for a forward over the pending tokens (causal among themselves)
    followed by a tree of guesses."""
    size = n_pending + len(tree.tokens)
    visible = torch.zeros(size, size, dtype=torch.bool)
    visible[:, :n_pending] = torch.ones(size, n_pending, dtype=torch.bool).tril()
    visible[n_pending:, :n_pending] = True
    visible[n_pending:, n_pending:] = tree.visible
    positions = list(range(last_position - n_pending + 1, last_position + 1)) + [last_position + o for o in tree.offsets]
    return {"position_ids": torch.tensor([positions], device=device), "attention_mask": visible.to(device)}


class TextStream:
    """Turns token ids into text pieces without re-decoding the whole output each step and
    without emitting half of a multi-byte character."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        before = decode(self.ids[self.prefix:self.read])
        after = decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""


class Generation:
    """One run. Iterate it for TokenEvents; closing the iterator early cancels the run.

    After iteration: status, text, token_ids, steps, tokens, result (the run summary)."""

    def __init__(self, lm: LoadedModel, cfg: GenConfig, store: Store | None = None,
                 calibration: dict | None = None, telemetry: bool = True):
        cfg.check()
        self.lm, self.cfg, self.store = lm, cfg, store
        self.prompt_ids = prompt_ids(lm, cfg.prompt, cfg.raw)
        needed = len(self.prompt_ids) + cfg.max_new_tokens
        if needed > lm.max_context:
            raise GenerationError(
                f"The prompt ({len(self.prompt_ids)} tokens) plus max_new_tokens ({cfg.max_new_tokens}) needs "
                f"{needed} positions but {lm.name} has a context of {lm.max_context}; shorten one of them.")
        self.calibration = calibration or hardware.calibration_for(lm.device, store)
        self.roofline = Roofline(self.calibration["memory_gbps"], hardware.peak_gflops(self.calibration, lm.dtype))
        self.kv_dtype = KV_DTYPES[cfg.kv_dtype]
        if self.kv_dtype is not None and not isinstance(lm.model, LeanLlama):
            raise GenerationError(f"A KV-cache precision apart from the weights' needs the lean forward, which runs "
                                  f"Llama-architecture models; {lm.name} is not one.")
        self.shape = model_shape(lm.model, kv_dtype=self.kv_dtype)
        self.sparse = sparse_layers(lm.model)
        try:
            self.drafter = None if cfg.spec == "none" else make_drafter(
                lm, cfg.spec, cfg.draft_model, cfg.max_ngram, load=lambda m: load_model(m, device=str(lm.device)),
                window=cfg.window, guesses=cfg.guesses)
        except SpeculativeError as exc:
            raise GenerationError(str(exc)) from None
        self.telemetry = telemetry
        self.eos = eos_ids(lm)
        self.run_id: int | None = None
        self.status = "pending"
        self.error: str | None = None
        self.stop_reason: str | None = None
        self.text = ""
        self.token_ids: list[int] = []
        self.steps: list[dict] = []
        self.tokens: list[dict] = []
        self.telemetry_rows: list[dict] = []
        self.cache = None
        self.result: dict | None = None
        self._flushed_steps = self._flushed_tokens = 0
        self._last_flush = time.monotonic()
        self._writer: ThreadPoolExecutor | None = None
        self._writes: list = []

    def config_record(self) -> dict:
        return {"model": self.lm.name, "device": str(self.lm.device), "dtype": str(self.lm.dtype).removeprefix("torch."),
                "quant": self.lm.quant, "sparsity": self.lm.sparsity, "sparsity_mode": self.lm.sparsity_mode,
                **asdict(self.cfg)}

    def __iter__(self):
        if self.store is not None:
            self.run_id = self.store.start_run(
                model=self.lm.name, device=str(self.lm.device), dtype=self.config_record()["dtype"],
                config=self.config_record(), hardware=hardware.hardware_summary(self.lm.device), prompt=self.cfg.prompt)
        self.status = "running"
        sampler = hardware.TelemetrySampler(self.lm.device) if self.telemetry else None
        try:
            if sampler:
                sampler.__enter__()
            yield from self._decode(time.perf_counter_ns())
            self.status = "ok"
        except (GeneratorExit, KeyboardInterrupt):
            self.status = "cancelled"
            self.stop_reason = "cancelled"
            raise
        except Exception as exc:
            self.status = "error"
            self.error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            if sampler:
                sampler.__exit__(None, None, None)
                self.telemetry_rows = sampler.samples
            self._finish()

    @torch.inference_mode()
    def _decode(self, t_request: int):
        lm, cfg = self.lm, self.cfg
        generator = torch.Generator().manual_seed(cfg.seed) if cfg.seed is not None else None
        stream = TextStream(lm.tokenizer)
        ids = list(self.prompt_ids)
        self.cache = DynamicCache(config=lm.config) if cfg.kv_cache else None
        if self.cache is not None and hasattr(self.drafter, "attach"):  # an early-exit draft shares the cache
            self.drafter.attach(self.cache, self.kv_dtype)
        step_start = t_request
        pending = ids  # tokens the next forward must take in
        k = cfg.spec_k
        step = 0
        backoff = speculative.Backoff() if cfg.adaptive and self.drafter else None
        while True:
            past = len(ids) - len(pending)
            t_draft = time.perf_counter_ns()
            room = cfg.max_new_tokens - len(self.token_ids) - 1  # drafts beyond the budget would be wasted
            sample = (lambda lg: sampling_probs(lg, cfg)) if cfg.temperature > 0 else None
            guessing = self.drafter and step > 0 and room > 0 and (backoff is None or backoff.allows())
            proposal = self.drafter.propose(ids, min(k, room), sample, generator) if guessing else []
            tree = proposal if isinstance(proposal, speculative.Tree) else None
            drafts = tree.tokens if tree else proposal
            t_upload = time.perf_counter_ns()
            inputs = torch.tensor([pending + drafts], device=lm.device)
            extra = tree_inputs(tree, len(pending), len(ids) - 1, lm.device) if tree else {}
            t_forward = time.perf_counter_ns()
            if self.kv_dtype is not None:
                extra["kv_dtype"] = self.kv_dtype
            out = lm.model(input_ids=inputs, cache=self.cache, use_cache=cfg.kv_cache,
                           logits_to_keep=len(drafts) + 1, **extra)
            hardware.sync(lm.device)
            t_sync = time.perf_counter_ns()
            logits = out.logits[0].float().cpu()
            t_select = time.perf_counter_ns()
            kept = 0  # extra tokens whose cache entries stay: an accepted prefix of them
            if drafts and sample:  # speculative sampling keeps the target's distribution
                target = torch.stack([sample(row) for row in logits])
                emitted = speculative.sample_accept(target, self.drafter.draft_probs, drafts, generator)
                kept = len(emitted) - 1
            elif drafts:
                predicted = logits.argmax(dim=-1).tolist()
                if tree:
                    emitted, path = speculative.tree_accept(predicted, tree)
                    kept = len(path) if path == list(range(len(path))) else 0
                else:
                    emitted = greedy_accept(predicted, drafts)
                    kept = len(emitted) - 1
                if hasattr(self.drafter, "observe"):  # Jacobi and lookahead keep the target's other predictions
                    self.drafter.observe(predicted, len(emitted) - 1)
            else:
                emitted = [select_token(logits[-1], cfg, generator)]
            if cfg.kv_cache and drafts:  # drop the cache entries of guesses not kept
                speculative.crop_cache(self.cache, past + len(pending) + kept)
            t_host = time.perf_counter_ns()

            events, done = [], None
            for token in emitted[: cfg.max_new_tokens - len(self.token_ids)]:
                ids.append(token)
                self.token_ids.append(token)
                piece = stream.push(token)
                self.text += piece
                done = self._stop_check(token, piece)
                if done == "stop_string":
                    cut = self._cut_at_stop()
                    piece = piece[: max(0, len(piece) - (len(self.text) - len(cut)))]
                    self.text = cut
                events.append((token, piece))
                if done:
                    break
            if not done and len(self.token_ids) >= cfg.max_new_tokens:
                done = "max_new_tokens"
            pending = ids[self.cache.get_seq_length():] if cfg.kv_cache else ids
            accepted = len(emitted) - 1 if drafts else 0
            row = self._account(step, t_request, (step_start, t_draft, t_upload, t_forward, t_sync, t_select, t_host),
                                n_input=len(inputs[0]), past=past, kv_cache=cfg.kv_cache, drafted=len(drafts),
                                accepted=accepted, n_emitted=len(events))
            if done:
                self.stop_reason = done
            first = len(self.token_ids) - len(events)
            for i, (token, piece) in enumerate(events):
                yield TokenEvent(index=first + i, token_id=token, piece=piece, step=step, t_ms=row["t_ms"],
                                 gap_ms=row["wall_ms"] if i == 0 else 0.0, buckets=row["token_buckets"])
            step_start = row["t_end_ns"]  # the consumer's time with the tokens counts toward the next step
            if done:
                return
            k = next_k(k, len(drafts), accepted, cfg.adaptive, MAX_K)
            if backoff and step > 0:  # decode steps only: the prefill is no measure of a plain step
                # the step's own time: the consumer's (a page drawing, a benchmark's other runs) is not
                # what guessing costs
                backoff.record((row["t_end_ns"] - t_draft) / 1e6, len(events), bool(drafts))
            step += 1
            if self._flush_due():
                self._flush()

    def _stop_check(self, token: int, piece: str) -> str | None:
        if token in self.eos and not self.cfg.ignore_eos:
            return "eos"
        # a stop string that appeared now ends within the last piece
        if any(s and s in self.text[-(len(s) + len(piece)):] for s in self.cfg.stop):
            return "stop_string"
        return None

    def _cut_at_stop(self) -> str:
        cut = min(self.text.find(s) for s in self.cfg.stop if s and s in self.text)
        return self.text[:cut]

    def _account(self, step, t_request, marks, n_input, past, kv_cache, drafted, accepted, n_emitted) -> dict:
        """Close the step's timing (host phase ends now), attribute it, and keep its rows."""
        t_end = time.perf_counter_ns()
        start, t_draft, t_upload, t_forward, t_sync, t_select, t_host = marks
        ms = lambda a, b: (b - a) / 1e6  # noqa: E731
        phases = {
            "draft": ms(t_draft, t_upload), "upload": ms(t_upload, t_forward), "forward": ms(t_forward, t_sync),
            "sync": ms(t_sync, t_select), "select": ms(t_select, t_host),
            # bookkeeping after the tokens, plus the time since the previous step handed over its tokens
            "host": ms(t_host, t_end) + ms(start, t_draft),
        }
        work = forward_work(self.shape, n_input, past, kv_cache=kv_cache, logits_kept=drafted + 1)
        kept = 1 + accepted  # positions whose results are used: the pending token and the accepted drafts
        if not kv_cache and step > 0:  # a cached decoder would only have run the kept positions
            useful = forward_work(self.shape, kept, n_input - drafted - 1, logits_kept=kept)
        elif drafted:
            useful = forward_work(self.shape, n_input - drafted + accepted, past, logits_kept=kept)
        else:
            useful = None
        if self.sparse:
            saved = forward_savings(self.sparse)
            work = reduce_work(work, saved["skipped_bytes"], saved["skipped_flops"])
            if saved["zero_bytes"] or saved["zero_flops"]:  # masked: zeros multiplied for nothing
                useful = reduce_work(useful or work, saved["zero_bytes"], saved["zero_flops"])
        attributed = attribute(phases, work, self.roofline, waste_fraction(self.roofline, work, useful),
                               draft_waste=(drafted - accepted) / drafted if drafted else 0.0)
        wall = (t_end - marks[0]) / 1e6
        row = {
            "step": step, "kind": "prefill" if step == 0 else "decode", "n_input": n_input, "n_emitted": n_emitted,
            "drafted": drafted, "accepted": accepted,
            "context_len": past + n_input, **{f"{p}_ms": phases[p] for p in PHASES}, "wall_ms": wall,
            "weight_bytes": work.weight_bytes, "kv_read_bytes": work.kv_read_bytes,
            "kv_write_bytes": work.kv_write_bytes, "flops": work.flops,
            "memory_est_ms": attributed["memory_est_ms"], "compute_est_ms": attributed["compute_est_ms"],
            "roofline_ms": attributed["roofline_ms"], "waste_fraction": attributed["waste_fraction"],
            **{f"{b}_ms": v for b, v in attributed["buckets"].items()},
        }
        self.steps.append(row)
        token_buckets = split_over_tokens(attributed["buckets"], max(n_emitted, 1))
        t_ms = (t_end - t_request) / 1e6
        for i, token in enumerate(self.token_ids[len(self.token_ids) - n_emitted:]):
            self.tokens.append({"idx": len(self.tokens), "step": step, "token_id": token,
                                "piece": self.lm.tokenizer.decode([token]), "t_ms": t_ms,
                                "gap_ms": wall if i == 0 else 0.0, **{f"{b}_ms": token_buckets[b] for b in BUCKETS}})
        return {**row, "t_ms": t_ms, "t_end_ns": t_end, "token_buckets": token_buckets}

    def _unflushed(self) -> dict[str, list[dict]]:
        batches = {"steps": [{"run_id": self.run_id, **r} for r in self.steps[self._flushed_steps:]],
                   "tokens": [{"run_id": self.run_id, **r} for r in self.tokens[self._flushed_tokens:]]}
        self._flushed_steps, self._flushed_tokens = len(self.steps), len(self.tokens)
        return batches

    def _flush_due(self) -> bool:
        waiting = len(self.tokens) - self._flushed_tokens
        return waiting >= FLUSH_EVERY_TOKENS or (waiting > 0 and time.monotonic() - self._last_flush >= FLUSH_EVERY_S)

    def _flush(self) -> None:
        """Write the rows so far from a background thread, so that no token waits for the disk."""
        self._last_flush = time.monotonic()
        if self.store is not None and self.run_id is not None:
            if self._writer is None:
                self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenpath-store")
            self._writes.append(self._writer.submit(self.store.insert, self._unflushed()))

    def _wait_for_writes(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            for write in self._writes:
                write.result()

    def _finish(self) -> None:
        metrics = run_metrics([t["t_ms"] for t in self.tokens], len(self.prompt_ids))
        totals = sum_buckets([{b: s[f"{b}_ms"] for b in BUCKETS} for s in self.steps])
        decode_steps = [s for s in self.steps if s["kind"] == "decode"]
        metrics.update({
            "distances_ms": totals,
            "stop_reason": self.stop_reason,
            "kv_cache_bytes": cache_nbytes(self.cache) if self.cache is not None else 0,
            "kv_bytes_per_token": self.shape.kv_bytes_per_token,
            "kv_dtype": next(name for name, dt in KV_DTYPES.items() if dt == (self.kv_dtype or self.lm.dtype)),
            "weight_bytes_per_forward": self.shape.weight_bytes,
            "roofline_ratio_decode": (sum(s["roofline_ms"] for s in decode_steps)
                                      / sum(s["forward_ms"] for s in decode_steps)) if decode_steps else None,
            "calibration": {k: self.calibration[k] for k in ("device_key", "memory_gbps", "matmul_gflops", "dispatch_us")},
        })
        if self.drafter is not None:
            metrics["speculative"] = speculative.summary(self.steps, len(self.token_ids))
        self.result = {"run_id": self.run_id, "status": self.status, "error": self.error, "text": self.text,
                       "token_ids": list(self.token_ids), **metrics}
        if self.store is not None and self.run_id is not None:
            self._wait_for_writes()
            batches = self._unflushed()
            batches["telemetry"] = [{"run_id": self.run_id, **r} for r in self.telemetry_rows]
            self.store.finish_run(self.run_id, status=self.status, output=self.text, token_ids=self.token_ids,
                                  metrics={k: v for k, v in metrics.items() if k != "itl_ms"}, error=self.error,
                                  batches=batches)

    def run(self) -> dict:
        for _ in self:
            pass
        return self.result
