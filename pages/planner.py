"""Deployment planner: up to four configurations side by side as five-bucket estimates, with the scaling
curves, and the planner against this machine's recorded runs."""
import json
from dataclasses import replace

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from engine.plan import planner as plan
from engine.plan.kvcalc import human, project_model_folders
from engine.plan.shapes import ShapeError
from engine.measure import hardware
from ui import (LEGEND, BUCKET_COLOURS, figure, md_escape, open_store, page_setup, show_calibration_verdict,
                whole_number_input)

page_setup("Planner")

st.title("Deployment planner")
st.markdown(
    "The five distances of a token for a model on GPUs you may not have: weights and KV cache over each GPU's "
    "memory bandwidth (**memory**), FLOPs over its peak (**compute**), the tensor-parallel all-reduces and "
    "pipeline sends over the links between GPUs (**physical**: where the boards and links of a DGX become a "
    "number), fixed per-step costs (**time**) and speculative work thrown away (**decision**). Every figure "
    "here is an **estimate** from data-sheet peaks and the efficiency factors below; each configuration's "
    "formulas are one click away.")

# (label, [(model, gpu, gpus, interconnect, weights)]) the stories the presets tell
STORIES = {
    "GPT-3 175B on a DGX A100: NVSwitch against PCIe": [
        ("gpt3-175b", "a100-80gb-sxm", 8, "nvswitch", "bf16"), ("gpt3-175b", "a100-80gb-pcie", 8, "pcie", "bf16")],
    "Llama-2-70B on 2, 4 and 8 GPUs: NVLink against PCIe": [
        ("llama-2-70b", "a100-80gb-sxm", 2, "nvlink", "bf16"), ("llama-2-70b", "a100-80gb-sxm", 8, "nvlink", "bf16"),
        ("llama-2-70b", "a100-80gb-pcie", 2, "pcie", "bf16"), ("llama-2-70b", "a100-80gb-pcie", 8, "pcie", "bf16")],
    "What int8 buys on an H200": [
        ("llama-3.1-70b", "h200-141gb-sxm", 1, "nvlink", "bf16"), ("llama-3.1-70b", "h200-141gb-sxm", 1, "nvlink", "int8")],
    "70B on 8 x A100 over PCIe or 4 x H100 over NVLink": [
        ("llama-3.1-70b", "a100-80gb-pcie", 8, "pcie", "bf16"), ("llama-3.1-70b", "h100-80gb-sxm", 4, "nvlink", "bf16")],
}
WEIGHTS = list(plan.LEVEL_BITS) + ["bits per weight"]


def model_choices() -> dict[str, str]:
    """Label -> what plan.resolve_model takes: the presets, then the project's own model folders."""
    choices = {name: pid for pid, name in plan.preset_ids().items()}
    choices.update({f"{name} (data/models)": str(path) for name, path in project_model_folders().items()})
    return choices


def config_form(story: str, i: int, default: tuple, column) -> dict:
    model, gpu, gpus, link, weights = default
    choices, key = model_choices(), f"{story}-{i}"
    ids = plan.gpu_ids()
    with column:
        st.markdown(f"**Configuration {i + 1}**")
        labels = list(choices)
        name = st.selectbox("Model", labels, index=list(choices.values()).index(model), key=f"{key}-model")
        gpu_id = st.selectbox("GPU", ids, index=ids.index(gpu), key=f"{key}-gpu")
        count = whole_number_input(st, "GPUs", value=gpus, step=1, key=f"{key}-gpus")
        links = list(plan.interconnects())
        link = st.selectbox("Interconnect", links, index=links.index(link), key=f"{key}-link")
        level = st.selectbox("Weights", WEIGHTS, index=WEIGHTS.index(weights), key=f"{key}-weights")
        bits = st.number_input("Bits per weight", value=4.85, step=0.05, key=f"{key}-bits",
                               disabled=level != "bits per weight", help="for formats such as Q4_K_M (4.85)")
        tp = whole_number_input(st, "Tensor parallel (0 = all GPUs / pp)", value=0, step=1, key=f"{key}-tp")
        pp = whole_number_input(st, "Pipeline parallel", value=1, step=1, key=f"{key}-pp")
    return {"model": choices[name], "gpu": gpu_id, "gpus": count, "interconnect": link, "tp": tp or None, "pp": pp,
            "weights": "bf16" if level == "bits per weight" else level,
            "bits_per_weight": bits if level == "bits per weight" else None}


