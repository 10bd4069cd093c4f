"""Live generation: every switch, tokens streaming in coloured by latency, buckets growing live."""
import html
import statistics
import time
from dataclasses import asdict

import streamlit as st

from engine.generate import KV_DTYPES, MAX_NEW_TOKENS_CAP, GenConfig, GenerationError
from engine.models import workloads
from engine.quant import INT4_GROUPS, LEVELS
from engine.sparsity import MODES
from engine.speculative import MAX_GUESSES, MAX_K, MAX_WINDOW, METHODS
from engine.worker import WorkerFailed, WorkerRefused
from ui import (bucket_chart, default_model_id, generation_queue, generation_worker, level_table, live_bars,
                open_store, page_setup)

page_setup("Live generation")
# On a rerun (Generate) Streamlit fades the last run's elements out over 1.5 s, an animation the browser
# draws frame by frame while the model's first tokens run: without it the page's side used 10 ms of CPU
# per second of a 128-token decode instead of 22 (bench/ui.py's PageCpu, drawing at the end only).
st.html("<style>[data-stale=true]{transition:none !important}</style>")
st.title("Live generation")

LIVE_HELP = ("Every redraw costs the browser and the server CPU time that the model shares on a small machine: "
             "about 35 ms on a 2-core CPU, 25 ms of it Streamlit's own update. Decode speed against the command "
             "line there (bench/ui.py, medians of 24 rounds): every second 0.95, every 2 seconds 0.94-0.98, at "
             "the end only 0.96-0.99. At the end only: a progress note every 5 s, the text and charts when the "
             "run ends.")
# how often the page redraws the streaming text and buckets (seconds; None: only when the run ends)
REDRAWS = {"every second": 1.0, "every 2 seconds": 2.0, "every 5 seconds": 5.0, "at the end only": None}
shipped = workloads()
choice = st.selectbox("Prompt", ["(write my own)"] + list(shipped),
                      format_func=lambda n: n if n not in shipped else f"workload: {n} ({shipped[n]['kind']})")
with st.form("live"):
    prompt = st.text_area("Prompt text", shipped[choice]["prompt"] if choice in shipped else
                          "Explain in two sentences why a KV cache speeds up text generation.", height=140)
    c = st.columns(4)
    model_id = c[0].text_input("Model", default_model_id(), help="'default', a local folder or a Hugging Face id")
    device = c[1].selectbox("Device", ["auto", "cpu", "cuda", "mps"])
    max_new = c[2].number_input("Max new tokens", 1, MAX_NEW_TOKENS_CAP, 64)
    kv_cache = c[3].toggle("KV cache", True, help="Off: every step recomputes the whole sequence.")
    c = st.columns(4)
    level = c[0].selectbox("Weights", LEVELS)
    group = c[1].selectbox("int4 group size", INT4_GROUPS)
    target = c[2].slider("Activation sparsity", 0.0, 0.9, 0.0, 0.05)
    mode = c[3].selectbox("Sparsity mode", [*MODES, "2:4"], help="mask: zero small inputs, dense matmul; "
                          "skip: never read their weights; 2:4: prune 2 of every 4 weights (NVIDIA GPUs, bf16/fp16)")
    c = st.columns(4)
    temperature = c[0].number_input("Temperature (0 = greedy)", 0.0, 5.0, 0.0, 0.1)
    top_p = c[1].number_input("Top-p", 0.01, 1.0, 1.0, 0.05)
    top_k = c[2].number_input("Top-k (0 = off)", 0, 1000, 0)
    seed = c[3].number_input("Seed", 0, 2**31 - 1, 0)
    c = st.columns(4)
    spec = c[0].selectbox("Speculative decoding", METHODS, help="Greedy only: drafts are checked by one target "
                          "forward, so the output equals plain greedy's.")
    draft_model = c[1].text_input("Draft model (for draft)", "self-int8",
                                  help="self-int8, self-exit:K (the first K layers), or a model id or folder")
    spec_k = c[2].number_input("Draft length K", 1, MAX_K, 4)
    adaptive = c[3].toggle("Adaptive", False, help="Grow K after full acceptance, shrink it after a rejection; "
                           "pause guessing while it costs more per token than plain steps.")
    c = st.columns(4)
    max_ngram = c[0].number_input("N-gram size", 2, 6, 3, help="Prompt lookup: the longest n-gram matched. "
                                  "Lookahead: N, the length of the n-grams it collects and verifies.")
    window = c[1].number_input("Lookahead window W", 1, MAX_WINDOW, 4,
                               help="Columns of guesses refined in parallel, each a Jacobi trajectory.")
    guesses = c[2].number_input("Lookahead guesses G", 1, MAX_GUESSES, 4,
                                help="At most this many collected n-grams verified per step.")
    kv_dtype = c[3].selectbox("KV-cache precision", list(KV_DTYPES),
                              help="auto: the weights' compute dtype. bf16/fp16 halve the cache's bytes beside "
                                   "fp32 weights; attention then runs in that precision.")
    c = st.columns(2)
    baseline = c[0].checkbox("Run the fp32 greedy baseline too, on the same prompt, and compare")
    redraw_s = REDRAWS[c[1].selectbox("Draw the tokens while they stream", list(REDRAWS), index=1, help=LIVE_HELP)]
    submitted = st.form_submit_button("Generate", type="primary")
