"""In-process load: a sweep's requests submitted straight into the local continuous-batching engine, with no
HTTP. LocalTarget has ServerTarget's methods, so the sweep's records, summaries, SLO figures and rows follow."""
from __future__ import annotations

import threading

import numpy as np

from engine.errors import UserError
from engine.paths import DEFAULT_MODEL_NAME
from engine.plan import planner
from engine.plan import simulate as sim
from engine.run.batch import PREFILL_CHUNK
from engine.run.local import Handle, LocalEngine
from engine.run.prepare import prepare
from engine.run.text import tokenizer_prompt_ids
from engine.serve.arrivals import synthetic_prompt
from engine.serve.client import tokenizer_for
from engine.serve.load import Reply, SweepConfig
from engine.serve.scrape import LOCAL_PREFIX_CACHE
from engine.spec import GenConfig, RunSpec


def prefilled_tokens(tokenizer, n: int) -> int:
    """The tokens the engine prefills for a synthetic prompt of n tokens: the prompt in the model's chat template,
    as a sweep sends it (not raw), where the tokenizer has one."""
    prompt = synthetic_prompt(n, np.random.default_rng(1), tokenizer)
    return len(tokenizer_prompt_ids(tokenizer, prompt, chat=bool(getattr(tokenizer, "chat_template", None))))


def planned_setup(calibration: dict, prompt_tokens: int, new_tokens: int, max_batch: int,
                  model: str = "default", tokenizer=None) -> tuple[planner.Setup, sim.Scheduler]:
    """The local engine as the planner sees it: this machine (its calibration) as the device, fp32, prompts of
    prompt_tokens as the engine prefills them (in the chat template, with the model's tokenizer where it is
    here), and the engine's scheduler: max_batch sequences, each step's prefill chunks (PREFILL_CHUNK prompt
    tokens in all) a forward each, then one batched decode."""
    tokenizer = tokenizer or tokenizer_for(DEFAULT_MODEL_NAME if model == "default" else str(model))
    prefilled = prefilled_tokens(tokenizer, prompt_tokens) if tokenizer is not None else prompt_tokens
    setup = planner.Setup(model=planner.resolve_model(model), gpu=planner.local_device(calibration),
                          weights="fp32", kv_dtype="fp32", prompt_tokens=prefilled, new_tokens=new_tokens,
                          efficiency=planner.local_efficiency(calibration, "fp32", "fp32"))
    return setup, sim.Scheduler(max_num_seqs=max_batch, max_batched_tokens=PREFILL_CHUNK, separate_prefills=True)


