"""Stored runs and load sweeps as Chrome trace-event JSON, the format ui.perfetto.dev and chrome://tracing open.

Each run or sweep is a process whose clock starts at 0 when it started (microseconds): a local run's
steps and their phases are threads of slices, its tokens instants, its buckets and telemetry counters;
a load sweep's requests are threads, the server's gauges counters."""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

from engine.errors import UserError
from engine.measure.distances import BUCKETS, PHASES
from engine.report.sweep_views import request_level
from engine.serve import records as served_store
from engine.store import journal
from engine.store.db import Store

SWEEP_PID_BASE = 1_000_000_000  # a load sweep's process id, apart from any run id
STEP_TID = 1
PHASE_TIDS = {phase: 2 + i for i, phase in enumerate(PHASES)}
TELEMETRY = {  # column: (counter name, scale)
    "cpu_percent": ("CPU use (%)", 1.0), "rss_bytes": ("resident memory (MB)", 1e-6),
    "gpu_util_percent": ("GPU use (%)", 1.0), "gpu_mem_used_bytes": ("GPU memory used (MB)", 1e-6),
    "gpu_power_w": ("GPU power (W)", 1.0), "gpu_sm_clock_mhz": ("GPU SM clock (MHz)", 1.0),
    "gpu_mem_clock_mhz": ("GPU memory clock (MHz)", 1.0), "gpu_temp_c": ("GPU temperature (C)", 1.0),
}
GAUGES = {"running": "server: requests running", "waiting": "server: requests waiting",
          "kv_cache_usage": "server: KV-cache usage (fraction)"}


class TraceError(UserError):
    """A trace that cannot be made from this selection."""


def _us(ms: float) -> float:
    return round(float(ms) * 1e3, 3)


def _number(value) -> float | None:
    """A stored figure as a float; None for a missing one (SQL NULL arrives as None or NaN)."""
    if value is None:
        return None
    value = float(value)
    return None if math.isnan(value) else value


def _meta(pid: int, tid: int | None, kind: str, value) -> dict:
    event = {"name": kind, "ph": "M", "pid": pid, "args": {"sort_index" if kind.endswith("sort_index") else "name": value}}
    if tid is not None:
        event["tid"] = tid
    return event


def run_rows(store: Store, run_id: int) -> tuple[dict, list[dict], list[dict], list[dict]]:
    """(run row, steps, tokens, telemetry) of a stored run; a run still recording is read from its journal."""
    run = store.run(int(run_id))
    if run is None:
        raise TraceError(f"Run {run_id} is not in {store.path}; `python -m engine runs` lists the runs there.")
    path = journal.journal_path(store.path, int(run_id))
    if run["status"] == "running" and path.exists():
        kept = journal.read(path)
        return run, kept["steps"], kept["tokens"], []
    records = lambda frame: frame.to_dict("records")  # noqa: E731
    return run, records(store.steps(run_id)), records(store.tokens(run_id)), records(store.telemetry(run_id))


def run_events(store: Store, run_id: int) -> list[dict]:
    """One run: a slice per step, a slice per phase of each step on that phase's thread (the steps tile
    the run, each phase laid after the previous one), an instant and the five buckets per token, telemetry."""
    run, steps, tokens, telemetry = run_rows(store, run_id)
    pid = int(run_id)
    label = f"run #{pid}: {run['model']} {run.get('weights') or ''} ({run['status']}, {run.get('backend') or 'local'})"
    events = [_meta(pid, None, "process_name", label), _meta(pid, None, "process_sort_index", pid),
              _meta(pid, STEP_TID, "thread_name", "steps and tokens"), _meta(pid, STEP_TID, "thread_sort_index", 0)]
    for phase, tid in PHASE_TIDS.items():
        events += [_meta(pid, tid, "thread_name", f"phase: {phase}"), _meta(pid, tid, "thread_sort_index", tid)]
    start_ms = 0.0
    for s in steps:
        wall = _number(s["wall_ms"]) or 0.0
        args = {k: s[k] for k in ("step", "n_input", "n_emitted", "context_len") if k in s}
        args.update({f"{b}_ms": _number(s.get(f"{b}_ms")) for b in BUCKETS})
        events.append({"name": s["kind"], "cat": "step", "ph": "X", "pid": pid, "tid": STEP_TID,
                       "ts": _us(start_ms), "dur": _us(wall), "args": args})
        at = start_ms
        for phase in PHASES:
            took = _number(s.get(f"{phase}_ms"))
            if took is None:
                continue
            events.append({"name": phase, "cat": "phase", "ph": "X", "pid": pid, "tid": PHASE_TIDS[phase],
                           "ts": _us(at), "dur": _us(took), "args": {"step": int(s["step"])}})
            at += took
        start_ms += wall
    for t in tokens:
        ts = _us(t["t_ms"])
        events.append({"name": t["piece"] or f"token {t['token_id']}", "cat": "token", "ph": "i", "s": "t",
                       "pid": pid, "tid": STEP_TID, "ts": ts,
                       "args": {"idx": int(t["idx"]), "step": int(t["step"]), "token_id": int(t["token_id"])}})
        buckets = {b: _number(t.get(f"{b}_ms")) for b in BUCKETS}
        events.append({"name": "buckets of each token (ms)", "cat": "bucket", "ph": "C", "pid": pid, "ts": ts,
                       "args": {b: v for b, v in buckets.items() if v is not None}})
    for sample in telemetry:
        for column, (name, scale) in TELEMETRY.items():
            value = _number(sample.get(column))
            if value is not None:
                events.append({"name": name, "cat": "telemetry", "ph": "C", "pid": pid, "ts": _us(sample["t_ms"]),
                               "args": {"value": value * scale}})
    return events


