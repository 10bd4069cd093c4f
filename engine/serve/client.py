"""A run against an OpenAI-compatible server (vLLM, SGLang, llama.cpp's server, TGI): one streamed
request timed chunk by chunk on the client, split with the server's own metrics, stored like a local run."""
from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx2
import openai

from engine.serve import scrape as server_metrics
from engine.serve import split as served_split
from engine.serve import records as served_store
from engine.measure.metrics import percentile
from engine.paths import DEFAULT_MODEL_NAME
from engine.serve.metrics import request_metrics
from engine.measure.distances import BUCKETS
from engine.store.db import Store

STALL_TIMEOUT_S = 120.0  # the longest wait for the next byte of a stream before the run is cut short
CONNECT_TIMEOUT_S = 10.0
MAX_NEW_TOKENS_CAP = 4096


class ServedError(Exception):
    """The server cannot be used as asked; the message is one sentence for the user."""


class ServedRunError(ServedError):
    """A served run that started failed or was cut short; it is recorded with the tokens it got."""


def api_root(endpoint: str) -> str:
    """scheme://host:port of an endpoint given with or without /v1; keys never travel in the URL."""
    parts = urlsplit((endpoint or "").strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ServedError(f"'{endpoint}' is not a server address: give one like http://127.0.0.1:8000.")
    if parts.username or parts.password or parts.query:
        raise ServedError("Put no credentials or query in the server address: name the environment variable that "
                          "holds the API key with --api-key-env.")
    try:
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        raise ServedError(f"'{endpoint}' has a port that is not a number between 0 and 65535.") from None
    path = parts.path.rstrip("/").removesuffix("/v1")
    return f"{parts.scheme}://{parts.hostname}{port}{path}"


def api_key(api_key_env: str | None) -> str:
    """The key from the named environment variable; servers without keys get a placeholder."""
    if not api_key_env:
        return "none"
    value = os.environ.get(api_key_env)
    if not value:
        raise ServedError(f"The environment variable {api_key_env} named for the API key is not set.")
    return value


def make_client(endpoint: str, api_key_env: str | None = None, timeout_s: float = STALL_TIMEOUT_S,
                connections: int = 8) -> openai.OpenAI:
    """An OpenAI client for the server, without retries (a retry would hide the request's timing)."""
    timeout = httpx2.Timeout(timeout_s, connect=min(CONNECT_TIMEOUT_S, timeout_s))
    limits = httpx2.Limits(max_connections=connections, max_keepalive_connections=connections)
    return openai.OpenAI(base_url=f"{api_root(endpoint)}/v1", api_key=api_key(api_key_env), max_retries=0,
                         timeout=timeout, http_client=httpx2.Client(timeout=timeout, limits=limits))


def explain(exc: Exception, root: str, timeout_s: float | None = None, api_key_env: str | None = None) -> str:
    """One sentence for a failed call to the server."""
    if isinstance(exc, (openai.APITimeoutError, httpx2.TimeoutException)):
        return f"The server at {root} sent nothing for {timeout_s or STALL_TIMEOUT_S:g} s, so the request was abandoned."
    if isinstance(exc, openai.AuthenticationError) or getattr(exc, "status_code", None) in (401, 403):
        where = f"the key in ${api_key_env}" if api_key_env else "no API key"
        return (f"The server at {root} refused the request with {where} (HTTP {exc.status_code}): put its key in an "
                "environment variable and name it with --api-key-env.")
    if isinstance(exc, openai.APIConnectionError) and not isinstance(exc.__cause__, httpx2.RemoteProtocolError):
        return f"Nothing answers at {root}: check the address and the port, and that the server is running."
    if isinstance(exc, (httpx2.RemoteProtocolError, httpx2.ReadError, openai.APIConnectionError)):
        return f"The server at {root} closed the connection in the middle of the stream."
    if isinstance(exc, openai.APIStatusError):
        return f"The server at {root} rejected the request (HTTP {exc.status_code}): {_server_message(exc)}."
    return f"The server at {root} answered something that is not an OpenAI-compatible stream ({type(exc).__name__})."


def _server_message(exc: openai.APIStatusError) -> str:
    body = exc.body if isinstance(exc.body, dict) else {}
    message = body.get("message") or (body.get("error") or {}).get("message") if body else None
    return str(message or exc.message).strip().rstrip(".")[:300]


def list_models(endpoint: str, api_key_env: str | None = None, timeout_s: float = CONNECT_TIMEOUT_S) -> list[str]:
    """The model names the server serves (GET /v1/models)."""
    return _models(make_client(endpoint, api_key_env, timeout_s), api_root(endpoint), api_key_env, timeout_s)


def _models(client: openai.OpenAI, root: str, api_key_env: str | None, timeout_s: float) -> list[str]:
    try:
        page = client.models.list()
        names = [m.id for m in page.data]
    except openai.NotFoundError:
        raise ServedError(f"{root} answers HTTP but is not an OpenAI-compatible API: GET /v1/models was not found.") from None
    except (openai.APIError, httpx2.HTTPError) as exc:
        if isinstance(exc, openai.APIStatusError) and exc.status_code not in (401, 403):
            raise ServedError(f"{root} answers HTTP but is not an OpenAI-compatible API: GET /v1/models gave "
                              f"HTTP {exc.status_code}.") from None
        raise ServedError(explain(exc, root, timeout_s, api_key_env)) from None
    except (AttributeError, TypeError, ValueError):
        raise ServedError(f"{root} answers HTTP but is not an OpenAI-compatible API: GET /v1/models returned no model list.") from None
    if not names:
        raise ServedError(f"The server at {root} lists no models.")
    return names


def round_trip_ms(client: openai.OpenAI, tries: int = 3) -> float:
    """The quickest of a few GET /v1/models: the network's round trip plus the server's least work."""
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter_ns()
        client.models.list()
        best = min(best, (time.perf_counter_ns() - t0) / 1e6)
    return best


@functools.lru_cache(maxsize=4)
def tokenizer_for(served_model: str):
    """The served model's tokenizer when it is available here without a network (the default
    model's own, or a local folder's), else None."""
    from transformers import AutoTokenizer

    folder = Path(served_model)
    if served_model == DEFAULT_MODEL_NAME or folder.name == DEFAULT_MODEL_NAME:
        from engine.model.loader import default_model_dir  # the model's folder only when it is the default
        folder = default_model_dir()
    if not (folder / "tokenizer.json").exists() and not (folder / "tokenizer_config.json").exists():
        return None
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError):
        return None