class LocalTarget:
    """The local engine as a sweep's target: each request is a recorded run, tagged with the request's
    sweep, level and index (engine.serve.load.request_tag); each of its tokens is timed as the engine decodes it."""

    root = "local"
    kind = "local"

    def __init__(self, cfg: SweepConfig, lm, store, max_batch: int = 8, kv_budget_bytes: int | None = None,
                 model: str = "default", weights: str = "fp32", prefix_cache_bytes: int | None = None,
                 kv_dtype: str = "auto"):
        self.cfg, self.store = cfg, store
        self.engine = LocalEngine(lm, store=store, max_batch=max_batch, kv_budget_bytes=kv_budget_bytes,
                                  prefix_cache_bytes=prefix_cache_bytes, kv_dtype=kv_dtype)
        self.model, self.tokenizer = lm.name, lm.tokenizer
        self.settings = {"kind": self.kind, "model": lm.name, "weights": lm.weights, "max_batch": max_batch,
                         "kv_budget_bytes": kv_budget_bytes, "prefix_cache_bytes": prefix_cache_bytes,
                         "kv_dtype": kv_dtype}
        # as they were given (--model, --weights), so that --from-sweep loads the same model at the same level
        self.model_option, self.weights_option = model, weights
        self._handles: set[Handle] = set()
        self._lock = threading.Lock()

    @classmethod
    def load(cls, cfg: SweepConfig, store, model: str = "default", weights: str = "fp32", max_batch: int = 8,
             kv_budget_bytes: int | None = None, prefix_cache_bytes: int | None = None,
             kv_dtype: str = "auto") -> LocalTarget:
        """The model loaded per `model` ('default', a Hugging Face id or a local folder) at the weight level
        `weights` and the engine over it, keeping every cache in `kv_dtype`, as `python -m engine load --local`
        makes it: every request a recorded run in `store`."""
        return cls(cfg, prepare(RunSpec(GenConfig("", kv_dtype=kv_dtype), model=model, weights=weights), store), store,
                   max_batch=max_batch, kv_budget_bytes=kv_budget_bytes, model=model, weights=weights,
                   prefix_cache_bytes=prefix_cache_bytes, kv_dtype=kv_dtype)

    def rtt_ms(self) -> None:
        return None  # no network between the sweep and the engine

    def describe(self) -> dict:
        return self.settings

    def options(self) -> dict:
        """The command-line options that make this target again (stored with the sweep, for --from-sweep)."""
        mib = {key: self.settings[key + "_bytes"] / 2**20 if self.settings[key + "_bytes"] is not None else None
               for key in ("kv_budget", "prefix_cache")}
        return {"local": True, "model": self.model_option, "weights": self.weights_option,
                "max_batch": self.settings["max_batch"], "kv_budget_mb": mib["kv_budget"],
                "prefix_cache_mb": mib["prefix_cache"], "kv_dtype": self.settings["kv_dtype"]}

    def snapshot(self) -> dict | None:
        """The prompt tokens the kept prompts were asked for and supplied so far (counted as vLLM's prefix cache
        counts them); None without kept prompts. The engine keeps no histograms: every request's run holds its
        own figures."""
        prefixes = self.engine.engine.prefixes
        if prefixes is None:
            return None
        return {LOCAL_PREFIX_CACHE["queries"]: prefixes.queried_tokens,
                LOCAL_PREFIX_CACHE["hits"]: prefixes.reused_tokens}

    def gauges(self, timeout_s: float) -> dict:
        """Sequences decoding and waiting for a slot now, and, under a KV budget, the share of it reserved."""
        batch = self.engine.engine
        found = {"running": float(len(batch.running)), "waiting": float(len(batch.queued))}
        if batch.kv_budget_bytes:
            found["kv_cache_usage"] = batch.reserved_bytes / batch.kv_budget_bytes
        return found

    def why_down(self) -> str | None:
        """None while the engine steps, else the failure of its last step in one sentence."""
        error = self.engine.error
        return f"the local engine's step failed ({type(error).__name__}: {error})" if error else None

    def cut(self) -> None:
        with self._lock:
            handles = list(self._handles)
        for handle in handles:
            handle.cancel()

    def close(self) -> None:
        """End what is still queued or running and stop the engine's thread."""
        self.engine.close()

    def check(self, requests) -> None:
        """Refuse, before a sweep stores anything, a sweep none of whose (prompt, max_tokens) requests the engine
        would take (a KV budget too small for any, every prompt beyond the context), with the engine's UserError for
        the first; where some are taken, the others fail one by one, as a server refuses them."""
        refusal, seen = None, set()
        for prompt, max_tokens in requests:  # lazily: the first request the engine takes ends the check
            if (prompt, max_tokens) in seen:
                continue
            seen.add((prompt, max_tokens))
            try:
                self.engine.check(prompt, max_new_tokens=max_tokens, temperature=self.cfg.temperature, raw=self.cfg.raw)
            except UserError as exc:
                refusal = refusal or exc
                continue
            self.engine.engine.ready()  # the first run ids, taken now rather than as the first request arrives
            return
        if refusal is not None:
            raise refusal

    def send(self, prompt: str, max_tokens: int, exact_length: bool, deadline_s: float | None,
             tag: str | None = None) -> Reply:
        """One request through the engine: each token is a chunk, timed from the submit."""
        reply = Reply(token_source="engine")
        try:
            handle = self.engine.submit(prompt, max_new_tokens=max_tokens, tag=tag, temperature=self.cfg.temperature,
                                        raw=self.cfg.raw, ignore_eos=exact_length, stream=False)
        except UserError as exc:  # refused before anything was recorded, like a server's 400
            reply.status, reply.error = "error", str(exc)
            return reply
        late = threading.Event()
        timer = threading.Timer(deadline_s, lambda: (late.set(), handle.cancel())) if deadline_s else None
        with self._lock:
            self._handles.add(handle)
        if timer is not None:
            timer.start()
        try:
            handle.wait()
        finally:
            if timer is not None:
                timer.cancel()
            with self._lock:
                self._handles.discard(handle)
        # each token's time is the engine's, taken as it was decoded: a reader woken for every token would only
        # take the GIL from the step it measures (an HTTP client's wakeups share the cores, not the server's GIL)
        reply.times = [row["t_ms"] for row in handle.sequence.tokens]
        reply.tokens = [1] * len(reply.times)
        result = handle.result
        reply.result.usage_prompt, reply.result.usage_completion = result["n_prompt_tokens"], result["n_new_tokens"]
        reply.result.finish_reason = result["stop_reason"]
        if result["status"] == "error":
            reply.status = "interrupted" if reply.times else "error"
            reply.error = result["error"]
        elif result["status"] == "cancelled":
            if late.is_set():
                reply.status, reply.error = "deadline", f"the request missed its {deadline_s:g} s deadline and was cut"
            else:
                reply.status, reply.error = "cancelled", "stopped"
        return reply
