"""Reports of a sweep (the Sweeps page's grid, its runs tagged sweep:ID) and of a load sweep against a
server (its levels and requests), built from the stored rows with the report module's sections."""
from __future__ import annotations

import html

import plotly.graph_objects as go

from engine.report.advisor import advise, settings
from engine.report.charts import readable, run_switches
from engine.measure.distances import BUCKETS
from engine.report.html import ReportError, Section, build_html, definitions_section, runs_report, table
from engine.serve.records import sweeps
from engine.report.sweep_views import level_frame

SWEEP_TAG = "sweep:"


def sweep_tag(sweep_id: str) -> str:
    return SWEEP_TAG + sweep_id


def sweep_runs(store, sweep_id: str) -> list[dict]:
    frame = store.query("SELECT * FROM runs WHERE tag = ? AND status = 'ok' ORDER BY run_id", [sweep_tag(sweep_id)])
    return frame.to_dict("records")


def advisor_rows(runs: list[dict]) -> list[dict]:
    """The advisor's view of stored runs: one row per setting (its repeats together), the buckets per token, the rates."""
    class Row:  # run_switches reads attributes
        def __init__(self, run):
            self.__dict__.update(run)

    return settings([{"label": f"{r['model']} · {' · '.join(run_switches(Row(r)))}", "run_id": r["run_id"],
                      **{f"{b}_ms": (r[f"{b}_ms"] or 0.0) / (r["n_new_tokens"] or 1) for b in BUCKETS},
                      "decode_tokens_per_s": r["decode_tokens_per_s"], "ttft_ms": r["ttft_ms"],
                      "tokens_per_s": r["tokens_per_s"]} for r in runs])


def sweep_report(store, sweep_id: str) -> str:
    """The sweep's runs compared against its first (the baseline), with the advisor's reading."""
    runs = sweep_runs(store, sweep_id)
    if not runs:
        raise ReportError(f"No finished runs of sweep '{sweep_id}' in {store.path.name}: run a sweep on the Sweeps "
                          "page first (its id is shown under its results).")
    rows = advisor_rows(runs)
    advice = "".join(f"<li>{html.escape(line)}</li>" for line in advise(rows, rows[0]))
    return runs_report(store, [r["run_id"] for r in runs], title=f"Tokenpath: sweep {sweep_id}",
                       extra=[Section("Advisor", f"<ul>{advice}</ul>")])


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
    header = ["concurrency", "completed", "TTFT p50/p90/p99 ms", "ITL p50/p90/p99 ms", "TPOT p50 ms", "E2E p50 ms",
              "requests/s", "output tokens/s"]
    trio = lambda r, m: "/".join(f"{r[f'{m} p{q} ms']:.0f}" if r[f"{m} p{q} ms"] is not None else "-"  # noqa: E731
                                 for q in (50, 90, 99))
    body = [[str(r["concurrency"]), str(r["completed"]), trio(r, "ttft"), trio(r, "itl"), f"{r['tpot p50 ms']:.1f}",
             f"{r['e2e p50 ms']:.0f}", f"{r['requests/s']:.2f}", f"{r['output tokens/s']:.1f}"]
            for r in levels.to_dict("records")]
    curve = go.Figure(go.Scatter(x=levels["output tokens/s"], y=levels["tpot p50 ms"], mode="lines+markers+text",
                                 text=[f"{c} users" for c in levels["concurrency"]], textposition="top center"))
    readable(curve, title="Per-user latency against total throughput", xaxis_title="output tokens/s, all users",
             yaxis_title="TPOT p50, ms", height=420)
    settings = (f"<p>Server {html.escape(str(sweep['endpoint']))}, model {html.escape(str(sweep['server_model']))}, "
                f"status {html.escape(str(sweep['status']))}, started {sweep['started_at']:%Y-%m-%d %H:%M} UTC. TTFT, "
                "ITL (the gap between streamed chunks), TPOT and E2E are measured by the client, as vLLM's benchmark "
                "defines them.</p>")
    sections = [Section("Load sweep", settings + table(header, body, numeric_from=1), [curve]), definitions_section()]
    return build_html(f"Tokenpath: load sweep #{sweep_id}", sections)
