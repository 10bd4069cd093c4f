"""Live generation: every switch, tokens streaming in coloured by latency, buckets growing live."""
import html
import statistics
import time

import pandas as pd
import streamlit as st

from engine.measure import hardware
from engine.report.definitions import METRICS, SERVED_METRICS
from engine.switches.drafters import MAX_GUESSES, MAX_K, MAX_WINDOW
from engine.dtypes import KV_CHOICES
from engine.paths import workloads
from engine.plan.planner import gpu_ids
from engine.switches.quant import INT4_GROUPS, LEVELS
from engine.switches.sparsity import ALL_MODES
from engine.spec import DEFAULTS as SPEC
from engine.spec import LIMITS, GenConfig, GenerationError, RunSpec
from engine.switches.speculative import METHODS
from engine.run.worker import WorkerFailed, WorkerRefused
from ui import (bucket_chart, default_model_id, generation_queue, generation_worker, level_table, live_bars,
                md_escape, open_store, page_setup, setting_input, show_calibration_verdict, show_warm_up, warm_up,
                warm_up_words, worker_request, whole_number_input)

page_setup("Live generation")
# On a rerun (Generate) Streamlit fades the last run's elements out over 1.5 s, an animation the browser
# draws frame by frame while the model's first tokens run on the same cores.
st.html("<style>[data-stale=true]{transition:none !important}</style>")
st.title("Live generation")
store = open_store()  # once a rerun: opening checks the schema and folds in dead runs, which a click waits for
verdict_slot = st.empty()  # drawn again after a run, which may have calibrated this device or beaten its peak
with verdict_slot.container():
    show_calibration_verdict(store, "live")
show_warm_up()

LIVE_HELP = ("Every redraw costs the browser and the server CPU time that the model shares on a small machine, so "
             "drawing less often leaves more of it to the model (bench/ui.py measures what each choice costs). "
             "At the end only: a progress note every 5 s, the text and charts when the run "
             "ends.")
# how often the page redraws the streaming text and buckets (seconds; None: only when the run ends)
LOCAL_METRICS = dict(METRICS)
REDRAWS = {"every second": 1.0, "every 2 seconds": 2.0, "every 5 seconds": 5.0, "at the end only": None}
USERS = [n for n in (1, 2, 4, 8, 16) if LIMITS["users"].low <= n <= LIMITS["users"].high]
USERS_HELP = ("Sequences decoded together: your prompt beside prompts from the workloads, each step reading the "
              "weights once for all of them, so each token carries a share of that trip. Speculative decoding and "
              "sparsity decode one sequence at a time.")
BATCH_HELP = {"Tokens/s per user, end to end": "Each sequence's tokens over its own time from request to last token "
                                                 "(its prefill and its wait for the others' included), averaged over "
                                                 "the users; the decode rates alone are in the table below.",
              "Tokens/s in total, end to end": "Every sequence's tokens over the batch's wall time, from the first "
                                               "request to the last token, prefills included.",
              "Bytes per decode token, all users": "Weights, KV reads and KV writes per decode token of every user: "
                                                   "each token's share of its step's weights plus its own cache.",
              "Your TTFT": "Time to your sequence's first token, prefills of the others' prompts included."}
shipped = workloads()
# the form's defaults: the run specification's own (engine.spec.DEFAULTS), under the page's names
DEFAULTS = {"model": default_model_id(), "device": SPEC["device"], "max_new": SPEC["max_new_tokens"],
            "group": SPEC["group_size"], "mode": SPEC["sparsity_mode"], "temperature": SPEC["temperature"],
            "top_p": SPEC["top_p"], "top_k": SPEC["top_k"], "seed": int(LIMITS["seed"].low), "draft_model": "self-int8",
            "speculative_k": SPEC["speculative_k"], "adaptive": SPEC["adaptive"], "max_ngram": SPEC["max_ngram"],
            "window": SPEC["window"], "guesses": SPEC["guesses"], "kv_dtype": SPEC["kv_dtype"],
            "redraw": "every 2 seconds"}
