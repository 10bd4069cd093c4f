"""Serving: load sweeps against an OpenAI-compatible server (vLLM, SGLang, llama.cpp, TGI), run in a
subprocess of their own, and the latency, throughput and server figures of every stored sweep."""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import plotly.graph_objects as go
import streamlit as st

from engine.report.trace import trace_json
from engine.serve import client as served
from engine.serve import records as served_store
from engine.report import sweep_views
from engine.serve.load import load_prompts, parse_concurrency
from engine.paths import workloads
from engine.paths import REPO_ROOT
from engine.serve.client import ServedError
from engine.serve.metrics import DEFINITIONS
from engine.report.sweeps import load_sweep_report
from ui import open_store, page_setup

page_setup("Serving")
st.title("Serving")
st.markdown("Point Tokenpath at a server that speaks the OpenAI API and measure it under load: for each "
            "concurrency level, that many streamed requests at once, until each level has sent its share. "
            "Every request is stored, so two servers or configurations can be compared below. Load goes only "
            "to the address given.")
store = open_store()
if store is None:
    st.stop()

with st.expander("What the figures mean"):
    for name, text in DEFINITIONS.items():
        st.markdown(f"**{name}**: {text}")

shipped = workloads()
with st.form("sweep"):
    c = st.columns([3, 2, 2])
    endpoint = c[0].text_input("Server address", "http://127.0.0.1:8000", help="scheme://host:port, with or without /v1")
    key_env = c[1].text_input("API key environment variable", "", help="the name of a variable set where the app "
                              "runs; the key itself is never typed here, stored or logged")
    model = c[2].text_input("Served model", "", help="blank: the first model the server lists (GET /v1/models)")
    c = st.columns(4)
    levels_text = c[0].text_input("Concurrency levels", "1,2,4,8")
    n_requests = c[1].number_input("Requests per level", 1, 1000, 8)
    new_tokens = c[2].number_input("New tokens per request", 1, 4096, 32)
    prompt_set = c[3].selectbox("Prompts", ["every shipped workload", *shipped])
    start = st.form_submit_button("Start the sweep", type="primary")


def launch(progress: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "engine", "load", "--endpoint", endpoint, "--concurrency", levels_text,
               "--requests", str(int(n_requests)), "--max-new-tokens", str(int(new_tokens)), "--db", str(store.path),
               "--progress", str(progress), "--json"]
    if prompt_set != "every shipped workload":
        command += ["--prompts", prompt_set]
    if model.strip():
        command += ["--served-model", model.strip()]
    if key_env.strip():
        command += ["--api-key-env", key_env.strip()]
    log = open(progress.with_suffix(".log"), "w")
    return subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=log)


if start:
    try:  # the quick checks here, so a mistake reads as one sentence before anything starts
        parse_concurrency(levels_text)
        load_prompts(None if prompt_set == "every shipped workload" else prompt_set)
        names = served.list_models(endpoint, key_env.strip() or None)
        if model.strip() and model.strip() not in names:
            raise ServedError(f"The server has no model '{model.strip()}'; it serves: {', '.join(names[:8])}.")
    except ServedError as exc:
        st.error(str(exc))
    else:
        progress = Path(tempfile.mkdtemp(prefix="tokenpath-load-")) / "progress.json"
        st.session_state["load"] = {"process": launch(progress), "progress": progress}


@st.fragment(run_every=1.0)
def progress_panel() -> None:
    job = st.session_state.get("load")
    if not job:
        return
    process, path = job["process"], job["progress"]
    state = json.loads(path.read_text()) if path.exists() else {"done": 0, "total": 1, "eta_s": None}
    running = process.poll() is None
    left = f", about {state['eta_s']:.0f} s left" if running and state.get("eta_s") is not None else ""
    st.progress(min(state["done"] / max(state["total"], 1), 1.0),
                text=f"{state['done']} of {state['total']} requests{left}"
                     + ("" if running else f" · sweep {state.get('sweep_id')} {state.get('status', 'ended')}"))
    if running and st.button("Stop", help="cut the requests in flight and keep every request that finished"):
        process.terminate()
    if not running:
        log = path.with_suffix(".log")
        if process.returncode not in (0, None) and log.exists() and log.read_text().strip():
            st.error(log.read_text().strip().splitlines()[-1].removeprefix("error: "))
        st.session_state.pop("load")
        st.rerun()


progress_panel()

frame = served_store.sweeps(store)
if frame.empty:
    st.info("No load sweep stored yet.")
    st.stop()
label = {r.sweep_id: f"#{r.sweep_id} {r.server_model} at {r.endpoint} · {r.status} · {r.started_at:%Y-%m-%d %H:%M}"
         for r in frame.itertuples()}
chosen = st.multiselect("Sweeps to show (the first in detail, all on the capacity curve)", list(label),
                        default=[frame["sweep_id"].iloc[0]], format_func=label.get)
if not chosen:
    st.stop()
