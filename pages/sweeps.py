"""Sweeps: a grid of settings on one workload (engine/sweep.py), its runs in the generation process with
the settings interleaved, compared over their repeats, read by the advisor, and the command that makes it again."""
import time

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from engine.report.advisor import advise
from engine.report.sweeps import sweep_report, sweep_results
from engine.measure.compare import compare
from engine.measure.distances import BUCKETS
from engine.paths import workloads
from engine.model.loader import pick_device
from engine.switches.quant import available_levels
from engine.sweep import (KV, MAX_REPEAT, MAX_TOKENS, MIN_TOKENS, SPARSITY, SweepError, SweepSpec, speculative_methods,
                          start, stored, stored_ids)
from engine.run.worker import WorkerFailed, WorkerRefused
from engine.report.charts import LEGEND
from ui import (BUCKET_COLOURS, default_model_id, figure, md_escape, open_store, page_setup, ratio_cell,
                run_in_worker, worker_request, whole_number_input)

page_setup("Sweeps")
st.title("Sweeps")
st.markdown("Run every combination of the chosen settings on one workload, one after another, then compare. "
            "The first setting of each list is the baseline the others are measured against.")
shipped = workloads()
device = "auto"

with st.form("sweep"):
    workload = st.selectbox("Workload", list(shipped), format_func=lambda n: f"{n}: {shipped[n]['kind']}")
    c = st.columns([2, 1])  # three rows, so each list's chips read whole in a window 1024 px wide
    runnable = available_levels(pick_device(device))
    levels = c[0].multiselect("Weights", runnable, default=[lv for lv in ("fp32", "int8-dyn", "int4-wo") if lv in runnable])
    kv = c[1].multiselect("KV cache", list(KV), default=["on"])
    c = st.columns(3)
    sparsities = c[0].multiselect("Sparsity (fp32 only)", list(SPARSITY), default=["dense"],
                                  help="mask-50 zeroes half the activations; skip-50 also skips the weight rows "
                                       "they leave idle.")
    methods = c[1].multiselect("Speculative", list(speculative_methods()), default=["none"])
    users = c[2].multiselect("Users", [1, 2, 4, 8], default=[1], help="Sequences decoded together in one batch: "
                             "the weights are read once a step for all of them. More than one user needs the KV "
                             "cache on, dense and no speculative method; a batch's tokens/s are every user's.")
    c = st.columns(3)
    tokens = whole_number_input(c[0], "New tokens per run", MIN_TOKENS, MAX_TOKENS, 32)
    repeats = whole_number_input(c[1], "Repeats", 1, MAX_REPEAT, 3, help="Each setting runs this many times, the "
                                 "settings interleaved (A B A B), so a speed ratio gets a 95% interval and a drift of "
                                 "the machine falls on every setting alike; the sweep takes this many times longer.")
    go_button = st.form_submit_button("Run the sweep", type="primary")

store = open_store()

if go_button and store is not None:
    spec = SweepSpec(workload, levels, kv, sparsities, methods, users, new_tokens=int(tokens), repeat=int(repeats),
                     model=default_model_id(), device=device)
    try:
        sweep_id = start(store, spec)  # checked, then stored before its first run; its runs are tagged sweep:<id>
    except SweepError as exc:
        st.error(md_escape(str(exc)))
        st.stop()
    bar = st.progress(0.0, text="Starting...")
    order, started = spec.runs(sweep_id), time.monotonic()
    for i, (arm, run_spec) in enumerate(order):
        try:
            run_in_worker(worker_request(run_spec, store), on_wait=lambda pos: bar.progress(
                i / len(order), text=f"Waiting: {pos} generation(s) ahead."))
        except (WorkerRefused, WorkerFailed) as exc:
            st.error(md_escape(f"{arm.label}: {exc}"))
            continue
        elapsed = time.monotonic() - started
        left = elapsed / (i + 1) * (len(order) - i - 1)
        bar.progress((i + 1) / len(order), text=f"{i + 1} of {len(order)} done; about {left:.0f} s left")
    st.session_state["sweep_id"] = sweep_id

NAMES = {"label": "setting", "run_ids": "runs", "decode_tokens_per_s": "decode tokens/s (all users)",
         "ttft_ms": "time to first token (ms)", "tokens_per_s": "tokens/s",
         **{f"{b}_ms": f"{b} (ms per token)" for b in BUCKETS}}