where = st.radio("Where the model runs", ["this machine", "a server"], horizontal=True,
                 help="A server: any OpenAI-compatible endpoint (vLLM, SGLang, llama.cpp's server, TGI), measured from "
                      "this client through its streaming API and, where it has one, its /metrics.")
served = where == "a server"
choice = st.selectbox("Prompt", ["(write my own)"] + list(shipped),
                      format_func=lambda n: n if n not in shipped else f"workload: {n} ({shipped[n]['kind']})")
with st.form("live"):
    prompt = st.text_area("Prompt text", shipped[choice]["prompt"] if choice in shipped else
                          "Explain in two sentences why a KV cache speeds up text generation.", height=120)
    if served:
        c = st.columns(4)
        endpoint = c[0].text_input("Server URL", "http://127.0.0.1:8000", help="The server's base URL; "
                                   "python -m engine serve-vllm starts vLLM on this machine.")
        served_model = c[1].text_input("Server model name", "", help="Blank: the first model GET /v1/models lists.")
        gpu = c[2].selectbox("The server's GPU", ["(not named)"] + gpu_ids(), help="Named, the planner splits the "
                             "server's work into memory and compute (an estimate); not named, it stays one figure.")
        api_key_env = c[3].text_input("API key variable", "", help="The name of an environment variable of this "
                                      "dashboard's process that holds the key; the key itself is never stored.")
        st.caption("KV cache, weight precision, speculative decoding and sparsity are the server's own settings.")
    # the four switches the product is about; everything else is one click away
    kv_cache, level, speculative, target, users = True, "fp32", "none", 0.0, 1  # a server has its own
    if not served:
        c = st.columns(5)
        kv_cache = c[0].toggle("KV cache", True, help="Off: every step recomputes the whole sequence.")
        level = c[1].selectbox("Weight precision", list(LEVELS), help="; ".join(f"{n}: {lv.help}" for n, lv in LEVELS.items()))
        speculative = c[2].selectbox("Speculative decoding", list(METHODS),
                                     help="; ".join(f"{n}: {m.help}" for n, m in METHODS.items()))
        target = c[3].slider("Activation sparsity", LIMITS["sparsity"].low, LIMITS["sparsity"].high, SPEC["sparsity"], 0.05, help="The share of each layer's inputs set "
                             "to zero; the mode (under More settings) decides whether their weights are still read.")
        users = c[4].selectbox("Users", USERS, help=USERS_HELP)
    with st.expander("More settings"):
        c = st.columns(4)
        model_id = c[0].text_input("Model", DEFAULTS["model"], help="'default', a local folder or a Hugging Face id")
        device = c[1].selectbox("Device", ["auto", "cpu", "cuda", "mps"])
        max_new = setting_input(c[2], "Max new tokens", "max_new_tokens")
        kv_dtype = c[3].selectbox("KV-cache precision", list(KV_CHOICES),
                                  help="auto: the weights' compute dtype. bf16/fp16 halve the cache's bytes beside "
                                       "fp32 weights; on the CPU's kernels attention runs in float32 over the "
                                       "rounded values, elsewhere in that precision.")
        c = st.columns(4)
        group = c[0].selectbox("int4 group size", INT4_GROUPS)
        mode = c[1].selectbox("Sparsity mode", ALL_MODES, help="mask: zero small inputs, dense matmul; "
                              "skip: never read their weights; 2:4: prune 2 of every 4 weights (NVIDIA GPUs, bf16/fp16)")
        temperature = setting_input(c[2], "Temperature (0 = greedy)", "temperature", step=0.1)
        top_p = setting_input(c[3], "Top-p", "top_p", step=0.05)
        c = st.columns(4)
        top_k = setting_input(c[0], "Top-k (0 = off)", "top_k")
        seed = setting_input(c[1], "Random seed (when sampling)", "seed", value=DEFAULTS["seed"])
        draft_model = c[2].text_input("Draft model (for draft)", DEFAULTS["draft_model"],
                                      help="self-int8, self-exit:K (the first K layers), or a model id or folder")
        speculative_k = whole_number_input(c[3], "Draft length K", 1, MAX_K, DEFAULTS["speculative_k"])
        c = st.columns(4)
        adaptive = c[0].toggle("Adaptive", DEFAULTS["adaptive"], help="Grow K after full acceptance, shrink it after "
                               "a rejection; pause guessing while it costs more per token than plain steps.")
        max_ngram = whole_number_input(c[1], "N-gram size", 2, 6, DEFAULTS["max_ngram"], help="Prompt lookup: the longest "
                                             "n-gram matched. Lookahead: N, the length of the n-grams it collects and verifies.")
        window = whole_number_input(c[2], "Lookahead window W", 1, MAX_WINDOW, DEFAULTS["window"],
                                          help="Columns of guesses refined in parallel, each a Jacobi trajectory.")
        guesses = whole_number_input(c[3], "Lookahead guesses G", 1, MAX_GUESSES, DEFAULTS["guesses"],
                                           help="At most this many collected n-grams verified per step.")
        c = st.columns(2)
        baseline = c[0].checkbox("Run the fp32 greedy baseline too, on the same prompt, and compare")
        redraw_label = c[1].selectbox("Draw the tokens while they stream", list(REDRAWS), index=1, help=LIVE_HELP)
    submitted = st.form_submit_button("Generate", type="primary")
