"""A run against an OpenAI-compatible server (vLLM, SGLang, llama.cpp's server, TGI): one streamed
request timed chunk by chunk on the client, split with the server's own metrics, stored like a local run."""
from __future__ import annotations

import functools
import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx2
import openai

from engine.address import ServedError, ServedRunError, api_root
from engine.serve import network
from engine.serve import scrape as server_metrics
from engine.serve import split as served_split
from engine.serve import records as served_store
from engine.measure.metrics import itl_percentiles
from engine.paths import DEFAULT_MODEL_NAME
from engine.spec import STALL_TIMEOUT_S, RunSpec
from engine.serve.metrics import request_metrics
from engine.measure.distances import BUCKETS
from engine.store.db import Store

CONNECT_TIMEOUT_S = 10.0
BUDGET_GRACE_S = 2.0  # after the budget's last token: how long to wait for the server's usage and finish


class MalformedStream(httpx2.DecodingError):
    """A streamed line that is not JSON, or JSON not shaped as an OpenAI chunk; str() says which."""


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
    """An OpenAI client for the server, without retries (a retry would hide the request's timing), made after
    the library's one-time work for a streamed request is done (warm_up)."""
    warm_up()
    timeout = httpx2.Timeout(timeout_s, connect=min(CONNECT_TIMEOUT_S, timeout_s))
    limits = httpx2.Limits(max_connections=connections, max_keepalive_connections=connections)
    return openai.OpenAI(base_url=f"{api_root(endpoint)}/v1", api_key=api_key(api_key_env), max_retries=0,
                         timeout=timeout, http_client=httpx2.Client(timeout=timeout, transport=network.transport(limits),
                                                                     event_hooks={"request": [network.attach]}))


# a short stream of each kind of request, as a server sends them: one chunk, then the end
_WARM_CHUNKS = {"chat/completions": {"object": "chat.completion.chunk", "choices": [
                    {"index": 0, "delta": {"content": "w"}, "finish_reason": "length"}]},
                "completions": {"object": "text_completion", "choices": [
                    {"index": 0, "text": "w", "finish_reason": "length"}]}}


@functools.cache
def warm_up() -> None:
    """Once per process, before any request's clock starts: the openai library's first streamed request
    imports its completions resources and inspects the request's parameter types, work many times a request's
    own that a load sweep's first request (or a served run) would otherwise count in its time to first token.
    Both kinds of request (chat and raw completions) go once to a transport inside this process that answers
    a short stream, so every later request pays only its own work; nothing leaves the process."""
    def answer(request: httpx2.Request) -> httpx2.Response:
        kind = "chat/completions" if request.url.path.endswith("chat/completions") else "completions"
        chunk = {"id": "w", "created": 0, "model": "w", **_WARM_CHUNKS[kind]}
        stream = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=stream)

    with httpx2.Client(transport=httpx2.MockTransport(answer)) as http:
        client = openai.OpenAI(base_url="http://warm-up.invalid/v1", api_key="none", max_retries=0, http_client=http)
        for raw in (False, True):
            body = request_body(model="w", prompt="w", raw=raw, max_new_tokens=1, temperature=0.0, top_p=1.0, seed=0,
                                token_ids=True, stop=["w"])
            for _ in read_stream(open_stream(client, body), StreamResult()):
                pass


def explain(exc: Exception, root: str, timeout_s: float | None = None, api_key_env: str | None = None) -> str:
    """One sentence for a failed call to the server."""
    if isinstance(exc, MalformedStream):
        return f"The server at {root} sent {exc}, so the stream was abandoned."
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


def round_trip_ms(client: openai.OpenAI, tries: int = 3, api_key_env: str | None = None) -> float:
    """The quickest of a few GET /v1/models: the network's round trip plus the server's least work."""
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter_ns()
        try:
            client.models.list()
        except (openai.APIError, httpx2.HTTPError) as exc:
            root = str(client.base_url).rstrip("/").removesuffix("/v1")
            raise ServedError(explain(exc, root, client.timeout.read, api_key_env).rstrip(".") +
                              " (while timing the round trip).") from None
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
                 seed: int | None, token_ids: bool, stop: list[str] | None = None) -> dict:
    body = {"model": model, "max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
            "stream": True, "stream_options": {"include_usage": True}}
    if stop:
        body["stop"] = list(stop)
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


