"""In-process serving: requests submitted straight into the continuous-batching engine, with no HTTP.

The load tools call this where they would call a server:

    engine = LocalEngine(lm, store=store, max_batch=8)   # a thread steps the batch from now on
    handle = engine.submit("a prompt", max_new_tokens=64) # returns at once; the request's clock starts here
    for event in handle:                                  # TokenEvents as they are decoded; event.t_ms counts
        ...                                               # from the submit, event.gap_ms is the step's time
    handle.result                                         # the run's summary: run_id, ttft_ms, tpot_ms, ...
    handle.cancel()                                       # ends it at the next step, freeing its slot and cache
    engine.close()                                        # ends what is still queued or running, stops the thread

submit() raises engine.run.batch.BatchError (a UserError) for a request the engine cannot run, before
anything is recorded; every request it accepts is a recorded run when a store is given.

BatchRun is a RunSpec with users > 1 run the way open_run runs any spec: its prompt and users - 1 others
decoded together in one BatchEngine, iterated for the tokens of every sequence as they come."""
from __future__ import annotations

import queue
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, replace

from engine.measure import hardware
from engine.measure.distances import BUCKETS
from engine.model.cpu_kernels import release_threads
from engine.run.batch import BatchEngine, Sequence, batch_prompts, batch_summary
from engine.run.generate import TokenEvent, collector_spared
from engine.spec import GenConfig, RunSpec


class Handle:
    """One submitted request: iterate it for its TokenEvents (it ends when the request does). A handle submitted
    with stream=False yields none and wakes its reader once, at the end: the token rows are then in
    handle.sequence.tokens, each with the time it was decoded."""

    def __init__(self, stream: bool = True):
        self.stream = stream
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.sequence: Sequence | None = None
        self._cancel = False

    def __iter__(self):
        while (event := self.events.get()) is not None:
            yield event

    @property
    def result(self) -> dict | None:
        """The run's summary once it has ended, else None."""
        return self.sequence.result if self.sequence is not None else None

    def wait(self) -> dict:
        """Block until the request has ended; its summary."""
        for _ in self:
            pass
        return self.result

    def cancel(self) -> None:
        self._cancel = True
        if self.sequence is not None:
            self.sequence.cancel()


class LocalEngine:
    """A BatchEngine stepped by a thread of its own; submit() from any thread."""

    def __init__(self, lm, store=None, max_batch: int = 8, kv_budget_bytes: int | None = None,
                 kv_dtype: str = "auto", template: GenConfig | None = None, prefix_cache_bytes: int | None = None):
        self.engine = BatchEngine(lm, store=store, max_batch=max_batch, kv_budget_bytes=kv_budget_bytes,
                                  kv_dtype=kv_dtype, prefix_cache_bytes=prefix_cache_bytes)
        self.template = template or GenConfig("", kv_dtype=kv_dtype)
        self.error: BaseException | None = None  # the last step failure (its runs ended with it)
        self._inbox: list[tuple[GenConfig, Handle, int, str | None]] = []
        self._wake = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="tokenpath-batch", daemon=True)
        release_threads()  # the model is stepped in the engine's thread from now on
        self._thread.start()

    def check(self, prompt: str, max_new_tokens: int = 64, **settings) -> GenConfig:
        """The request's GenConfig, or the UserError the engine refuses it with (a prompt beyond the context, a KV
        budget too small for it)."""
        cfg = replace(self.template, prompt=prompt, max_new_tokens=max_new_tokens, **settings)
        self.engine.check(cfg)
        return cfg

    def submit(self, prompt: str, max_new_tokens: int = 64, tag: str | None = None, stream: bool = True,
               **settings) -> Handle:
        """Queue a request; settings are GenConfig fields (temperature, stop, ignore_eos, ...); tag is stored
        with its run; stream=False: the handle yields no events, only ends (see Handle)."""
        cfg = self.check(prompt, max_new_tokens, **settings)  # refused here, in the caller's thread, unrecorded
        handle = Handle(stream)
        with self._wake:
            if self._closing:
                raise RuntimeError("This LocalEngine is closed.")
            self._inbox.append((cfg, handle, time.perf_counter_ns(), tag))
            self._wake.notify()
        return handle

    def close(self) -> None:
        """End what is still queued or running, stop the thread and write every run (RecordDeferred when the
        database cannot be written: the runs wait in their journals)."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join()
        self.engine.write()

    def _loop(self) -> None:
        # from each idle spell's end to the next one's start, the cycle collector spares what was alive when it
        # ended (collector_spared): in a process that keeps many results (a long sweep's), a full collection
        # stalls a step for hundreds of milliseconds
        with ExitStack() as busy_spell:
            busy_spell.enter_context(collector_spared())
            while True:
                with self._wake:
                    arrivals, self._inbox = self._inbox, []
                    closing = self._closing
                for cfg, handle, t_request, tag in arrivals:
                    seq = self.engine.submit(cfg, tag=tag, t_request=t_request, sink=handle.events,
                                             stream=handle.stream)
                    handle.sequence = seq
                    if handle._cancel:
                        seq.cancel()
                if closing:
                    self.engine.end_all()
                    return
                try:
                    busy = self.engine.step()
                except Exception as exc:  # every run in the step ended with it; later requests still run
                    self.error, busy = exc, True
                if not busy:
                    busy_spell.close()
                    with self._wake:
                        if not self._inbox and not self._closing:
                            release_threads()  # while idle, other engines' steps spin their threads
                            self._wake.wait()
                    busy_spell.enter_context(collector_spared())


@dataclass
class BatchEvent(TokenEvent):
    """A token of one sequence in a batch: user 0 is the spec's own prompt, the others come from the workloads."""
    user: int = 0
    run_id: int | None = None


