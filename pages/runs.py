"""Runs: every stored run, filterable; compare, export (CSV made safe for spreadsheets, Parquet as is), delete."""
import io
import json

import pandas as pd
import streamlit as st

from engine.measure.compare import compare
from engine.measure.distances import BUCKETS
from engine.report.advisor import arms as setting_arms, mixed_repeats
from engine.run.reproduce import run_command
from ui import csv_safe, figure, flash, open_store, page_setup, readable_runs, runs_table, show_flash


def calibration_label(run_metrics, flagged: set) -> str | None:
    """The calibration a run was attributed with, in a few words (its figures identify it)."""
    summary = json.loads(run_metrics).get("calibration") if isinstance(run_metrics, str) else None
    if not summary:
        return None
    return (f"{summary['memory_gbps']:.1f} GB/s, {summary['matmul_gflops']['float32']:,.0f} GFLOP/s fp32"
            + (" (flagged: taken on a busy machine)" if summary["memory_gbps"] in flagged else ""))


def comparison(picked):
    """The selected runs side by side, one column a run: the readable figures, then each bucket per
    token. Every cell is text, so a column of settings and figures converts to one Arrow type."""
    table = readable_runs(picked).set_index("run")
    for b in BUCKETS:
        table[f"{b} (ms per token)"] = [figure(row[f"{b}_ms"] / row["n_new_tokens"]) if row["n_new_tokens"] else None
                                        for row in picked.to_dict("records")]
    return table.T.map(lambda v: "" if v is None or v != v else str(v))


page_setup("Runs")
st.title("Runs")
store = open_store()
if store is None:
    st.stop()
show_flash()
runs = store.all_runs()
if runs.empty:
    st.info("No runs recorded yet: start one on Live generation or with `python -m engine generate`.")
    st.stop()

c = st.columns(5)
models = c[0].multiselect("Model", sorted(runs["model"].dropna().unique()))
levels = c[1].multiselect("Weights", sorted(runs["weights"].dropna().unique()))
methods = c[2].multiselect("Speculative", sorted(runs["speculative"].dropna().unique()))
statuses = c[3].multiselect("Status", sorted(runs["status"].dropna().unique()))
kv = c[4].selectbox("KV cache", ["any", "on", "off"])
flagged = store.flagged_calibration_figures()
runs["calibration"] = runs["metrics"].map(lambda m: calibration_label(m, flagged))
first, last = runs["started_at"].min().date(), runs["started_at"].max().date()
dates = st.date_input("Started between (UTC)", (first, last), min_value=first, max_value=last)
view = runs
if models:
    view = view[view["model"].isin(models)]
if levels:
    view = view[view["weights"].isin(levels)]
if methods:
    view = view[view["speculative"].isin(methods)]
if statuses:
    view = view[view["status"].isin(statuses)]
if kv != "any":
    view = view[view["kv_cache"] == (kv == "on")]
if isinstance(dates, tuple) and len(dates) == 2:
    day = view["started_at"].dt.date
    view = view[(day >= dates[0]) & (day <= dates[1])]

columns = ["run_id", "started_at", "status", "model", "device", "weights", "kv_cache", "sparsity", "sparsity_mode",
           "speculative", "temperature", "n_prompt_tokens", "n_new_tokens", "ttft_ms", "tpot_ms", "tokens_per_s",
           "physical_ms", "memory_ms", "compute_ms", "time_ms", "decision_ms", "calibration", "prompt", "error"]
all_columns = st.toggle("All columns", False, help="Every stored field, as stored (times in ms).")
st.caption(f"{len(view)} of {len(runs)} runs. Tick rows to compare, export or delete them. Figures rounded to three "
           "significant digits; tokens/s end to end.")
selection = dict(on_select="rerun", selection_mode="multi-row",
                 key=f"runs_table_{st.session_state.get('runs_table_round', 0)}_{all_columns}")
if all_columns:
    event = st.dataframe(csv_safe(view[columns]), hide_index=True, width="stretch", **selection)
else:
    event = runs_table(readable_runs(view), **selection)
picked = view.iloc[event.selection.rows] if event.selection.rows else view.iloc[0:0]

if picked.empty:
    st.info("Tick one or more rows to compare, export or delete.")
    st.stop()

ids = [int(i) for i in picked["run_id"]]
st.subheader(f"{len(ids)} selected")
st.dataframe(comparison(picked), width="stretch")
arms = setting_arms(picked.sort_values("run_id").to_dict("records"))
if len(arms) > 1:  # repeats of one setting are one arm; the oldest selected run's setting is the baseline
    base = arms[0]["decode_rates"]
    st.markdown("**Decode speed against the oldest selected run's setting**, each setting's runs taken as repeats")
    st.dataframe(pd.DataFrame([{"setting": a["label"], "runs": ", ".join(f"#{i}" for i in a["run_ids"]),
                                "decode tok/s (mean)": figure(a["decode_tokens_per_s"]),
                                "decode vs baseline": compare(base, a["decode_rates"]).text()
                                if base and a["decode_rates"] else "no decode speed"} for a in arms]),
                 hide_index=True, width="stretch")
    st.caption("The 95% interval is Welch's t over the repeats' log speeds; where it includes 1 there is no "
               "measurable difference. Repeat a run with `--repeat N` or `--from-run ID` to narrow it.")
    for line in mixed_repeats(arms):
        st.warning(line)
with st.expander("The command that makes each run again"):
    for row in picked.itertuples():
        st.caption(f"#{row.run_id}")
        st.code(run_command(row._asdict()), language="bash")
st.page_link("pages/distances.py", label="Open the selected runs on Distances",
             query_params={"run": [str(i) for i in ids]})

from engine.report.html import runs_report  # noqa: E402 (kept beside the one button that uses it)

report_ids = sorted(ids)  # the oldest selected run is the baseline of the report's speedups
st.download_button("Download report", lambda: runs_report(store, report_ids), mime="text/html",
                   file_name=f"tokenpath-report-{'-'.join(map(str, report_ids[:8]))}.html", on_click="ignore",
                   help="One HTML file to hand over: machine and calibration, each run's settings, the five-bucket "
                        "pictures, speedups against the oldest selected run, quality, definitions. It opens "
                        "without a network.")
from engine.report.trace import trace_json  # noqa: E402

st.download_button("Download trace", lambda: trace_json(store, report_ids), mime="application/json",
                   file_name=f"tokenpath-trace-{'-'.join(map(str, report_ids[:8]))}.json", on_click="ignore",
                   help="The selected runs as a Chrome trace-event file: open it in ui.perfetto.dev or "
                        "chrome://tracing to see each step's phases, each token and the telemetry on one clock.")

c = st.columns(3)
c[0].download_button("Export CSV", csv_safe(picked[columns]).to_csv(index=False), file_name="tokenpath-runs.csv",
                     mime="text/csv")
parquet = io.BytesIO()
picked[columns].to_parquet(parquet, index=False)
c[1].download_button("Export Parquet", parquet.getvalue(), file_name="tokenpath-runs.parquet",
                     mime="application/octet-stream")
with c[2].popover("Delete selected runs"):
    st.write(f"Delete runs {', '.join(f'#{i}' for i in ids)} with all their steps, tokens and telemetry? "
             "This cannot be undone.")
    if st.button("Yes, delete them", type="primary"):
        deleted = store.delete_runs(ids)
        # a new key: the browser would otherwise keep ticking rows of the deleted selection
        st.session_state["runs_table_round"] = st.session_state.get("runs_table_round", 0) + 1
        flash(f"Deleted {deleted} run(s): {', '.join(f'#{i}' for i in ids)}.")
        st.rerun()
