"""Distances: where the time went, per token and per run, estimate against measurement."""
import json

import plotly.graph_objects as go
import streamlit as st

from engine.measure import hardware
from engine.measure.distances import BUCKETS
from engine.measure.energy import energy_sentence
from engine.report.charts import totals_chart
from ui import (LEGEND, BUCKET_MEANING, bucket_chart, log_ticks, md_escape, open_store, page_setup, run_label,
                show_calibration_verdict)

page_setup("Distances")
st.title("Latency by distance")
st.markdown("Every step's measured wall time split into five buckets that add up to it. "
            + " ".join(f"**{b}**: {BUCKET_MEANING[b]}." for b in BUCKETS))

store = open_store()
if store is None:
    st.stop()
verdict = show_calibration_verdict(store, "distances")
runs = store.runs_with_tokens(200)
if runs.empty:
    st.info("No finished runs yet: start one on Live generation.")
    st.stop()
labels = {row.run_id: run_label(row) for row in runs.itertuples()}
wanted = st.query_params.get_all("run")
default = [int(r) for r in wanted if r.isdigit() and int(r) in labels] or [int(runs["run_id"].iloc[0])]
chosen = st.multiselect("Runs", list(labels), default=default, format_func=labels.get)
if not chosen:
    st.info("Choose one or more runs.")
    st.stop()

from engine.report.trace import trace_json  # noqa: E402

st.download_button("Download trace", lambda: trace_json(store, sorted(chosen)), mime="application/json",
                   file_name=f"tokenpath-trace-{'-'.join(map(str, sorted(chosen)[:8]))}.json", on_click="ignore",
                   help="These runs as a Chrome trace-event file for ui.perfetto.dev or chrome://tracing "
                        "(also `python -m engine trace --run ID --out FILE.json`).")
st.subheader("Bucket totals per run")
totals = runs[runs["run_id"].isin(chosen)].set_index("run_id")
per_token = st.toggle("Per token (divide by the tokens each run produced)", True)
st.plotly_chart(totals_chart([labels[i] for i in totals.index], totals.reset_index().to_dict("records"), per_token),
                width="stretch")


def calibration_note(run_metrics) -> str:
    """Which calibration the run's buckets were computed with, and its flag if it has one."""
    summary = json.loads(run_metrics).get("calibration") if isinstance(run_metrics, str) else None
    if not summary:
        return "No calibration recorded with this run."
    found = hardware.find_calibration(store, summary)
    when = f"measured {found.get('measured_at') or found['created_at']} UTC" if found else "no longer stored"
    if found and found.get("reused_from"):
        when += " (reused from this machine's calibration cache)"
    note = (f"Attributed with the calibration {when}: memory {summary['memory_gbps']:.1f} GB/s, fp32 peak "
            f"{summary['matmul_gflops']['float32']:,.0f} GFLOP/s, dispatch {summary['dispatch_us']:.1f} µs.")
    in_use = verdict.calibration
    if in_use is None or summary["memory_gbps"] != in_use["memory_gbps"]:
        note += " Not the calibration in use now (see the verdict above)."
    beyond = hardware.above_peak_sentence((json.loads(run_metrics).get("peak_check") or {}).get("peak_fraction"))
    if beyond:
        note += f" Its decode read memory faster than that peak: {md_escape(beyond)}"
    return note


for run_id in chosen:
    st.subheader(md_escape(labels[run_id]))
    tokens = store.tokens(run_id)
    steps = store.steps(run_id)
    st.caption(calibration_note(totals.loc[run_id, "metrics"]))
    st.plotly_chart(bucket_chart(tokens.to_dict("records"), "Per-token buckets (ms)"), width="stretch")

    roof = go.Figure()
    roof.add_scatter(x=steps["step"], y=steps["forward_ms"], name="forward, measured", mode="lines+markers")
    roof.add_scatter(x=steps["step"], y=steps["roofline_ms"], name="roofline estimate: max(bytes/bandwidth, FLOPs/peak)",
                     mode="lines", line_dash="dash")
    roof.update_layout(xaxis_title="step (0 = prefill)", yaxis_title="ms", height=300, margin=dict(l=40, r=10, t=40, b=40),
                       legend=LEGEND, yaxis_type="log")
    roof.update_yaxes(**log_ticks([*steps["forward_ms"], *steps["roofline_ms"]]))
    roof.update_xaxes(dtick=1 if len(steps) <= 20 else None)  # steps are whole numbers
    decode = steps[steps["kind"] == "decode"]
    forward = decode["forward_ms"].sum()  # 0 for a served run: the server's forward is not timed here
    ratio = decode["roofline_ms"].sum() / forward if forward > 0 else None
    st.plotly_chart(roof, width="stretch")
    st.caption("The roofline is what the bytes and FLOPs of each forward would take at the calibrated bandwidth and "
               "peak; the gap to the measured forward is dispatch, launch and kernels running below peak "
               f"(the time bucket). Decode steps: the estimate is {ratio:.0%} of the measured forward time."
               + (f" {hardware.above_peak_sentence(ratio)}" if hardware.above_peak_sentence(ratio) else "")
               if ratio else "Only a prefill step in this run." if decode.empty else
               "The server's forward passes are not timed from the client, so there is no roofline to set beside them.")

    if steps["drafted"].sum() > 0:
        spec = go.Figure()
        spec.add_bar(x=steps["step"], y=steps["accepted"], name="drafts accepted", marker_color="#2ca02c")
        spec.add_bar(x=steps["step"], y=steps["drafted"] - steps["accepted"], name="drafts rejected",
                     marker_color="#d62728")
        spec.update_layout(barmode="stack", xaxis_title="step", yaxis_title="draft tokens", height=260,
                           margin=dict(l=40, r=10, t=40, b=40), legend=LEGEND)
        st.plotly_chart(spec, width="stretch")
        st.caption(f"Speculative decoding: {int(steps['accepted'].sum())} of {int(steps['drafted'].sum())} drafted "
                   f"tokens accepted; {steps['n_emitted'].sum() / len(steps):.2f} tokens per target forward. Rejected "
                   "drafts and their share of the verification are in the decision bucket.")

    telemetry = store.telemetry(run_id)
    if not telemetry.empty:
        tel = go.Figure()
        tel.add_scatter(x=telemetry["t_ms"], y=telemetry["cpu_percent"], name="CPU use, % of all cores", mode="lines")
        if telemetry["gpu_util_percent"].notna().any():
            tel.add_scatter(x=telemetry["t_ms"], y=telemetry["gpu_util_percent"], name="GPU utilisation %", mode="lines")
        tel.add_scatter(x=tokens["t_ms"], y=[100] * len(tokens), mode="markers", name="a token is ready",
                        marker=dict(symbol="line-ns-open", size=10))
        tel.update_layout(xaxis_title="ms since the request started", yaxis_title="%", yaxis_range=[0, 105], height=260,
                          margin=dict(l=40, r=10, t=40, b=40), legend=LEGEND)
        st.plotly_chart(tel, width="stretch")
        st.caption(f"Telemetry sampled every 100 ms; resident memory peaked at "
                   f"{telemetry['rss_bytes'].max() / 2**30:.2f} GiB.")
    if energy_sentence(totals.loc[run_id]):
        st.caption(md_escape(energy_sentence(totals.loc[run_id])))