@dataclass
class Chunk:
    """One streamed chunk that carried output: when it arrived, its text, and its token ids when known."""
    t_ns: int
    text: str
    token_ids: list[int] | None


@dataclass
class StreamResult:
    """What the end of a stream told: usage, finish reason, llama.cpp's timings."""
    usage_prompt: int | None = None
    usage_completion: int | None = None
    finish_reason: str | None = None
    timings: dict | None = None
    extra: dict = field(default_factory=dict)


def request_body(*, model: str, prompt: str, raw: bool, max_new_tokens: int, temperature: float, top_p: float,
                 seed: int | None, token_ids: bool) -> dict:
    body = {"model": model, "max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
            "stream": True, "stream_options": {"include_usage": True}}
    if seed is not None:
        body["seed"] = seed
    if token_ids:  # vLLM streams each chunk's token ids on request; other servers are not sent the field
        body["extra_body"] = {"return_token_ids": True}
    if raw:
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
    return body


def open_stream(client: openai.OpenAI, body: dict):
    """The streaming response: completions for a raw prompt, chat completions otherwise."""
    if "prompt" in body:
        return client.completions.create(**body)
    return client.chat.completions.create(**body)


def read_stream(stream, result: StreamResult):
    """Yield a Chunk for each chunk with output; fill result from the chunks without."""
    for event in stream:
        t_ns = time.perf_counter_ns()
        extra = event.model_extra or {}
        if event.usage is not None:
            result.usage_prompt = event.usage.prompt_tokens
            result.usage_completion = event.usage.completion_tokens
        if extra.get("timings"):
            result.timings = extra["timings"]
        if not event.choices:
            continue
        choice = event.choices[0]
        if choice.finish_reason:
            result.finish_reason = choice.finish_reason
        text = choice.delta.content if hasattr(choice, "delta") else choice.text
        ids = (choice.model_extra or {}).get("token_ids")
        if text or ids:
            yield Chunk(t_ns=t_ns, text=text or "", token_ids=list(ids) if ids else None)


