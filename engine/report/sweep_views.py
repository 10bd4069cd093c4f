"""What the Serving page draws from a stored load sweep: the per-level table, the latency against
throughput curve, latency and goodput against request rate, ITL by output position and the request
timeline, as plain DataFrames."""
from __future__ import annotations

import json

import pandas as pd

from engine.serve.metrics import PERCENTILES

METRICS = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")


def level_frame(levels: list[dict] | str) -> pd.DataFrame:
    """One row per level: its label, rate, p50/p90/p99 of each metric, throughput, goodput and attainment
    against the sweep's SLO, the server's queue and KV use. A level that completed nothing has empty figures."""
    if isinstance(levels, str):
        levels = json.loads(levels or "[]")
    rows = []
    for lv in levels:
        row = {"level": lv.get("label") or f"{lv['concurrency']} at once", "concurrency": lv.get("concurrency"),
               "rate": lv.get("rate"), "completed": lv["completed"], "failed": lv["failed"]}
        for m in METRICS:
            for q in PERCENTILES:
                row[f"{m.removesuffix('_ms')} p{q} ms"] = lv[m][f"p{q}"]
        row.update({"requests/s": lv["requests_per_s"], "output tokens/s": lv["output_tokens_per_s"],
                    "goodput req/s": lv.get("goodput_requests_per_s"), "attainment": lv.get("attainment"),
                    "waiting max": lv.get("waiting_max"), "KV cache max": lv.get("kv_cache_usage_max"),
                    "prefix cache hit rate": lv.get("prefix_cache_hit_rate"),
                    "physical p50 ms": (lv.get("physical_ms") or {}).get("p50"),
                    "connections reused": lv.get("connections_reused")})
        server = lv.get("server") or {}
        for key in ("ttft", "itl", "queue"):
            count = server.get(f"{key}_count")
            row[f"server {key} mean ms"] = server[f"{key}_ms"] / count if count else None
        row["status"] = lv.get("status", "ok") if lv.get("status", "ok") == "ok" else f"broke: {lv.get('error')}"
        rows.append(row)
    return pd.DataFrame(rows)


def user_and_server_rates(frame: pd.DataFrame, gpus: int = 1) -> pd.DataFrame:
    """Tokens/s one user sees (1000 / TPOT p50) against output tokens/s per GPU, per level that completed requests."""
    part = frame[frame["completed"] > 0].dropna(subset=["tpot p50 ms"])
    return pd.DataFrame({"level": part["level"], "tokens/s per user": 1e3 / part["tpot p50 ms"],
                         "tokens/s per GPU": part["output tokens/s"] / gpus})


def request_level(row) -> str:
    """A stored request's level as the tables name it: '2 req/s', '4 at once' or 'trace' (a replay at its own timing)."""
    rate, concurrency = getattr(row, "rate", None), getattr(row, "concurrency", None)
    if rate is not None and rate == rate:
        return f"{rate:.3g} req/s"
    return f"{int(concurrency)} at once" if concurrency is not None and concurrency == concurrency else "trace"


def itl_by_position(requests: pd.DataFrame) -> pd.DataFrame:
    """Mean and p90 gap before each output chunk position, per level (completed requests)."""
    rows = []
    for r in requests[requests["status"] == "ok"].itertuples():
        times = list(r.chunk_ms)
        for position, (a, b) in enumerate(zip(times, times[1:]), start=1):
            rows.append({"level": request_level(r), "position": position, "itl_ms": b - a})
    if not rows:
        return pd.DataFrame(columns=["level", "position", "mean ms", "p90 ms"])
    frame = pd.DataFrame(rows).groupby(["level", "position"], sort=False)["itl_ms"]
    return pd.DataFrame({"mean ms": frame.mean(), "p90 ms": frame.quantile(0.9)}).reset_index()


def timeline(requests: pd.DataFrame) -> pd.DataFrame:
    """Each request's span from the sweep's start: sent, first token, last chunk (seconds)."""
    frame = requests.copy()
    frame["start_s"] = frame["sent_ms"] / 1e3
    frame["first_s"] = (frame["sent_ms"] + frame["ttft_ms"].fillna(0)) / 1e3
    frame["end_s"] = (frame["sent_ms"] + frame["e2e_ms"].fillna(0)) / 1e3
    frame["level"] = [request_level(r) for r in frame.itertuples()]
    frame["label"] = frame["level"] + " #" + frame["idx"].astype(str)
    return frame[["label", "level", "idx", "status", "start_s", "first_s", "end_s", "n_output_tokens"]]
