"""Continuous batching: many sequences decoded together, each step's weights read once for all of them.

BatchEngine keeps arrivals in a queue and up to max_batch sequences running. Under a KV budget it counts the bytes
each running sequence's cache takes: the room the decode grows it by, 128 positions at a time
(LeanLlama.decode_batch, engine.model.lean.room_for), reserved for its prompt when it is admitted (a prefill takes
no more: a fresh prompt prefilled beside others gets that room at once, a long prompt's chunks concatenate; a cache
that grows is copied once, so for that moment its old storage is held too; one that opens with a kept prompt, read
where the prompt is kept, counts only its own positions' room, the prompt counting once among the kept prompts,
which are let go to make room only while no cache reads them, so a sequence reads one so only where the budget
holds it beside the sequence's whole life). A step first makes room for the running
sequences' next positions: when the budget runs out it preempts the newest-admitted sequence, as vLLM does, freeing
its cache and putting it back at the front of the queue, to be recomputed (one prefill of its prompt and the tokens
it has so far, which gives its next token) when memory allows. Then, unless it preempted, it admits the arrivals
that a free slot and the budget allow, runs up to prefill_chunk prompt tokens of the admitted ones (oldest first, a
long prompt in chunks over several steps; in one forward where no product depends on the rows beside it,
LeanLlama.prefill_batch, else one forward a sequence), and one batched decode of every sequence past its prefill. A
prompt whose cache holds all but its last token (the rest found among the kept prompts, or its earlier chunks) runs
that token as one more row of the decode: a decode step in all but its row's kind, which no prefill budget counts.
Sequences join and leave between steps; a cancelled one frees its slot and its cache at the next step. A request too
long for the budget even alone is refused before it is queued.

Every sequence is its own recorded run with its own journal; the engine's Writer (engine.store.writer) writes the
runs' rows together, off the stepping thread. A sequence's rows share each forward it took part in (a prefill's,
the last one that prefilled it): its memory estimate carries 1/batch of the weights' trip (engine.store.rows), its
own KV bytes and FLOPs stay its own, and the rest of the step, like the time it waited to be admitted or while
another sequence's prefill ran, is the time distance; its steps tile its timeline, so its buckets sum to its
measured time. A preempted sequence's recompute is a step of its run (kind recompute), and the time from its
preemption to its recompute's forward is the time distance too."""
from __future__ import annotations

import math
import queue
import threading
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import DynamicCache

from engine.dtypes import name_of, torch_dtype
from engine.errors import UserError
from engine.measure import hardware
from engine.measure.accounting import batch_decode_work, model_shape
from engine.measure.distances import BUCKETS, sum_buckets
from engine.measure.metrics import run_metrics
from engine.model.lean import LeanLlama, cache_layer_kinds, new_cache, room_for
from engine.run.generate import TokenEvent, collector_spared
from engine.run.prefix import Prefixes, reusable
from engine.store.record import Recorder
from engine.store.writer import Writer
from engine.store.rows import Attribution, Outcome, account, columns
from engine.spec import LIMITS, MAX_BATCH, GenConfig, check_batchable
from engine.run.step import select_token, select_tokens
from engine.paths import workloads
from engine.run.text import Output, prompt_ids

# prompt tokens a step prefills, between the running sequences' decode steps. From a hundred or so rows on the
# products are as busy per row as they get, so a larger chunk gives a burst of prompts its first tokens no sooner
# (the same tokens at the same rate), while every sequence decoding beside it waits for the whole chunk: a few
# hundred rows keep that wait to a few decode steps' time and let the first prompts of a burst start decoding
PREFILL_CHUNK = 256
PROMPTS_KEPT = 1024


def most_positions(n_prompt: int, max_new_tokens: int) -> int:
    """The most positions of room a sequence's cache takes in its life, preempted on the way or not: its last
    token is emitted, never fed back."""
    return room_for(n_prompt + max_new_tokens - 1)


class BatchError(UserError):
    """A batch that cannot run as asked; the message is one sentence."""


def budget_bytes(mb: float | None, flag: str = "--kv-budget-mb") -> int | None:
    """The MiB of --kv-budget-mb (or another flag's) in bytes (None: not given); BatchError unless it is a
    positive number of MiB."""
    if mb is None:
        return None
    if not (math.isfinite(mb * 2**20) and int(mb * 2**20) > 0):
        raise BatchError(f"{flag} must be a positive number of MiB, not {mb:g}.")
    return int(mb * 2**20)


