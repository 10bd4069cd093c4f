"""Reading and writing served runs and load sweeps in the run store (engine.store.db's tables, schemas 5 and 9).
Served runs share the runs, steps and tokens tables with local runs; sweeps have tables of their own."""
from __future__ import annotations

import json
import socket

import psutil

from engine.store.recovery import process_alive
from engine.store.sql import utcnow
from engine.store.db import Store

def _owner() -> dict:
    me = psutil.Process()
    return {"host": socket.gethostname(), "pid": me.pid, "pid_started": me.create_time()}


def start_run(store: Store, *, endpoint: str, server_model: str, config: dict, prompt: str) -> int:
    """The run row, written as the request leaves, so a crash leaves a visible interrupted run."""
    row = {"started_at": utcnow(), "status": "running", "backend": "served", "endpoint": endpoint,
           "server_model": server_model, "model": server_model, "device": "server", "dtype": None,
           "kv_cache": True, "temperature": float(config.get("temperature", 0.0)), "weights": None, "speculative": "none",
           "config": json.dumps(config), "hardware": json.dumps({"gpu": config.get("gpu")}), "prompt": prompt,
           "tag": config.get("tag"), **_owner()}
    names = ", ".join(row)
    with store.connect() as con:
        return con.execute(f"INSERT INTO runs ({names}) VALUES ({', '.join('?' for _ in row)}) RETURNING run_id",
                           list(row.values())).fetchone()[0]


def start_sweep(store: Store, *, endpoint: str, server_model: str, config: dict, kind: str = "concurrency") -> int:
    with store.connect() as con:
        owner = _owner()
        return con.execute(
            "INSERT INTO load_sweeps (started_at, status, endpoint, server_model, config, levels, host, pid, "
            "pid_started, kind) VALUES (?, 'running', ?, ?, ?, '[]', ?, ?, ?, ?) RETURNING sweep_id",
            [utcnow(), endpoint, server_model, json.dumps(config), owner["host"], owner["pid"], owner["pid_started"],
             kind],
        ).fetchone()[0]


def update_sweep(store: Store, sweep_id: int, *, levels: list[dict], status: str = "running",
                 error: str | None = None, server: dict | None = None, result: dict | None = None) -> None:
    finished = utcnow() if status != "running" else None
    with store.connect() as con:
        con.execute("UPDATE load_sweeps SET levels = ?, status = ?, error = ?, server = ?, finished_at = ?, "
                    "result = ? WHERE sweep_id = ?",
                    [json.dumps(levels, default=str), status, error, json.dumps(server or {}), finished,
                     json.dumps(result, default=str) if result is not None else None, sweep_id])


def sweeps(store: Store, limit: int = 50):
    """Sweeps, newest first; one left 'running' by a process that is gone reads as interrupted."""
    frame = store.query("SELECT * FROM load_sweeps ORDER BY sweep_id DESC LIMIT ?", [limit])
    host = socket.gethostname()
    for i, row in frame.iterrows():
        if row["status"] == "running" and row["host"] == host and not process_alive(row["pid"], row["pid_started"]):
            frame.loc[i, "status"] = "interrupted"
    return frame


def sweep_requests(store: Store, sweep_id: int):
    """The sweep's requests in level order, warm-up requests left out."""
    return store.query("SELECT * FROM requests WHERE sweep_id = ? AND warmup IS NOT TRUE "
                       "ORDER BY coalesce(level, concurrency), idx", [int(sweep_id)])


def sweep_samples(store: Store, sweep_id: int):
    return store.query("SELECT * FROM load_samples WHERE sweep_id = ? ORDER BY t_ms", [int(sweep_id)])


def served_runs(store: Store, limit: int = 50):
    return store.query("SELECT * EXCLUDE (pid, pid_started) FROM runs WHERE backend = 'served' "
                       "ORDER BY run_id DESC LIMIT ?", [limit])