SHAPE_ERRORS = (AttributeError, TypeError, KeyError, IndexError, ValueError)


def read_stream(stream, result: StreamResult):
    """Yield a Chunk for each chunk with output; fill result from the chunks without. A line that is
    not JSON, or not shaped as a chunk, raises MalformedStream."""
    events = iter(stream)
    while True:
        try:
            event = next(events)
        except StopIteration:
            return
        except ValueError as exc:  # json's decoding error
            raise MalformedStream(f"a stream line that is not JSON ({str(exc)[:80]})") from None
        try:
            chunk = _chunk(event, result, time.perf_counter_ns())
        except SHAPE_ERRORS:
            raise MalformedStream("JSON that is not shaped as an OpenAI stream chunk") from None
        if chunk is not None:
            yield chunk


def _chunk(event, result: StreamResult, t_ns: int) -> Chunk | None:
    extra = event.model_extra or {}
    if event.usage is not None:
        result.usage_prompt = _count(event.usage.prompt_tokens)
        result.usage_completion = _count(event.usage.completion_tokens)
    if extra.get("timings"):
        result.timings = dict(extra["timings"])
    if not event.choices:
        return None
    choice = event.choices[0]
    if choice.finish_reason:
        result.finish_reason = str(choice.finish_reason)
    text = choice.delta.content if hasattr(choice, "delta") else choice.text
    ids = (choice.model_extra or {}).get("token_ids")
    if text is not None and not isinstance(text, str):
        raise TypeError("text")
    if ids is not None and not all(isinstance(i, int) for i in ids):
        raise TypeError("token ids")
    return Chunk(t_ns=t_ns, text=text or "", token_ids=list(ids) if ids else None) if text or ids else None


def _count(value) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise TypeError("usage")
    return value


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
    from engine.plan.planner import server_work_split

    model = served_model
    if served_model == DEFAULT_MODEL_NAME or Path(served_model).name == DEFAULT_MODEL_NAME:
        from engine.model.loader import default_model_dir  # the model's folder only when it is the default
        model = str(default_model_dir())
    try:
        return served_split.normalised(server_work_split(model, gpu, context_tokens, batch, weights, kv_dtype))
    except ValueError as exc:  # the planner's one-sentence errors (unknown GPU or model)
        raise ServedError(str(exc)) from None


class Watchdog:
    """Ends a stream that brings no token for timeout_s or runs past its deadline, from a thread of its
    own: a read blocked on a server that sends only keep-alive comments, or drips, wakes up at once."""

    def __init__(self, timeout_s: float, deadline_s: float):
        self.timeout_s, self.deadline_s = timeout_s, deadline_s
        self.t0 = self.last = time.monotonic()
        self.reason: str | None = None
        self.late = False  # the deadline, not the stall timer, ended the stream
        self._stream = None
        self._done = threading.Event()

    def watch(self, stream) -> None:
        self._stream = stream
        threading.Thread(target=self._run, daemon=True, name="tokenpath-watchdog").start()

    def progress(self) -> None:
        self.last = time.monotonic()

    def shorten(self, seconds: float) -> None:
        """End the stream within `seconds` from now, whatever comes."""
        self.deadline_s = min(self.deadline_s, time.monotonic() - self.t0 + seconds)

    def stop(self) -> None:
        self._done.set()

    def _run(self) -> None:
        while not self._done.wait(0.05):
            now = time.monotonic()
            if now - self.last > self.timeout_s:
                self.reason = f"sent no token for {self.timeout_s:g} s"
            elif now - self.t0 > self.deadline_s:
                self.late = True
                self.reason = f"did not finish within the run's deadline of {self.deadline_s:g} s"
            if self.reason:
                _cut(self._stream)
                return


def _cut(stream) -> None:
    """Shut the stream's socket down, which wakes a read blocked on it in another thread."""
    network = stream.response.extensions.get("network_stream")
    sock = network.get_extra_info("socket") if network is not None else None
    if sock is None:
        stream.close()
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed
        pass