def bytes_per_token(steps: list[dict]) -> float | None:
    """Bytes a decode token moved: each decode step row's weights (its sequence's share of a batched forward),
    KV reads and writes, averaged over the rows; None where the rows count no bytes (a served run)."""
    decode = [s for s in steps if s["kind"] == "decode" and "weight_bytes" in s]
    return sum(s["weight_bytes"] + s["kv_read_bytes"] + s["kv_write_bytes"] for s in decode) / len(decode) \
        if decode else None


def load_figures(run) -> dict:
    """How an ended run shared the machine, in the same keys for a batch and a lone run: users, tokens/s in
    total and per user, each sequence's run and the bytes a decode token moved."""
    if isinstance(run, BatchRun):
        return {k: run.result[k] for k in ("users", "tokens_per_s_total", "tokens_per_s_per_user", "run_ids",
                                           "bytes_per_token")}
    rate = run.result.get("tokens_per_s")
    return {"users": 1, "tokens_per_s_total": rate, "tokens_per_s_per_user": rate, "run_ids": [run.run_id],
            "bytes_per_token": bytes_per_token(run.steps)}


class BatchRun:
    """A spec with users > 1 as one continuously batched run: the spec's prompt and users - 1 others
    (engine.run.batch.batch_prompts), each sequence its own recorded run. Every request is checked when the
    run is made, so a refusal records nothing. Iterate it for BatchEvents (the tokens of every sequence, step
    by step); closing the iterator early cancels every sequence. Afterwards: status, result (batch_summary's
    figures, the bytes a decode token moved, the whole batch's peak check), tokens and steps (every
    sequence's rows, each with its run_id and user)."""

    def __init__(self, lm, spec: RunSpec, store=None, calibration: dict | None = None,
                 prompts_file: str | None = None, kv_budget_bytes: int | None = None):
        self.spec = spec
        self.engine = BatchEngine(lm, store, max_batch=spec.users, kv_budget_bytes=kv_budget_bytes,
                                  kv_dtype=spec.gen.kv_dtype, calibration=calibration, arrivals=False)
        self.requests = [replace(spec.gen, prompt=p) for p in batch_prompts(spec.gen.prompt, spec.users, prompts_file)]
        # stored with every sequence's run: what makes the whole batch again (engine.run.reproduce)
        self.batch = {"run_spec": spec.to_dict(), "prompts": [r.prompt for r in self.requests],
                      "prompts_file": prompts_file, "kv_budget_bytes": kv_budget_bytes}
        for request in self.requests:
            self.engine.check(request)
        self.special_ids = sorted(lm.tokenizer.all_special_ids)
        self.sequences: list[Sequence] = []
        self.tokens: list[dict] = []  # every sequence's token rows, in the order they were decoded
        self.status = "pending"
        self.result: dict | None = None

    @property
    def run_id(self) -> int | None:
        """The spec's own sequence's run."""
        return self.sequences[0].run_id if self.sequences else None

    @property
    def run_ids(self) -> list[int | None]:
        return [s.run_id for s in self.sequences]

    @property
    def live_tokens(self) -> list[dict]:
        return self.tokens

    @property
    def steps(self) -> list[dict]:
        return [{**row, "run_id": s.run_id, "user": user} for user, s in enumerate(self.sequences) for row in s.steps]

    def __iter__(self):
        self.status = "running"
        self.engine.ready()
        start = time.perf_counter()
        self.sequences = [self.engine.submit(cfg, tag=self.spec.tag, batch={**self.batch, "user": user})
                          for user, cfg in enumerate(self.requests)]
        taken = [0] * len(self.sequences)
        end = None  # when the last step ended: the rates leave out the final write
        try:
            with collector_spared():
                while self.engine.step():
                    for user, seq in enumerate(self.sequences):
                        for row in seq.tokens[taken[user]:]:
                            self.tokens.append({**row, "run_id": seq.run_id, "user": user})
                            yield BatchEvent(index=row["idx"], token_id=row["token_id"], piece=row["piece"],
                                             step=row["step"], t_ms=row["t_ms"], gap_ms=row["gap_ms"],
                                             buckets={b: row[f"{b}_ms"] for b in BUCKETS}, user=user,
                                             run_id=seq.run_id)
                        taken[user] = len(seq.tokens)
            end = time.perf_counter()
            self.status = "ok" if all(s.status == "ok" for s in self.sequences) else "incomplete"
        except (GeneratorExit, KeyboardInterrupt):
            self.status = "cancelled"
            raise
        except Exception:  # the engine ended every sequence's run with the error
            self.status = "error"
            raise
        finally:
            end = end or time.perf_counter()
            try:
                self.engine.close()  # every sequence still running is recorded as cancelled; every run is written
            finally:
                self.result = self._summary(end - start)

    def _summary(self, wall_s: float) -> dict:
        own = (self.sequences[0].result if self.sequences else None) or {}
        forwards = {id(f): f for s in self.sequences for f in s.forwards}  # a batched forward counts once
        decode_rates = [s.result["decode_tokens_per_s"] for s in self.sequences
                        if s.result and s.result.get("decode_tokens_per_s")]
        return {**batch_summary(self.sequences, wall_s), "status": self.status,
                "stop_reason": own.get("stop_reason"), "text": own.get("text"), "own": own,
                "bytes_per_token": bytes_per_token([row for s in self.sequences for row in s.steps]),
                # on the planner's footing: the spec's own sequence, whose steps' mean batch the plan takes
                "bytes_per_token_own": bytes_per_token(self.sequences[0].steps) if self.sequences else None,
                # each sequence's decode rate (1 / TPOT): what the planner predicts, prefill and queue left out
                "decode_tokens_per_s_per_user": sum(decode_rates) / len(decode_rates) if decode_rates else None,
                "decode_tokens_per_s_total": sum(decode_rates) if decode_rates else None,
                "planned": self._planned(own),
                **hardware.decode_checks(list(forwards.values()), self.engine.calibration)}

    def _planned(self, own: dict) -> dict:
        """The planner's prediction for the spec's own sequence at the batch it decoded in (its decode steps'
        mean), or the sentence why there is none."""
        from engine.plan.planner import plan_for_run
        from engine.plan.shapes import ShapeError

        if not own.get("n_new_tokens"):
            return {"error": "No token was decoded, so there is nothing to predict."}
        run = {"model": self.engine.lm.name, "dtype": self.engine._dtype(), "weights": self.engine.lm.weights,
               "metrics": own, "n_prompt_tokens": own["n_prompt_tokens"], "n_new_tokens": own["n_new_tokens"]}
        try:
            plan = plan_for_run(run, self.engine.calibration)
        except ShapeError as exc:
            return {"error": str(exc)}
        return {k: plan[k] for k in ("batch", "decode_ms_per_token", "tokens_per_s_per_user", "tokens_per_s_total",
                                     "bytes_per_token", "distances_ms")}

    def run(self) -> dict:
        for _ in self:
            pass
        return self.result