def workload_form() -> dict:
    c = st.columns(6)
    out = {"batch": whole_number_input(c[0], "Batch", value=1, step=1),
           "prompt_tokens": whole_number_input(c[1], "Prompt tokens", value=128, step=64),
           "new_tokens": whole_number_input(c[2], "New tokens", value=256, step=64),
           "kv_dtype": c[3].selectbox("KV precision", ["bf16", "fp16", "fp32", "fp8", "int8", "int4"])}
    acceptance = c[4].number_input("Speculative acceptance (0 = off)", value=0.0, step=0.05, min_value=0.0,
                                   max_value=1.0)
    out["speculative_acceptance"] = acceptance or None
    out["speculative_draft_length"] = whole_number_input(c[5], "Draft length", value=4, step=1, disabled=not acceptance)
    return out


def efficiency_form() -> plan.Efficiency:
    base = plan.Efficiency()
    with st.expander("Efficiency factors: the defaults and where each came from"):
        values = {}
        for name in ("bandwidth", "kv_bandwidth", "compute", "prefill_compute", "link", "collective_fixed_us",
                     "step_fixed_us", "host_sync_us", "host_us_per_sequence"):
            fraction = getattr(base, name) <= 1  # a share of a peak; the others are microseconds
            # a share of a peak above zero, a fixed cost not below zero: the browser refuses the rest
            values[name] = st.number_input(name, value=float(getattr(base, name)), step=0.01 if fraction else 1.0,
                                           min_value=0.01 if fraction else 0.0, max_value=1.0 if fraction else None,
                                           key=f"eff-{name}")
            st.caption(md_escape(plan.ORIGIN[name]))
        st.caption("dequant_ops " + md_escape(f"{base.dequant_ops}: {plan.ORIGIN['dequant_ops']}"))
    return replace(base, **values)


def label(result: dict) -> str:
    return f"{result['model'].split(' (')[0]} · {result['gpus']} x {result['gpu']} · {result['interconnect']}"


def build(form: dict, workload: dict, efficiency: plan.Efficiency) -> plan.Setup:
    return plan.Setup(model=plan.resolve_model(form["model"]), gpu=plan.get_gpu(form["gpu"]), gpus=form["gpus"],
                      tp=form["tp"], pp=form["pp"], interconnect=form["interconnect"], weights=form["weights"],
                      bits_per_weight=form["bits_per_weight"], efficiency=efficiency, **workload)


story = st.selectbox("Preset", list(STORIES))
answer = st.container()  # the answer first, filled once the settings below are read
st.subheader("Settings")
count = st.slider("Configurations", 1, 4, len(STORIES[story]), key=f"{story}-count")
defaults = STORIES[story] + [STORIES[story][-1]] * 4
columns = st.columns(count)
forms = [config_form(story, i, defaults[i], columns[i]) for i in range(count)]
workload = workload_form()
efficiency = efficiency_form()

results, setups = [], []
for i, form in enumerate(forms):
    try:
        setup = build(form, workload, efficiency)
        results.append(plan.plan(setup))
        setups.append(setup)
    except ShapeError as exc:
        columns[i].error(md_escape(exc))
if not results:
    st.stop()


def summary_table(results: list[dict]) -> pd.DataFrame:
    """One row per configuration, as the page shows it: a static table, which wraps its headers to the page's
    width where a data grid would hide columns behind a scroll, with each number written as it reads."""
    shown = lambda value: "-" if value is None else f"{value:,.0f}" if abs(value) >= 1000 else f"{value:g}"  # noqa: E731
    return pd.DataFrame([{
        "configuration": label(r), "weights (bits)": shown(r["bits_per_weight"]), "tp x pp": f"{r['tp']} x {r['pp']}",
        # estimates from data-sheet peaks and fitted factors: three significant digits at most
        "decode ms per token (estimate)": shown(figure(r["decode_ms_per_token"])),
        "tokens/s per user (estimate)": shown(figure(r["tokens_per_s_per_user"])),
        "tokens/s in all (estimate)": shown(figure(r["tokens_per_s_total"])),
        "prefill ms (estimate)": shown(figure(r["prefill_ms"])),
        "memory per GPU": human(r["memory_per_gpu_bytes"]), "fits": "yes" if r["fits"] else "no",
        "largest batch": shown(r["largest_batch"]),
    } for r in results]).set_index("configuration")