chosen = {"model": model_id, "device": device, "max_new": max_new, "group": group, "mode": mode,
          "temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed, "draft_model": draft_model,
          "speculative_k": speculative_k, "adaptive": adaptive, "max_ngram": max_ngram, "window": window, "guesses": guesses,
          "kv_dtype": kv_dtype, "redraw": redraw_label}
changed = [f"{name.replace('_', ' ')} {value}" for name, value in chosen.items() if value != DEFAULTS[name]]
st.caption("More settings: " + (md_escape(", ".join(changed)) if changed else "all at their defaults")
           + (", with the fp32 baseline" if baseline else ""))
redraw_s = REDRAWS[redraw_label]
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


def served_summary(result: dict) -> dict:
    figures = {"TTFT": f"{result['ttft_ms']:.0f} ms" if result["ttft_ms"] is not None else "n/a",
               "TPOT": f"{result['tpot_ms']:.1f} ms" if result["tpot_ms"] else "n/a",
               "E2E": f"{result['e2e_ms']:.0f} ms" if result["e2e_ms"] is not None else "n/a",
               "Tokens/s": f"{result['tokens_per_s']:.1f}" if result["tokens_per_s"] else "n/a",
               "Chunks / tokens": f"{result['n_chunks']} / {result['n_new_tokens']} ({result['token_source']})",
               "Network round trip": f"{result['rtt_ms']:.1f} ms" if result.get("rtt_ms") is not None else "n/a",
               "Server work": f"{result['server_work_ms']:.0f} ms" + ("" if result["distances_ms"].get("memory")
                                                                       is None else " (split by the planner)")}
    return figures


def summary(result: dict, steps: list[dict]) -> dict:
    if "e2e_ms" in result:  # a served run
        return served_summary(result)
    decode = [s for s in steps if s["kind"] == "decode"]
    per_token_bytes = statistics.mean(s["weight_bytes"] + s["kv_read_bytes"] + s["kv_write_bytes"]
                                      for s in decode) if decode else None
    figures = {"TTFT": f"{result['ttft_ms']:.0f} ms", "TPOT": f"{result['tpot_ms']:.1f} ms" if result["tpot_ms"] else "n/a",
            "Tokens/s": f"{result['tokens_per_s']:.1f}",
            "KV cache": f"{result['kv_cache_bytes'] / 2**20:.2f} MiB",
            "Bytes per token (accounted)": f"{per_token_bytes / 1e6:.0f} MB" if per_token_bytes else "n/a",
            "Roofline estimate / measured forward": f"{result['roofline_ratio_decode']:.0%}" if result["roofline_ratio_decode"] else "n/a"}
    speculative = result.get("speculative")
    if speculative:
        acceptance = speculative["acceptance_rate"]
        figures["Acceptance"] = f"{acceptance:.0%}" if acceptance is not None else "n/a"
        figures["Tokens per target forward"] = f"{speculative['tokens_per_target_forward']:.2f}"
    return figures