rows = {r.sweep_id: r for r in frame.itertuples()}
levels = {label[s]: sweep_views.level_frame(rows[s].levels) for s in chosen}
first = chosen[0]
if not levels[label[first]].empty:  # the report is built when the button is pressed
    st.download_button("Download report", lambda: load_sweep_report(store, int(first)), mime="text/html",
                       file_name=f"tokenpath-load-sweep-{first}.html", on_click="ignore",
                       help=f"One HTML file of sweep #{first} (also `python -m engine report --load-sweep {first} "
                            "--out FILE.html`).")
st.download_button("Download trace", lambda: trace_json(store, sweep_ids=sorted(int(s) for s in chosen)),
                   mime="application/json", file_name=f"tokenpath-load-sweep-trace-{first}.json", on_click="ignore",
                   help="The chosen sweeps as a Chrome trace-event file for ui.perfetto.dev or chrome://tracing: a "
                        "track per request with each chunk, the server's gauges as counters (also `python -m engine "
                        f"trace --load-sweep {first} --out FILE.json`).")

st.subheader("Per level")
table = levels[label[first]]
help_for = {"ttft": "TTFT", "itl": "ITL", "tpot": "TPOT", "e2e": "E2E", "requests/s": "requests/s",
            "output tokens/s": "output tokens/s"}
columns = {col: st.column_config.NumberColumn(col, format="%.1f", help=DEFINITIONS[help_for[key]])
           for col in table.columns for key in help_for if col.startswith(key)}
columns["KV cache max"] = st.column_config.NumberColumn("KV cache max", format="percent",
                                                        help="the server's KV-cache use at its highest in the level")
st.dataframe(table, hide_index=True, width="stretch", column_config=columns)
st.caption("Client figures are measured by Tokenpath's clock; the 'server ... mean' columns are the server's own "
           "histograms (sum / count between the level's first and last scrape of /metrics).")

curve = sweep_views.capacity_curve(levels)
fig = go.Figure()
for name, part in curve.groupby("sweep", sort=False):
    fig.add_scatter(x=part["output tokens/s"], y=part["tpot p50 ms"], mode="lines+markers+text", name=name,
                    text=[f"{c} at once" for c in part["concurrency"]], textposition="top center")
fig.update_layout(title="Per-user latency against total throughput", xaxis_title="output tokens/s, all users",
                  yaxis_title="TPOT p50 (ms per token, one user)", height=380, margin=dict(l=40, r=10, t=60, b=40),
                  legend=dict(orientation="h", yanchor="bottom", y=1.02, x=0))
st.plotly_chart(fig, width="stretch")

requests = served_store.sweep_requests(store, first)
if requests.empty:
    st.info("This sweep stored no requests.")
    st.stop()
c = st.columns(2)
itl = sweep_views.itl_by_position(requests)
fig = go.Figure()
for level, part in itl.groupby("concurrency"):
    fig.add_scatter(x=part["position"], y=part["mean ms"], mode="lines", name=f"{level} at once")
fig.update_layout(title="ITL by output position (mean over requests)", xaxis_title="output chunk position",
                  yaxis_title="gap before the chunk (ms)", height=340, margin=dict(l=40, r=10, t=60, b=40))
c[0].plotly_chart(fig, width="stretch")

spans = sweep_views.timeline(requests)
fig = go.Figure()
for level, part in spans.groupby("concurrency"):
    fig.add_bar(y=part["label"], x=part["end_s"] - part["start_s"], base=part["start_s"], orientation="h",
                name=f"{level} at once", hovertext=part["status"])
fig.add_scatter(y=spans["label"], x=spans["first_s"], mode="markers", marker=dict(symbol="line-ns-open", size=10),
                name="first token")
fig.update_layout(title="Requests over time", xaxis_title="seconds since the sweep started", yaxis=dict(
    showticklabels=False, autorange="reversed"), height=340, margin=dict(l=10, r=10, t=60, b=40), barmode="overlay")
c[1].plotly_chart(fig, width="stretch")

samples = served_store.sweep_samples(store, first)
if samples.empty:
    st.caption("The server publishes no queue or KV-cache gauges on /metrics, so none are drawn.")
else:
    fig = go.Figure()
    fig.add_scatter(x=samples["t_ms"] / 1e3, y=samples["running"], name="running", mode="lines")
    fig.add_scatter(x=samples["t_ms"] / 1e3, y=samples["waiting"], name="waiting (queued)", mode="lines")
    fig.add_scatter(x=samples["t_ms"] / 1e3, y=samples["kv_cache_usage"] * 100, name="KV cache used (%)",
                    mode="lines", yaxis="y2")
    fig.update_layout(title="The server's queue and KV cache during the sweep", xaxis_title="seconds since the sweep started",
                      yaxis_title="requests", yaxis2=dict(title="KV cache %", overlaying="y", side="right", rangemode="tozero"),
                      height=320, margin=dict(l=40, r=40, t=60, b=40), legend=dict(orientation="h", yanchor="bottom", y=1.02, x=0))
    st.plotly_chart(fig, width="stretch")
failed = requests[requests["status"] != "ok"]
if not failed.empty:
    st.warning(f"{len(failed)} request(s) did not complete: " + "; ".join(sorted(set(failed["error"].dropna()))[:3]))
