"""Load sweeps: N streamed requests at each concurrency level against one server, every request
stored, the server's queue and KV-cache gauges polled while a level runs, Stop keeping what finished."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx2
import openai

from engine.serve import scrape as server_metrics
from engine.serve import records as served_store
from engine.paths import workloads
from engine.run.spec import GenConfig, RunSpec
from engine.serve.client import (STALL_TIMEOUT_S, ServedError, StreamResult, TokenCounter, _models, api_root, explain,
                     make_client, open_stream, read_stream, request_body, round_trip_ms, tokenizer_for)
from engine.serve.metrics import level_summary, request_metrics
from engine.store.db import Store

MAX_CONCURRENCY = 256
MAX_REQUESTS = 10_000


@dataclass
class SweepConfig:
    endpoint: str
    concurrency: list[int]
    requests: int
    max_new_tokens: int = 64
    prompts: list[tuple[str, str]] = field(default_factory=list)  # (name, text), used in turn
    served_model: str | None = None
    api_key_env: str | None = None
    temperature: float = 0.0
    raw: bool = False
    timeout_s: float = STALL_TIMEOUT_S
    poll_s: float = 1.0

    def check(self) -> None:
        if not self.concurrency or any(not 1 <= c <= MAX_CONCURRENCY for c in self.concurrency):
            raise ServedError(f"Concurrency levels must be whole numbers from 1 to {MAX_CONCURRENCY}.")
        if not 1 <= self.requests <= MAX_REQUESTS:
            raise ServedError(f"--requests must be between 1 and {MAX_REQUESTS}, not {self.requests}.")
        if not 1 <= self.max_new_tokens <= 4096:
            raise ServedError(f"--max-new-tokens must be between 1 and 4096, not {self.max_new_tokens}.")
        if not self.prompts:
            raise ServedError("The sweep has no prompts.")
        # the sampling settings and the stall timeout are checked as a served run's are
        RunSpec(gen=GenConfig("load", max_new_tokens=self.max_new_tokens, temperature=self.temperature),
                backend="served", endpoint=self.endpoint, timeout_s=self.timeout_s).check()


def parse_concurrency(text: str) -> list[int]:
    try:
        levels = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise ServedError(f"'{text}' is not a list of concurrency levels: give numbers like 1,2,4,8.") from None
    return levels


def load_prompts(spec: str | None) -> list[tuple[str, str]]:
    """All shipped workloads, one by name, or a file: a JSON list of strings or {name, prompt}, or
    plain text with one prompt per paragraph."""
    shipped = workloads()
    if not spec:
        return [(name, w["prompt"]) for name, w in shipped.items()]
    if spec in shipped:
        return [(spec, shipped[spec]["prompt"])]
    path = Path(spec)
    if not path.is_file():
        raise ServedError(f"'{spec}' is neither a prompts file nor a shipped workload ({', '.join(shipped)}).")
    text = path.read_text(errors="replace")
    if path.suffix == ".json":
        try:
            items = json.loads(text)
            return [(f"#{i}", p) if isinstance(p, str) else (p.get("name", f"#{i}"), p["prompt"])
                    for i, p in enumerate(items)]
        except (ValueError, TypeError, KeyError, AttributeError):
            raise ServedError(f"{spec} is not a JSON list of prompts (strings or objects with a 'prompt').") from None
    prompts = [p.strip() for p in text.split("\n\n") if p.strip()]
    if not prompts:
        raise ServedError(f"{spec} holds no prompts.")
    return [(f"#{i}", p) for i, p in enumerate(prompts)]


class Poller(threading.Thread):
    """Scrapes the server's gauges every poll_s seconds while a level runs."""

    def __init__(self, root: str, poll_s: float, t0: float):
        super().__init__(daemon=True)
        self.root, self.poll_s, self.t0 = root, poll_s, t0
        self.samples: list[dict] = []
        self.done = threading.Event()

    def run(self) -> None:
        with httpx2.Client() as client:
            while not self.done.is_set():
                found = server_metrics.gauges(server_metrics.scrape(self.root, client))
                if found:
                    self.samples.append({"t_ms": (time.monotonic() - self.t0) * 1e3, **found})
                self.done.wait(self.poll_s)


