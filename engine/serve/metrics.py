"""Latency metrics of streamed requests, defined as vLLM's `vllm bench serve` defines them, and their
per-level summaries (percentiles, requests/s, output tokens/s). DEFINITIONS is what the pages show."""
from __future__ import annotations

from engine.measure.metrics import percentile

DEFINITIONS = {
    "TTFT": "time to first token: from sending the request to the arrival of the first streamed chunk that "
            "carries output (measured by the client, so it includes the network and the server's queue)",
    "ITL": "inter-token latency as vLLM's benchmark defines it: the gap between two consecutive streamed "
           "chunks. A chunk that carries several tokens is one gap, not several (AIPerf's 'ITL' is TPOT below)",
    "TPOT": "time per output token: (end-to-end latency - TTFT) / (output tokens - 1), the output tokens "
            "counted by the server's usage when it reports them",
    "E2E": "end-to-end latency: from sending the request to the arrival of its last chunk that carries output",
    "requests/s": "requests completed in a level divided by the level's wall time",
    "output tokens/s": "output tokens of the level's completed requests divided by the level's wall time",
}
PERCENTILES = (50, 90, 99)


def request_metrics(chunk_times_ms: list[float], chunk_tokens: list[int], usage_tokens: int | None = None) -> dict:
    """TTFT, ITL list, TPOT and E2E of one request from its chunks' arrival times (ms since it was
    sent) and the tokens each carried; usage_tokens (the server's count) wins when given."""
    n_chunks = len(chunk_times_ms)
    if not n_chunks:
        return {"ttft_ms": None, "itl_ms": [], "tpot_ms": None, "e2e_ms": None, "n_output_tokens": 0, "n_chunks": 0}
    n_tokens = usage_tokens if usage_tokens else sum(chunk_tokens) or n_chunks
    ttft, e2e = chunk_times_ms[0], chunk_times_ms[-1]
    return {
        "ttft_ms": ttft,
        "itl_ms": [b - a for a, b in zip(chunk_times_ms, chunk_times_ms[1:])],
        "tpot_ms": (e2e - ttft) / (n_tokens - 1) if n_tokens > 1 else None,
        "e2e_ms": e2e,
        "n_output_tokens": int(n_tokens),
        "n_chunks": n_chunks,
    }


def spread(values) -> dict:
    """Mean and the usual percentiles of a list (None for an empty one)."""
    values = [v for v in values if v is not None]
    out = {"mean": sum(values) / len(values) if values else None}
    out.update({f"p{q}": percentile(values, q) for q in PERCENTILES})
    return out


def level_summary(requests: list[dict], wall_s: float) -> dict:
    """One concurrency level: percentiles of each metric over its completed requests, and throughput."""
    done = [r for r in requests if r.get("status") == "ok"]
    output_tokens = sum(r["n_output_tokens"] for r in done)
    return {
        "completed": len(done),
        "failed": len(requests) - len(done),
        "wall_s": wall_s,
        "ttft_ms": spread(r["ttft_ms"] for r in done),
        "itl_ms": spread(gap for r in done for gap in r["itl_ms"]),
        "tpot_ms": spread(r["tpot_ms"] for r in done),
        "e2e_ms": spread(r["e2e_ms"] for r in done),
        "requests_per_s": len(done) / wall_s if wall_s > 0 else None,
        "output_tokens_per_s": output_tokens / wall_s if wall_s > 0 else None,
    }