with answer:
    st.subheader("Side by side (estimates)")
    st.table(summary_table(results))
    for r in results:
        if not r["fits"]:
            st.warning(md_escape(f"{label(r)} does not fit: {human(r['memory_per_gpu_bytes'])} per GPU."))
    bars = go.Figure()
    for b in plan.BUCKETS:
        bars.add_bar(x=[label(r) for r in results], y=[r["distances_ms"][b] for r in results], name=b,
                     marker_color=BUCKET_COLOURS[b])
    bars.update_layout(barmode="stack", yaxis_title="ms per decode token (estimate)", height=380,
                       margin=dict(l=40, r=10, t=40, b=40), legend=LEGEND)
    st.plotly_chart(bars, width="stretch")
    for r, setup in zip(results, setups):
        with st.expander(f"Formulas: {label(r)}"):
            for bucket, formula in plan.formulas(setup).items():
                st.code(f"{bucket}: {formula}", language=None)
            st.caption(f"Speculative steps emit {r['tokens_per_step']:.2f} tokens each. Pipeline stages run one after "
                       f"another, so each GPU idles {r['pipeline_idle_fraction']:.0%} of a step.")

st.subheader("Scaling curves (estimates)")
left, right = st.columns(2)
scaling, latency = go.Figure(), go.Figure()
CURVE_COLOURS = ["#17becf", "#9467bd", "#bcbd22", "#e377c2"]  # per configuration, apart from the bucket colours


def fit_markers(rows: list[dict], colour: str) -> dict:
    """Filled where the configuration fits in GPU memory, hollow where it does not."""
    return dict(color=colour, size=9, symbol=["circle" if x["fits"] else "circle-open" for x in rows])


for r, setup, colour in zip(results, setups, CURVE_COLOURS):
    rows = plan.gpu_sweep(setup)
    scaling.add_scatter(x=[x["gpus"] for x in rows], y=[x["tokens_per_s_per_user"] for x in rows], name=label(r),
                        mode="lines+markers", line_color=colour, marker=fit_markers(rows, colour),
                        text=["" if x["fits"] else "does not fit" for x in rows])
    sweep = plan.batch_sweep(setup)
    latency.add_scatter(x=[x["tokens_per_s_total"] for x in sweep], y=[x["decode_ms_per_token"] for x in sweep],
                        text=[f"batch {x['batch']}" + ("" if x["fits"] else " (does not fit)") for x in sweep],
                        name=label(r), mode="lines+markers", line_color=colour, marker=fit_markers(sweep, colour))
scaling.update_layout(xaxis_title="GPUs (tensor parallel)", yaxis_title="tokens/s per user", height=360,
                      xaxis=dict(type="log", tickvals=[1, 2, 4, 8], ticktext=["1", "2", "4", "8"]),
                      margin=dict(l=40, r=10, t=30, b=40), showlegend=False)
latency.update_layout(xaxis_title="aggregate tokens/s", yaxis_title="ms per token per user", height=360,
                      margin=dict(l=40, r=10, t=30, b=40), legend=dict(orientation="h", y=-0.3))
left.plotly_chart(scaling, width="stretch")
right.plotly_chart(latency, width="stretch")
st.caption("Left: the physical bucket grows with the GPU count while memory shrinks. Right: one point per batch "
           "size from 1 to 256; to the right, more users share each weight read. Hollow markers: does not fit in "
           "GPU memory.")


def planned_vs_measured(store) -> pd.DataFrame:
    runs = store.plain_decode_runs(8)
    rows = []
    for run in runs.to_dict("records"):
        calibration = json.loads(run["metrics"] or "{}").get("calibration")
        if not calibration:
            continue
        try:
            predicted = plan.plan_for_run(run, calibration)
        except ShapeError:
            continue
        cached = calibration["cache_read"] if predicted["from_cache"] else None
        rows.append({"run": run["run_id"], "model": run["model"], "weights": run["weights"] or run["dtype"],
                     "measured TPOT ms": round(run["tpot_ms"], 2),
                     "planned ms (estimate)": round(predicted["decode_ms_per_token"], 2),
                     "planned / measured": round(predicted["decode_ms_per_token"] / run["tpot_ms"], 3),
                     "planned memory ms (estimate)": round(predicted["distances_ms"]["memory"], 2),
                     "weights read from": "last-level cache" if cached else "memory",
                     "read GB/s planned (estimate)": round(predicted["read_gbps"], 1),
                     "µs per product": round(cached["matvec_call_us"] if cached else
                                             calibration.get("matvec_call_us", 0.0), 1)})
    return pd.DataFrame(rows)


st.subheader("On this machine: planned against measured")
st.markdown("The planner with the calibration each run was attributed with (the bandwidth the decode's own "
            "matrix-vector kernel reached on cold weights, or where a step's bytes stay in the last-level cache, the "
            "rate the calibration read such weights there, between its reads of half the cache and of all of it; the "
            "time each such product "
            "takes beyond its bytes; matmul peaks and the integer levels' own rates; dispatch cost) and the run's "
            "own model, precision and lengths, beside the run's measured time per output token.")
