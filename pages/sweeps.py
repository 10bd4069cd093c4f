"""Sweeps: a grid of settings on one workload, run in order in the generation process, compared, and
read by the advisor."""
import itertools
import time

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from engine.measure.compare import compare, interleaved
from engine.report.advisor import advise, settings
from engine.report.sweeps import sweep_report, sweep_tag
from engine.measure.distances import BUCKETS
from engine.paths import workloads
from engine.model.loader import pick_device
from engine.switches.quant import available_levels
from engine.run.spec import GenConfig, RunSpec
from engine.switches.speculative import METHODS
from engine.run.worker import WorkerFailed, WorkerRefused
from engine.report.charts import LEGEND
from ui import (BUCKET_COLOURS, default_model_id, figure, md_escape, open_store, page_setup, run_in_worker,
                worker_request, whole_number_input)

page_setup("Sweeps")
st.title("Sweeps")
st.markdown("Run every combination of the chosen settings on one workload, one after another, then compare. "
            "The first setting of each list is the baseline the others are measured against.")
shipped = workloads()
device = "auto"
SPARSITY = {"dense": (0.0, "mask"), "mask 50%": (0.5, "mask"), "skip 50%": (0.5, "skip")}
SPEC = {name: dict(spec=name, **m.sweep) if name != "none" else {} for name, m in METHODS.items()}

with st.form("sweep"):
    workload = st.selectbox("Workload", list(shipped), format_func=lambda n: f"{n}: {shipped[n]['kind']}")
    c = st.columns([3, 1.4, 2, 2, 1.2, 1.2])  # the weights' chips need room for their full names
    runnable = available_levels(pick_device(device))
    levels = c[0].multiselect("Weights", runnable, default=[lv for lv in ("fp32", "int8-dyn", "int4-wo") if lv in runnable])
    kv = c[1].multiselect("KV cache", ["on", "off"], default=["on"])
    sparsities = c[2].multiselect("Sparsity (fp32 only)", ["dense", "mask 50%", "skip 50%"], default=["dense"])
    specs = c[3].multiselect("Speculative", list(SPEC), default=["none"])
    tokens = whole_number_input(c[4], "New tokens per run", 4, 512, 32)
    repeats = whole_number_input(c[5], "Repeats", 1, 10, 3, help="Each setting runs this many times, the settings "
                                       "interleaved (A B A B), so a speed ratio gets a 95% interval and a drift of the "
                                       "machine falls on every setting alike; the sweep takes this many times longer.")
    go_button = st.form_submit_button("Run the sweep", type="primary")

store = open_store()


def label(level, kv_on, sparse, spec):
    return (f"{level}, KV {kv_on}" + ("" if sparse == "dense" else f", {sparse}")
            + ("" if spec == "none" else f", {spec}"))


if go_button and store is not None:
    grid = [(lv, k, sp, sd) for lv, k, sp, sd in itertools.product(levels, kv, sparsities, specs)
            if sp == "dense" or lv == "fp32"]
    if not grid:
        st.error("Choose at least one value in every list.")
        st.stop()
    bar = st.progress(0.0, text="Starting...")
    runs, started = [], time.monotonic()
    sweep_id = time.strftime("%Y%m%d-%H%M%S")  # its runs are tagged sweep:<id>, for its report
    order = interleaved(grid, int(repeats))
    for i, (lv, k, sp, sd) in enumerate(order):
        name = label(lv, k, sp, sd)
        cfg = GenConfig(shipped[workload]["prompt"], max_new_tokens=int(tokens), kv_cache=k == "on", ignore_eos=True,
                        **SPEC[sd])
        spec = RunSpec(gen=cfg, model=default_model_id(), device=device, weights=lv, sparsity=SPARSITY[sp][0],
                       sparsity_mode=SPARSITY[sp][1], tag=sweep_tag(sweep_id))
        try:
            result = run_in_worker(worker_request(spec, store), on_wait=lambda pos: bar.progress(
                i / len(order), text=f"Waiting: {pos} generation(s) ahead."))["result"]
        except (WorkerRefused, WorkerFailed) as exc:
            st.error(md_escape(f"{name}: {exc}"))
            continue
        runs.append({"label": name, "run_id": result["run_id"], **{f"{b}_ms": result["distances_ms"][b]
                     / result["n_new_tokens"] for b in BUCKETS},
                     "decode_tokens_per_s": result["decode_tokens_per_s"], "ttft_ms": result["ttft_ms"],
                     "tokens_per_s": result["tokens_per_s"]})
        elapsed = time.monotonic() - started
        left = elapsed / (i + 1) * (len(order) - i - 1)
        bar.progress((i + 1) / len(order), text=f"{i + 1} of {len(order)} done; about {left:.0f} s left")
    st.session_state["sweep_results"] = settings(runs)
    st.session_state["sweep_id"] = sweep_id

results = st.session_state.get("sweep_results")
if results:
    frame = pd.DataFrame(results)
    st.subheader("Where each token's time went, per setting")
    fig = go.Figure()
    for b in BUCKETS:
        fig.add_bar(y=frame["label"], x=frame[f"{b}_ms"], name=b, orientation="h", marker_color=BUCKET_COLOURS[b])
    fig.update_layout(barmode="stack", xaxis_title="ms per token (all steps, prefill included)",
                      height=120 + 40 * len(frame), margin=dict(l=10, r=10, t=40, b=40), legend=LEGEND,
                      yaxis=dict(autorange="reversed"))  # the baseline, the first setting, at the top
    st.plotly_chart(fig, width="stretch")
    frame["decode vs baseline"] = [compare(results[0]["decode_rates"], r["decode_rates"]).text() for r in results]
    shown = frame.drop(columns=["decode_rates"]).rename(columns={
        "label": "setting", "run_id": "run", "decode_tokens_per_s": "decode tokens/s", "ttft_ms": "time to first token (ms)",
        "tokens_per_s": "tokens/s", **{f"{b}_ms": f"{b} (ms per token)" for b in BUCKETS}})
    st.dataframe(shown.map(lambda v: figure(v) if isinstance(v, float) else v), hide_index=True, width="stretch")
    st.caption("Figures are means over each setting's repeats; the ratio's 95% interval is Welch's t over the "
               "repeats' log speeds, and where it includes 1 there is no measurable difference.")
    st.subheader("Advisor")
    for line in advise(results, results[0]):
        st.markdown(f"- {line}")
    sweep_id = st.session_state.get("sweep_id")
    if sweep_id and store is not None:
        st.download_button("Download report", lambda: sweep_report(store, sweep_id), mime="text/html",
                           file_name=f"tokenpath-sweep-{sweep_id}.html", on_click="ignore",
                           help=f"One HTML file of this sweep's runs (sweep {sweep_id}; also "
                                f"`python -m engine report --sweep {sweep_id} --out FILE.html`).")
