"""A small real HTTP server with a known service time for the load, capacity and served-run tests: at
most SLOTS requests are served at once (the rest queue, first come first served), each streams max_tokens
chunks one STEP_S apart with token ids and usage, and /metrics has vLLM's queue and KV gauges, its
per-request histograms and its prefix-cache counters.

Its prefix cache works as vLLM's does, in whole blocks of BLOCK tokens (a token here is a word of the
prompt): a prompt's leading blocks that an earlier prompt had are hits, and only the rest is prefilled,
PREFILL_MS_PER_TOKEN each, before the first chunk.
`python load_server.py PORT SLOTS STEP_S [DIE_AFTER] [--prefill-ms-per-token MS] [--log FILE] [--cert PEM --key PEM]`:
with DIE_AFTER the process exits on that request; with --log each request's prompt goes to FILE as a JSON line;
with --cert and --key it speaks HTTPS."""
import argparse
import json
import os
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "known-step-model"
BLOCK = 16
STATE = {"running": 0, "waiting": 0, "posts": 0, "queries": 0, "hits": 0}
HISTOGRAMS = {name: [0.0, 0] for name in ("e2e_request_latency", "request_queue_time", "request_prefill_time",
                                          "request_decode_time")}
CACHED: set = set()  # the word blocks seen so far, each keyed by all the words up to its end
LOCK = threading.Lock()


def metrics_text() -> str:
    # written as vLLM writes them (prometheus_client: a counter's TYPE line names it with _total)
    lines = [f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running {STATE['running']}",
             f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting {STATE['waiting']}",
             f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc {STATE['running'] / ARGS.slots}",
             f"# TYPE vllm:prefix_cache_queries_total counter\nvllm:prefix_cache_queries_total {STATE['queries']}",
             f"# TYPE vllm:prefix_cache_hits_total counter\nvllm:prefix_cache_hits_total {STATE['hits']}"]
    for name, (total, count) in HISTOGRAMS.items():
        family = f"vllm:{name}_seconds"
        lines.append(f"# TYPE {family} histogram\n{family}_bucket{{le=\"+Inf\"}} {count}\n"
                     f"{family}_sum {total}\n{family}_count {count}")
    return "\n".join(lines) + "\n"


def look_up(words: list[str]) -> int:
    """The prompt's leading words found in the cache (whole blocks), after which its blocks are cached."""
    keys = [tuple(words[:end]) for end in range(BLOCK, len(words) + 1, BLOCK)]
    with LOCK:
        found = 0
        for key in keys:
            if key not in CACHED:
                break
            found += BLOCK
        CACHED.update(keys)
        STATE["queries"] += len(words)
        STATE["hits"] += found
    return found


def prompt_text(body: dict) -> str:
    if "messages" in body:
        return "\n\n".join(str(m.get("content", "")) for m in body["messages"])
    return str(body.get("prompt", ""))


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _send(self, status, data: bytes, kind: str):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/models":
            self._send(200, json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode(),
                       "application/json")
        elif self.path == "/metrics":
            with LOCK:
                text = metrics_text()
            self._send(200, text.encode(), "text/plain; version=0.0.4")
        else:
            self._send(404, b"{}", "application/json")

    def do_POST(self):
        arrived = time.monotonic()
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with LOCK:
            STATE["posts"] += 1
            if ARGS.die_after is not None and STATE["posts"] > ARGS.die_after:
                os._exit(1)
            STATE["waiting"] += 1
        with SEATS:
            seated = time.monotonic()
            with LOCK:
                STATE["waiting"] -= 1
                STATE["running"] += 1
            try:
                self._stream(body, arrived, seated)
            except ConnectionError:  # the client cut the stream (Stop, a deadline)
                self.close_connection = True
            finally:
                with LOCK:
                    STATE["running"] -= 1

    def _stream(self, body, arrived, seated):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        words = prompt_text(body).split()
        hits = look_up(words)
        if ARGS.log:
            with LOCK, open(ARGS.log, "a") as log:
                log.write(json.dumps({"prompt": prompt_text(body), "hits": hits}) + "\n")
        time.sleep(ARGS.prefill_ms_per_token * (len(words) - hits) / 1e3)
        prefilled = time.monotonic()
        chat = "messages" in body
        n = body["max_tokens"]
        for i in range(n):
            time.sleep(STEP_S)
            piece = f" w{i}"
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            choice["token_ids"] = [100 + i]
            if i == n - 1:
                choice["finish_reason"] = "length"
            self._event({"id": "x", "object": "chunk", "created": 0, "model": MODEL, "choices": [choice]})
        done = time.monotonic()
        with LOCK:  # counted before the stream ends, so a scrape right after it sees this request
            for name, seconds in (("e2e_request_latency", done - arrived), ("request_queue_time", seated - arrived),
                                  ("request_prefill_time", prefilled - seated), ("request_decode_time", done - prefilled)):
                HISTOGRAMS[name][0] += seconds
                HISTOGRAMS[name][1] += 1
        self._event({"id": "x", "object": "chunk", "created": 0, "model": MODEL, "choices": [],
                     "usage": {"prompt_tokens": len(words), "completion_tokens": n, "total_tokens": len(words) + n}})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True

    def _event(self, obj):
        self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
        self.wfile.flush()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("slots", type=int)
    parser.add_argument("step_s", type=float)
    parser.add_argument("die_after", type=int, nargs="?")
    parser.add_argument("--prefill-ms-per-token", type=float, default=0.0)
    parser.add_argument("--log")
    parser.add_argument("--cert")
    parser.add_argument("--key")
    ARGS = parser.parse_args()
    STEP_S = ARGS.step_s
    SEATS = threading.Semaphore(ARGS.slots)
    server = ThreadingHTTPServer(("127.0.0.1", ARGS.port), Handler)
    server.daemon_threads = True
    if ARGS.cert:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(ARGS.cert, ARGS.key)
        server.socket = context.wrap_socket(server.socket, server_side=True)
    server.serve_forever()