def sweep_events(store: Store, sweep_id: int) -> list[dict]:
    """One load sweep: a thread per request (queued behind the busy connections of its level, waiting for
    the first token, streaming, each chunk an instant, the end) and the server's gauges as counters."""
    found = store.query("SELECT * FROM load_sweeps WHERE sweep_id = ?", [int(sweep_id)])
    if found.empty:
        raise TraceError(f"Load sweep {sweep_id} is not in {store.path}; the Serving page lists the sweeps there.")
    sweep = found.iloc[0].to_dict()
    pid = SWEEP_PID_BASE + int(sweep_id)
    events = [_meta(pid, None, "process_name", f"load sweep #{sweep_id}: {sweep['server_model']} at "
                                               f"{sweep['endpoint']} ({sweep['status']})"),
              _meta(pid, None, "process_sort_index", pid)]
    requests = served_store.sweep_requests(store, sweep_id).to_dict("records")
    level_start = {}
    for r in requests:
        sent = _number(r["sent_ms"]) or 0.0
        level_start[_number(r["level"])] = min(level_start.get(_number(r["level"]), sent), sent)
    for tid, r in enumerate(requests, start=1):
        sent = _number(r["sent_ms"]) or 0.0
        name = f"{request_level(SimpleNamespace(**r))}: request {r['idx']} ({r['prompt_name']})"
        events += [_meta(pid, tid, "thread_name", name),
                   _meta(pid, tid, "thread_sort_index", tid)]
        base = {"pid": pid, "tid": tid, "cat": "request"}
        # a rate level's request waits in the client from its arrival (only behind --max-concurrency); a
        # concurrency level's, from the level's start until a connection of the level is free
        due = _number(r["scheduled_ms"]) if _number(r["rate"]) is not None else level_start[_number(r["level"])]
        queued = sent - (due if due is not None else sent)
        if queued > 0:
            events.append({**base, "name": "queued in the client (every connection it may use busy)", "ph": "X",
                           "ts": _us(due), "dur": _us(queued)})
        chunks = [float(c) for c in (r["chunk_ms"] if r["chunk_ms"] is not None else [])]
        counts = list(r["chunk_tokens"]) if r["chunk_tokens"] is not None else [None] * len(chunks)
        ttft, e2e = _number(r["ttft_ms"]), _number(r["e2e_ms"])
        end = e2e if e2e is not None else (chunks[-1] if chunks else 0.0)
        first = ttft if ttft is not None else end
        events.append({**base, "name": "to first token", "ph": "X", "ts": _us(sent), "dur": _us(first)})
        if end > first:
            events.append({**base, "name": "streaming", "ph": "X", "ts": _us(sent + first), "dur": _us(end - first)})
        for i, (at, n) in enumerate(zip(chunks, counts)):
            events.append({**base, "name": "chunk", "ph": "i", "s": "t", "ts": _us(sent + at),
                           "args": {"chunk": i, "tokens": None if n is None else int(n)}})
        events.append({**base, "name": f"end: {r['status']}", "ph": "i", "s": "t", "ts": _us(sent + end),
                       "args": {"status": r["status"], "error": r["error"], "output_tokens": r["n_output_tokens"]}})
    for sample in served_store.sweep_samples(store, sweep_id).to_dict("records"):
        for column, name in GAUGES.items():
            value = _number(sample.get(column))
            if value is not None:
                events.append({"name": name, "cat": "server", "ph": "C", "pid": pid, "ts": _us(sample["t_ms"]),
                               "args": {"value": value}})
    return events


def trace(store: Store, run_ids=(), sweep_ids=()) -> dict:
    """The trace-event JSON object of these runs and load sweeps, each event list ordered by time."""
    if not run_ids and not sweep_ids:
        raise TraceError("Nothing to trace: choose at least one run or load sweep.")
    events = []
    for run_id in dict.fromkeys(run_ids):
        events += run_events(store, run_id)
    for sweep_id in dict.fromkeys(sweep_ids):
        events += sweep_events(store, sweep_id)
    events.sort(key=lambda e: (e["ph"] != "M", e.get("ts", 0.0)))  # stable: a step stays before its phases
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": "Tokenpath", "database": str(store.path),
                          "runs": ",".join(map(str, run_ids)), "load_sweeps": ",".join(map(str, sweep_ids)),
                          "clock": "microseconds since each run or sweep started"}}


def trace_json(store: Store, run_ids=(), sweep_ids=()) -> str:
    return json.dumps(trace(store, run_ids, sweep_ids), separators=(",", ":"), allow_nan=False)