class ServedRun:
    """One served run of a RunSpec whose backend is 'served'. Iterate it for ChunkEvents; close() (or
    leaving the loop) cancels the request.

    Like engine.run.generate.Generation: after iteration status, text, token_ids, steps, tokens,
    result and run_id; every chunk goes to the run's journal as it arrives, so a kill keeps it. The
    run ends at its own token budget (it closes the stream), at the stall timer (spec.timeout_s
    without a token: keep-alive comments and empty chunks are no progress) and at its deadline."""

    def __init__(self, spec: RunSpec, store: Store | None = None):
        spec.check()
        g = spec.gen
        self.spec, self.store, self.gpu, self.api_key_env = spec, store, spec.gpu, spec.api_key_env
        self.timeout_s, self.budget = spec.timeout_s, g.max_new_tokens
        self.root = api_root(spec.endpoint)
        # the watchdog ends a stall at timeout_s; the client's own read timeout is only its backstop
        self.client = make_client(spec.endpoint, spec.api_key_env, spec.timeout_s + 1.0, connections=2)
        models = _models(self.client, self.root, spec.api_key_env, spec.timeout_s)
        if spec.served_model and spec.served_model not in models:
            raise ServedError(f"The server at {self.root} has no model '{spec.served_model}'; it serves: "
                              f"{', '.join(models[:8])}.")
        self.served_model = spec.served_model or models[0]
        planner_split(spec.gpu, self.served_model, 1)  # an unknown GPU or model is refused before the request
        # the request goes on a connection of its own, so it pays (and its trace records) the name lookup,
        # connect and TLS a first request pays; the listing's kept-alive connection would hide them
        self.stream_client = make_client(spec.endpoint, spec.api_key_env, spec.timeout_s + 1.0, connections=1)
        self.network: dict | None = None  # the request's network parts (engine.serve.network), once it is answered
        self.before = server_metrics.scrape(self.root)
        self.server_kind = "vllm" if server_metrics.is_vllm(self.before) else "openai-compatible"
        self.body = request_body(model=self.served_model, prompt=g.prompt, raw=g.raw, max_new_tokens=g.max_new_tokens,
                                 temperature=g.temperature, top_p=g.top_p, seed=g.seed, stop=g.stop,
                                 token_ids=self.server_kind == "vllm")
        self.config = {"endpoint": self.root, "served_model": self.served_model, "max_new_tokens": g.max_new_tokens,
                       "temperature": g.temperature, "top_p": g.top_p, "seed": g.seed, "raw": g.raw, "stop": g.stop,
                       "gpu": spec.gpu, "api_key_env": spec.api_key_env, "server_kind": self.server_kind,
                       "timeout_s": spec.timeout_s, "deadline_s": spec.deadline,
                       "run_spec": spec.to_dict()}  # stored whole with the run, so the run can be made again
        if spec.tag:
            self.config["tag"] = spec.tag
        self.prompt = g.prompt
        self.counter = TokenCounter(None if self.server_kind == "vllm" else tokenizer_for(self.served_model))
        if store is not None:
            from engine.store.record import Recorder  # the rows' module loads torch: only when a run is recorded

            self.recorder = Recorder(store)
        else:
            self.recorder = None
        self.status, self.error, self.stop_reason, self.text = "pending", None, None, ""
        self.token_ids: list[int | None] = []
        self.chunks: list[tuple[float, list[int | None], str]] = []  # (t_ms, token ids, text) per chunk
        self.steps: list[dict] = []
        self.tokens: list[dict] = []
        self.live_tokens: list[dict] = []  # a provisional row per token while streaming (final ones come at the end)
        self.result: dict | None = None
        self.stream_result = StreamResult()
        self._events = self._run()

    special_ids: list[int] = []  # a server streams text without special tokens

    @property
    def run_id(self) -> int | None:
        return self.recorder.run_id if self.recorder is not None else None

    def __iter__(self):
        return self

    def __next__(self) -> ChunkEvent:
        return next(self._events)

    def close(self) -> None:
        self._events.close()

    def _run(self):
        self.status = "running"
        stream = watchdog = None
        try:
            if self.recorder is not None:
                self.recorder.attach(
                    served_store.start_run(self.store, endpoint=self.root, server_model=self.served_model,
                                           config=self.config, prompt=self.prompt), None)
            t0 = time.perf_counter_ns()
            watchdog = Watchdog(self.timeout_s, self.spec.deadline)
            with network.RequestTrace(t0) as trace:
                stream = open_stream(self.stream_client, self.body)
            self.network = trace.parts()
            watchdog.watch(stream)
            for chunk in read_stream(stream, self.stream_result):
                if len(self.token_ids) >= self.budget:  # the server goes on past the budget: stop reading
                    break
                watchdog.progress()
                yield self._take(chunk, t0)
                if len(self.token_ids) >= self.budget:
                    watchdog.shorten(BUDGET_GRACE_S)  # time for the usage and finish that follow the last token
            self.status, self.stop_reason = "ok", self.stream_result.finish_reason
            if self.stop_reason is None and len(self.token_ids) < self.budget:
                raise httpx2.RemoteProtocolError("the stream ended without a finish reason")
            self.stop_reason = self.stop_reason or "length"
        except (GeneratorExit, KeyboardInterrupt):
            self.status = self.stop_reason = "cancelled"
            raise
        except Exception as exc:
            cut = watchdog.reason if watchdog is not None else None
            if not cut and not isinstance(exc, (openai.APIError, httpx2.HTTPError)):  # not the server's fault
                self.status, self.error = "error", f"{type(exc).__name__}: {exc}"
                raise
            if len(self.token_ids) >= self.budget:
                self.status, self.stop_reason = "ok", "length"  # the budget was reached; only the ending was late
            else:
                self.status = self.stop_reason = "interrupted" if self.chunks else "error"
                self.error = (f"The server at {self.root} {cut}, so the run was cut short." if cut else
                              explain(exc, self.root, self.timeout_s, self.api_key_env))
                raise ServedRunError(self.error + (f" Recorded as run {self.run_id} with {len(self.token_ids)} "
                                                   "tokens." if self.run_id else "")) from None
        finally:
            if watchdog is not None:
                watchdog.stop()
            if stream is not None:
                stream.close()  # a closed connection makes the server abort the request
            self.stream_client.close()
            self._finish()

    def _take(self, chunk: Chunk, t0: int) -> ChunkEvent:
        """One chunk into the run: its provisional rows go to the journal at once."""
        from engine.store.rows import ServedStepRow, ServedTokenRow, columns

        ids = self.counter.count(chunk)
        t_ms = (chunk.t_ns - t0) / 1e6
        gap = t_ms - (self.chunks[-1][0] if self.chunks else 0.0)
        first = len(self.token_ids)
        step = len(self.chunks)
        self.chunks.append((t_ms, ids, chunk.text))
        self.token_ids.extend(ids)
        self.text += chunk.text
        provisional = served_split.chunk_buckets([gap], network.physical_ms(self.network) if not first else 0.0,
                                                 None)[0]
        step_row = ServedStepRow(step=step, kind="prefill" if step == 0 else "decode", n_emitted=len(ids),
                                 context_len=first + len(ids), wall_ms=gap, **provisional)
        token_rows = [ServedTokenRow(idx=first + i, step=step, token_id=token, piece=self._piece(token, chunk.text, i),
                                     t_ms=t_ms, gap_ms=gap if i == 0 else 0.0, retokenised=self._retokenised,
                                     **{k: (v / len(ids) if v is not None else None) for k, v in provisional.items()})
                      for i, token in enumerate(ids)]
        if self.recorder is not None:
            self.recorder.add(columns(step_row), [columns(r) for r in token_rows], chunk.text)
        self.live_tokens.extend(vars(r) for r in token_rows)
        return ChunkEvent(index=step, first_token=first, piece=chunk.text, token_ids=ids, t_ms=t_ms,
                          gap_ms=gap, buckets=provisional)

    @property
    def _retokenised(self) -> bool:
        return self.counter.source == "tokenizer"

    def _piece(self, token: int | None, text: str, i: int) -> str:
        tokenizer = self.counter.tokenizer
        return tokenizer.decode([token]) if tokenizer is not None and token is not None else (text if i == 0 else "")

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
        rows = served_split.chunk_buckets(gaps, network.physical_ms(self.network), server, fractions)
        self._rows(rows, prompt_tokens or 0)
        usage = self.stream_result.usage_completion if self.status == "ok" else None
        metrics = request_metrics(times, counts, usage)
        cache = server_metrics.prefix_cache(self.before, after) if server else None  # only when the run was alone
        metrics.update(self._summary(metrics, rows, prompt_tokens, server), network=self.network, prefix_cache=cache)
        source = self.counter.source or "chunks"
        if source != "server" and usage:
            source = "usage"  # the count is the server's; the rows are the tokenizer's or the chunks'
        provenance = served_split.provenance(source, server, self.network, self.gpu, fractions,
                                             len(self.tokens) if self._retokenised else None, cache)
        real_ids = [t for t in self.token_ids if t is not None]
        self.result = {"run_id": self.run_id, "status": self.status, "error": self.error, "text": self.text,
                       "token_ids": real_ids, "provenance": provenance, **metrics}
        if self.recorder is not None and self.recorder.journal is not None:
            self.recorder.finish(status=self.status, output=self.text, token_ids=real_ids,
                                 metrics={k: v for k, v in metrics.items() if k != "itl_ms"}, error=self.error,
                                 steps=self.steps, tokens=self.tokens, telemetry=[],
                                 run_columns={"provenance": json.dumps(provenance),
                                              "server_work_ms": metrics.get("server_work_ms"),
                                              **network.columns(self.network),
                                              **server_metrics.prefix_cache_columns(cache)})

    def _rows(self, rows: list[dict], prompt_tokens: int) -> None:
        """A step row per chunk and a token row per token, the chunk's buckets divided over its tokens."""
        from engine.store.rows import ServedStepRow, ServedTokenRow, columns

        context = prompt_tokens
        for step, ((t_ms, ids, text), row) in enumerate(zip(self.chunks, rows)):
            gap = t_ms - (self.chunks[step - 1][0] if step else 0.0)
            context += len(ids)
            self.steps.append(columns(ServedStepRow(step=step, kind="prefill" if step == 0 else "decode",
                                                    n_emitted=len(ids), context_len=context, wall_ms=gap, **row)))
            share = {k: (v / len(ids) if v is not None else None) for k, v in row.items()}
            for i, token in enumerate(ids):
                self.tokens.append(columns(ServedTokenRow(
                    idx=len(self.tokens), step=step, token_id=token, piece=self._piece(token, text, i), t_ms=t_ms,
                    gap_ms=gap if i == 0 else 0.0, retokenised=self._retokenised, **share)))

    def _summary(self, metrics: dict, rows: list[dict], prompt_tokens: int | None, server: dict | None) -> dict:
        """The run row's summary figures beside the request metrics."""
        n, e2e, tpot, itl = metrics["n_output_tokens"], metrics["e2e_ms"], metrics["tpot_ms"], metrics["itl_ms"]
        totals = {b: (None if any(r[f"{b}_ms"] is None for r in rows) else sum(r[f"{b}_ms"] for r in rows))
                  for b in BUCKETS}
        return {
            "n_prompt_tokens": prompt_tokens, "n_new_tokens": n, "total_ms": e2e,
            "tokens_per_s": n / e2e * 1e3 if n and e2e else None, "decode_tokens_per_s": 1e3 / tpot if tpot else None,
            **itl_percentiles(itl),
            "distances_ms": totals if rows else {}, "server_work_ms": sum(r["server_work_ms"] for r in rows),
            "rtt_ms": self.network["send_ms"] + self.network["first_byte_ms"] if self.network else None,
            "server": server, "server_kind": self.server_kind,
            "token_source": self.counter.source or "chunks", "stop_reason": self.stop_reason,
            "usage_completion_tokens": self.stream_result.usage_completion, "n_token_rows": len(self.tokens),
        }