def own_tokens(tokens: list[dict]) -> list[dict]:
    """The rows of your own sequence: all of a lone run's, user 0's of a batch."""
    return [t for t in tokens if t.get("user", 0) == 0]


def own_result(done: dict) -> dict:
    """Your own sequence's run summary: a lone run's result, a batch's "own"."""
    return done["result"].get("own", done["result"])


def others_compact(tokens: list[dict], hidden: set[int], users: int, whole: bool = False) -> str:
    """The other users' sequences in small grey type, one line each: the end of its text while it streams,
    its whole text (wrapped) once the batch has ended."""
    if users <= 1:
        return ""
    lines = []
    for user in range(1, users):
        text = "".join(t["piece"] for t in tokens if t.get("user") == user and t["token_id"] not in hidden)
        shown = text if whole else " ".join(text.split())[-100:]  # its latest words, on one line
        lines.append(f'<div style="{"white-space:pre-wrap" if whole else "white-space:nowrap;overflow:hidden"}">'
                     f'<b>user {user + 1}</b>: {html.escape(shown)}</div>')
    return ('<div style="font-size:0.8rem;color:#555;font-family:monospace;margin-top:0.5rem">'
            f'<div>Decoded beside yours ({users - 1} other user{"s" if users > 2 else ""}, prompts from the '
            'workloads):</div>'
            + "".join(lines) + "</div>")


def rate(value: float | None, unit: str = "") -> str:
    return f"{value:.1f}{unit}" if value else "n/a"


def batch_figures(done: dict) -> dict:
    """A batch's headline figures: tokens/s per user against in total, the bytes a decode token moved."""
    result, own = done["result"], own_result(done)
    return {"Users": str(result["users"]), "Tokens/s per user, end to end": rate(result["tokens_per_s_per_user"]),
            "Tokens/s in total, end to end": rate(result["tokens_per_s_total"]),
            "Bytes per decode token, all users":
                f"{result['bytes_per_token'] / 1e6:.0f} MB" if result["bytes_per_token"] else "n/a",
            "Your TTFT": f"{own['ttft_ms']:.0f} ms" if own.get("ttft_ms") is not None else "n/a"}


def show_prediction(result: dict) -> None:
    """The planner's prediction for the batch your sequence decoded in, beside what was measured."""
    planned = result["planned"]
    if "error" in planned:
        st.info(f"No planner prediction for this batch: {md_escape(planned['error'])}")
        return
    mb = lambda v: f"{v / 1e6:.0f} MB" if v else "n/a"  # noqa: E731
    st.markdown(f"**Measured and planned** (the planner at batch {planned['batch']}, the mean batch of your "
                "sequence's decode steps)")
    st.table(pd.DataFrame({
        "": ["decode tokens/s per user", "decode tokens/s in total", "bytes per decode token of your sequence"],
        "measured": [rate(result["decode_tokens_per_s_per_user"]), rate(result["decode_tokens_per_s_total"]),
                     mb(result["bytes_per_token_own"])],
        "planned": [rate(planned["tokens_per_s_per_user"]), rate(planned["tokens_per_s_total"]),
                    mb(planned["bytes_per_token"])]}).set_index(""))
    st.caption("Decode rates leave out the prefill and the wait to be admitted, as the planner's do: each user's "
               "rate is 1 / its TPOT, the total their sum while they decode together. Your sequence's bytes are its "
               "decode steps' share of the weights plus its own cache, the steps the planner's batch is the mean of; "
               "the figure above the table is every user's tokens, including the steps after others finished, when "
               "fewer shared the weights.")
    measured, predicted = result["decode_tokens_per_s_per_user"], planned["tokens_per_s_per_user"]
    if measured and predicted and not 2 / 3 <= measured / predicted <= 3 / 2:
        parts = ", ".join(f"{b} {v:.1f}" for b, v in planned["distances_ms"].items() if v)
        st.warning(f"The plan is {max(measured / predicted, predicted / measured):.1f}x off the measurement here "
                   f"({'slower' if predicted < measured else 'faster'} than what ran). The measurement is what "
                   f"happened; the planner's decode step for this batch ({parts} ms) shows which of its estimates "
                   "for this level on this machine missed.")


