"""KV-cache and memory calculator, checked against the live model's real cache."""
import json

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from engine import access
from engine.plan import kvcalc
from engine.plan import shapes
from engine.spec import GenConfig, RunSpec
from engine.run.worker import WorkerFailed, WorkerRefused
from engine.plan.kvcalc import KVCalcError, human
from ui import (LEGEND, default_model_id, log_ticks, md_escape, open_store, page_setup, run_in_worker, worker_request,
                whole_number_input)

page_setup("KV calculator")

st.title("KV-cache and memory calculator")
st.markdown(
    "Every decode step reads the whole KV cache once, so its size is a **memory distance**: bytes that must "
    "travel to the compute units for every token. Per token the cache holds "
    "`2 (K and V) x layers x kv_heads x head_dim` values (MLA: one latent of `kv_lora_rank + rope head dim` "
    "per layer; sliding-window layers keep at most the window). GB = 10^9 bytes, GiB = 2^30 bytes."
)


def both_units(column, label: str, n_bytes: float | None) -> None:
    """A metric in decimal units with the binary figure under it (the pair is too wide for one line)."""
    text = human(n_bytes)
    decimal, _, binary = text.partition(" (")
    column.metric(label, decimal)
    if binary:
        column.caption(binary.rstrip(")"))




DEFAULT_PRESET = "Llama-3.1-8B"


def read_upload(upload) -> dict:
    """An uploaded config.json, read with a size limit whatever the uploader let through."""
    return shapes.parse_json_bytes(upload.read(shapes.CONFIG_MAX_BYTES + 1), upload.name)


def pick_spec() -> kvcalc.AttentionSpec | None:
    presets = kvcalc.load_presets()
    source = st.radio("Model", ["Preset", "Custom shape", "Upload a config.json", "Project model folder"],
                      horizontal=True)
    if source == "Preset":
        names = list(presets)
        # a model that fits on common GPUs opens the page, so its first view shows both answers
        name = st.selectbox("Preset", names, index=names.index(DEFAULT_PRESET) if DEFAULT_PRESET in names else 0)
        return presets[name]
    if source == "Custom shape":
        c = st.columns(5)
        layers = whole_number_input(c[0], "Layers", value=96, step=1)
        heads = whole_number_input(c[1], "Attention heads", value=96, step=1)
        kv_heads = whole_number_input(c[2], "KV heads", value=96, step=1)
        head_dim = whole_number_input(c[3], "Head dim", value=128, step=1)
        window = whole_number_input(c[4], "Sliding window (0 = none)", value=0, step=1)
        s = kvcalc.spec(layers=layers, kv_heads=kv_heads, head_dim=head_dim, attention_heads=heads)
        return kvcalc.with_window(s, window) if window else s
    if source == "Upload a config.json":
        upload = st.file_uploader(f"A model's config.json (at most {access.UPLOAD_MB} MB)", type=["json"],
                                  max_upload_size=access.UPLOAD_MB)
        if upload is None:
            st.info("Upload a model's config.json.")
            return None
        return kvcalc.spec_from_config(read_upload(upload), name=upload.name)
    folders = kvcalc.project_model_folders()
    if not folders:
        st.info("No model folders under data/models yet: run `make` (or `python -m engine prepare`).")
        return None
    return kvcalc.spec_from_model_folder(str(folders[st.selectbox("Model folder", list(folders))]))


try:
    spec = pick_spec()
    c = st.columns(6)
    dtype = c[0].selectbox("KV precision", list(kvcalc.KV_BITS), index=2)
    group = whole_number_input(c[1], "Group size (int8/int4 scales)", value=kvcalc.DEFAULT_GROUP, step=1,
                                     disabled=dtype not in kvcalc.GROUPED)
    context = whole_number_input(c[2], "Context (tokens)", value=2048, step=256)
    batch = whole_number_input(c[3], "Batch", value=1, step=1)
    tp = whole_number_input(c[4], "Tensor-parallel GPUs", value=1, step=1)
    weight_dtype = c[5].selectbox("Weights precision", list(kvcalc.WEIGHT_BITS), index=1)
    if spec is not None:
        params = st.number_input("Parameters (for the weights' memory; 0 = unknown)",
                                 value=float(spec.params or 0), step=1e6, format="%.0f")
        spec = kvcalc.replace(spec, params=params or None)
        result = kvcalc.calculate(spec, context=int(context), dtype=dtype, batch=int(batch), tp=int(tp),
                                  group=int(group), weight_dtype=weight_dtype)
except KVCalcError as exc:
    st.error(md_escape(exc))
    st.stop()

if spec is None:
    st.stop()

st.subheader(md_escape(f"{spec.name}: {spec.kind}"))
m = st.columns(2) + st.columns(2)  # two to a row: a figure and its label read whole in a 1024 px window
m[0].metric("Values per token", f"{result['values_per_token']:,}")
both_units(m[1], "Bytes per token", result["bytes_per_token"])
both_units(m[2], f"KV cache at {int(context):,} tokens x {int(batch)}" + (" per GPU" if tp > 1 else ""),
           result["total_bytes"])
both_units(m[3], "Weights" + (" per GPU" if tp > 1 else ""), result["weights_bytes"])
st.markdown("**Formula:** `" + kvcalc.formula(spec, dtype, int(context), int(batch), int(tp), int(group)) + "`"
            + (f"  \nPer GPU: the KV heads are split over {int(tp)} GPUs." if tp > 1 else ""))

