"""The instrumented decode loop: prefill, then one timed step per token, each attributed and recorded.

Generation coordinates three parts that each do one thing: engine.run.step runs a step (propose,
forward, accept, crop), engine.store.rows turns its timing into typed rows and buckets, engine.store.record
keeps the rows safe and writes the database. Steps tile the run's timeline: a step begins where
the previous one handed its tokens to the consumer of the stream, so the time the consumer takes
between tokens lands in the next step's host phase and the per-token buckets add up to the run's
end-to-end time."""
from __future__ import annotations

import gc
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
from transformers import DynamicCache

from engine import FREED_MEMORY, OPENMP_WAIT, huge_pages
from engine.measure import hardware
from engine.switches import speculative
from engine.measure.accounting import cache_nbytes, model_shape
from engine.measure.distances import BUCKETS, sum_buckets
from engine.dtypes import name_of, torch_dtype
from engine.model.lean import LeanLlama
from engine.measure.metrics import run_metrics
from engine.model.loader import LoadedModel, load_model
from engine.store.record import Recorder
from engine.store.rows import Attribution, account, columns
from engine.switches.sparsity import sparse_layers
from engine.switches.drafters import MAX_K, SpeculativeError
from engine.spec import GenConfig, GenerationError, RunSpec
from engine.run.step import DecodeState, decode_step
from engine.store.db import Store
from engine.run.text import Output, prompt_ids


_runs_sparing_the_collector = 0
_sparing = threading.Lock()


@contextmanager
def collector_spared():
    """Sets every object alive before a run (the model, its modules, the libraries: hundreds of
    thousands) aside from Python's cycle collector while runs decode, so a collection that a step's
    allocations trigger walks only what was made since (walking them all costs milliseconds of every
    step, and a full collection in a process that has kept many results, hundreds). Runs that interleave,
    in any thread, share one freeze, lifted when the last ends."""
    global _runs_sparing_the_collector
    with _sparing:
        if _runs_sparing_the_collector == 0:
            gc.freeze()
        _runs_sparing_the_collector += 1
    try:
        yield
    finally:
        with _sparing:
            _runs_sparing_the_collector -= 1
            if _runs_sparing_the_collector == 0:
                gc.unfreeze()


@dataclass
class TokenEvent:
    index: int
    token_id: int
    piece: str
    step: int
    t_ms: float
    gap_ms: float
    buckets: dict


