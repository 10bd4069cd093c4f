"""What the Serving page draws from a stored load sweep: the per-level table, the latency against
throughput curve, ITL by output position and the request timeline, as plain DataFrames."""
from __future__ import annotations

import json

import pandas as pd

from engine.serve.metrics import PERCENTILES

METRICS = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")


def level_frame(levels: list[dict] | str) -> pd.DataFrame:
    """One row per concurrency level: p50/p90/p99 of each metric, throughput, the server's queue and KV use."""
    if isinstance(levels, str):
        levels = json.loads(levels or "[]")
    rows = []
    for lv in levels:
        row = {"concurrency": lv["concurrency"], "completed": lv["completed"], "failed": lv["failed"]}
        for m in METRICS:
            for q in PERCENTILES:
                row[f"{m.removesuffix('_ms')} p{q} ms"] = lv[m][f"p{q}"]
        row.update({"requests/s": lv["requests_per_s"], "output tokens/s": lv["output_tokens_per_s"],
                    "waiting max": lv.get("waiting_max"), "KV cache max": lv.get("kv_cache_usage_max")})
        server = lv.get("server") or {}
        for key in ("ttft", "itl", "queue"):
            count = server.get(f"{key}_count")
            row[f"server {key} mean ms"] = server[f"{key}_ms"] / count if count else None
        rows.append(row)
    return pd.DataFrame(rows)


def capacity_curve(frames: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Per-user latency (TPOT p50, E2E p50) against total output throughput, one line per sweep."""
    parts = []
    for label, frame in frames.items():
        if not frame.empty:
            parts.append(frame.assign(sweep=label)[["sweep", "concurrency", "output tokens/s", "tpot p50 ms",
                                                    "e2e p50 ms", "ttft p50 ms"]])
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def itl_by_position(requests: pd.DataFrame) -> pd.DataFrame:
    """Mean and p90 gap before each output chunk position, per concurrency level (completed requests)."""
    rows = []
    for r in requests[requests["status"] == "ok"].itertuples():
        times = list(r.chunk_ms)
        for position, (a, b) in enumerate(zip(times, times[1:]), start=1):
            rows.append({"concurrency": r.concurrency, "position": position, "itl_ms": b - a})
    if not rows:
        return pd.DataFrame(columns=["concurrency", "position", "mean ms", "p90 ms"])
    frame = pd.DataFrame(rows).groupby(["concurrency", "position"])["itl_ms"]
    return pd.DataFrame({"mean ms": frame.mean(), "p90 ms": frame.quantile(0.9)}).reset_index()


def timeline(requests: pd.DataFrame) -> pd.DataFrame:
    """Each request's span from the sweep's start: sent, first token, last chunk (seconds)."""
    frame = requests.copy()
    frame["start_s"] = frame["sent_ms"] / 1e3
    frame["first_s"] = (frame["sent_ms"] + frame["ttft_ms"].fillna(0)) / 1e3
    frame["end_s"] = (frame["sent_ms"] + frame["e2e_ms"].fillna(0)) / 1e3
    frame["label"] = frame["concurrency"].map(lambda c: f"{c} at once") + " #" + frame["idx"].astype(str)
    return frame[["label", "concurrency", "idx", "status", "start_s", "first_s", "end_s", "n_output_tokens"]]
