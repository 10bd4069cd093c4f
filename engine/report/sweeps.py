"""Reports of a sweep (a grid of settings, engine/sweep.py, its runs tagged sweep:ID) and of a load sweep against a
server (its levels and requests), built from the stored rows with the report module's sections."""
from __future__ import annotations

import html
import json

import plotly.graph_objects as go

from engine.report.advisor import advise, against, settings
from engine.report.charts import readable
from engine.sweep import Arm, arm_of, stored, stored_ids, sweep_tag
from engine.measure.distances import BUCKETS
from engine.report.html import ReportError, Section, build_html, definitions_section, runs_report, table
from engine.serve.records import sweeps
from engine.report.sweep_views import level_frame
from engine.serve.capacity import describe
from engine.serve.command import ReproduceError, sweep_command


def sweep_runs(store, sweep_id: str) -> list[dict]:
    frame = store.query("SELECT * FROM runs WHERE tag = ? AND status = 'ok' ORDER BY run_id", [sweep_tag(sweep_id)])
    return frame.to_dict("records")


def batches(runs: list[dict]) -> list[tuple[Arm, list[dict]]]:
    """A sweep's stored runs (in run order) as the batches they decoded in: a lone run by itself, the sequences of
    a batch (consecutive runs of one arm, its users of them) together."""
    out: list[tuple[Arm, list[dict]]] = []
    for run in runs:
        arm = arm_of(run)
        if out and out[-1][0] == arm and len(out[-1][1]) < arm.users:
            out[-1][1].append(run)
        else:
            out.append((arm, [run]))
    return out


def advisor_rows(runs: list[dict]) -> list[dict]:
    """The advisor's view of a sweep's stored runs: one row per setting of its grid (its repeats together), in the
    order the settings first ran, the buckets per token, the rates. A batch is one repeat: its tokens/s are every
    user's together, its buckets per token over every user's tokens."""
    def total(batch, key):
        return sum(r[key] for r in batch) if all(r[key] is not None for r in batch) else None

    rows = []
    for arm, batch in batches(runs):
        tokens = sum(r["n_new_tokens"] or 0 for r in batch) or 1
        rows.append({"label": arm.label, "run_id": batch[0]["run_id"],
                     **{f"{b}_ms": sum(r[f"{b}_ms"] or 0.0 for r in batch) / tokens for b in BUCKETS},
                     "decode_tokens_per_s": total(batch, "decode_tokens_per_s"), "tokens_per_s": total(batch, "tokens_per_s"),
                     "ttft_ms": sum(r["ttft_ms"] or 0.0 for r in batch) / len(batch)})
    return settings(rows)


def sweep_results(store, sweep_id: str) -> list[dict]:
    """A sweep's settings as the advisor reads them, each with its decode speed against the first setting (the
    ratio, its 95% interval and verdict) in "decode vs baseline"; empty before any run finished."""
    rows = advisor_rows(sweep_runs(store, sweep_id))
    return [{**row, "decode vs baseline": against(rows[0]["decode_rates"], row["decode_rates"])} for row in rows]


def sweep_report(store, sweep_id: str) -> str:
    """The sweep's runs compared against its first (the baseline), with the advisor's reading and the command
    that makes the sweep again."""
    runs = sweep_runs(store, sweep_id)
    if not runs:
        raise ReportError(f"No finished runs of sweep '{sweep_id}' in {store.path.name}: run a sweep on the Sweeps "
                          "page or with `python -m engine sweep` first (its id is shown under its results).")
    rows = advisor_rows(runs)
    advice = "".join(f"<li>{html.escape(line)}</li>" for line in advise(rows, rows[0]))
    again = (f"<p>The command that makes this sweep again:</p><pre>{html.escape(stored(store, sweep_id).command())}"
             "</pre>" if sweep_id in stored_ids(store) else "")
    return runs_report(store, [r["run_id"] for r in runs], title=f"Tokenpath: sweep {sweep_id}",
                       extra=[Section("Advisor", f"<ul>{advice}</ul>{again}")])


def _num(value, spec: str) -> str:
    """A figure, or '-' for one a level did not have (no request completed)."""
    return "-" if value is None or value != value else format(value, spec)


def load_sweep_command(store, sweep_id: int) -> str:
    """The paragraph with the command that makes the load sweep again, or the sentence that says why none can."""
    try:
        return f"<p>Made again by <code>{html.escape(sweep_command(store, sweep_id))}</code> (add --db FILE).</p>"
    except ReproduceError as exc:
        return f"<p>{html.escape(str(exc))}</p>"


def load_sweep_report(store, sweep_id: int) -> str:
    """A load sweep: its settings, per-level percentiles and throughput, and the capacity curve."""
    frame = sweeps(store, 100000)
    match = frame[frame["sweep_id"] == sweep_id]
    if match.empty:
        raise ReportError(f"No load sweep #{sweep_id} in {store.path.name}: the Serving page lists the stored ones.")
    sweep = match.iloc[0]
    levels = level_frame(sweep["levels"])
    if levels.empty:
        raise ReportError(f"Load sweep #{sweep_id} has no finished level to report.")
    header = ["level", "completed", "failed", "TTFT p50/p90/p99 ms", "ITL p50/p90/p99 ms", "TPOT p50 ms",
              "E2E p50 ms", "requests/s", "output tokens/s", "goodput req/s", "attainment"]
    trio = lambda r, m: "/".join(_num(r[f"{m} p{q} ms"], ".0f") for q in (50, 90, 99))  # noqa: E731
    body = [[html.escape(str(r["level"])) + ("" if r["status"] == "ok" else f" ({html.escape(r['status'])})"),
             str(r["completed"]), str(r["failed"]), trio(r, "ttft"), trio(r, "itl"), _num(r["tpot p50 ms"], ".1f"),
             _num(r["e2e p50 ms"], ".0f"), _num(r["requests/s"], ".2f"), _num(r["output tokens/s"], ".1f"),
             _num(r["goodput req/s"], ".2f"), _num(r["attainment"], ".0%")]
            for r in levels.to_dict("records")]
    done = levels[levels["completed"] > 0]
    curve = go.Figure(go.Scatter(x=done["output tokens/s"], y=done["tpot p50 ms"], mode="lines+markers+text",
                                 text=list(done["level"]), textposition="top center"))
    readable(curve, title="Per-user latency against total throughput", xaxis_title="output tokens/s, all users",
             yaxis_title="TPOT p50, ms", height=420)
    settings = (f"<p>Server {html.escape(str(sweep['endpoint']))}, model {html.escape(str(sweep['server_model']))}, "
                f"status {html.escape(str(sweep['status']))}, started {sweep['started_at']:%Y-%m-%d %H:%M} UTC. TTFT, "
                "ITL (the gap between streamed chunks), TPOT and E2E are measured by the client, as vLLM's benchmark "
                "defines them.</p>")
    if isinstance(sweep.get("error"), str):
        settings += f"<p>Ended early: {html.escape(sweep['error'])}</p>"
    if isinstance(sweep.get("result"), str):
        settings += f"<p><b>{html.escape(describe(json.loads(sweep['result'])))}</b></p>"
    settings += load_sweep_command(store, sweep_id)
    sections = [Section("Load sweep", settings + table(header, body, numeric_from=1), [curve]), definitions_section()]
    return build_html(f"Tokenpath: load sweep #{sweep_id}", sections)