class Generation:
    """One run. Iterate it for TokenEvents; closing the iterator early cancels the run.

    After iteration: status, text, token_ids, steps, tokens, result (the run summary)."""

    def __init__(self, lm: LoadedModel, cfg: GenConfig, store: Store | None = None,
                 calibration: dict | None = None, telemetry: bool = True, tag: str | None = None,
                 spec: RunSpec | None = None):
        cfg.check()
        self.lm, self.cfg, self.telemetry, self.tag = lm, cfg, telemetry, tag
        self.spec = spec  # stored whole with the run, so the run can be made again from it
        self.prompt_ids = prompt_ids(lm, cfg.prompt, cfg.raw)
        needed = len(self.prompt_ids) + cfg.max_new_tokens
        if needed > lm.max_context:
            raise GenerationError(
                f"The prompt ({len(self.prompt_ids)} tokens) plus max_new_tokens ({cfg.max_new_tokens}) needs "
                f"{needed} positions but {lm.name} has a context of {lm.max_context}; shorten one of them.")
        self.kv_dtype = None if cfg.kv_dtype == "auto" else torch_dtype(cfg.kv_dtype)
        if self.kv_dtype is not None and not isinstance(lm.model, LeanLlama):
            raise GenerationError(f"A KV-cache precision apart from the weights' needs the lean forward, which runs "
                                  f"Llama-architecture models; {lm.name} is not one.")
        try:
            self.drafter = speculative.make_drafter(lm, cfg, load=lambda m: load_model(m, device=str(lm.device)))
        except SpeculativeError as exc:  # a setting of this run: the generation's own error
            raise GenerationError(str(exc)) from None
        self.calibration = calibration or hardware.calibration_for(lm.device, store)
        self.shape = model_shape(lm.model, kv_dtype=self.kv_dtype)
        self.attribution = Attribution(
            self.shape, hardware.roofline(self.calibration, lm.dtype, self.shape.weight_bytes, lm.weights),
            cfg.kv_cache, tuple(sparse_layers(lm.model)))
        self.recorder = Recorder(store) if store is not None else None
        self.output = Output(lm, cfg.max_new_tokens, cfg.stop, cfg.ignore_eos)
        self.status = "pending"
        self.error: str | None = None
        self.stop_reason: str | None = None
        self.steps: list[dict] = []
        self.tokens: list[dict] = []
        self.telemetry_rows: list[dict] = []
        self.state: DecodeState | None = None
        self.result: dict | None = None

    @property
    def text(self) -> str:
        return self.output.text

    @property
    def token_ids(self) -> list[int]:
        return self.output.token_ids

    @property
    def run_id(self) -> int | None:
        return self.recorder.run_id if self.recorder is not None else None

    @property
    def special_ids(self) -> list[int]:
        """The tokenizer's special token ids, which a page hides."""
        return sorted(self.lm.tokenizer.all_special_ids)

    @property
    def cache(self):
        """The run's KV cache (None before the run or with the cache off)."""
        return self.state.cache if self.state else None

    @property
    def live_tokens(self) -> list[dict]:
        """The token rows so far, for a page drawing the run while it streams."""
        return self.tokens

    def config_record(self) -> dict:
        return {"model": self.lm.name, "device": str(self.lm.device), "dtype": str(self.lm.dtype).removeprefix("torch."),
                "weights": self.lm.weights, "sparsity": self.lm.sparsity, "sparsity_mode": self.lm.sparsity_mode,
                **asdict(self.cfg), **({"run_spec": self.spec.to_dict()} if self.spec else {})}

    def __iter__(self):
        self.status = "running"
        sampler = None
        try:
            if self.recorder is not None:
                config = self.config_record()
                self.recorder.start(model=self.lm.name, device=str(self.lm.device), dtype=config["dtype"],
                                    config=config, hardware=hardware.hardware_summary(self.lm.device),
                                    prompt=self.cfg.prompt, n_prompt_tokens=len(self.prompt_ids), tag=self.tag)
            if self.telemetry:
                sampler = hardware.TelemetrySampler(self.lm.device)
                sampler.__enter__()
            with collector_spared():
                yield from self._loop(time.perf_counter_ns())
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

    def _loop(self, t_request: int):
        cfg = self.cfg
        generator = torch.Generator().manual_seed(cfg.seed) if cfg.seed is not None else None
        cache = DynamicCache(config=self.lm.config) if cfg.kv_cache else None
        if cache is not None and self.drafter is not None:
            self.drafter.attach(cache, self.kv_dtype)
        self.state = state = DecodeState(ids=list(self.prompt_ids), pending=list(self.prompt_ids), cache=cache,
                                         kv_dtype=self.kv_dtype)
        step_start, k, step = t_request, cfg.speculative_k, 0
        backoff = speculative.Backoff() if cfg.adaptive and self.drafter else None
        while True:
            room = cfg.max_new_tokens - len(self.token_ids) - 1  # drafts beyond the budget would be wasted
            guessing = step > 0 and room > 0 and (backoff is None or backoff.allows())
            out = decode_step(self.lm, state, cfg, self.drafter, min(k, room) if guessing else 0, generator,
                              step_start)
            events, text, done = self.output.take(out.emitted)
            state.ids.extend(token for token, _ in events)
            state.pending = state.ids[cache.get_seq_length():] if cfg.kv_cache else state.ids
            t_end = time.perf_counter_ns()
            row, token_rows = account(self.attribution, step, out,
                                      [(t, self.lm.tokenizer.decode([t])) for t, _ in events],
                                      len(self.token_ids) - len(events), t_request, t_end)
            self.steps.append(columns(row))
            new_tokens = [columns(r) for r in token_rows]
            self.tokens.extend(new_tokens)
            if self.recorder is not None:
                self.recorder.add(self.steps[-1], new_tokens, text)
            self.stop_reason = done
            buckets = {b: getattr(token_rows[0], f"{b}_ms") for b in BUCKETS} if token_rows else {}
            for i, (token, piece) in enumerate(events):
                yield TokenEvent(index=token_rows[i].idx, token_id=token, piece=piece, step=step,
                                 t_ms=token_rows[i].t_ms, gap_ms=token_rows[i].gap_ms, buckets=buckets)
            step_start = t_end  # the consumer's time with the tokens counts toward the next step
            if done:
                return
            k = speculative.next_k(k, out.drafted, out.accepted, cfg.adaptive, MAX_K)
            if backoff and step > 0:  # decode steps only: the prefill is no measure of a plain step
                # the step's own time: the consumer's (a page drawing, a benchmark's other runs) is not
                # what guessing costs
                backoff.record((t_end - out.marks[1]) / 1e6, len(events), bool(out.drafted))
            step += 1

    def _summary(self) -> dict:
        metrics = run_metrics([t["t_ms"] for t in self.tokens], len(self.prompt_ids))
        decode_steps = [s for s in self.steps if s["kind"] == "decode"]
        cache = self.cache
        metrics.update({
            "distances_ms": sum_buckets([{b: s[f"{b}_ms"] for b in BUCKETS} for s in self.steps]),
            "stop_reason": self.stop_reason,
            "kv_cache_bytes": cache_nbytes(cache) if cache is not None else 0,
            "kv_bytes_per_token": self.shape.kv_bytes_per_token,
            "kv_dtype": name_of(self.kv_dtype or self.lm.dtype),
            "openmp_wait": OPENMP_WAIT,
            "freed_memory": FREED_MEMORY,
            "huge_pages": huge_pages.describe(),
            "weight_bytes_per_forward": self.shape.weight_bytes,
            "calibration": {k: self.calibration.get(k) for k in hardware.RUN_CALIBRATION},
            # the decode's bytes per second against the calibrated peak, flagged when it beats it
            **hardware.decode_checks([(s["weight_bytes"] + s["kv_read_bytes"] + s["kv_write_bytes"], s["roofline_ms"],
                                       s["forward_ms"]) for s in decode_steps], self.calibration),
        })
        if self.drafter is not None:
            metrics["speculative"] = speculative.summary(self.steps, len(self.token_ids))
        return metrics

    def _keep_recorded(self) -> None:
        """A stop (Ctrl-C, SIGTERM) can land between taking a step's tokens and recording its rows:
        the run then ends as its rows say, without that step."""
        if self.steps and sum(t["step"] == self.steps[-1]["step"] for t in self.tokens) != self.steps[-1]["n_emitted"]:
            last = self.steps.pop()["step"]
            self.tokens = [t for t in self.tokens if t["step"] != last]
        if len(self.tokens) < len(self.token_ids):
            self.output.rewind([t["token_id"] for t in self.tokens], "".join(t["piece"] for t in self.tokens))

    def _finish(self) -> None:
        if self.status != "ok":
            self._keep_recorded()
        metrics = self._summary()
        self.result = {"run_id": self.run_id, "status": self.status, "error": self.error, "text": self.text,
                       "token_ids": list(self.token_ids), **metrics}
        if self.recorder is not None and self.recorder.journal is not None:  # None: no run row was written
            self.recorder.finish(status=self.status, output=self.text, token_ids=self.token_ids,
                                 metrics={k: v for k, v in metrics.items() if k != "itl_ms"}, error=self.error,
                                 steps=self.steps, tokens=self.tokens, telemetry=self.telemetry_rows)

    def run(self) -> dict:
        for _ in self:
            pass
        return self.result
