"""Load sweeps: levels of streamed requests against one server, either a fixed number in flight or
arrivals at a request rate (Poisson, gamma-gapped or a trace), every request stored, goodput against an
SLO, the server's queue and KV-cache gauges polled while a level runs, its prefix-cache hit rate per level
(with --shared-prefix-tokens every prompt opens with the same preamble), each request's network parts,
Stop keeping what finished."""
from __future__ import annotations

import json
import math
import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx2
import numpy as np
import openai

from engine.measure import slo as slos
from engine.serve import arrivals
from engine.measure.arrivals import lengths, level_rng, schedule
from engine.serve import network
from engine.serve import records as served_store
from engine.serve import scrape as server_metrics
from engine.paths import workloads
from engine.spec import DEADLINE_PER_TOKEN_S, GenConfig, RunSpec
from engine.serve.client import (BUDGET_GRACE_S, STALL_TIMEOUT_S, ServedError, StreamResult, TokenCounter, Watchdog,
                                 _models, api_root, explain, make_client, open_stream, read_stream, request_body,
                                 round_trip_ms, tokenizer_for)
from engine.serve.metrics import level_summary, request_metrics, spread
from engine.store.db import Store
from engine.store.request_rows import RequestRows

MAX_CONCURRENCY = 256
MAX_REQUESTS = arrivals.MAX_REQUESTS
MAX_WARMUP = 100
SHARED_PREFIX_STREAM = 2**20  # the random stream the shared prefix's words come from, apart from the levels'