store = open_store()
if store is not None:
    show_calibration_verdict(store, "planner")
    table = planned_vs_measured(store)
    if table.empty:
        st.info("No recorded local runs yet: generate one on the Live page or with `python -m engine generate`.")
    else:
        st.dataframe(table, hide_index=True, width="stretch")
        # only the memory term is bytes over a calibrated peak: a plan slower than its run in its other terms says
        # nothing about the calibration
        memory_share = table["planned memory ms (estimate)"] / table["measured TPOT ms"]
        beyond = hardware.above_peak_sentence(memory_share.max())
        if beyond:
            st.warning(f"A run's planned memory time, its bytes at the calibrated rate, against its measured time per "
                       f"token: {md_escape(beyond)} A low calibration plans slower decodes than the machine runs.")


def preset_choice(column, key: str) -> str:
    """A preset model id, Llama-3.1-8B first chosen."""
    presets = list(plan.preset_ids())
    return column.selectbox("Model", presets, index=presets.index("llama-3.1-8b"), key=key)


def answered_section(title: str, text: str):
    """A section's title and explanation, and the place for its answer above the form that follows."""
    st.subheader(title)
    st.markdown(text)
    return st.container()


answer = answered_section(
    "Capacity: how many requests a second at a latency target (estimates)",
    "Requests arrive at random (Poisson); a simulated engine batches them continuously while KV memory lasts, each "
    "step lasting what the planner's five buckets say at that batch. The capacity is the highest rate at which every "
    "metric's 99th percentile meets its target; the table lists each configuration (GPUs tensor-parallel), cheapest "
    "for the target rate first.")
with st.form("capacity"):
    c = st.columns(4)
    cap_model = preset_choice(c[0], "cap-model")
    cap_gpus = c[1].multiselect("GPUs", plan.gpu_ids(), default=["h100-80gb-sxm", "a100-80gb-sxm"], key="cap-gpu")
    cap_counts = c[2].multiselect("GPU counts", [1, 2, 4, 8], default=[1, 2], key="cap-counts")
    cap_weights = c[3].selectbox("Weights", list(plan.LEVEL_BITS), index=list(plan.LEVEL_BITS).index("bf16"),
                                 key="cap-weights")
    c = st.columns(5)
    cap_prompt = whole_number_input(c[0], "Prompt tokens (mean)", value=512, step=64, key="cap-prompt")
    cap_new = whole_number_input(c[1], "Output tokens (mean)", value=128, step=32, key="cap-new")
    cap_slo = c[2].text_input("SLO (ms)", value="ttft_ms=1000,tpot_ms=50", key="cap-slo")
    cap_target = c[3].number_input("Target requests/s", value=50.0, step=5.0, key="cap-target")
    cap_price = c[4].number_input("$ per GPU-hour (0 = data/gpu_prices.json)", value=0.0, step=0.1, key="cap-price")
    submitted = st.form_submit_button("Plan capacity")
if submitted:
    from engine.measure import slo as slos
    from engine.plan import capacity as cap
    from engine.plan import simulate as sim

    try:
        base = plan.Setup(model=plan.resolve_model(cap_model), gpu=plan.get_gpu(cap_gpus[0] if cap_gpus else "l4"),
                          weights=cap_weights, kv_dtype="fp8" if cap_weights in ("fp8", *plan.FP4) else "bf16",
                          prompt_tokens=cap_prompt, new_tokens=cap_new)
        if not cap_gpus or not cap_counts:
            raise ShapeError("Choose at least one GPU type and one GPU count.")
        with st.spinner("Simulating each configuration at rising request rates..."):
            found = cap.compare(base, cap_gpus, sorted(cap_counts),
                                sim.Workload(requests=100, prompt_tokens=cap_prompt, new_tokens=cap_new),
                                sim.Scheduler(), slos.parse_slo(cap_slo), 99, None, 1, cap_target, cap_price or None,
                                interconnect=lambda g: "nvlink" if g["gpu_link"]["gbps_per_direction"] else "pcie")
    except (ShapeError, slos.SLOError) as exc:
        answer.error(md_escape(exc))
    else:
        best = found["configurations"][0]
        answer.success(md_escape(
            f"Cheapest for {cap_target:g} requests/s: {best['gpus_for_target']} x {best['gpu']} "
            f"({best['replicas_for_target']} replicas of {best['gpus_per_instance']}), "
            f"${best['usd_per_hour_for_target']:.2f} per hour. One replica holds {best['capacity_requests_per_s']:.1f} "
            f"requests/s; " + (f"{best['limiting_metric']} fails first" if best["limiting_metric"] != "throughput"
                               else "the SLO holds until the engine saturates")
            + f", with the {best['limiting_bucket']} distance the largest part of a token's time (estimates)."))
        answer.dataframe(pd.DataFrame([{
            "configuration": f"{r['gpus_per_instance']} x {r['gpu']}",
            "capacity req/s (estimate)": round(r["capacity_requests_per_s"], 2),
            "output tokens/s (estimate)": round(r["output_tokens_per_s"]),
            "GPUs for the target": r["gpus_for_target"], "$ per hour for the target": round(r["usd_per_hour_for_target"], 2),
            "$ per million output tokens (estimate)": round(r["usd_per_million_output_tokens"], 4),
            "$ per million input tokens (estimate)": round(r["usd_per_million_input_tokens"], 4),
            "J per output token (estimate)": round(r["joules_per_output_token"], 4),
            "what ends capacity": f"{r['limiting_metric']} ({r['limiting_bucket']})",
            **{f"{b} ms per token (estimate)": round(v, 3) for b, v in r["distances_ms_per_token"].items()},
        } for r in found["configurations"]]), hide_index=True, width="stretch")
        for s in found["skipped"]:
            answer.caption(md_escape(f"Not planned: {s['gpus']} x {s['gpu']}: {s['why']}"))