FIGURES = ["setting", "decode tokens/s (all users)", "time to first token (ms)", "tokens/s", "repeats",
           "decode vs baseline"]  # the ratio closes the row; the runs go with the buckets, in the second table
SHORT_HEADERS = {
    "decode tokens/s (all users)": st.column_config.NumberColumn("decode tok/s", help="decode tokens per second, "
                                                                 "every user's together"),
    "time to first token (ms)": st.column_config.NumberColumn("TTFT (ms)", help="time to first token (ms)"),
    "tokens/s": st.column_config.NumberColumn("tokens/s", help="tokens per second, end to end"),
    "decode vs baseline": st.column_config.TextColumn("vs baseline", help="decode tokens per second against the first "
                                                      "setting's: the ratio of the repeats' geometric means and its 95% "
                                                      "interval (the verdicts are under the table)"),
    **{f"{b} (ms per token)": st.column_config.NumberColumn(b, help=f"the {b} bucket, ms per token") for b in BUCKETS},
}


def ratio_cells(rates: list[list[float]]) -> list[str]:
    """Each setting's decode speed against the first setting's, as a short cell; a dash where one has none."""
    return [ratio_cell(compare(rates[0], r)) if rates[0] and r else "-" for r in rates]


chosen = stored_ids(store) if store is not None else []
if chosen:
    latest = st.session_state.get("sweep_id")
    sweep_id = st.selectbox("Sweep", chosen, index=chosen.index(latest) if latest in chosen else 0,
                            help="The stored sweeps, newest first, made here or with `python -m engine sweep`.")
    st.markdown("The command that makes this sweep again (the same settings, repeats and order; add `--db FILE` "
                "for another database, `--json` for the figures as JSON):")
    st.code(stored(store, sweep_id).command(), language="bash", wrap_lines=True)
    results = sweep_results(store, sweep_id)
    if not results:
        st.info("No run of this sweep finished.")
        st.stop()
    frame = pd.DataFrame(results)
    st.subheader("Where each token's time went, per setting")
    fig = go.Figure()
    for b in BUCKETS:
        fig.add_bar(y=frame["label"], x=frame[f"{b}_ms"], name=b, orientation="h", marker_color=BUCKET_COLOURS[b])
    fig.update_layout(barmode="stack", xaxis_title="ms per token (all steps, prefill included)",
                      height=120 + 40 * len(frame), margin=dict(l=10, r=10, t=40, b=40), legend=LEGEND,
                      yaxis=dict(autorange="reversed"))  # the baseline, the first setting, at the top
    st.plotly_chart(fig, width="stretch")
    if stored(store, sweep_id).users != [1]:
        st.caption("A batch's bar is one user's time per token: each step decodes every user's token, so a user's "
                   "token takes longer while the batch's tokens per second (the table) rise; its time bucket is the "
                   "share of the steps that went to the other users' tokens and prompts.")
    frame["run_ids"] = [", ".join(f"#{i}" for i in ids) for ids in frame["run_ids"]]
    rounded = frame.map(lambda v: figure(v) if isinstance(v, float) else v).rename(columns=NAMES)
    rounded["decode vs baseline"] = ratio_cells(list(frame["decode_rates"]))
    # two tables, each whole in a window 1024 px wide: the figures compared, then where each token's time went
    st.dataframe(rounded[FIGURES], hide_index=True, width="stretch", column_config=SHORT_HEADERS)
    if len(results) > 1:  # each setting's verdict, in words
        st.markdown("  \n".join([f"Decode speed against the baseline ({md_escape(results[0]['label'])}):",
                                  *(md_escape(f"{r['label']}: {r['decode vs baseline']}") for r in results[1:])]))
    st.dataframe(rounded[["setting", *(NAMES[f"{b}_ms"] for b in BUCKETS), "runs"]], hide_index=True, width="stretch",
                 column_config=SHORT_HEADERS)
    st.caption("Figures are means over each setting's repeats; the ratio's 95% interval is Welch's t over the "
               "repeats' log speeds, and where it includes 1 there is no measurable difference. The buckets are ms "
               "per token.")
    st.subheader("Advisor")
    for line in advise(results, results[0]):
        st.markdown(f"- {line}")
    st.download_button("Download report", lambda: sweep_report(store, sweep_id), mime="text/html",
                       file_name=f"tokenpath-sweep-{sweep_id}.html", on_click="ignore",
                       help=f"One HTML file of this sweep's runs (sweep {sweep_id}; also "
                            f"`python -m engine report --sweep {sweep_id} --out FILE.html`).")
