"""Statements the store and the recovery of interrupted runs share: row batches, a run's ending."""
from __future__ import annotations

import json
import socket
from datetime import datetime, timezone

import pandas as pd
import psutil

from engine.measure.distances import BUCKETS

RUN_COLUMNS = ("n_prompt_tokens", "n_new_tokens", "ttft_ms", "tpot_ms", "tokens_per_s", "decode_tokens_per_s",
               "total_ms", "itl_p50_ms", "itl_p90_ms", "itl_p99_ms")


def utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


# run columns only some backends set (a served run's: its provenance, network parts and prefix-cache counters)
EXTRA_COLUMNS = ("provenance", "server_work_ms", "dns_ms", "connect_ms", "tls_ms", "send_ms", "first_byte_ms",
                 "headers_ms", "connection", "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hit_rate",
                 "energy_j", "energy_source", "energy_note")  # a local run's energy (engine.measure.energy)


def start_row(*, model: str, device: str, dtype: str, config: dict, hardware: dict, prompt: str,
              tag: str | None = None) -> dict:
    """A local run's row as it starts: its settings, status running, and the host and process recording it."""
    me = psutil.Process()
    return {"started_at": utcnow(), "status": "running", "model": model, "device": device, "dtype": dtype,
            "kv_cache": bool(config.get("kv_cache", True)), "temperature": float(config.get("temperature", 0.0)),
            "weights": config.get("weights", "fp32"), "sparsity": float(config.get("sparsity", 0.0)),
            "sparsity_mode": config.get("sparsity_mode"), "speculative": config.get("speculative", "none"),
            "config": json.dumps(config), "hardware": json.dumps(hardware), "prompt": prompt, "tag": tag,
            "host": socket.gethostname(), "pid": me.pid, "pid_started": me.create_time()}


def complete_run(con, run_id: int, *, status: str, output: str, token_ids, metrics: dict | None,
                 error: str | None, columns: dict | None = None, finished_at: datetime | str | None = None) -> None:
    """Set a run's end: when it ended (now unless given: a journal keeps it as text), status, output, summary
    metrics and bucket totals, and any of EXTRA_COLUMNS (inside the caller's transaction)."""
    complete_runs(con, [(run_id, {"status": status, "output": output, "token_ids": token_ids, "metrics": metrics,
                                  "error": error, "columns": columns, "finished_at": finished_at})])


def ending_row(run_id: int, *, status: str, output: str, token_ids, metrics: dict | None, error: str | None,
               columns: dict | None = None, finished_at: datetime | str | None = None) -> dict:
    """The run columns complete_run sets, by name, with the run's id."""
    if isinstance(finished_at, str):
        finished_at = datetime.fromisoformat(finished_at)
    metrics = dict(metrics or {})
    distances = metrics.get("distances_ms") or {}
    return {"run_id": run_id, "finished_at": finished_at or utcnow(), "status": status, "output": output,
            "token_ids": [int(t) for t in token_ids], "metrics": json.dumps(metrics, default=str), "error": error,
            **{c: metrics.get(c) for c in RUN_COLUMNS}, **{f"{b}_ms": distances.get(b) for b in BUCKETS},
            **{c: v for c, v in (columns or {}).items() if c in EXTRA_COLUMNS}}


def complete_runs(con, endings: list[tuple[int, dict]]) -> None:
    """complete_run for each (run_id, its keyword arguments), in one statement for the runs that set the same
    columns: an UPDATE a run made the writes of a busy engine take a core from its decoding. A NaN is stored as
    NULL, as a DataFrame's missing value."""
    groups: dict[tuple, list[dict]] = {}
    for run_id, ending in endings:
        row = ending_row(run_id, **ending)
        groups.setdefault(tuple(sorted(row)), []).append(row)
    for names, rows in groups.items():
        con.register("endings", pd.DataFrame(rows))
        try:
            con.execute(f"UPDATE runs SET {', '.join(f'{c} = endings.{c}' for c in names if c != 'run_id')} "
                        "FROM endings WHERE runs.run_id = endings.run_id")
        finally:
            con.unregister("endings")


def insert_batches(con, batches: dict[str, list[dict]]) -> None:
    for table, rows in batches.items():
        if rows:
            con.register("batch", pd.DataFrame(rows))
            con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM batch")
            con.unregister("batch")