class TokenCounter:
    """Tokens of each chunk: the server's ids, else the tokenizer's on the text so far, else one per chunk."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self.source: str | None = None
        self.text = ""
        self.n_ids = 0

    def count(self, chunk: Chunk) -> list[int | None]:
        self.text += chunk.text
        if chunk.token_ids is not None:
            self.source = "server"
            return chunk.token_ids
        if self.tokenizer is not None:
            self.source = self.source or "tokenizer"
            ids = self.tokenizer(self.text, add_special_tokens=False)["input_ids"]
            new, self.n_ids = ids[self.n_ids:], len(ids)
            return new or [None]  # a chunk that only completed a token still takes its own row
        self.source = self.source or "chunks"
        return [None]


@dataclass
class ChunkEvent:
    """One streamed chunk as it arrived. buckets are provisional while streaming (the network, then
    unsplit server work); the final split, with the server's metrics, is in the run's tokens and steps."""
    index: int
    first_token: int
    piece: str
    token_ids: list[int | None]
    t_ms: float
    gap_ms: float
    buckets: dict


def planner_split(gpu: str | None, served_model: str, context_tokens: int, batch: int = 1,
                  weights: str = "bf16", kv_dtype: str = "bf16") -> dict | None:
    """The planner's split of a decode step on a named GPU (memory, compute, fixed step time) as
    fractions of server work, or None without a GPU."""
    if not gpu:
        return None
    try:
        from engine.plan.planner import server_work_split
    except ImportError:
        raise ServedError("Splitting server work for a named GPU needs the planner (engine.plan.planner), which this copy "
                          "lacks: leave the GPU out.") from None
    model = served_model
    if served_model == DEFAULT_MODEL_NAME or Path(served_model).name == DEFAULT_MODEL_NAME:
        from engine.model.loader import default_model_dir  # the model's folder only when it is the default
        model = str(default_model_dir())
    try:
        return served_split.normalised(server_work_split(model, gpu, context_tokens, batch, weights, kv_dtype))
    except ValueError as exc:  # the planner's one-sentence errors (unknown GPU or model)
        raise ServedError(str(exc)) from None


class ServedRun:
    """One served run. Iterate it for ChunkEvents; close() (or leaving the loop) cancels the request.

    After iteration: status, text, token_ids, steps, tokens, result, run_id, like engine.run.generate.Generation."""

    def __init__(self, endpoint: str, *, served_model: str | None, prompt: str, max_new_tokens: int,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None, raw: bool = False,
                 api_key_env: str | None = None, gpu: str | None = None, store: Store | None = None,
                 timeout_s: float = STALL_TIMEOUT_S, tag: str | None = None):
        if not prompt or not prompt.strip():
            raise ServedError("The prompt is empty: type something for the model to continue.")
        if not 1 <= max_new_tokens <= MAX_NEW_TOKENS_CAP:
            raise ServedError(f"max_new_tokens must be between 1 and {MAX_NEW_TOKENS_CAP}, not {max_new_tokens}.")
        if temperature < 0 or not 0 < top_p <= 1:
            raise ServedError("temperature must be 0 (greedy) or positive, and top_p in (0, 1].")
        self.root, self.api_key_env, self.timeout_s, self.store, self.gpu = (
            api_root(endpoint), api_key_env, timeout_s, store, gpu)
        self.client = make_client(endpoint, api_key_env, timeout_s, connections=2)
        models = _models(self.client, self.root, api_key_env, timeout_s)
        if served_model and served_model not in models:
            raise ServedError(f"The server at {self.root} has no model '{served_model}'; it serves: "
                              f"{', '.join(models[:8])}.")
        self.served_model = served_model or models[0]
        planner_split(gpu, self.served_model, 1)  # an unknown GPU or model is refused before the request
        self.rtt_ms = round_trip_ms(self.client)
        self.before = server_metrics.scrape(self.root)
        self.server_kind = "vllm" if server_metrics.is_vllm(self.before) else "openai-compatible"
        self.body = request_body(model=self.served_model, prompt=prompt, raw=raw, max_new_tokens=max_new_tokens,
                                 temperature=temperature, top_p=top_p, seed=seed, token_ids=self.server_kind == "vllm")
        self.config = {"endpoint": self.root, "served_model": self.served_model, "max_new_tokens": max_new_tokens,
                       "temperature": temperature, "top_p": top_p, "seed": seed, "raw": raw, "gpu": gpu,
                       "api_key_env": api_key_env, "server_kind": self.server_kind, "timeout_s": timeout_s}
        if tag:
            self.config["tag"] = tag
        self.prompt = prompt
        self.counter = TokenCounter(None if self.server_kind == "vllm" else tokenizer_for(self.served_model))
        self.run_id: int | None = None
        self.status, self.error, self.text = "pending", None, ""
        self.token_ids: list[int | None] = []
        self.chunks: list[tuple[float, list[int | None], str]] = []  # (t_ms, token ids, text) per chunk
        self.steps: list[dict] = []
        self.tokens: list[dict] = []
        self.live_tokens: list[dict] = []  # a provisional row per chunk while streaming (tokens come at the end)
        self.result: dict | None = None
        self.stream_result = StreamResult()
        self._events = self._run()

    def __iter__(self):
        return self

    def __next__(self) -> ChunkEvent:
        return next(self._events)

    def close(self) -> None:
        self._events.close()

    def _run(self):
        if self.store is not None:
            self.run_id = served_store.start_run(self.store, endpoint=self.root, server_model=self.served_model,
                                                 config=self.config, prompt=self.prompt)
        self.status = "running"
        stream = None
        t0 = time.perf_counter_ns()
        try:
            stream = open_stream(self.client, self.body)
            for chunk in read_stream(stream, self.stream_result):
                yield self._take(chunk, t0)
            if self.stream_result.finish_reason is None:
                raise httpx2.RemoteProtocolError("the stream ended without a finish reason")
            self.status = "ok"
        except GeneratorExit:
            self.status = "cancelled"
            raise
        except (openai.APIError, httpx2.HTTPError) as exc:
            self.status = "interrupted" if self.chunks else "error"
            self.error = explain(exc, self.root, self.timeout_s, self.api_key_env)
            raise ServedRunError(self.error + (f" Recorded as run {self.run_id} with {len(self.token_ids)} tokens."
                                               if self.run_id else "")) from None
        finally:
            if stream is not None:
                stream.close()  # a closed connection makes the server abort the request
            self._finish()

    def _take(self, chunk: Chunk, t0: int) -> ChunkEvent:
        ids = self.counter.count(chunk)
        t_ms = (chunk.t_ns - t0) / 1e6
        gap = t_ms - (self.chunks[-1][0] if self.chunks else 0.0)
        first = len(self.token_ids)
        self.chunks.append((t_ms, ids, chunk.text))
        self.token_ids.extend(ids)
        self.text += chunk.text
        provisional = served_split.chunk_buckets([gap], self.rtt_ms if not first else 0.0, None)[0]
        self.live_tokens.append({"idx": len(self.live_tokens), "step": len(self.chunks) - 1,
                                 "token_id": ids[0] if ids else None, "piece": chunk.text, "t_ms": t_ms,
                                 "gap_ms": gap, **provisional})
        return ChunkEvent(index=len(self.chunks) - 1, first_token=first, piece=chunk.text, token_ids=ids, t_ms=t_ms,
                          gap_ms=gap, buckets=provisional)

    def _finish(self) -> None:
        after = server_metrics.scrape(self.root)
        server = server_metrics.delta(self.before, after) or server_metrics.llama_cpp_split(self.stream_result.timings)
        if server and server.get("requests") != 1:  # other requests shared the server: no per-request figures
            server = None
        times = [c[0] for c in self.chunks]
        counts = [len(c[1]) for c in self.chunks]
        prompt_tokens = self.stream_result.usage_prompt
        fractions = planner_split(self.gpu, self.served_model, (prompt_tokens or 0) + len(self.token_ids))
        gaps = [b - a for a, b in zip([0.0] + times, times)]
        rows = served_split.chunk_buckets(gaps, self.rtt_ms, server, fractions)
        self._rows(rows, prompt_tokens or 0)
        metrics = request_metrics(times, counts, self.stream_result.usage_completion if self.status == "ok" else None)
        metrics.update(self._summary(metrics, rows, prompt_tokens, server))
        source = self.counter.source or "chunks"
        provenance = served_split.provenance(source, server, self.rtt_ms, self.gpu, fractions)
        real_ids = [t for t in self.token_ids if t is not None]
        self.result = {"run_id": self.run_id, "status": self.status, "error": self.error, "text": self.text,
                       "token_ids": real_ids, "provenance": provenance, **metrics}
        if self.store is not None and self.run_id is not None:
            served_store.finish_run(self.store, self.run_id, status=self.status, output=self.text,
                                    token_ids=real_ids, metrics={k: v for k, v in metrics.items() if k != "itl_ms"},
                                    provenance=provenance, error=self.error, steps=self.steps, tokens=self.tokens)

    def _rows(self, rows: list[dict], prompt_tokens: int) -> None:
        """A step row per chunk and a token row per token, the chunk's buckets divided over its tokens."""
        tokenizer = self.counter.tokenizer
        context = prompt_tokens
        for step, ((t_ms, ids, text), row) in enumerate(zip(self.chunks, rows)):
            gap = t_ms - (self.chunks[step - 1][0] if step else 0.0)
            context += len(ids)
            self.steps.append({"step": step, "kind": "prefill" if step == 0 else "decode", "n_emitted": len(ids),
                               "context_len": context, "wall_ms": gap, **row})
            share = {k: (v / len(ids) if v is not None else None) for k, v in row.items()}
            for i, token in enumerate(ids):
                piece = tokenizer.decode([token]) if tokenizer is not None and token is not None else (
                    text if i == 0 else "")
                self.tokens.append({"idx": len(self.tokens), "step": step, "token_id": token, "piece": piece,
                                    "t_ms": t_ms, "gap_ms": gap if i == 0 else 0.0, **share})

    def _summary(self, metrics: dict, rows: list[dict], prompt_tokens: int | None, server: dict | None) -> dict:
        """The run row's summary figures beside the request metrics."""
        n, e2e, tpot, itl = metrics["n_output_tokens"], metrics["e2e_ms"], metrics["tpot_ms"], metrics["itl_ms"]
        totals = {b: (None if any(r[f"{b}_ms"] is None for r in rows) else sum(r[f"{b}_ms"] for r in rows))
                  for b in BUCKETS}
        return {
            "n_prompt_tokens": prompt_tokens, "n_new_tokens": n, "total_ms": e2e,
            "tokens_per_s": n / e2e * 1e3 if n and e2e else None, "decode_tokens_per_s": 1e3 / tpot if tpot else None,
            "itl_p50_ms": percentile(itl, 50), "itl_p90_ms": percentile(itl, 90), "itl_p99_ms": percentile(itl, 99),
            "distances_ms": totals if rows else {}, "server_work_ms": sum(r["server_work_ms"] for r in rows),
            "rtt_ms": self.rtt_ms, "server": server, "server_kind": self.server_kind,
            "token_source": self.counter.source or "chunks", "stop_reason": self.stream_result.finish_reason,
            "usage_completion_tokens": self.stream_result.usage_completion,
        }


def generate(endpoint: str, *, served_model: str | None, prompt: str, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, seed: int | None = None, raw: bool = False, api_key_env: str | None = None,
             gpu: str | None = None, store: Store | None = None, timeout_s: float = STALL_TIMEOUT_S,
             tag: str | None = None) -> ServedRun:
    """A served run, ready to iterate: its ChunkEvents, then .result, .tokens, .steps, .run_id, .status."""
    return ServedRun(endpoint, served_model=served_model, prompt=prompt, max_new_tokens=max_new_tokens,
                     temperature=temperature, top_p=top_p, seed=seed, raw=raw, api_key_env=api_key_env, gpu=gpu,
                     store=store, timeout_s=timeout_s, tag=tag)
