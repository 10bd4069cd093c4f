"""A small real HTTP server with a known service time for the load and capacity tests: at most SLOTS
requests are served at once (the rest queue, first come first served), each streams max_tokens chunks
one STEP_S apart with token ids and usage, and /metrics has vLLM's queue and KV gauges.
`python load_server.py PORT SLOTS STEP_S [DIE_AFTER]`: with DIE_AFTER the process exits on that request."""
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "known-step-model"
STATE = {"running": 0, "waiting": 0, "posts": 0}
LOCK = threading.Lock()


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
                text = (f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running {STATE['running']}\n"
                        f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting {STATE['waiting']}\n"
                        f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc {STATE['running'] / SLOTS}\n")
            self._send(200, text.encode(), "text/plain; version=0.0.4")
        else:
            self._send(404, b"{}", "application/json")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with LOCK:
            STATE["posts"] += 1
            if DIE_AFTER is not None and STATE["posts"] > DIE_AFTER:
                os._exit(1)
            STATE["waiting"] += 1
        with SEATS:
            with LOCK:
                STATE["waiting"] -= 1
                STATE["running"] += 1
            try:
                self._stream(body)
            except ConnectionError:  # the client cut the stream (Stop, a deadline)
                self.close_connection = True
            finally:
                with LOCK:
                    STATE["running"] -= 1

    def _stream(self, body):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
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
        self._event({"id": "x", "object": "chunk", "created": 0, "model": MODEL, "choices": [],
                     "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True

    def _event(self, obj):
        self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
        self.wfile.flush()


if __name__ == "__main__":
    PORT, SLOTS, STEP_S = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    DIE_AFTER = int(sys.argv[4]) if len(sys.argv) > 4 else None
    SEATS = threading.Semaphore(SLOTS)
    server = ThreadingHTTPServer(("127.0.0.1", PORT), Handler)
    server.daemon_threads = True
    server.serve_forever()