with st.expander("Weight precision levels on this device: which kernel runs each"):
    st.table(level_table(device).set_index("level"))
    st.caption("Accelerated: the kernel reads the low-bit weights directly, so fewer bytes cross from memory. "
               "Emulated: low-bit weights are stored but expanded to 16/32 bits on every forward, so memory "
               "shrinks but speed does not improve. On a CPU, 16-bit levels can be slower than fp32 when the "
               "arithmetic costs more than the bytes save. Sparsity: mask zeroes small inputs but still reads "
               "every weight; skip never reads the weights of zeroed inputs (CPU, fp32).")


def coloured_tokens(tokens: list[dict], hidden: set[int], per_token: bool = True) -> str:
    """Token pieces as HTML, each shaded by how long it took (darker = slower than the median; hover
    for milliseconds); special tokens (end of turn) are left out. Not per_token (while a run
    streams): five shades, neighbours of one shade in one element and no hover values, so that each
    redraw gives the browser a few dozen elements to lay out instead of one per token."""
    if not tokens:
        return ""
    median = statistics.median(t["gap_ms"] for t in tokens) or 1.0
    runs = []  # [shade, hover title, text]
    for t in tokens:
        if t["token_id"] in hidden:
            continue
        heat = min(max(t["gap_ms"] / median - 1.0, 0.0), 2.0) / 2.0
        if per_token:
            runs.append([heat, f' title="{t["gap_ms"]:.1f} ms"', t["piece"]])
            continue
        shade = round(heat * 4) / 4
        if runs and runs[-1][0] == shade:
            runs[-1][2] += t["piece"]
        else:
            runs.append([shade, "", t["piece"]])
    spans = "".join(f'<span{title} style="background: rgba(255, 127, 14, {0.08 + 0.6 * heat:.2f}); border-radius: 3px">'
                    f'{html.escape(text)}</span>' for heat, title, text in runs)
    return f'<div style="font-family: monospace; white-space: pre-wrap; line-height: 1.7">{spans}</div>'


def summary(result: dict, steps: list[dict]) -> dict:
    decode = [s for s in steps if s["kind"] == "decode"]
    per_token_bytes = statistics.mean(s["weight_bytes"] + s["kv_read_bytes"] + s["kv_write_bytes"]
                                      for s in decode) if decode else None
    figures = {"TTFT": f"{result['ttft_ms']:.0f} ms", "TPOT": f"{result['tpot_ms']:.1f} ms" if result["tpot_ms"] else "n/a",
            "Tokens/s": f"{result['tokens_per_s']:.1f}",
            "KV cache": f"{result['kv_cache_bytes'] / 2**20:.2f} MiB",
            "Bytes per token (accounted)": f"{per_token_bytes / 1e6:.0f} MB" if per_token_bytes else "n/a",
            "Roofline estimate / measured forward": f"{result['roofline_ratio_decode']:.0%}" if result["roofline_ratio_decode"] else "n/a"}
    spec = result.get("speculative")
    if spec:
        figures["Acceptance"] = f"{spec['acceptance_rate']:.0%}" if spec["acceptance_rate"] is not None else "n/a"
        figures["Tokens per target forward"] = f"{spec['tokens_per_target_forward']:.2f}"
    return figures


# Streamlit's running-man icon redraws several times a second, costing the browser about 40 ms of CPU a
# second that the model, on the same cores, loses; while a run streams, the page shows its own progress.
HIDE_RUNNING_ICON = "<style>[data-testid=stStatusWidgetRunningIcon]{display:none}</style>"
STREAMING_NOTE = '<div style="font-size:0.8rem;color:#666">Generating: {n} of at most {limit} tokens so far{rest}</div>'
QUIET_NOTE = " (text and charts appear when the run ends)"