split_answer = answered_section(
    "Prefill/decode disaggregation: the same GPUs in two pools (estimates)",
    "Prompts on a prefill pool, decoding on a decode pool, each request's KV cache sent between them over the link "
    "you choose (**physical** distance: NVLink inside a node, InfiniBand or Ethernet between nodes); against the same "
    "GPUs co-located, each prefilling and decoding. TTFT pays the transfer; TPOT no longer shares its steps with "
    "prompts. Also `python -m engine plan ... --rate R --disaggregate P:D --link L`.")
with st.form("disaggregate"):
    c = st.columns(4)
    dis_model = preset_choice(c[0], "dis-model")
    dis_gpu = c[1].selectbox("GPU", plan.gpu_ids(), index=plan.gpu_ids().index("h100-80gb-sxm"), key="dis-gpu")
    dis_link = c[2].selectbox("Link between the pools", list(plan.interconnects()),
                              index=list(plan.interconnects()).index("infiniband"), key="dis-link")
    dis_rate = c[3].number_input("Requests/s", value=4.0, step=0.5, key="dis-rate")
    c = st.columns(4)
    dis_prefill = whole_number_input(c[0], "Prefill GPUs", value=1, step=1, key="dis-prefill")
    dis_decode = whole_number_input(c[1], "Decode GPUs", value=1, step=1, key="dis-decode")
    dis_prompt = whole_number_input(c[2], "Prompt tokens", value=2048, step=256, key="dis-prompt")
    dis_new = whole_number_input(c[3], "Output tokens", value=256, step=32, key="dis-new")
    split = st.form_submit_button("Compare")
if split:
    from engine.plan import disaggregate as dis
    from engine.plan import simulate as sim

    try:
        setup = plan.Setup(model=plan.resolve_model(dis_model), gpu=plan.get_gpu(dis_gpu), prompt_tokens=dis_prompt,
                           new_tokens=dis_new)
        with st.spinner("Simulating both pools and the co-located GPUs..."):
            found = dis.disaggregate(setup, sim.Workload(requests=200, rate=dis_rate, prompt_tokens=dis_prompt,
                                                         new_tokens=dis_new), sim.Scheduler(), dis_prefill,
                                     dis_decode, dis_link)
    except ShapeError as exc:
        split_answer.error(md_escape(exc))
    else:
        co, dg = found["colocated"], found["disaggregated"]
        split_answer.success(md_escape(
            f"Disaggregated TTFT p50 {dg['ttft_ms_p50']:.1f} ms against {co['ttft_ms_p50']:.1f} ms co-located; TPOT "
            f"p50 {dg['tpot_ms_p50']:.2f} ms against {co['tpot_ms_p50']:.2f} ms. Each request's KV cache "
            f"({human(found['kv_bytes_per_request'])}) crosses {found['link']} in {found['kv_transfer_ms']:.3f} ms "
            "(estimates)."))
        split_answer.dataframe(pd.DataFrame([
            {"GPUs": name, **{f"{k[:4].upper()} {k[-3:]} ms (estimate)": round(pool[k], 2)
                              for k in ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99")}}
            for name, pool in ((f"{co['gpus']} co-located", co),
                               (f"{found['prefill_gpus']} prefill + {found['decode_gpus']} decode", dg))]),
            hide_index=True, width="stretch")