# Streamlit's running-man icon redraws several times a second, browser CPU time that the model, on the
# same cores, loses; while a run streams, the page shows its own progress.
def waiting_words(position: int) -> str:
    """Why a run waits for its turn: the generation process loading or calibrating, or runs ahead of it."""
    state = warm_up()
    if state["state"] in ("loading", "calibrating"):
        return warm_up_words(state)
    return f"Waiting for the device: {position} generation(s) ahead."


HIDE_RUNNING_ICON = "<style>[data-testid=stStatusWidgetRunningIcon]{display:none}</style>"
STREAMING_NOTE = '<div style="font-size:0.8rem;color:#666">Generating: {n} of at most {limit} tokens so far{rest}</div>'
QUIET_NOTE = " (text and charts appear when the run ends)"


def draw(live_box, tokens: list[dict], special: set, limit: int, users: int, redraw_s: float | None) -> None:
    """The streaming run so far: text, bars and note, or with redraw_s None the note only."""
    own = own_tokens(tokens)
    note = STREAMING_NOTE.format(n=len(own), limit=limit, rest=("" if redraw_s else QUIET_NOTE)
                                 + (f"; {len(tokens)} for all {users} users" if users > 1 else ""))
    # one raw-HTML element for text, bars and note: each element update costs the browser a redraw
    live_box.html((coloured_tokens(own, special, per_token=False) + live_bars(own)
                   + others_compact(tokens, special, users) + note) if redraw_s else note)


