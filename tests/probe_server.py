"""load_server.py (its HTTP, usage, /metrics and prefix cache) with a batched engine whose step time is known: one
loop steps every request in flight together, each step lasting FIXED_MS + PER_SEQUENCE_MS x the sequences in it +
PREFILL_MS_PER_TOKEN x the prompt words prefilled in it (those its prefix cache did not find). A request joins at
the next step, which prefills it and brings its first token; every later step brings one more. Steps end on an
absolute schedule while the engine is busy, so a late wake-up does not lengthen the steps after it. Its /metrics
histograms count each request's wait for its first step (measured) and its prefill: the nominal length of the step
that prefilled it, as the engine's own clock would time it.
`python probe_server.py PORT FIXED_MS PER_SEQUENCE_MS PREFILL_MS_PER_TOKEN`"""
import argparse
import threading
import time
from http.server import ThreadingHTTPServer

import load_server

WAKE = threading.Condition()
JOINING: list = []
RUNNING: list = []


class Sequence:
    def __init__(self, prefill: int, tokens: int):
        self.prefill, self.tokens, self.emitted = prefill, tokens, 0
        self.started = self.step_ms = None


def engine(fixed_ms: float, per_sequence_ms: float, prefill_ms: float) -> None:
    end = None
    while True:
        with WAKE:
            while not JOINING and not RUNNING:
                WAKE.wait()
                end = None  # idle: the next step starts when work comes
            prefills = sum(s.prefill for s in JOINING)
            joined = list(JOINING)
            RUNNING.extend(JOINING)
            JOINING.clear()
            step = fixed_ms + per_sequence_ms * len(RUNNING) + prefill_ms * prefills
        start = end if end is not None else time.monotonic()
        for s in joined:
            s.started, s.step_ms = start, step
        end = start + step / 1e3
        time.sleep(max(end - time.monotonic(), 0.0))
        with WAKE:
            for s in RUNNING:
                s.emitted += 1
            RUNNING[:] = [s for s in RUNNING if s.emitted < s.tokens]
            WAKE.notify_all()


class Handler(load_server.Handler):
    def _stream(self, body, arrived, seated):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        words = load_server.prompt_text(body).split()
        hits = load_server.look_up(words)
        n = body["max_tokens"]
        sequence = Sequence(len(words) - hits, n)
        with WAKE:
            JOINING.append(sequence)
            WAKE.notify_all()
        chat = "messages" in body
        for i in range(n):
            with WAKE:
                while sequence.emitted <= i:
                    WAKE.wait()
            choice = {"index": 0, "delta": {"content": f" w{i}"}} if chat else {"index": 0, "text": f" w{i}"}
            choice["token_ids"] = [100 + i]
            if i == n - 1:
                choice["finish_reason"] = "length"
            self._event({"id": "x", "object": "chunk", "created": 0, "model": load_server.MODEL, "choices": [choice]})
        with load_server.LOCK:  # counted before the stream ends, so a scrape right after it sees this request
            for name, seconds in (("request_queue_time", max(sequence.started - seated, 0.0)),
                                  ("request_prefill_time", sequence.step_ms / 1e3),
                                  ("e2e_request_latency", time.monotonic() - arrived)):
                load_server.HISTOGRAMS[name][0] += seconds
                load_server.HISTOGRAMS[name][1] += 1
        self._event({"id": "x", "object": "chunk", "created": 0, "model": load_server.MODEL, "choices": [],
                     "usage": {"prompt_tokens": len(words), "completion_tokens": n, "total_tokens": len(words) + n}})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("fixed_ms", type=float)
    parser.add_argument("per_sequence_ms", type=float)
    parser.add_argument("prefill_ms_per_token", type=float)
    args = parser.parse_args()
    load_server.ARGS = argparse.Namespace(slots=256, die_after=None, log=None)
    load_server.SEATS = threading.Semaphore(256)
    threading.Thread(target=engine, args=(args.fixed_ms, args.per_sequence_ms, args.prefill_ms_per_token),
                     daemon=True).start()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    server.serve_forever()
