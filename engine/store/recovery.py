"""Runs whose process ended before the run did, and load sweeps' requests not yet written: folded in from their
journals when a store opens.

A journal with no live owner goes into the database in one transaction: the run's row if it was not written
yet, its steps and tokens, and
either the run's own ending (when the process wrote it to the journal but could not reach the
database) or status 'interrupted' with the totals its rows add up to. Runs left 'running' without a
journal (a kill between the run's row and its journal) become 'interrupted', with no tokens, when their process
is gone. A sweep's journal (engine.store.request_rows) adds the requests the database lacks."""
from __future__ import annotations

import socket

import psutil

from engine.store import journal
from engine.measure.distances import BUCKETS
from engine.measure.metrics import run_metrics
from engine.store.sql import complete_run, insert_batches

DIED = "the process recording this run ended before the run did"


def recover(store) -> int:
    """Fold every ownerless journal and mark ownerless running runs; returns how many runs changed."""
    changed = 0
    folder = journal.journal_dir(store.path)
    journals = sorted(folder.glob("run-*.jsonl")) if folder.is_dir() else []
    live = set()
    with store.connect() as con:
        for path in journals:
            run_id = int(path.stem.removeprefix("run-"))
            with journal.claimed(path) as kept:  # held until folded, so that no other recovery folds it too
                if kept is not None:
                    changed += fold(con, run_id, kept)
                elif path.exists():
                    live.add(run_id)
        for path in sorted(folder.glob("sweep-*.jsonl")) if folder.is_dir() else []:
            with journal.claimed(path) as kept:
                if kept is not None:
                    changed += fold_requests(con, int(path.stem.removeprefix("sweep-")), kept.get("requests", []))
        rows = con.execute("SELECT run_id, pid, pid_started FROM runs WHERE status = 'running' AND host = ?",
                           [socket.gethostname()]).fetchall()
        for run_id, pid, started in rows:
            if run_id not in live and not process_alive(pid, started):
                interrupt(con, run_id, {"run": {}, "steps": [], "tokens": [], "text": ""})
                changed += 1
    return changed


def fold(con, run_id: int, kept: dict) -> int:
    """Write one journal's rows and the run's ending in one transaction; 0 if the run had ended. A run whose row
    was still to be written (engine.store.writer) gets it from the journal."""
    status = con.execute("SELECT status FROM runs WHERE run_id = ?", [run_id]).fetchone()
    row = kept["run"].get("row")
    if (status is None and row is None) or (status is not None and status[0] != "running"):
        return 0
    con.execute("BEGIN")
    if status is None:
        insert_batches(con, {"runs": [row]})
    for table in ("steps", "tokens", "telemetry"):
        con.execute(f"DELETE FROM {table} WHERE run_id = ?", [run_id])
    finish = kept["finish"]
    batches = {"steps": kept["steps"], "tokens": kept["tokens"],
               "telemetry": (finish or {}).pop("telemetry", [])}
    insert_batches(con, {t: [{"run_id": run_id, **r} for r in rows] for t, rows in batches.items()})
    if finish:
        complete_run(con, run_id, **finish)
    else:
        interrupt(con, run_id, kept)
    con.execute("COMMIT")
    return 1


def fold_requests(con, sweep_id: int, rows: list[dict]) -> int:
    """Write the journal's requests that the sweep's writes had not; returns how many."""
    written = {journal.request_key({"level": level, "idx": idx, "warmup": warmup}) for level, idx, warmup in con.execute(
        "SELECT level, idx, warmup FROM requests WHERE sweep_id = ?", [sweep_id]).fetchall()}
    missing = [row for row in rows if journal.request_key(row) not in written]
    insert_batches(con, {"requests": missing})
    return len(missing)


def interrupt(con, run_id: int, kept: dict) -> None:
    """End a run whose process died with the rows its journal kept (none where it had no journal)."""
    complete_run(con, run_id, status="interrupted", output=kept["text"],
                 token_ids=[t["token_id"] for t in kept["tokens"]], metrics=totals(kept), error=DIED)


def totals(kept: dict) -> dict:
    """The summary an interrupted run's rows add up to."""
    metrics = run_metrics([t["t_ms"] for t in kept["tokens"]], kept["run"].get("n_prompt_tokens"))
    metrics.pop("itl_ms")
    # a served run's memory and compute are None where its server work was not split
    metrics["distances_ms"] = {b: None if any(s[f"{b}_ms"] is None for s in kept["steps"])
                               else sum(s[f"{b}_ms"] for s in kept["steps"]) for b in BUCKETS}
    metrics["stop_reason"] = "interrupted"
    return metrics


def process_alive(pid: int | None, started: float | None) -> bool:
    if pid is None:
        return False
    try:
        return abs(psutil.Process(pid).create_time() - (started or 0.0)) < 1.0
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