def stream(request: dict, label: str, redraw_s: float | None, started: dict) -> dict:
    """Run one request in the generation process, drawing text and buckets every redraw_s seconds,
    or with redraw_s None only a progress note until the end; returns the run's summary. The run's
    number goes into started["run_id"] as soon as it is known; started["streaming"] is true until
    the run is closed."""
    st.html(HIDE_RUNNING_ICON)
    st.markdown(f"**{label}**")
    live_box = st.empty()
    tokens = []
    spec = request["spec"]
    limit, users = spec["gen"]["max_new_tokens"], spec.get("users", 1)
    # drawn now, with the rest of the page, rather than on the run's first steps
    live_box.html(STREAMING_NOTE.format(n=0, limit=limit, rest="" if redraw_s else QUIET_NOTE))
    # at the end only: a short note every few seconds, which also lets a Stop click end the run
    run = generation_worker().generate(request, every_s=redraw_s or 5.0,
                                       on_run_id=lambda run_id: started.update(run_id=run_id))
    started["streaming"] = True
    done = None
    try:
        kind, ready = next(run)
        if kind == "preparing":  # a model or variant is loading
            with st.spinner(f"Loading {spec['model']} at {spec['weights']} (first time only) and prefilling..."):
                _, ready = next(run)
        started["run_ids"] = ready["run_ids"]
        special = set(ready["special_ids"])
        tokens.extend(ready["tokens"])
        if redraw_s and tokens:  # the first token shows as soon as it is out
            draw(live_box, tokens, special, limit, users, redraw_s)
        for kind, payload in run:
            if kind == "done":
                done = payload
                break
            tokens.extend(payload)
            draw(live_box, tokens, special, limit, users, redraw_s)
    finally:
        run.close()  # a page rerun (Stop) ends the run here: it is recorded as cancelled
        started["streaming"] = False
        if done is None:  # refused or failed: the progress note goes, the message takes its place
            live_box.empty()
    own = own_tokens(done["tokens"])
    with live_box.container():
        st.html(coloured_tokens(own, special))
        st.plotly_chart(bucket_chart(own), width="stretch", key=f"{label}-final")
        if users > 1:
            st.html(others_compact(done["tokens"], special, users, whole=True))
    items = list((batch_figures(done) if users > 1 else summary(done["result"], done["steps"])).items())
    helps = BATCH_HELP if users > 1 else SERVED_METRICS if "e2e_ms" in done["result"] else LOCAL_METRICS
    for start in range(0, len(items), 4):  # four to a row: six side by side cut their values short
        for col, (name, value) in zip(st.columns(4), items[start:start + 4]):
            col.metric(name, value, help=helps.get(name))
    if users > 1:
        show_prediction(done["result"])
    beyond = hardware.above_peak_sentence(done["result"].get("roofline_ratio_decode"))
    if beyond:
        st.warning(f"Roofline estimate / measured forward: {md_escape(beyond)}")
    if "e2e_ms" in done["result"]:
        st.caption(f"Run #{done['run_id']}, stopped by {done['stop_reason']}. TTFT, ITL and E2E are measured by this "
                   "client; queue, prefill and decode times come from the server's /metrics where it has them; a "
                   "memory/compute split is the planner's estimate for the GPU named. Hover a figure for its "
                   "definition (vLLM's benchmark definitions).")
    elif users > 1:
        others = done["run_ids"][1:]
        theirs = "the other user's is" if len(others) == 1 else "the other users' are"
        st.caption(f"Your sequence is run #{done['run_id']}, stopped by {done['stop_reason']}; {theirs} "
                   f"{runs_said(others)}, each recorded on its own. Token shading: darker took longer than the median "
                   "token. Each token's memory bucket is its share of the step's weights plus its own cache, and its "
                   "time bucket the step's work on the other users' tokens and prompts: a user's token takes longer "
                   "in a batch while the tokens per second in total rise. The step times are measured.")
    else:
        st.caption(f"Run #{done['run_id']}, stopped by {done['stop_reason']}. Token shading: darker took longer than "
                   "the median token (hover for milliseconds). Memory and compute are roofline estimates; the step "
                   "times are measured.")
    return done


def last_run(started: dict, timeout_s: float = 15.0) -> tuple[int | None, list[int]]:
    """The number of the run this session started last and of every run of its batch (its own first), once its
    stream is closed (and the runs recorded as ended). Streamlit starts the rerun that a Stop click causes while
    the stopped run is still being closed in the old script thread, which may not even have its number yet."""
    deadline = time.monotonic() + timeout_s
    while started.get("streaming") and time.monotonic() < deadline:
        time.sleep(0.1)
    run_id, run_ids = started.pop("run_id", None), started.pop("run_ids", None)
    return run_id, run_ids or ([run_id] if run_id is not None else [])


