"""A small real HTTP server that streams OpenAI-style chunks without token ids, /metrics or usage
choices of its own, for the fault tests: `python stream_server.py PORT MODE [DELAY_S]`.
MODE: ok (finishes with usage), stall (two chunks, then silence), key (401 without a bearer key),
forever (a chunk every DELAY_S past max_tokens, never finishing), comments (only SSE keep-alive
comments and empty chunks, every DELAY_S), badjson (a data line that is not JSON after two chunks),
badshape (JSON that is not a chunk after two chunks), modelsonce (GET /v1/models answers once, then 500)."""
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
        global MODELS_ANSWERED
        if self.path == "/v1/models" and MODE == "modelsonce" and MODELS_ANSWERED:
            self._json(500, {"error": {"message": "internal error"}})
        elif self.path == "/v1/models" and self._authorised():
            MODELS_ANSWERED = True
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
        if MODE in ("forever", "comments", "badjson", "badshape"):
            self._endless(chat)
            return
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

    def _endless(self, chat):
        """Streams until the client goes: words, keep-alive comments, or a broken line after two words."""
        try:
            for i in range(10**9):
                if MODE == "comments":
                    self.wfile.write(b": keep-alive\n\n")
                    self._event({"id": "x", "object": "chunk", "created": 0, "model": MODEL,
                                 "choices": [{"index": 0, "delta": {}}]})
                elif i == 2 and MODE == "badjson":
                    self.wfile.write(b"data: {this is not json\n\n")
                elif i == 2 and MODE == "badshape":
                    self.wfile.write(b'data: {"choices": "x", "usage": 7}\n\n')
                else:
                    piece = " " + WORDS[i % len(WORDS)]
                    self._event({"id": "x", "object": "chunk", "created": 0, "model": MODEL,
                                 "choices": [{"index": 0, "delta": {"content": piece}} if chat else
                                             {"index": 0, "text": piece}]})
                self.wfile.flush()
                time.sleep(DELAY)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _event(self, obj):
        self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
        self.wfile.flush()


if __name__ == "__main__":
    PORT, MODE = int(sys.argv[1]), sys.argv[2]
    DELAY = float(sys.argv[3]) if len(sys.argv) > 3 else 0.01
    MODELS_ANSWERED = False
    ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