class Sweep:
    """One sweep: run() goes level by level and stores as it goes; stop() from any thread (or a
    signal handler) ends it after cutting the requests in flight, keeping what finished."""

    def __init__(self, cfg: SweepConfig, store: Store, progress_path: str | Path | None = None, on_progress=None):
        cfg.check()
        self.cfg, self.store = cfg, store
        self.root = api_root(cfg.endpoint)
        self.client = make_client(cfg.endpoint, cfg.api_key_env, cfg.timeout_s, connections=max(cfg.concurrency))
        models = _models(self.client, self.root, cfg.api_key_env, cfg.timeout_s)
        if cfg.served_model and cfg.served_model not in models:
            raise ServedError(f"The server at {self.root} has no model '{cfg.served_model}'; it serves: "
                              f"{', '.join(models[:8])}.")
        self.model = cfg.served_model or models[0]
        self.vllm = server_metrics.is_vllm(server_metrics.scrape(self.root))
        self.tokenizer = None if self.vllm else tokenizer_for(self.model)
        self.progress_path = Path(progress_path) if progress_path else None
        self.on_progress = on_progress
        self.stopping = threading.Event()
        self._streams: set = set()
        self._lock = threading.Lock()
        self._progress_lock = threading.Lock()  # request threads share one progress file
        self.levels: list[dict] = []
        self.done = 0
        self.sweep_id: int | None = None

    @property
    def total(self) -> int:
        return self.cfg.requests * len(self.cfg.concurrency)

    def stop(self) -> None:
        self.stopping.set()
        with self._lock:
            streams = list(self._streams)
        for stream in streams:
            stream.close()

    def run(self) -> dict:
        config = {k: v for k, v in asdict(self.cfg).items() if k != "prompts"}
        config["prompts"] = [name for name, _ in self.cfg.prompts]
        config["rtt_ms"] = round_trip_ms(self.client)
        self.sweep_id = served_store.start_sweep(self.store, endpoint=self.root, server_model=self.model, config=config)
        self.t0 = time.monotonic()
        status, error = "ok", None
        try:
            for level in self.cfg.concurrency:
                if self.stopping.is_set():
                    break
                self.levels.append(self._level(level))
                served_store.update_sweep(self.store, self.sweep_id, levels=self.levels)
            status = "stopped" if self.stopping.is_set() else "ok"
        except BaseException as exc:
            status, error = "error", f"{type(exc).__name__}: {exc}"
            raise
        finally:
            served_store.update_sweep(self.store, self.sweep_id, levels=self.levels, status=status, error=error,
                                      server={"kind": "vllm" if self.vllm else "openai-compatible"})
            self._progress(status)
        return {"sweep_id": self.sweep_id, "status": status, "endpoint": self.root, "server_model": self.model,
                "levels": self.levels}

    def _level(self, concurrency: int) -> dict:
        before = server_metrics.scrape(self.root)
        poller = Poller(self.root, self.cfg.poll_s, self.t0)
        poller.start()
        start = time.monotonic()
        with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="tokenpath-load") as pool:
            records = list(pool.map(lambda i: self._request(concurrency, i), range(self.cfg.requests)))
        wall = time.monotonic() - start
        poller.done.set()
        poller.join(timeout=10)
        records = [r for r in records if r is not None]
        after = server_metrics.scrape(self.root)
        self.store.insert({"requests": [{k: v for k, v in r.items() if k != "itl_ms"} for r in records],
                           "load_samples": [{"sweep_id": self.sweep_id, "concurrency": concurrency, **s}
                                            for s in poller.samples]})
        summary = level_summary(records, wall)
        return {"concurrency": concurrency, **summary, "server": server_metrics.delta(before, after),
                "kv_cache_usage_max": max((s.get("kv_cache_usage", 0.0) for s in poller.samples), default=None),
                "waiting_max": max((s.get("waiting", 0.0) for s in poller.samples), default=None)}

    def _request(self, concurrency: int, idx: int) -> dict | None:
        if self.stopping.is_set():
            return None
        name, prompt = self.cfg.prompts[idx % len(self.cfg.prompts)]
        body = request_body(model=self.model, prompt=prompt, raw=self.cfg.raw, max_new_tokens=self.cfg.max_new_tokens,
                            temperature=self.cfg.temperature, top_p=1.0, seed=None, token_ids=self.vllm)
        counter, result = TokenCounter(self.tokenizer), StreamResult()
        times, tokens, status, error, stream = [], [], "ok", None, None
        sent = time.monotonic()
        t0 = time.perf_counter_ns()
        try:
            stream = open_stream(self.client, body)
            with self._lock:
                self._streams.add(stream)
            for chunk in read_stream(stream, result):
                times.append((chunk.t_ns - t0) / 1e6)
                tokens.append(len(counter.count(chunk)))
            if result.finish_reason is None:
                status, error = ("cancelled", "stopped") if self.stopping.is_set() else (
                    "interrupted", "the stream ended without a finish reason")
        except (openai.APIError, httpx2.HTTPError) as exc:
            status = "cancelled" if self.stopping.is_set() else ("interrupted" if times else "error")
            error = "stopped" if status == "cancelled" else explain(exc, self.root, self.cfg.timeout_s,
                                                                    self.cfg.api_key_env)
        finally:
            if stream is not None:
                with self._lock:
                    self._streams.discard(stream)
                stream.close()
        metrics = request_metrics(times, tokens, result.usage_completion if status == "ok" else None)
        record = {"sweep_id": self.sweep_id, "concurrency": concurrency, "idx": idx, "prompt_name": name,
                  "status": status, "error": error, "sent_ms": (sent - self.t0) * 1e3,
                  "n_prompt_tokens": result.usage_prompt, "token_source": counter.source or "chunks",
                  "chunk_ms": times, "chunk_tokens": tokens, **metrics}
        with self._lock:
            self.done += 1
        self._progress("running", concurrency)
        return record

    def _progress(self, status: str, level: int | None = None) -> None:
        with self._progress_lock:
            elapsed = time.monotonic() - self.t0
            left = self.total - self.done
            state = {"sweep_id": self.sweep_id, "status": status, "done": self.done, "total": self.total,
                     "concurrency": level, "elapsed_s": elapsed,
                     "eta_s": elapsed / self.done * left if self.done and status == "running" else None}
            if self.on_progress:
                self.on_progress(state)
            if self.progress_path:
                tmp = self.progress_path.with_suffix(".tmp")
                tmp.write_text(json.dumps(state))
                tmp.replace(self.progress_path)