def check_cap(max_batch: int) -> None:
    if not isinstance(max_batch, int) or not 1 <= max_batch <= MAX_BATCH:
        raise BatchError(f"The batch holds 1 to {MAX_BATCH} sequences, not {max_batch}.")


def batch_prompts(prompt: str, users: int, prompts_file: str | None = None) -> list[str]:
    """The prompt and users - 1 others: the lines of prompts_file (blank ones skipped), else the shipped
    workloads' prompts, in order and taken again from the first when there are fewer."""
    LIMITS["users"].check(users)
    if prompts_file is not None:
        try:
            others = [line for line in Path(prompts_file).read_text(encoding="utf-8").splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as exc:
            raise BatchError(f"The prompts file {prompts_file} cannot be read as UTF-8 text ({exc.__class__.__name__}).") from None
        if not others:
            raise BatchError(f"The prompts file {prompts_file} holds no prompt: write one prompt per line.")
    else:
        others = [w["prompt"] for w in workloads().values()]
    return [prompt] + [others[i % len(others)] for i in range(users - 1)]


class Sequence:
    """One request in the engine: its settings, its cache and its recorded run. Iterating a handle from
    LocalEngine reads its tokens as they come; here they also collect in `tokens` (the token rows)."""

    def __init__(self, engine: BatchEngine, cfg: GenConfig, ids: list[int], tag: str | None, t_request: int,
                 sink: queue.SimpleQueue | None, stream: bool = True):
        self.cfg, self.prompt_ids, self.tag, self.sink, self.stream = cfg, ids, tag, sink, stream
        self.output = Output(engine.lm, cfg.max_new_tokens, cfg.stop, cfg.ignore_eos)
        self.generator = torch.Generator().manual_seed(cfg.seed) if cfg.seed is not None else None
        self.phase = "queued"  # queued, prefill, decode, done
        self.cache: DynamicCache | None = None
        self.held = 0  # positions of room its cache takes, or that are reserved for the prefill under way
        self.filled = 0  # prompt tokens (after a preemption: prompt and output tokens) in the cache
        self.prefill_forward_ns = 0
        self.reused = 0  # positions of its cache a kept prompt supplied (engine.run.prefix)
        self.opening: tuple[int, ...] | None = None  # the kept prompt its cache reads where it is kept
        self.past = 0  # positions in the cache
        self.step = 0
        self.t_request = t_request
        self.t_admitted: int | None = None
        self.t_last = self.t_request  # when its previous step handed over its tokens
        self.preemptions = 0
        self.t_preempted: int | None = None
        self.preempted_ns = 0  # from each preemption to the recompute's admission
        self.steps: list[dict] = []
        self.tokens: list[dict] = []
        self.forwards: list[tuple[float, float, float]] = []  # each batched decode whole, for the peak check
        self.recorder: Recorder | None = None
        self.run_id: int | None = None
        self.status = "queued"
        self.stop_reason: str | None = None
        self.error: str | None = None
        self.result: dict | None = None
        self.cancel_requested = False

    @property
    def text(self) -> str:
        return self.output.text

    @property
    def token_ids(self) -> list[int]:
        return self.output.token_ids

    @property
    def fill_ids(self) -> list[int]:
        """What its prefill runs: the prompt, or after a preemption the prompt and every token so far."""
        return self.prompt_ids + self.token_ids

    def cancel(self) -> None:
        """Stop this sequence at the next step; its slot and cache are freed then."""
        self.cancel_requested = True


class BatchEngine:
    """Continuous batching over one loaded model. submit() adds arrivals, step() advances every running
    sequence by one step, run() steps until all are done. Not thread-safe: LocalEngine drives one from
    its own thread."""

    def __init__(self, lm, store=None, max_batch: int = 8, kv_budget_bytes: int | None = None,
                 kv_dtype: str = "auto", prefill_chunk: int = PREFILL_CHUNK, calibration: dict | None = None,
                 arrivals: bool = True, prefix_cache_bytes: int | None = None):
        check_cap(max_batch)
        self.lm, self.store, self.max_batch = lm, store, max_batch
        # the runs' rows are written together, off the stepping thread (engine.store.writer); run ids are taken
        # ahead while requests keep arriving (arrivals), once for a fixed batch
        self.writer = Writer(store, ids_ahead=max_batch, top_up=arrivals) if store is not None else None
        self.kv_budget_bytes, self.prefill_chunk = kv_budget_bytes, prefill_chunk
        self.kv_dtype_name = kv_dtype
        self.kv_dtype = None if kv_dtype == "auto" else torch_dtype(kv_dtype)
        self.shape = model_shape(lm.model, kv_dtype=self.kv_dtype)
        self.prefills_together = isinstance(lm.model, LeanLlama) and lm.model.prefills_side_by_side()
        self.cache_layers = cache_layer_kinds(lm.config)
        if prefix_cache_bytes and not reusable(self.cache_layers):
            raise BatchError(f"{lm.name} keeps only a window of positions in some layers, so a kept prompt's cache "
                             "cannot start another's: run it without --prefix-cache-mb.")
        self.prefixes = Prefixes(prefix_cache_bytes, self.shape.kv_bytes_per_token) if prefix_cache_bytes else None
        self.calibration = calibration or hardware.calibration_for(lm.device, store)
        self.attribution = Attribution(
            self.shape, hardware.roofline(self.calibration, lm.dtype, self.shape.weight_bytes, lm.weights),
            True, ())
        self.queued: list[Sequence] = []
        self.running: list[Sequence] = []
        self.finished: list[Sequence] = []
        # sequences whose last token a step emitted, ended once all its tokens are (each token's time is when it was
        # handed over, not after the runs that ended before it in the step were written)
        self.done: deque[tuple[Sequence, str]] = deque()
        self.batch_sizes: list[int] = []  # sequences in each batched decode so far
        self.preemptions = 0
        self.pieces: dict[int, str] = {}  # each token's own text, as its row stores it
        # what the step's rows owe the journals and the streams, handed over together (deliver)
        self.unflushed: dict = {}  # recorders given rows, in the order they were
        self.undelivered: list = []  # (sink, event or None for the end) in order
        self.prompts: dict[tuple[str, bool], tuple[int, ...]] = {}  # each prompt's ids: a load repeats its prompts
        self.prompts_lock = threading.Lock()
        # every run's row carries the machine's description; asked once, as the engine starts
        self.hardware = hardware.hardware_summary(lm.device)

    @property
    def reserved_bytes(self) -> int:
        """KV bytes the running sequences' caches take, or that are reserved for the prefills under way: a kept
        prompt's positions that a cache reads where they are kept count among the kept prompts' bytes instead."""
        return sum(s.held - s.reused if s.opening is not None else s.held
                   for s in self.running) * self.shape.kv_bytes_per_token

    def _in_use(self) -> set[tuple[int, ...]]:
        """The kept prompts the running sequences' caches read where they are kept."""
        return {s.opening for s in self.running if s.opening is not None}

    def _fits(self, extra_positions: int, keep: tuple[int, ...] | None = None) -> bool:
        """Whether the budget has room for extra_positions more, the kept prompts that no cache reads (nor keep, the
        one a sequence being admitted is to read) making way first."""
        if self.kv_budget_bytes is None:
            return True
        need = self.reserved_bytes + extra_positions * self.shape.kv_bytes_per_token
        if self.prefixes is not None and need <= self.kv_budget_bytes < need + self.prefixes.bytes:
            in_use = self._in_use() | {keep}
            while need <= self.kv_budget_bytes < need + self.prefixes.bytes and self.prefixes.evict(in_use):
                pass
        return need + (self.prefixes.bytes if self.prefixes is not None else 0) <= self.kv_budget_bytes

    def check(self, cfg: GenConfig) -> list[int]:
        """The prompt's token ids, or BatchError (GenerationError) with one sentence when this request cannot run
        in this engine; nothing is recorded."""
        cfg.check()
        if cfg.kv_dtype != self.kv_dtype_name:
            raise BatchError(f"The batch keeps every cache in one precision ({self.kv_dtype_name}); this request "
                             f"asks for {cfg.kv_dtype}.")
        if not isinstance(self.lm.model, LeanLlama):
            raise BatchError(f"Batching runs on the lean forward, which runs Llama-architecture models; {self.lm.name} "
                             "is not one.")
        check_batchable(cfg, self.lm.sparsity)
        ids = self._prompt_ids(cfg.prompt, cfg.raw)
        needed = len(ids) + cfg.max_new_tokens
        if needed > self.lm.max_context:
            raise BatchError(f"A prompt ({len(ids)} tokens) plus max_new_tokens ({cfg.max_new_tokens}) needs {needed} "
                             f"positions but {self.lm.name} has a context of {self.lm.max_context}; shorten one of them.")
        most = most_positions(len(ids), cfg.max_new_tokens)
        need = most * self.shape.kv_bytes_per_token
        if self.kv_budget_bytes is not None and need > self.kv_budget_bytes:
            raise BatchError(f"The KV budget ({self.kv_budget_bytes / 2**20:.3g} MiB) is smaller than one sequence "
                             f"needs ({need / 2**20:.2f} MiB: room for {most} positions); raise it or shorten the "
                             "request.")
        return ids

    def _prompt_ids(self, prompt: str, raw: bool) -> list[int]:
        """The prompt's token ids, tokenized once per engine (check() runs in the caller's thread, then again as
        the request is submitted); the latest PROMPTS_KEPT prompts are kept. Callers' threads and the engine's
        share them."""
        key = (prompt, raw)
        with self.prompts_lock:
            ids = self.prompts.get(key)
        if ids is None:
            ids = tuple(prompt_ids(self.lm, prompt, raw))
            with self.prompts_lock:
                if len(self.prompts) >= PROMPTS_KEPT:
                    del self.prompts[next(iter(self.prompts))]
                self.prompts[key] = ids
        return list(ids)

    def ready(self) -> None:
        """Take the run ids the next runs get, so that no run's clock counts the connection (a refused request
        takes none)."""
        if self.writer is not None:
            self.writer.ready()

    def submit(self, cfg: GenConfig, tag: str | None = None, t_request: int | None = None,
               sink: queue.SimpleQueue | None = None, batch: dict | None = None, stream: bool = True) -> Sequence:
        """Queue a request and start its recorded run. Its clock starts at t_request (perf_counter_ns, default
        now); sink, when given, receives its TokenEvents as they come (stream), then None when it ends. batch, when
        given, is stored in the run's config (what makes the batch again: engine.run.reproduce)."""
        seq = Sequence(self, cfg, self.check(cfg), tag, t_request or time.perf_counter_ns(), sink, stream)
        if self.store is not None:
            seq.recorder = Recorder(self.store, self.writer)
            seq.run_id = seq.recorder.start(
                model=self.lm.name, device=str(self.lm.device), dtype=self._dtype(), config=self._config(cfg, batch),
                hardware=self.hardware, prompt=cfg.prompt,
                n_prompt_tokens=len(seq.prompt_ids), tag=tag)
        self.queued.append(seq)
        return seq

    def run(self) -> list[Sequence]:
        """Step until every submitted sequence is done and its run is written; the sequences in the order they
        finished."""
        with collector_spared():
            while self.step():
                pass
        self.write()
        return self.finished

    def step(self) -> bool:
        """Admit, prefill up to prefill_chunk prompt tokens, one batched decode (which a prefill down to its last
        prompt token joins). False when nothing was left to do."""
        try:
            return self._step()
        finally:
            self.deliver()

    def _step(self) -> bool:
        for seq in [s for s in self.queued + self.running if s.cancel_requested]:
            self._end(seq, "cancelled", "cancelled")
        if not self._make_room():
            self._admit()
        if not self.running:
            return False
        try:
            decoding = [s for s in self.running if s.phase == "decode"]
            prefilling = [s for s in self.running if s.phase == "prefill"]
            # a prefill left with its last token (the rest found kept, or prefilled before) is a decode step: it
            # joins the decode's forward, which reads the weights once for both
            joining = [s for s in prefilling if 0 < s.filled == len(s.fill_ids) - 1]
            self._prefill([s for s in prefilling if s not in joining])
            if decoding or joining:
                self._decode(decoding, joining)
            self._end_done()
        except Exception as exc:  # the step failed for every sequence in it not done: each run ends with the error
            self._end_done()
            for seq in self.running + self.queued:
                seq.error = f"{type(exc).__name__}: {exc}"
                self._end(seq, "error", None)
            raise
        return True

    def close(self, status: str = "cancelled") -> None:
        """End every sequence still queued or running (a stop of the whole engine) and write every ended run."""
        self.end_all(status)
        self.write()

    def end_all(self, status: str = "cancelled") -> None:
        """End every sequence still queued or running."""
        try:
            for seq in self.running + self.queued:
                self._end(seq, status, status)
        finally:
            self.deliver()

    def deliver(self) -> None:
        """Hand the rows added since the last call to the operating system, a flush a journal, then each stream its
        events. A step does this just before its forward, which lets go of the GIL while the streams' readers wake
        and take their events, and at its end for what remains: a flush lets go of the GIL, and an event wakes its
        stream's reader, each of which would otherwise take the GIL from the step's bookkeeping row after row."""
        unflushed, self.unflushed = self.unflushed, {}
        events, self.undelivered = self.undelivered, []
        failed = None
        for recorder in unflushed:
            try:
                recorder.flush()
            except OSError as exc:  # the others' rows still go out; the step fails with the first error
                failed = failed or exc
        for sink, event in events:
            sink.put(event)
        if failed is not None:
            raise failed

    def write(self) -> None:
        """Write the rows of every run that started or ended so far, now (they are otherwise written together,
        at most flush_s() after they come); RecordDeferred when they cannot be, and they wait in their journals."""
        if self.writer is not None:
            self.writer.write()

    def _make_room(self) -> bool:
        """Grow each decoding sequence's count to the room its next position takes, preempting the newest-admitted
        running sequence while they do not fit the budget; whether it preempted. The oldest one alone always
        fits: check() refused any request whose whole life does not."""
        preempted = False
        for seq in list(self.running):
            if seq.phase != "decode" or seq not in self.running:
                continue
            grown = max(seq.held, room_for(seq.past + 1))
            if grown == seq.held:
                continue
            while not self._fits(grown - seq.held) and seq in self.running:
                self._preempt(self.running[-1])
                preempted = True
            if seq in self.running:
                seq.held = grown
        return preempted

    def _preempt(self, seq: Sequence) -> None:
        """Free the sequence's cache and put it back at the front of the queue, to be recomputed."""
        self.running.remove(seq)
        self.queued.insert(0, seq)
        seq.phase = seq.status = "queued"
        seq.cache, seq.opening, seq.held, seq.filled, seq.reused, seq.prefill_forward_ns = None, None, 0, 0, 0, 0
        seq.preemptions += 1
        seq.t_preempted = time.perf_counter_ns()
        self.preemptions += 1

    def _admit(self) -> None:
        while self.queued and len(self.running) < self.max_batch:
            seq = self.queued[0]
            entry, shared = self.prefixes.opening(seq.fill_ids) if self.prefixes is not None else (None, 0)
            share = self._reads_kept(seq, entry, shared)
            room = room_for(len(seq.fill_ids))
            if not (self._fits(room - shared, keep=entry) if share else self._fits(room)):
                return  # it waits for a running sequence to finish and free its cache
            self.queued.pop(0)
            seq.phase = seq.status = "prefill"
            now = time.perf_counter_ns()
            seq.t_admitted = seq.t_admitted or now
            if seq.t_preempted is not None:
                seq.preempted_ns += now - seq.t_preempted
                seq.t_preempted = None
            seq.held = room
            seq.cache = new_cache(self.cache_layers)
            if self.prefixes is not None:
                # the prompt found kept, which the room made kept too; a copy is looked up again, as making room may
                # have let go what was found
                found = (entry, shared) if share else None
                seq.opening, seq.reused = self.prefixes.reuse(seq.fill_ids, seq.cache, found)
                seq.filled = seq.reused
            self.running.append(seq)

    def _reads_kept(self, seq: Sequence, entry: tuple[int, ...] | None, shared: int) -> bool:
        """Whether the sequence's cache is to read the kept prompt entry's first `shared` positions where they are
        kept: only where its first forward is the decode step's, which reads them so (one prompt token left; any
        other forward would copy them in, engine.run.prefix), and where the budget holds the entry beside the
        sequence's whole life, so that it alone always fits (a running sequence cannot let go what it reads)."""
        if not 0 < shared == len(seq.fill_ids) - 1 or not self.lm.model.reads_openings(self.kv_dtype):
            return False
        most = most_positions(len(seq.prompt_ids), seq.cfg.max_new_tokens) - shared + len(entry)
        return self.kv_budget_bytes is None or most * self.shape.kv_bytes_per_token <= self.kv_budget_bytes

    def _prefill(self, seqs: list[Sequence]) -> None:
        """Up to prefill_chunk tokens of the prompts in their prefill (oldest first; after a preemption, a
        sequence's prompt and output tokens): in one forward where no product depends on the rows beside it, else
        one forward a sequence, so that each sequence's logits are those it gets alone."""
        parts, budget = [], self.prefill_chunk
        for seq in seqs:
            if budget <= 0:
                break
            chunk = seq.fill_ids[seq.filled:seq.filled + budget]
            parts.append((seq, chunk))
            budget -= len(chunk)
        for together in [parts] if self.prefills_together and len(parts) > 1 else [[part] for part in parts]:
            self._prefill_forward(together)

    @torch.inference_mode()
    def _prefill_forward(self, parts: list[tuple[Sequence, list[int]]]) -> None:
        """The sequences' chunks through the model in one forward; a sequence whose prefill it ends takes its
        first token (after a preemption, its next)."""
        self.deliver()  # the last step's rows and events, as the forward lets go of the GIL for them
        t_forward = time.perf_counter_ns()
        kv_bytes = None  # (read, written), where the forward counted them (one token through the fused decode)
        if len(parts) == 1:
            (seq, chunk), = parts
            extra = {"kv_dtype": self.kv_dtype} if self.kv_dtype is not None else {}
            out = self.lm.model(input_ids=torch.tensor([chunk], device=self.lm.device), cache=seq.cache,
                                use_cache=True, logits_to_keep=1, **extra)
            logits = out.logits[0, -1:]
            kv_bytes = getattr(out, "kv_bytes", None) if seq.filled == seq.reused else None
        else:
            logits = self.lm.model.prefill_batch([chunk for _, chunk in parts], [seq.cache for seq, _ in parts],
                                                 self.kv_dtype)
        hardware.sync(self.lm.device)
        t_sync = time.perf_counter_ns()
        ended = []
        for (seq, chunk), row in zip(parts, logits):
            seq.prefill_forward_ns += t_sync - t_forward
            seq.filled += len(chunk)
            if seq.filled == len(seq.fill_ids):
                ended.append((seq, select_token(row.float().cpu(), seq.cfg, seq.generator)))
                self._keep_prompt(seq)
        t_host = time.perf_counter_ns()
        for seq, token in ended:
            self._prefill_ended(seq, token, t_sync, t_host, kv_bytes, len(parts))

    def _keep_prompt(self, seq: Sequence) -> None:
        """A fresh prompt's cache, prefilled, kept for the prompts that open as it does."""
        if self.prefixes is not None and not seq.token_ids:
            room = None if self.kv_budget_bytes is None else self.kv_budget_bytes - self.reserved_bytes
            self.prefixes.keep(seq.prompt_ids, seq.cache, room, self._in_use)

    def _prefill_ended(self, seq: Sequence, token: int, t_sync: int, t_host: int, kv_bytes, batch: int) -> None:
        """The prefill's row and first token (after a preemption, the next). Its forwards are one phase, which
        ended at t_sync; everything else since the request or its previous step (waiting to be admitted or
        readmitted, the other sequences' steps between the chunks) is the host phase: serial waiting. The weights
        its last forward read were read for every sequence in it, so it carries its share of them."""
        began = t_sync - seq.prefill_forward_ns
        seq.past = len(seq.fill_ids)
        seq.phase = seq.status = "decode"
        self._emit(seq, Outcome(n_input=seq.past - seq.reused, past=seq.reused, drafted=0, accepted=0,
                                emitted=[token], marks=(seq.t_last, began, began, began, t_sync, t_sync, t_host),
                                kv_bytes=kv_bytes, batch=batch),
                   kind="recompute" if seq.preemptions and seq.step else None)

    @torch.inference_mode()
    def _decode(self, seqs: list[Sequence], joining: list[Sequence] = ()) -> None:
        """One forward of the decoding sequences' last tokens and the joining prefills' last prompt tokens."""
        rows = seqs + list(joining)
        positions = [s.past for s in seqs] + [s.filled for s in joining]
        self.deliver()  # the last step's rows and events, as the forward lets go of the GIL for them
        t_forward = time.perf_counter_ns()
        out = self.lm.model.decode_batch([s.token_ids[-1] for s in seqs] + [s.fill_ids[-1] for s in joining],
                                         positions, [s.cache for s in rows], self.kv_dtype)
        hardware.sync(self.lm.device)
        t_sync = time.perf_counter_ns()
        logits = out.logits if out.logits.dtype == torch.float32 and out.logits.is_cpu else out.logits.float().cpu()
        tokens = select_tokens(logits, [s.cfg for s in rows], [s.generator for s in rows])
        per_token = self.shape.kv_bytes_per_token
        joined_bytes = []  # a prefill of earlier chunks too: the estimate counts them all
        for seq, position in zip(joining, positions[len(seqs):]):
            seq.prefill_forward_ns += t_sync - t_forward
            joined_bytes.append((per_token * (position + 1), per_token) if seq.filled == seq.reused else None)
            seq.filled += 1
        t_host = time.perf_counter_ns()
        self.batch_sizes.append(len(rows))
        work = batch_decode_work(self.shape, positions)
        whole = (work.bytes_moved, self.attribution.roofline.time_ms(work), (t_sync - t_forward) / 1e6)
        for seq, token in zip(seqs, tokens):
            outcome = Outcome(n_input=1, past=seq.past, drafted=0, accepted=0, emitted=[token],
                              marks=(seq.t_last, t_forward, t_forward, t_forward, t_sync, t_sync, t_host),
                              kv_bytes=(per_token * (seq.past + 1), per_token), batch=len(rows))
            seq.past += 1
            seq.forwards.append(whole)
            self._emit(seq, outcome)
        for seq, token, kv_bytes in zip(joining, tokens[len(seqs):], joined_bytes):
            self._keep_prompt(seq)  # in its own row's time, not the decoding sequences'
            self._prefill_ended(seq, token, t_sync, t_host, kv_bytes, len(rows))

    def _piece(self, token: int) -> str:
        """The token's text on its own, decoded once per engine: a step of many sequences asks for many."""
        if token not in self.pieces:
            self.pieces[token] = self.lm.tokenizer.decode([token])
        return self.pieces[token]

    def _emit(self, seq: Sequence, out: Outcome, kind: str | None = None) -> None:
        """Take the step's token into the sequence's output, rows, journal and stream; end it when done. kind
        names a step that is neither the first prefill nor a decode (a recompute)."""
        events, text, done = seq.output.take(out.emitted)
        t_end = time.perf_counter_ns()
        row, token_rows = account(self.attribution, seq.step, out,
                                  [(t, self._piece(t)) for t, _ in events],
                                  len(seq.token_ids) - len(events), seq.t_request, t_end)
        row.kind = kind or row.kind
        seq.steps.append(columns(row))
        new_tokens = [columns(r) for r in token_rows]
        seq.tokens.extend(new_tokens)
        if seq.recorder is not None:
            seq.recorder.add(seq.steps[-1], new_tokens, text, flush=False)
            self.unflushed[seq.recorder] = None
        if seq.sink is not None and seq.stream:
            buckets = {b: getattr(token_rows[0], f"{b}_ms") for b in BUCKETS} if token_rows else {}
            self.undelivered.extend((seq.sink, TokenEvent(index=r.idx, token_id=token, piece=piece, step=seq.step,
                                                          t_ms=r.t_ms, gap_ms=r.gap_ms, buckets=buckets))
                                    for r, (token, piece) in zip(token_rows, events))
        seq.step += 1
        seq.t_last = t_end
        if done:
            self.done.append((seq, done))

    def _end_done(self) -> None:
        """End the sequences the step finished, one at a time: those after one whose ending fails stay to end."""
        while self.done:
            seq, reason = self.done.popleft()
            self._end(seq, "ok", reason)

    def _end(self, seq: Sequence, status: str, reason: str | None) -> None:
        """Finish the sequence's run and free its slot and cache."""
        for pool in (self.queued, self.running):
            if seq in pool:
                pool.remove(seq)
        seq.phase, seq.status, seq.stop_reason, seq.cache, seq.opening = "done", status, reason, None, None
        metrics = self._summary(seq)
        seq.result = {"run_id": seq.run_id, "status": status, "error": seq.error, "text": seq.text,
                      "token_ids": list(seq.token_ids), **metrics}
        self.finished.append(seq)
        try:
            if seq.recorder is not None:
                self.unflushed.pop(seq.recorder, None)  # its finish flushes its rows before its ending
                seq.recorder.finish(status=status, output=seq.text, token_ids=seq.token_ids,
                                    metrics={k: v for k, v in metrics.items() if k != "itl_ms"}, error=seq.error,
                                    steps=seq.steps, tokens=seq.tokens, telemetry=[])
        finally:
            if seq.sink is not None:
                self.undelivered.append((seq.sink, None))

    def _summary(self, seq: Sequence) -> dict:
        metrics = run_metrics([t["t_ms"] for t in seq.tokens], len(seq.prompt_ids))
        decode = [s for s in seq.steps if s["kind"] == "decode"]
        metrics.update({
            "distances_ms": sum_buckets([{b: s[f"{b}_ms"] for b in BUCKETS} for s in seq.steps]),
            "stop_reason": seq.stop_reason,
            "queue_ms": ((seq.t_admitted or time.perf_counter_ns()) - seq.t_request) / 1e6,
            "preemptions": seq.preemptions,
            "prefix_reused_tokens": seq.reused,
            "preempted_ms": (seq.preempted_ns + (time.perf_counter_ns() - seq.t_preempted if seq.t_preempted
                                                 else 0)) / 1e6,
            "batch_mean": sum(s["batch"] for s in decode) / len(decode) if decode else None,
            "batch_max": max((s["batch"] for s in decode), default=None),
            "kv_bytes_per_token": self.shape.kv_bytes_per_token,
            "kv_dtype": name_of(self.kv_dtype or self.lm.dtype),
            "weight_bytes_per_forward": self.shape.weight_bytes,
            "calibration": {k: self.calibration.get(k) for k in hardware.RUN_CALIBRATION},
            **hardware.decode_checks(seq.forwards, self.calibration),
        })
        return metrics

    def _dtype(self) -> str:
        return str(self.lm.dtype).removeprefix("torch.")

    def _config(self, cfg: GenConfig, batch: dict | None = None) -> dict:
        return {"model": self.lm.name, "device": str(self.lm.device), "dtype": self._dtype(), "weights": self.lm.weights,
                "sparsity": self.lm.sparsity, "sparsity_mode": self.lm.sparsity_mode, **asdict(cfg),
                "max_batch": self.max_batch, "kv_budget_bytes": self.kv_budget_bytes,
                "prefix_cache_bytes": self.prefixes.capacity if self.prefixes is not None else None,
                **({"batch": batch} if batch else {})}


def batch_summary(seqs: list[Sequence], wall_s: float) -> dict:
    """What a batch of sequences did together: tokens per second in total over the wall time and per user (each
    sequence's tokens over its own time), and each sequence's run."""
    tokens = sum(len(s.token_ids) for s in seqs)
    per_user = [len(s.token_ids) / (s.result["total_ms"] / 1e3) for s in seqs if s.result.get("total_ms")]
    return {
        "users": len(seqs),
        "status": "ok" if all(s.status == "ok" for s in seqs) else "incomplete",
        "wall_s": wall_s,
        "n_new_tokens": tokens,
        "tokens_per_s_total": tokens / wall_s if wall_s > 0 else None,
        "tokens_per_s_per_user": sum(per_user) / len(per_user) if per_user else None,
        "run_ids": [s.run_id for s in seqs],
        "runs": [{k: s.result.get(k) for k in ("run_id", "status", "n_prompt_tokens", "n_new_tokens", "ttft_ms",
                                               "tpot_ms", "total_ms", "queue_ms", "batch_mean", "preemptions",
                                               "stop_reason", "text")}
                 for s in seqs],
    }
