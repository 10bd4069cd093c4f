"""The DuckDB run store: every run, step, token, telemetry sample and calibration.

Connections are short (open, write, close) so the app and the command line can both record;
a writer that finds the file locked by another process waits and retries."""
from __future__ import annotations

import json
import os
import socket
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import duckdb
import pandas as pd
import psutil

from .models import REPO_ROOT

SCHEMA_VERSION = 5
LOCK_WAIT_S = 60.0
BUCKETS = ("physical", "memory", "compute", "time", "decision")
_BUCKET_COLS = ", ".join(f"{b}_ms DOUBLE" for b in BUCKETS)

MIGRATIONS = {
    1: [
        "CREATE TABLE tokenpath_meta (key VARCHAR PRIMARY KEY, value VARCHAR)",
        "CREATE SEQUENCE run_ids START 1",
        f"""CREATE TABLE runs (
            run_id BIGINT PRIMARY KEY DEFAULT nextval('run_ids'),
            started_at TIMESTAMP, finished_at TIMESTAMP, status VARCHAR,
            model VARCHAR, device VARCHAR, dtype VARCHAR, kv_cache BOOLEAN, temperature DOUBLE,
            config VARCHAR, hardware VARCHAR, prompt VARCHAR, output VARCHAR, token_ids INTEGER[],
            n_prompt_tokens INTEGER, n_new_tokens INTEGER, ttft_ms DOUBLE, tpot_ms DOUBLE,
            tokens_per_s DOUBLE, decode_tokens_per_s DOUBLE, total_ms DOUBLE,
            itl_p50_ms DOUBLE, itl_p90_ms DOUBLE, itl_p99_ms DOUBLE, {_BUCKET_COLS},
            metrics VARCHAR, error VARCHAR, host VARCHAR, pid INTEGER, pid_started DOUBLE)""",
        f"""CREATE TABLE steps (
            run_id BIGINT, step INTEGER, kind VARCHAR, n_input INTEGER, n_emitted INTEGER,
            context_len INTEGER, draft_ms DOUBLE, upload_ms DOUBLE, forward_ms DOUBLE, sync_ms DOUBLE,
            select_ms DOUBLE, host_ms DOUBLE, wall_ms DOUBLE, weight_bytes BIGINT, kv_read_bytes BIGINT,
            kv_write_bytes BIGINT, flops DOUBLE, memory_est_ms DOUBLE, compute_est_ms DOUBLE,
            roofline_ms DOUBLE, waste_fraction DOUBLE, {_BUCKET_COLS})""",
        f"""CREATE TABLE tokens (
            run_id BIGINT, idx INTEGER, step INTEGER, token_id INTEGER, piece VARCHAR,
            t_ms DOUBLE, gap_ms DOUBLE, {_BUCKET_COLS})""",
        """CREATE TABLE telemetry (
            run_id BIGINT, t_ms DOUBLE, cpu_percent DOUBLE, rss_bytes BIGINT, gpu_util_percent DOUBLE,
            gpu_mem_used_bytes BIGINT, gpu_power_w DOUBLE, gpu_sm_clock_mhz DOUBLE,
            gpu_mem_clock_mhz DOUBLE, gpu_temp_c DOUBLE)""",
        "CREATE TABLE calibration (device_key VARCHAR, created_at TIMESTAMP, results VARCHAR)",
    ],
    2: [
        "ALTER TABLE runs ADD COLUMN quant VARCHAR DEFAULT 'fp32'",
        """CREATE TABLE quality (
            created_at TIMESTAMP, model VARCHAR, device VARCHAR, variant VARCHAR, settings VARCHAR,
            perplexity DOUBLE, kl_mean DOUBLE, top1_agreement DOUBLE, n_tokens INTEGER,
            eval_text_sha VARCHAR, first_divergence INTEGER, seconds DOUBLE)""",
    ],
    3: [
        "ALTER TABLE runs ADD COLUMN sparsity DOUBLE DEFAULT 0",
        "ALTER TABLE runs ADD COLUMN sparsity_mode VARCHAR",
        """CREATE TABLE sparsity_thresholds (model VARCHAR, sparsity DOUBLE, text_sha VARCHAR,
            created_at TIMESTAMP, thresholds VARCHAR)""",
    ],
    4: [
        "ALTER TABLE steps ADD COLUMN drafted INTEGER DEFAULT 0",
        "ALTER TABLE steps ADD COLUMN accepted INTEGER DEFAULT 0",
        "ALTER TABLE runs ADD COLUMN spec VARCHAR DEFAULT 'none'",
    ],
    5: [  # served runs (an OpenAI-compatible server) and load sweeps against one
        "ALTER TABLE runs ADD COLUMN backend VARCHAR DEFAULT 'local'",
        "ALTER TABLE runs ADD COLUMN endpoint VARCHAR",
        "ALTER TABLE runs ADD COLUMN server_model VARCHAR",
        "ALTER TABLE runs ADD COLUMN provenance VARCHAR",  # JSON: figure -> measured by client, server, or estimate
        "ALTER TABLE runs ADD COLUMN server_work_ms DOUBLE",
        "ALTER TABLE steps ADD COLUMN server_work_ms DOUBLE",
        "ALTER TABLE tokens ADD COLUMN server_work_ms DOUBLE",
        "CREATE SEQUENCE sweep_ids START 1",
        """CREATE TABLE load_sweeps (
            sweep_id BIGINT PRIMARY KEY DEFAULT nextval('sweep_ids'), started_at TIMESTAMP, finished_at TIMESTAMP,
            status VARCHAR, endpoint VARCHAR, server_model VARCHAR, config VARCHAR, levels VARCHAR,
            server VARCHAR, error VARCHAR, host VARCHAR, pid INTEGER, pid_started DOUBLE)""",
        """CREATE TABLE requests (
            sweep_id BIGINT, concurrency INTEGER, idx INTEGER, prompt_name VARCHAR, status VARCHAR, error VARCHAR,
            sent_ms DOUBLE, n_prompt_tokens INTEGER, n_output_tokens INTEGER, n_chunks INTEGER, token_source VARCHAR,
            ttft_ms DOUBLE, tpot_ms DOUBLE, e2e_ms DOUBLE, chunk_ms DOUBLE[], chunk_tokens INTEGER[])""",
        """CREATE TABLE load_samples (
            sweep_id BIGINT, concurrency INTEGER, t_ms DOUBLE, running DOUBLE, waiting DOUBLE, kv_cache_usage DOUBLE)""",
    ],
}