def tokens_said(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def runs_said(ids: list[int]) -> str:
    return ("run " if len(ids) == 1 else "runs ") + ", ".join(f"#{i}" for i in ids)


def stopped_batch(rows: list[dict]) -> str:
    """What a Stop did to a batch, in words: which users' runs it cancelled and which had already finished."""
    cancelled = [r for r in rows if r["status"] == "cancelled"]
    finished = [r for r in rows if r["status"] != "cancelled"]
    words = (f"The batch of {len(rows)} users was stopped: {runs_said([r['run_id'] for r in cancelled])} "
             f"{'was' if len(cancelled) == 1 else 'were'} cancelled and kept as cancelled "
             f"({', '.join(tokens_said(r['n_new_tokens']) for r in cancelled)})")
    if finished:
        words += (f"; {runs_said([r['run_id'] for r in finished])} had already ended "
                  f"({', '.join(sorted({r['status'] for r in finished}))})")
    return words + ". Yours is below; every run is on the Runs and Distances pages."


stop_clicked = st.session_state.pop("stop_clicked", False)
# the run this session started last: a plain dict that stream() and the worker's generator fill without
# touching st.session_state, where every access is a point at which a Stop click's rerun interrupts
started = st.session_state.setdefault("started_run", {})
last, batch_ids = last_run(started)
batch_rows = [row for row in map(store.run, batch_ids) if row] if store is not None and len(batch_ids) > 1 else []
if batch_rows and not submitted and any(row["status"] == "cancelled" for row in batch_rows):
    st.warning(stopped_batch(batch_rows))
    st.html(coloured_tokens(store.tokens(last).to_dict("records"), set()))
elif last is not None and not submitted and store is not None:
    row = store.run(last)
    if row and row["status"] == "cancelled":
        st.warning(f"Run #{last} was stopped and is kept as cancelled ({tokens_said(row['n_new_tokens'])}).")
        st.html(coloured_tokens(store.tokens(last).to_dict("records"), set()))
    elif row and stop_clicked and row["status"] == "ok":
        st.info(f"Run #{last} had already finished when Stop was clicked ({tokens_said(row['n_new_tokens'])}); "
                "it is kept as ok: see it on the Runs and Distances pages.")

if submitted and store is not None:
    cfg = GenConfig(prompt=prompt, max_new_tokens=int(max_new), kv_cache=kv_cache, temperature=float(temperature),
                    top_p=float(top_p), top_k=int(top_k), seed=int(seed), speculative=speculative,
                    speculative_k=int(speculative_k), adaptive=adaptive, draft_model=draft_model.strip() or None, max_ngram=int(max_ngram),
                    window=int(window), guesses=int(guesses), kv_dtype=kv_dtype)
    run_spec = RunSpec(gen=cfg, model=model_id.strip() or "default", device=device, weights=level,
                       group_size=int(group), sparsity=float(target), sparsity_mode=mode, users=int(users))
    if served:
        run_spec = RunSpec(gen=cfg, backend="served", endpoint=endpoint.strip(), served_model=served_model.strip() or None,
                           gpu=None if gpu == "(not named)" else gpu, api_key_env=api_key_env.strip() or None)
    try:
        run_spec.check()
    except GenerationError as exc:
        st.error(md_escape(str(exc)))
        st.stop()
    request = worker_request(run_spec, store)
    waiting = st.empty()
    run_area = st.empty()  # the Stop button and the run's heading go with it when the run is refused
    with generation_queue().turn(lambda pos: waiting.info(waiting_words(pos))):
        waiting.empty()
        done = None
        try:
            with run_area.container():
                stop_slot = st.empty()  # the button goes once the runs have ended
                stop_slot.button("Stop", help="Ends the run now; it is kept as cancelled.",
                                 on_click=lambda: st.session_state.update(stop_clicked=True))
                done = stream(request, "This run", redraw_s, started)
                if baseline:
                    base = RunSpec(gen=GenConfig(prompt=prompt, max_new_tokens=int(max_new)), model=run_spec.model,
                                   device=device)
                    ref = stream(worker_request(base, store), "Baseline: fp32, greedy, KV cache on, dense", redraw_s,
                                 started)
                    mine = own_result(done)
                    if ref["result"]["tpot_ms"] and mine.get("tpot_ms"):
                        st.metric("Speedup in decode (baseline TPOT / this run's TPOT)",
                                  f"{ref['result']['tpot_ms'] / mine['tpot_ms']:.2f}x")
                stop_slot.empty()
        except (WorkerRefused, WorkerFailed) as exc:  # one sentence; a failed run is recorded with status error
            if done is None:  # nothing of this run to show
                run_area.empty()
            st.error(md_escape(str(exc)))
    if done is not None:
        with verdict_slot.container():
            show_calibration_verdict(store, "live-after-run")