def stream(request: dict, label: str, redraw_s: float | None, started: dict) -> dict:
    """Run one request in the generation process, drawing text and buckets every redraw_s seconds,
    or with redraw_s None only a progress note until the end; returns the run's summary. The run's
    number goes into started["run_id"] as soon as it is known; started["streaming"] is true until
    the run is closed."""
    st.html(HIDE_RUNNING_ICON)
    st.markdown(f"**{label}**")
    live_box = st.empty()
    tokens = []
    limit = request["config"]["max_new_tokens"]
    # drawn now, with the rest of the page, rather than on the run's first steps
    live_box.html(STREAMING_NOTE.format(n=0, limit=limit, rest="" if redraw_s else QUIET_NOTE))
    # at the end only: a short note every few seconds, which also lets a Stop click end the run
    run = generation_worker().generate(request, every_s=redraw_s or 5.0,
                                       on_run_id=lambda run_id: started.update(run_id=run_id))
    started["streaming"] = True
    try:
        kind, ready = next(run)
        if kind == "preparing":  # a model or variant is loading
            with st.spinner(f"Loading {request['model']} at {request['level']} (first time only) and prefilling..."):
                _, ready = next(run)
        special = set(ready["special_ids"])
        for kind, payload in run:
            if kind == "done":
                done = payload
                break
            tokens.extend(payload)
            note = STREAMING_NOTE.format(n=len(tokens), limit=limit, rest="" if redraw_s else QUIET_NOTE)
            # one raw-HTML element for text, bars and note: each element update costs the browser a redraw
            live_box.html((coloured_tokens(tokens, special, per_token=False) + live_bars(tokens) + note)
                          if redraw_s else note)
    finally:
        run.close()  # a page rerun (Stop) ends the run here: it is recorded as cancelled
        started["streaming"] = False
    with live_box.container():
        st.html(coloured_tokens(done["tokens"], special))
        st.plotly_chart(bucket_chart(done["tokens"]), width="stretch", key=f"{label}-final")
    items = list(summary(done["result"], done["steps"]).items())
    for start in range(0, len(items), 4):  # four to a row: six side by side cut their values short
        for col, (name, value) in zip(st.columns(4), items[start:start + 4]):
            col.metric(name, value)
    st.caption(f"Run #{done['run_id']}, stopped by {done['stop_reason']}. Token shading: darker took longer than "
               "the median token (hover for milliseconds). Memory and compute are roofline estimates; the step "
               "times are measured.")
    return done


def last_run(started: dict, timeout_s: float = 15.0) -> int | None:
    """The number of the run this session started last, once its stream is closed (and the run
    recorded as ended). Streamlit starts the rerun that a Stop click causes while the stopped run
    is still being closed in the old script thread, which may not even have its number yet."""
    deadline = time.monotonic() + timeout_s
    while started.get("streaming") and time.monotonic() < deadline:
        time.sleep(0.1)
    return started.pop("run_id", None)


def tokens_said(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


store = open_store()
stop_clicked = st.session_state.pop("stop_clicked", False)
# the run this session started last: a plain dict that stream() and the worker's generator fill without
# touching st.session_state, where every access is a point at which a Stop click's rerun interrupts
started = st.session_state.setdefault("started_run", {})
last = last_run(started)
if last is not None and not submitted and store is not None:
    row = store.run(last)
    if row and row["status"] == "cancelled":
        st.warning(f"Run #{last} was stopped and is kept as cancelled ({tokens_said(row['n_new_tokens'])}).")
    elif row and stop_clicked and row["status"] == "ok":
        st.info(f"Run #{last} had already finished when Stop was clicked ({tokens_said(row['n_new_tokens'])}); "
                "it is kept as ok: see it on the Runs and Distances pages.")

if submitted and store is not None:
    cfg = GenConfig(prompt=prompt, max_new_tokens=int(max_new), kv_cache=kv_cache, temperature=float(temperature),
                    top_p=float(top_p), top_k=int(top_k), seed=int(seed), spec=spec, spec_k=int(spec_k),
                    adaptive=adaptive, draft_model=draft_model.strip() or None, max_ngram=int(max_ngram),
                    window=int(window), guesses=int(guesses), kv_dtype=kv_dtype)
    try:
        cfg.check()
    except GenerationError as exc:
        st.error(str(exc))
        st.stop()
    request = {"db": str(store.path), "model": model_id.strip() or "default", "device": device, "level": level,
               "group": int(group), "sparsity": float(target), "sparsity_mode": mode, "config": asdict(cfg)}
    waiting = st.empty()
    st.button("Stop", help="Ends the run now; it is kept as cancelled.",
              on_click=lambda: st.session_state.update(stop_clicked=True))
    with generation_queue().turn(lambda pos: waiting.info(f"Waiting for the device: {pos} generation(s) ahead.")):
        waiting.empty()
        try:
            done = stream(request, "This run", redraw_s, started)
            if baseline:
                base = {**request, "level": "fp32", "sparsity": 0.0, "sparsity_mode": "mask",
                        "config": asdict(GenConfig(prompt=prompt, max_new_tokens=int(max_new)))}
                ref = stream(base, "Baseline: fp32, greedy, KV cache on, dense", redraw_s, started)
                if ref["result"]["tpot_ms"] and done["result"]["tpot_ms"]:
                    st.metric("Speedup in decode (baseline TPOT / this run's TPOT)",
                              f"{ref['result']['tpot_ms'] / done['result']['tpot_ms']:.2f}x")
        except (WorkerRefused, WorkerFailed) as exc:  # one sentence; a failed run is recorded with status error
            st.error(str(exc))