class StoreError(Exception):
    """The database cannot be used; the message is one sentence for the user."""


def default_db_path() -> Path:
    return Path(os.environ.get("TOKENPATH_DB", REPO_ROOT / "data" / "runs.duckdb"))


def utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


def _is_lock_error(exc: Exception) -> bool:
    text = str(exc).lower()
    return "lock" in text and ("could not set" in text or "conflicting" in text)


class Store:
    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else default_db_path()
        self._prepare()
        self.mark_interrupted()

    @contextmanager
    def connect(self):
        deadline = time.monotonic() + LOCK_WAIT_S
        delay = 0.01
        while True:
            try:
                con = duckdb.connect(str(self.path))
                break
            except duckdb.Error as exc:
                if _is_lock_error(exc) and time.monotonic() < deadline:
                    time.sleep(delay)
                    delay = min(delay * 2, 0.25)
                    continue
                if _is_lock_error(exc):
                    raise StoreError(f"The database {self.path} stayed locked by another process for {LOCK_WAIT_S:.0f} s.") from None
                raise StoreError(f"{self.path} is not a readable DuckDB database ({str(exc).splitlines()[0]}); "
                                 "point --db or TOKENPATH_DB at another file.") from None
        try:
            yield con
        finally:
            con.close()

    def _prepare(self) -> None:
        if self.path.is_dir():
            raise StoreError(f"{self.path} is a folder, not a database file; point --db or TOKENPATH_DB at a file.")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"Cannot create the folder for the database {self.path}: {exc.strerror}.") from None
        with self.connect() as con:
            tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
            if tables and "tokenpath_meta" not in tables:
                raise StoreError(f"{self.path} is a DuckDB file of something else (it has tables but none of "
                                 "Tokenpath's); it was left untouched, point --db or TOKENPATH_DB at another file.")
            version = 0
            if tables:
                row = con.execute("SELECT value FROM tokenpath_meta WHERE key = 'schema_version'").fetchone()
                version = int(row[0]) if row else 0
            if version > SCHEMA_VERSION:
                raise StoreError(f"{self.path} was written by a newer Tokenpath (schema {version}); update this copy.")
            for v in range(version + 1, SCHEMA_VERSION + 1):
                con.execute("BEGIN")
                for statement in MIGRATIONS[v]:
                    con.execute(statement)
                con.execute("INSERT OR REPLACE INTO tokenpath_meta VALUES ('schema_version', ?)", [str(v)])
                con.execute("COMMIT")

    def mark_interrupted(self) -> int:
        """Runs left 'running' by a process on this host that no longer exists become 'interrupted'."""
        host = socket.gethostname()
        with self.connect() as con:
            rows = con.execute("SELECT run_id, pid, pid_started FROM runs WHERE status = 'running' AND host = ?",
                               [host]).fetchall()
            dead = [run_id for run_id, pid, started in rows if not _process_alive(pid, started)]
            for run_id in dead:
                con.execute("UPDATE runs SET status = 'interrupted', finished_at = ?, "
                            "error = 'the process recording this run ended before the run did' WHERE run_id = ?",
                            [utcnow(), run_id])
        return len(dead)

    def start_run(self, *, model: str, device: str, dtype: str, config: dict, hardware: dict, prompt: str) -> int:
        me = psutil.Process()
        with self.connect() as con:
            return con.execute(
                """INSERT INTO runs (started_at, status, model, device, dtype, kv_cache, temperature, quant, sparsity,
                   sparsity_mode, spec, config, hardware, prompt, host, pid, pid_started)
                   VALUES (?, 'running', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING run_id""",
                [utcnow(), model, device, dtype, bool(config.get("kv_cache", True)),
                 float(config.get("temperature", 0.0)), config.get("quant", "fp32"), float(config.get("sparsity", 0.0)),
                 config.get("sparsity_mode"), config.get("spec", "none"), json.dumps(config),
                 json.dumps(hardware), prompt,
                 socket.gethostname(), me.pid, me.create_time()],
            ).fetchone()[0]

    def finish_run(self, run_id: int, *, status: str, output: str = "", token_ids=(), metrics: dict | None = None,
                   error: str | None = None, batches: dict[str, list[dict]] | None = None) -> None:
        """Complete the run row, writing its last batches of rows in the same connection."""
        metrics = dict(metrics or {})
        columns = ["n_prompt_tokens", "n_new_tokens", "ttft_ms", "tpot_ms", "tokens_per_s", "decode_tokens_per_s",
                   "total_ms", "itl_p50_ms", "itl_p90_ms", "itl_p99_ms"]
        values = [metrics.get(c) for c in columns]
        distances = metrics.get("distances_ms") or {}
        columns += [f"{b}_ms" for b in BUCKETS]
        values += [distances.get(b) for b in BUCKETS]
        assignments = ", ".join(f"{c} = ?" for c in columns)
        with self.connect() as con:
            _insert_batches(con, batches or {})
            con.execute(
                f"UPDATE runs SET finished_at = ?, status = ?, output = ?, token_ids = ?, metrics = ?, error = ?, "
                f"{assignments} WHERE run_id = ?",
                [utcnow(), status, output, list(token_ids), json.dumps(metrics), error, *values, run_id],
            )

    def insert(self, batches: dict[str, list[dict]]) -> None:
        """Rows for several tables ({table: [row dict, ...]}) in one connection."""
        with self.connect() as con:
            _insert_batches(con, batches)

    def query(self, sql: str, params=None):
        """A pandas DataFrame of any read query."""
        with self.connect() as con:
            return con.execute(sql, params or []).df()

    def runs(self, limit: int = 50):
        return self.query("SELECT * EXCLUDE (pid, pid_started) FROM runs ORDER BY run_id DESC LIMIT ?", [limit])

    def run(self, run_id: int) -> dict | None:
        frame = self.query("SELECT * FROM runs WHERE run_id = ?", [run_id])
        return None if frame.empty else frame.iloc[0].to_dict()

    def steps(self, run_id: int):
        return self.query("SELECT * FROM steps WHERE run_id = ? ORDER BY step", [run_id])

    def tokens(self, run_id: int):
        return self.query("SELECT * FROM tokens WHERE run_id = ? ORDER BY idx", [run_id])

    def telemetry(self, run_id: int):
        return self.query("SELECT * FROM telemetry WHERE run_id = ? ORDER BY t_ms", [run_id])

    def delete_runs(self, run_ids: list[int]) -> int:
        """Delete these runs with their steps, tokens and telemetry; returns how many runs went."""
        ids = [int(i) for i in run_ids]
        if not ids:
            return 0
        marks = ", ".join("?" for _ in ids)
        with self.connect() as con:
            con.execute("BEGIN")
            for table in ("steps", "tokens", "telemetry"):
                con.execute(f"DELETE FROM {table} WHERE run_id IN ({marks})", ids)
            deleted = con.execute(f"DELETE FROM runs WHERE run_id IN ({marks}) RETURNING run_id", ids).fetchall()
            con.execute("COMMIT")
        return len(deleted)

    def save_quality(self, result: dict) -> None:
        row = {k: result.get(k) for k in ("model", "device", "variant", "perplexity", "kl_mean", "top1_agreement",
                                          "n_tokens", "eval_text_sha", "first_divergence", "seconds")}
        self.insert({"quality": [{**row, "created_at": utcnow(), "settings": json.dumps(result.get("settings", {}))}]})

    def sparsity_thresholds(self, model: str, sparsity: float, text_sha: str) -> dict | None:
        with self.connect() as con:
            row = con.execute("SELECT thresholds FROM sparsity_thresholds WHERE model = ? AND sparsity = ? AND "
                              "text_sha = ? ORDER BY created_at DESC LIMIT 1", [model, sparsity, text_sha]).fetchone()
        return json.loads(row[0]) if row else None

    def save_sparsity_thresholds(self, model: str, sparsity: float, text_sha: str, thresholds: dict) -> None:
        with self.connect() as con:
            con.execute("INSERT INTO sparsity_thresholds VALUES (?, ?, ?, ?, ?)",
                        [model, sparsity, text_sha, utcnow(), json.dumps(thresholds)])

    def save_calibration(self, device_key: str, results: dict) -> None:
        with self.connect() as con:
            con.execute("INSERT INTO calibration VALUES (?, ?, ?)", [device_key, utcnow(), json.dumps(results)])

    def latest_calibration(self, device_key: str) -> dict | None:
        with self.connect() as con:
            row = con.execute("SELECT results, created_at FROM calibration WHERE device_key = ? "
                              "ORDER BY created_at DESC LIMIT 1", [device_key]).fetchone()
        if not row:
            return None
        return {**json.loads(row[0]), "created_at": row[1].isoformat(timespec="seconds")}


def _insert_batches(con, batches: dict[str, list[dict]]) -> None:
    for table, rows in batches.items():
        if rows:
            con.register("batch", pd.DataFrame(rows))
            con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM batch")
            con.unregister("batch")


def _process_alive(pid: int | None, started: float | None) -> bool:
    if pid is None:
        return False
    try:
        return abs(psutil.Process(pid).create_time() - (started or 0.0)) < 1.0
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
