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
anything is recorded; every request it accepts is a recorded run when a store is given."""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import replace

from engine.run.batch import BatchEngine, Sequence
from engine.run.spec import GenConfig


class Handle:
    """One submitted request: iterate it for its TokenEvents (it ends when the request does)."""

    def __init__(self):
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
                 kv_dtype: str = "auto", template: GenConfig | None = None):
        self.engine = BatchEngine(lm, store=store, max_batch=max_batch, kv_budget_bytes=kv_budget_bytes,
                                  kv_dtype=kv_dtype)
        self.template = template or GenConfig("", kv_dtype=kv_dtype)
        self.error: BaseException | None = None  # the last step failure (its runs ended with it)
        self._inbox: list[tuple[GenConfig, Handle, int, str | None]] = []
        self._wake = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="tokenpath-batch", daemon=True)
        self._thread.start()

    def submit(self, prompt: str, max_new_tokens: int = 64, tag: str | None = None, **settings) -> Handle:
        """Queue a request; settings are GenConfig fields (temperature, stop, ignore_eos, ...); tag is stored
        with its run."""
        cfg = replace(self.template, prompt=prompt, max_new_tokens=max_new_tokens, **settings)
        self.engine.check(cfg)  # bad input is refused here, in the caller's thread, before anything is recorded
        handle = Handle()
        with self._wake:
            if self._closing:
                raise RuntimeError("This LocalEngine is closed.")
            self._inbox.append((cfg, handle, time.perf_counter_ns(), tag))
            self._wake.notify()
        return handle

    def close(self) -> None:
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._wake:
                arrivals, self._inbox = self._inbox, []
                closing = self._closing
            for cfg, handle, t_request, tag in arrivals:
                seq = self.engine.submit(cfg, tag=tag, t_request=t_request, sink=handle.events)
                handle.sequence = seq
                if handle._cancel:
                    seq.cancel()
            if closing:
                self.engine.close()
                return
            try:
                busy = self.engine.step()
            except Exception as exc:  # every run in the step ended with it; later requests still run
                self.error, busy = exc, True
            if not busy:
                with self._wake:
                    if not self._inbox and not self._closing:
                        self._wake.wait()