st.subheader("Against GPU memory")
gpus = pd.DataFrame(result["gpus"])
gpus["short"] = gpus["gpu"].str.replace(r"^(NVIDIA |AMD Instinct |AMD )", "", regex=True).str.replace("GeForce ", "")
fig = go.Figure()
fig.add_bar(x=gpus["short"], y=(gpus["weights_bytes"].fillna(0)) / 2**30, name="weights", marker_color="#7f7f7f")
fig.add_bar(x=gpus["short"], y=gpus["kv_bytes"] / 2**30, name="KV cache", marker_color="#1f77b4")
fig.add_scatter(x=gpus["short"], y=gpus["memory_bytes"] / 2**30, mode="markers", name="GPU memory",
                marker=dict(symbol="line-ew-open", size=40, color="#d62728", line_width=3))
fig.update_layout(barmode="stack", yaxis_title="GiB (2^30 bytes) per GPU", height=380,
                  margin=dict(l=40, r=10, t=40, b=40), legend=LEGEND)
st.plotly_chart(fig, width="stretch")
if result["weights_bytes"] is None:
    st.caption("Parameter count unknown: the bars show the KV cache alone.")
# short headers and GPU names, so every column reads whole; each header's help and the caption below say more
table = pd.DataFrame({
    "GPU": gpus["short"],
    "memory (GiB)": (gpus["memory_bytes"] / 2**30).round(1),
    "GB/s (vendor)": gpus["bandwidth_gbps"],
    "fits": gpus["fits"],
    "longest context (tokens)": gpus["longest_context"],
    "largest batch": gpus["largest_batch"],
    "KV read (ms/step)": pd.to_numeric(gpus["kv_read_ms_per_step"]).round(3),
    # all None when the parameter count is unknown: numeric NaN, shown as empty cells
    "weights read (ms/step)": pd.to_numeric(gpus["weights_read_ms_per_step"]).round(3),
})
headers = {
    "GPU": st.column_config.TextColumn("GPU", width=190),  # the longest name whole
    "GB/s (vendor)": st.column_config.NumberColumn("GB/s", help="memory bandwidth, the vendor's figure"),
    "longest context (tokens)": st.column_config.NumberColumn("context max", help="the longest context (tokens) "
                                                              "whose cache, at this batch, fits beside the weights"),
    "KV read (ms/step)": st.column_config.NumberColumn("KV read (ms)", help="the time a decode step takes to read "
                                                       "the whole KV cache once (ms per step)"),
    "weights read (ms/step)": st.column_config.NumberColumn("weights read (ms)", help="the time a decode step takes "
                                                            "to read the weights once (ms per step)"),
}
st.dataframe(table, hide_index=True, width="stretch", height=35 * (len(table) + 1) + 3,  # every GPU, no scrolling
             column_config=headers)
st.caption("Context max: the longest context (tokens) whose caches, at this batch, fit beside the weights. Largest "
           "batch: sequences of this context whose caches fit beside the weights. KV read and weights read: the time "
           "to read the whole KV cache, or the weights, once at the vendor's bandwidth, which every decode step does "
           "(ms per step).")
st.caption("Longest context is searched up to the model's own limit where the config gives one. Reading times "
           "are bytes / the vendor's peak bandwidth: a lower bound, an estimate, not a measurement.")

st.subheader("KV size against context")
presets = kvcalc.load_presets()
chosen = st.multiselect("Compare presets", list(presets), default=list(presets)[:3])
points = [2**k for k in range(7, 18)]
line = go.Figure()
for s in [spec] + [presets[n] for n in chosen if n != spec.name]:
    line.add_scatter(x=points, y=[kvcalc.kv_bytes(s, n, dtype, int(batch), int(tp), int(group)) / 2**30 for n in points],
                     name=s.name, mode="lines+markers")
line.update_layout(xaxis_type="log", yaxis_type="log", xaxis_title="context (tokens, log scale)",
                   yaxis_title=f"KV cache, GiB ({dtype}, batch {int(batch)})", height=380,
                   margin=dict(l=40, r=10, t=30, b=40), legend=dict(orientation="h", yanchor="top", y=-0.2, x=0))
line.update_xaxes(**log_ticks(points, thousands=True))
line.update_yaxes(**log_ticks([y for trace in line.data for y in trace.y]))
st.plotly_chart(line, width="stretch")

st.subheader("Checked against the live model")
st.markdown("The loaded default model's real cache after recorded runs, beside the calculator's prediction for "
            "the same context (context = prompt tokens + new tokens - 1: the last token is never fed back).")
store = open_store()
if store is not None:
    live = kvcalc.spec_from_model_folder("default")
    if st.button("Measure now (a short recorded run)"):
        spec = RunSpec(gen=GenConfig("Describe a lighthouse.", max_new_tokens=16), model=default_model_id())
        try:
            with st.spinner("Running in the generation process..."):
                run_in_worker(worker_request(spec, store))
        except (WorkerRefused, WorkerFailed) as exc:
            st.error(md_escape(str(exc)))
    runs = store.cached_runs_of(live.name, 10)
    if runs.empty:
        st.info("No recorded runs of the default model with a KV cache yet: press the button above.")
    else:
        rows = []
        for r in runs.itertuples():
            metrics = json.loads(r.metrics)
            measured = metrics.get("kv_cache_bytes")
            kv_dtype = metrics.get("kv_dtype") or {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[r.dtype]
            context_len = r.n_prompt_tokens + r.n_new_tokens - 1
            predicted = kvcalc.kv_bytes(live, context_len, kv_dtype)
            rows.append({"run": r.run_id, "cache dtype": kv_dtype, "context": context_len, "measured bytes": measured,
                         "predicted bytes": int(predicted), "equal": measured == predicted})
        st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")