@dataclass
class SweepConfig:
    endpoint: str | None  # None: the requests go to the local engine (LocalTarget)
    concurrency: list[int] = field(default_factory=list)
    requests: int = 16
    max_new_tokens: int = 64
    prompts: list[tuple[str, str]] = field(default_factory=list)  # (name, text), used in turn
    served_model: str | None = None
    api_key_env: str | None = None
    temperature: float = 0.0
    raw: bool = False
    timeout_s: float = STALL_TIMEOUT_S
    poll_s: float = 1.0
    rates: list[float] = field(default_factory=list)  # requests/s; open-loop levels instead of concurrency
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    input_tokens: int | None = None  # synthetic prompts of this many tokens instead of `prompts`
    output_tokens: int | None = None  # fixed output lengths (ignore_eos where the server has it)
    length_spread: float = 0.0
    trace: list[dict] | None = None  # arrivals.read_trace's rows
    trace_name: str | None = None
    duration_s: float | None = None  # rate levels: rate x duration requests, at least `requests`
    warmup: int = 0
    slo: dict = field(default_factory=dict)
    deadline_s: float | None = None
    shared_prefix_tokens: int | None = None  # every prompt starts with the same preamble of this many tokens

    def check(self) -> None:
        if self.concurrency and (self.rates or self.trace):
            raise ServedError("Give concurrency levels or request rates (or a trace), not both.")
        if not self.concurrency and not self.rates and not self.trace:
            raise ServedError("The sweep has no levels: give concurrency levels, request rates or a trace.")
        if any(not 1 <= c <= MAX_CONCURRENCY for c in self.concurrency):
            raise ServedError(f"Concurrency levels must be whole numbers from 1 to {MAX_CONCURRENCY}.")
        if self.rates:
            arrivals.parse_rates(",".join(map(str, self.rates)))
        arrivals.check_burstiness(self.burstiness)
        if self.max_concurrency is not None and not 1 <= self.max_concurrency <= MAX_CONCURRENCY:
            raise ServedError(f"--max-concurrency must be between 1 and {MAX_CONCURRENCY}, not {self.max_concurrency}.")
        if not 1 <= self.requests <= MAX_REQUESTS:
            raise ServedError(f"--requests must be between 1 and {MAX_REQUESTS}, not {self.requests}.")
        if not 1 <= self.max_new_tokens <= arrivals.MAX_OUTPUT_TOKENS:
            raise ServedError(f"--max-new-tokens must be between 1 and 4096, not {self.max_new_tokens}.")
        if self.output_tokens is not None and not 1 <= self.output_tokens <= arrivals.MAX_OUTPUT_TOKENS:
            raise ServedError(f"--output-tokens must be between 1 and 4096, not {self.output_tokens}.")
        if self.input_tokens is not None and not 1 <= self.input_tokens <= arrivals.MAX_INPUT_TOKENS:
            raise ServedError(f"--input-tokens must be between 1 and {arrivals.MAX_INPUT_TOKENS}, not {self.input_tokens}.")
        if self.shared_prefix_tokens is not None and not 1 <= self.shared_prefix_tokens <= arrivals.MAX_INPUT_TOKENS:
            raise ServedError(f"--shared-prefix-tokens must be between 1 and {arrivals.MAX_INPUT_TOKENS}, "
                              f"not {self.shared_prefix_tokens}.")
        if not (math.isfinite(self.length_spread) and 0 <= self.length_spread < 1):
            raise ServedError(f"--length-spread must be a fraction from 0 up to (not including) 1, not {self.length_spread:g}.")
        for name, value in (("--deadline", self.deadline_s),
                            ("--duration", self.duration_s), ("the poll interval", self.poll_s)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ServedError(f"{name} must be a positive number of seconds, not {value:g}.")
        if self.seed < 0:
            raise ServedError(f"--seed must be 0 or a positive whole number, not {self.seed}.")
        if not 0 <= self.warmup <= MAX_WARMUP:
            raise ServedError(f"--warmup must be between 0 and {MAX_WARMUP} requests, not {self.warmup}.")
        if not self.prompts and self.input_tokens is None and not self.trace:
            raise ServedError("The sweep has no prompts.")
        # the sampling settings and the stall timeout are checked as a served run's are
        RunSpec(gen=GenConfig("load", max_new_tokens=self.max_new_tokens, temperature=self.temperature),
                backend="served" if self.endpoint else "local", endpoint=self.endpoint, timeout_s=self.timeout_s).check()

    def levels(self) -> list[dict]:
        """One spec per level: a concurrency, or a rate with how its arrivals come."""
        if self.concurrency:
            return [{"kind": "concurrency", "concurrency": c} for c in self.concurrency]
        if self.trace and not self.rates:
            return [{"kind": "rate", "rate": arrivals.trace_rate(self.trace), "arrival": "trace"}]
        kind = "trace scaled" if self.trace else arrivals.arrival_kind(self.burstiness)
        return [{"kind": "rate", "rate": r, "arrival": kind} for r in self.rates]


def request_tag(sweep_id: int, level: int, idx: int) -> str:
    """The tag of the run a request became (local engine): its sweep, level and index, the requests row's key."""
    return f"load:{sweep_id}:{level}:{idx}"


def level_label(spec: dict) -> str:
    if spec.get("kind", "concurrency") == "concurrency":
        return f"{spec['concurrency']} at once"
    return f"{spec['rate']:.3g} req/s" if spec.get("rate") else "trace"


def parse_concurrency(text: str) -> list[int]:
    try:
        levels = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise ServedError(f"'{text}' is not a list of concurrency levels: give numbers like 1,2,4,8.") from None
    if not levels:
        raise ServedError("Give at least one concurrency level, such as 1,2,4,8.")
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
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ServedError(f"{spec} cannot be read as UTF-8 text ({exc.reason} at byte {exc.start}).") from None
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


@dataclass
class Reply:
    """One streamed request as the client saw it: each chunk's arrival (ms after sending) and tokens."""
    times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    status: str = "ok"
    error: str | None = None
    result: StreamResult = field(default_factory=StreamResult)
    token_source: str = "chunks"
    network: dict | None = None  # engine.serve.network's parts: none for the in-process engine


class ServerTarget:
    """Where a sweep's requests go: an OpenAI-compatible server. send() streams one request; cut()
    closes every stream in flight; snapshot() and gauges() read its /metrics. The in-process engine
    (engine.run.load_target.LocalTarget) has the same methods."""

    def __init__(self, cfg: SweepConfig, connections: int):
        self.cfg = cfg
        self.root = api_root(cfg.endpoint)
        # the watchdog ends a stall at timeout_s; the client's own read timeout is only its backstop
        self.client = make_client(cfg.endpoint, cfg.api_key_env, cfg.timeout_s + 1.0, connections=connections)
        models = _models(self.client, self.root, cfg.api_key_env, cfg.timeout_s)
        if cfg.served_model and cfg.served_model not in models:
            raise ServedError(f"The server at {self.root} has no model '{cfg.served_model}'; it serves: "
                              f"{', '.join(models[:8])}.")
        self.model = cfg.served_model or models[0]
        # one client for /metrics, whose scrapes run beside the requests every poll: a client made per scrape
        # builds a TLS context each time, CPU the measured server shares on a small machine
        self.scraper = httpx2.Client()
        self.vllm = server_metrics.is_vllm(server_metrics.scrape(self.root, self.scraper))
        self.kind = "vllm" if self.vllm else "openai-compatible"
        self.tokenizer = None if self.vllm else tokenizer_for(self.model)
        self._streams: set = set()
        self._lock = threading.Lock()
        self.cutting = False

    def rtt_ms(self) -> float:
        return round_trip_ms(self.client)

    def describe(self) -> dict:
        return {"kind": self.kind}

    def options(self) -> dict:
        """The command-line options beyond the sweep's own that reach this target again: none, --endpoint is its."""
        return {}

    def close(self) -> None:
        self.client.close()
        self.scraper.close()

    def snapshot(self) -> dict | None:
        """The server's /metrics now, or None without them."""
        return server_metrics.scrape(self.root, self.scraper)

    def gauges(self, timeout_s: float) -> dict:
        """Its queue and KV-cache gauges now (empty for a server without vLLM's)."""
        return server_metrics.gauges(server_metrics.scrape(self.root, self.scraper, timeout_s,
                                                           server_metrics.VLLM_GAUGES.values()))

    def why_down(self) -> str | None:
        """None while the server still answers GET /v1/models, else why not in one sentence."""
        try:
            _models(self.client, self.root, self.cfg.api_key_env, min(self.cfg.timeout_s, 10.0))
        except ServedError as exc:
            return str(exc)
        return None

    def cut(self) -> None:
        self.cutting = True
        with self._lock:
            streams = list(self._streams)
        for stream in streams:
            stream.close()

    def send(self, prompt: str, max_tokens: int, exact_length: bool, deadline_s: float | None,
             tag: str | None = None) -> Reply:
        """One streamed request; tag names it where the target records it (a server keeps no record of ours).
        Like a served run it ends at its token budget (the stream is closed), at the stall timer (timeout_s
        without a token: keep-alive comments and empty chunks are no progress) and at its deadline: the
        sweep's --deadline, else the stall timeout plus DEADLINE_PER_TOKEN_S for each token of its budget."""
        cfg, reply = self.cfg, Reply()
        body = request_body(model=self.model, prompt=prompt, raw=cfg.raw, max_new_tokens=max_tokens,
                            temperature=cfg.temperature, top_p=1.0, seed=None, token_ids=self.vllm)
        if exact_length and self.vllm:  # vLLM keeps going past the end-of-text token on request
            body.setdefault("extra_body", {})["ignore_eos"] = True
        counter, stream, received = TokenCounter(self.tokenizer), None, 0
        watchdog = Watchdog(cfg.timeout_s, deadline_s or cfg.timeout_s + DEADLINE_PER_TOKEN_S * max_tokens)

        def cut() -> str:
            return f"the server {watchdog.reason}, so the request was cut"

        t0 = time.perf_counter_ns()
        try:
            with network.RequestTrace(t0) as trace:
                stream = open_stream(self.client, body)
            reply.network = trace.parts()
            with self._lock:
                self._streams.add(stream)
            watchdog.watch(stream)
            for chunk in read_stream(stream, reply.result):
                if received >= max_tokens:  # the server goes on past the budget: stop reading
                    break
                watchdog.progress()
                reply.times.append((chunk.t_ns - t0) / 1e6)
                reply.tokens.append(len(counter.count(chunk)))
                received += reply.tokens[-1]
                if received >= max_tokens:
                    watchdog.shorten(BUDGET_GRACE_S)  # time for the usage and finish that follow the last token
            if reply.result.finish_reason is None and received < max_tokens:
                reply.status = "interrupted" if reply.times else "error"
                reply.error = cut() if watchdog.reason else "the stream ended without a finish reason"
        except (openai.APIError, httpx2.HTTPError, httpx2.StreamError) as exc:  # StreamError: closed by Stop
            if received < max_tokens:  # past the budget only the ending was late
                reply.status = "interrupted" if reply.times else "error"
                reply.error = cut() if watchdog.reason else explain(exc, self.root, cfg.timeout_s, cfg.api_key_env)
        finally:
            watchdog.stop()
            if stream is not None:
                with self._lock:
                    self._streams.discard(stream)
                stream.close()  # a closed connection makes the server abort the request
        if deadline_s and watchdog.late and reply.status != "ok":
            reply.status, reply.error = "deadline", f"the request missed its {deadline_s:g} s deadline and was cut"
        elif self.cutting and reply.status != "ok":
            reply.status, reply.error = "cancelled", "stopped"
        reply.token_source = counter.source or "chunks"
        return reply


class Poller(threading.Thread):
    """Samples the requests in flight and the target's gauges every poll_s seconds while a level runs."""

    def __init__(self, gauges, poll_s: float, t0: float, in_flight):
        super().__init__(daemon=True)
        self.gauges, self.poll_s, self.t0, self.in_flight = gauges, poll_s, t0, in_flight
        self.samples: list[dict] = []
        self.done = threading.Event()
        self.has_metrics = True

    def run(self) -> None:
        while not self.done.is_set():
            sample = {"t_ms": (time.monotonic() - self.t0) * 1e3, "in_flight": float(self.in_flight())}
            if self.has_metrics:  # a target without gauges is asked once, not every poll
                found = self.gauges(self.poll_s + 1)
                self.has_metrics = bool(found)
                sample.update(found)
            self.samples.append(sample)
            self.done.wait(self.poll_s)


def slo_view(record: dict) -> dict:
    """A stored request as engine.measure.slo reads it: itl is the largest gap, tpot 0 for one token."""
    gaps = [b - a for a, b in zip(record["chunk_ms"], record["chunk_ms"][1:])]
    return {"ok": record["status"] == "ok", "ttft_ms": record["ttft_ms"], "e2e_ms": record["e2e_ms"],
            "tpot_ms": record["tpot_ms"] if record["tpot_ms"] is not None else (0.0 if record["ttft_ms"] is not None
                                                                                else None),
            "itl_ms": max(gaps) if gaps else (0.0 if record["ttft_ms"] is not None else None),
            "output_tokens": record["n_output_tokens"]}


def slo_figures(records: list[dict], slo: dict, wall_s: float) -> dict:
    """Good requests, goodput and attainment over the level's requests (failed ones count against it),
    and each target's own attainment, to tell which one fails first."""
    if not slo:
        return {}
    views = [slo_view(r) for r in records if r["status"] != "cancelled"]
    if not views or wall_s <= 0:
        return {"slo": slo, "good": 0, "goodput_requests_per_s": 0.0, "goodput_tokens_per_s": 0.0, "attainment": 0.0,
                "metric_attainment": {m: 0.0 for m in slo}}
    out = slos.goodput(views, slo, wall_s)
    return {"slo": slo, "good": sum(slos.is_good(v, slo) for v in views), **out,
            "metric_attainment": {m: slos.attainment(views, {m: t}) for m, t in slo.items()}}


def level_requests(requests: int, rate: float, duration_s: float | None) -> int:
    """How many requests a rate level sends: `requests`, or more to fill duration_s at that rate."""
    return min(MAX_REQUESTS, max(requests, math.ceil(rate * duration_s))) if duration_s else requests


def level_items(cfg: SweepConfig, spec: dict, index: int) -> list[arrivals.Item]:
    """Level `index`'s requests, the same for the same seed: prompts, output lengths, arrival offsets."""
    if cfg.trace:
        return arrivals.trace_items(cfg.trace, spec["rate"] if spec["arrival"] == "trace scaled" else None)
    rng = level_rng(cfg.seed, index)
    n = level_requests(cfg.requests, spec["rate"], cfg.duration_s) if spec["kind"] == "rate" else cfg.requests
    offsets = schedule(n, spec["rate"], cfg.burstiness, rng) if spec["kind"] == "rate" else [None] * n
    outs = (lengths(n, cfg.output_tokens, cfg.length_spread, rng) if cfg.output_tokens
            else [cfg.max_new_tokens] * n)
    if cfg.input_tokens:
        ins = lengths(n, cfg.input_tokens, cfg.length_spread, rng)
        return [arrivals.Item(f"{k} tokens", None, out, input_tokens=k, offset_s=t)
                for k, out, t in zip(ins, outs, offsets)]
    return [arrivals.Item(*cfg.prompts[i % len(cfg.prompts)], out, offset_s=t)
            for i, (out, t) in enumerate(zip(outs, offsets))]


def is_progress(path: Path) -> bool:
    """Whether the file holds a sweep's progress (a small JSON object with its sweep_id and status)."""
    try:
        if path.stat().st_size > 2**16:
            return False
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(state, dict) and {"sweep_id", "status"} <= state.keys()


class Sweep:
    """One sweep: run() goes level by level and stores as it goes; stop() from any thread (or a
    signal handler) ends it after cutting the requests in flight, keeping what finished. For a search
    over rates, open(), run_level() as often as needed, then close(). The requests go to `target` (a
    LocalTarget, or by default a ServerTarget for cfg.endpoint)."""

    def __init__(self, cfg: SweepConfig, store: Store, progress_path: str | Path | None = None, on_progress=None,
                 target=None):
        cfg.check()
        self.cfg, self.store = cfg, store
        self.progress_path = Path(progress_path) if progress_path else None
        if self.progress_path is not None and os.path.realpath(self.progress_path) == store.file:
            raise ServedError(f"{self.progress_path} is the database the sweep is stored in: give the progress a "
                              "file of its own.")
        if self.progress_path is not None and self.progress_path.is_file() and not is_progress(self.progress_path):
            raise ServedError(f"{self.progress_path} is not a sweep's progress file, and the progress is never written "
                              "over another file: give a new file.")
        self.on_progress = on_progress
        self._progress_lock = threading.Lock()  # request threads share one progress file
        self.done, self.total, self.sweep_id, self.level_now = 0, 0, None, None
        self.t0 = time.monotonic()
        self._progress("starting")  # an unwritable progress file is refused before anything is sent
        self.target = target or ServerTarget(cfg, connections=self._connections())
        self.root, self.model = self.target.root, self.target.model
        self.stopping = threading.Event()
        self._count_lock = threading.Lock()
        self._in_flight = 0
        self.levels: list[dict] = []
        self.specs = cfg.levels()
        self.prefix = self._shared_prefix()
        self.total = sum(len(level_items(self.cfg, s, i)) for i, s in enumerate(self.specs)) + cfg.warmup

    def _connections(self) -> int:
        if self.cfg.concurrency:
            return max(self.cfg.concurrency)
        return self.cfg.max_concurrency or MAX_CONCURRENCY

    def stop(self) -> None:
        self.stopping.set()
        self.target.cut()

    def open(self, kind: str | None = None) -> int:
        config = {k: v for k, v in asdict(self.cfg).items() if k not in ("prompts", "trace")}
        config["prompts"] = [name for name, _ in self.cfg.prompts]
        config["rtt_ms"] = self.target.rtt_ms()
        config.update(self.target.options())
        kind = kind or ("concurrency" if self.cfg.concurrency else "rate")
        self.sweep_id = served_store.start_sweep(self.store, endpoint=self.root, server_model=self.model,
                                                 config=config, kind=kind)
        self.rows = RequestRows(self.store, self.sweep_id)
        self.t0 = time.monotonic()
        if self.cfg.warmup:
            self._warmup()
        return self.sweep_id

    def close(self, status: str, error: str | None = None, result: dict | None = None) -> None:
        self.rows.close()
        served_store.update_sweep(self.store, self.sweep_id, levels=self.levels, status=status, error=error,
                                  server=self.target.describe(), result=result)
        self._progress(status)

    def run(self) -> dict:
        self.open()
        status, error = "ok", None
        try:
            for index, spec in enumerate(self.specs):
                if self.stopping.is_set():
                    break
                level = self.run_level(spec, index)
                if level["status"] != "ok":
                    status, error = "error", f"level {index + 1} ({level['label']}) broke: {level['error']}"
                    break
            if status == "ok" and self.stopping.is_set():
                status = "stopped"
        except BaseException as exc:
            status, error = "error", f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self.close(status, error)
        return self.summary(status, error)

    def summary(self, status: str, error: str | None, **extra) -> dict:
        return {"sweep_id": self.sweep_id, "status": status, "error": error, "endpoint": self.root,
                "server_model": self.model, "requests_ok": sum(lv["completed"] for lv in self.levels),
                "requests_failed": sum(lv["failed"] for lv in self.levels), **extra, "levels": self.levels}

    def run_level(self, spec: dict, index: int | None = None) -> dict:
        """Send one level's requests, store them with its samples, append and store its summary."""
        index = len(self.levels) if index is None else index
        items = level_items(self.cfg, spec, index)
        if index >= len(self.specs):
            self.total += len(items)
        self.level_now = level_label(spec)
        before = self.target.snapshot()
        poller = Poller(self.target.gauges, self.cfg.poll_s, self.t0, lambda: self._in_flight)
        poller.start()
        start = time.monotonic()
        if spec["kind"] == "concurrency":
            with ThreadPoolExecutor(max_workers=spec["concurrency"], thread_name_prefix="tokenpath-load") as pool:
                sent = pool.map(lambda i: self._request(spec, index, i, items[i], None), range(len(items)))
                records = [r for r in sent if r is not None]
        else:
            records = self._open_loop(spec, index, items, start)
        wall = time.monotonic() - start
        poller.done.set()
        poller.join(timeout=10)
        after = self.target.snapshot()
        self.rows.write()
        self.store.insert({"load_samples": [{"sweep_id": self.sweep_id, "level": index,
                                             "concurrency": spec.get("concurrency"), **s} for s in poller.samples]})
        level = self._summarise(spec, index, records, wall, poller.samples)
        level["server"] = server_metrics.delta(before, after)
        level.update(server_metrics.prefix_cache_columns(server_metrics.prefix_cache(before, after)))
        if level["failed"] and not self.stopping.is_set():
            why = self.target.why_down()
            # missed deadlines are a measurement; a server down, or nothing but faults, breaks the level
            faults = Counter(r["error"] for r in records if r["status"] in ("error", "interrupted"))
            if why or (faults and not level["completed"]):
                level["status"], level["error"] = "broken", why or faults.most_common(1)[0][0]
        self.levels.append(level)
        served_store.update_sweep(self.store, self.sweep_id, levels=self.levels)
        return level

    def _open_loop(self, spec: dict, index: int, items: list[arrivals.Item], start: float) -> list[dict]:
        """Send each request at its arrival time whatever is still in flight (at most max_concurrency
        at once; the rest wait in the client, and that wait is recorded apart from TTFT)."""
        workers = self.cfg.max_concurrency or MAX_CONCURRENCY
        futures = []
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenpath-load") as pool:
            for i, item in enumerate(items):
                due = start + item.offset_s
                if self.stopping.wait(max(0.0, due - time.monotonic())):
                    break
                futures.append(pool.submit(self._request, spec, index, i, item, due))
        return [r for r in (f.result() for f in futures) if r is not None]

    def requests(self):
        """Every level's requests as (prompt, max_tokens), in the order the sweep sends them."""
        for index, spec in enumerate(self.specs):
            for i, item in enumerate(level_items(self.cfg, spec, index)):
                yield self._prompt(item, index, i), item.max_tokens

    def _shared_prefix(self) -> str:
        """The preamble every prompt starts with ('' without one): the same words for the same seed."""
        if not self.cfg.shared_prefix_tokens:
            return ""
        rng = np.random.default_rng([self.cfg.seed, SHARED_PREFIX_STREAM])
        return arrivals.synthetic_prompt(self.cfg.shared_prefix_tokens, rng, self.target.tokenizer) + "\n\n"

    def _prompt(self, item: arrivals.Item, index: int, i: int) -> str:
        if item.prompt is not None:
            return self.prefix + item.prompt
        rng = np.random.default_rng([self.cfg.seed, index + 1, i])  # warm-up (-1) gets prompts of its own
        return self.prefix + arrivals.synthetic_prompt(item.input_tokens, rng, self.target.tokenizer)

    def _warmup(self) -> None:
        """Requests sent one at a time before the first level, stored as warm-up and left out of every figure."""
        spec = self.specs[0]
        items = level_items(self.cfg, spec, 0)
        for i in range(self.cfg.warmup):
            self._request(spec, -1, i, items[i % len(items)], None)

    def _request(self, spec: dict, index: int, idx: int, item: arrivals.Item, due: float | None) -> dict | None:
        sent = time.monotonic()
        record = {"sweep_id": self.sweep_id, "level": index, "concurrency": spec.get("concurrency"),
                  "rate": spec.get("rate"), "warmup": index < 0, "idx": idx, "prompt_name": item.name,
                  "sent_ms": (sent - self.t0) * 1e3,
                  "scheduled_ms": ((due if due is not None else sent) - self.t0) * 1e3}
        if self.stopping.is_set():  # Stop: what was never sent is not a request
            return None
        with self._count_lock:
            self._in_flight += 1
        try:
            exact = bool(self.cfg.output_tokens or self.cfg.trace)
            reply = self.target.send(self._prompt(item, index, idx), item.max_tokens, exact, self.cfg.deadline_s,
                                     tag=request_tag(self.sweep_id, index, idx))
        finally:
            with self._count_lock:
                self._in_flight -= 1
        metrics = request_metrics(reply.times, reply.tokens,
                                  reply.result.usage_completion if reply.status == "ok" else None)
        record.update({"status": reply.status, "error": reply.error, "n_prompt_tokens": reply.result.usage_prompt,
                       "token_source": reply.token_source, "chunk_ms": reply.times, "chunk_tokens": reply.tokens,
                       **metrics, **network.columns(reply.network), "physical_ms": network.physical_ms(reply.network)})
        if self.cfg.slo and index >= 0:
            record["good"] = slos.is_good(slo_view(record), self.cfg.slo)
        # kept as it ends (in the sweep's journal, then the database), so a sweep killed mid-level keeps every
        # request that finished
        self.rows.add({k: v for k, v in record.items() if k != "itl_ms"})
        with self._count_lock:
            self.done += 1
        self._progress("running")
        return record

    def _summarise(self, spec: dict, index: int, records: list[dict], wall: float, samples: list[dict]) -> dict:
        done = [r for r in records if r["status"] == "ok"]
        in_flight = [s["in_flight"] for s in samples]
        departures, kept_up = slos.kept_up([(r["sent_ms"] + r["e2e_ms"]) / 1e3 for r in done], spec.get("rate"))
        return {"level": index, "label": level_label(spec), **spec, "burstiness": self.cfg.burstiness,
                "max_concurrency": self.cfg.max_concurrency, "requests": len(records),
                **level_summary(records, wall),
                "deadline_missed": sum(r["status"] == "deadline" for r in records),
                "client_queue_ms": spread(r["sent_ms"] - r["scheduled_ms"] for r in records),
                "e2e_mean_ms": sum(r["e2e_ms"] for r in done) / len(done) if done else None,
                "in_flight_mean": sum(in_flight) / len(in_flight) if in_flight else None,
                "departures_per_s": departures,
                "kept_up": kept_up,
                # every request that held the server, failed or not: one cut at its deadline overlapped the next
                "overlapped": slos.overlapped([(r["sent_ms"], r["sent_ms"] + r["e2e_ms"]) for r in records
                                               if r.get("e2e_ms") is not None]),
                **slo_figures(records, self.cfg.slo, wall),
                "physical_ms": spread(r["physical_ms"] for r in done),  # each request's own network time
                "connections_reused": sum(r["connection"] == network.REUSED for r in records),
                "kv_cache_usage_max": max((s.get("kv_cache_usage", 0.0) for s in samples), default=None),
                "waiting_max": max((s.get("waiting", 0.0) for s in samples), default=None),
                "status": "ok", "error": None}

    def _progress(self, status: str) -> None:
        with self._progress_lock:
            elapsed = time.monotonic() - self.t0
            left = self.total - self.done
            state = {"sweep_id": self.sweep_id, "status": status, "done": self.done, "total": self.total,
                     "level": self.level_now, "elapsed_s": elapsed,
                     "eta_s": elapsed / self.done * left if self.done and status == "running" else None}
            if self.on_progress and status != "starting":
                self.on_progress(state)
            if self.progress_path:
                self._write_progress(state)

    def _write_progress(self, state: dict) -> None:
        path = self.progress_path
        tmp = path.with_name(path.name + ".tmp")
        try:
            if path.is_dir():
                raise IsADirectoryError(21, "it is a folder")
            tmp.write_text(json.dumps(state))
            tmp.replace(path)
        except OSError as exc:
            if tmp.is_file():
                tmp.unlink()
            if state["status"] == "starting":  # checked before the sweep; later a full disk must not stop it
                raise ServedError(f"The progress file {path} cannot be written ({exc.strerror or exc}): give a file "
                                  "in a writable folder.") from None
