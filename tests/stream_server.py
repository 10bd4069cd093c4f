"""A small real HTTP server that streams OpenAI-style chunks without token ids, /metrics or usage
choices of its own, for the fault tests: `python stream_server.py PORT MODE [DELAY_S]`.
MODE: ok (finishes with usage), stall (two chunks, then silence), key (401 without a bearer key)."""
import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

WORDS = "The quick brown fox jumps over the lazy dog while the cat watches from the warm window".split()
MODEL = "SmolLM2-135M-Instruct"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _json(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorised(self):
        if MODE == "key" and self.headers.get("Authorization") != "Bearer sesame":
            self._json(401, {"error": {"message": "Unauthorized"}})
            return False
        return True

    def do_GET(self):
        if self.path == "/v1/models" and self._authorised():
            self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        elif self.path != "/v1/models":
            self._json(404, {"error": "not found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if not self._authorised():
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chat = "messages" in body
        n = min(body["max_tokens"], len(WORDS))
        for i in range(n):
            if MODE == "stall" and i == 2:
                time.sleep(3600)
            piece = ("" if i == 0 else " ") + WORDS[i]
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            self._event({"id": "x", "object": "chunk", "created": 0, "model": MODEL, "choices": [choice]})
            time.sleep(DELAY)
        done = {"index": 0, "delta": {}, "finish_reason": "length"} if chat else {"index": 0, "text": "",
                                                                                    "finish_reason": "length"}
        self._event({"id": "x", "object": "chunk", "created": 0, "model": MODEL, "choices": [done]})
        self._event({"id": "x", "object": "chunk", "created": 0, "model": MODEL, "choices": [],
                     "usage": {"prompt_tokens": 9, "completion_tokens": n, "total_tokens": 9 + n}})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True

    def _event(self, obj):
        self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
        self.wfile.flush()


if __name__ == "__main__":
    PORT, MODE = int(sys.argv[1]), sys.argv[2]
    DELAY = float(sys.argv[3]) if len(sys.argv) > 3 else 0.01
    ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
