"""Serving: load sweeps against an OpenAI-compatible server (vLLM, SGLang, llama.cpp, TGI) or this machine's
batching engine, run in a subprocess of their own, and the latency, throughput and server figures of every
stored sweep with the command that makes it again."""
import json

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from engine import access
from engine.report.trace import trace_json
from engine.serve import client as served
from engine.serve import jobs
from engine.serve import records as served_store
from engine.report import sweep_views
from engine.errors import UserError
from engine.measure.slo import parse_slo
from engine.serve.arrivals import MAX_INPUT_TOKENS, parse_rates
from engine.serve.load import load_prompts, parse_concurrency
from engine.paths import workloads
from engine.serve.client import ServedError
from engine.serve.metrics import DEFINITIONS
from engine.report.sweeps import load_sweep_report
from engine.spec import MAX_BATCH
from engine.model.loader import pick_device
from engine.switches.quant import LEVELS, available_levels
from engine.serve.capacity import describe
from engine.serve.command import sweep_command
from engine.serve.command import ReproduceError
from ui import (LEGEND, default_model_id, figure, log_ticks, md_escape, open_store, plot_escape, page_setup,
                whole_number_input)

# below the plot, clear of the title above it
LEGEND_BELOW = dict(orientation="h", yanchor="top", y=-0.25, x=0)

page_setup("Serving")
st.title("Serving")
st.markdown("Point Tokenpath at a server that speaks the OpenAI API and measure it under load: for each "
            "level, either that many streamed requests kept in flight, or requests arriving at that rate (a Poisson "
            "process, as `vllm bench serve` sends them) whatever is still running. With a latency target (SLO) each "
            "level also gets its goodput: the requests per second that met every target. Every request is stored, "
            "so two servers or configurations can be compared below. Load goes only to the address given, or to this "
            "machine's own batching engine, which needs no server and sweeps in seconds. "
            "`python -m engine capacity` searches the highest rate that holds a target; its sweeps show here too.")
store = open_store()
if store is None:
    st.stop()

with st.expander("What the figures mean"):
    for name, text in DEFINITIONS.items():
        st.markdown(f"**{name}**: {text}")

shipped = workloads()
TARGETS = ("a server (its address)", "this machine (the local batching engine)")
if access.shared_mode():  # a shared dashboard names no server and no key variable; its own models run here
    st.info(access.SERVED_REFUSAL)
    local = True
else:
    local = st.radio("Send the load to", TARGETS, horizontal=True,
                     help="This machine: the requests go straight into Tokenpath's continuous-batching engine in a "
                          "process of its own (`python -m engine load --local`), each one a recorded run, with no "
                          "server to start.") == TARGETS[1]
with st.form("sweep"):
    if local:
        c = st.columns([3, 2, 2])
        model_id = c[0].text_input("Model", default_model_id(), help="'default', a local folder or a Hugging Face id"
                                   + ("; a shared dashboard runs only the project's own models" if access.shared_mode()
                                      else ""))
        weights = c[1].selectbox("Weight precision", available_levels(pick_device("auto")),
                                 help="the level the whole batch runs at (those that run here); "
                                      + "; ".join(f"{n}: {lv.help}" for n, lv in LEVELS.items()))
        max_batch = whole_number_input(c[2], "Max batch", 1, MAX_BATCH, 8, help="sequences decoded together in one step")
        c = st.columns(2)
        kv_budget = c[0].number_input("KV-cache budget (MiB, 0 = none)", 0.0, 1e6, 0.0, help="KV-cache memory the "
                                      "batch may reserve; arrivals beyond it wait for a slot")
        prefix_cache = c[1].number_input("Prefix cache (MiB, 0 = off)", 0.0, 1e6, 0.0, help="keep prefilled prompts' "
                                         "KV cache: a later request opening with a kept prompt's tokens prefills "
                                         "only the rest, as vLLM's prefix caching does (`load --prefix-cache-mb`)")
        st.caption("The engine runs the model at this weight level with its KV cache, as `load --local --weights` "
                   "does; a server's address, model name and key do not apply here.")
    else:
        c = st.columns([3, 2, 2])
        endpoint = c[0].text_input("Server address", "http://127.0.0.1:8000", help="scheme://host:port, with or without /v1")
        key_env = c[1].text_input("API key environment variable", "", help="the name of a variable set where the app "
                                  "runs; the key itself is never typed here, stored or logged")
        model = c[2].text_input("Served model", "", help="blank: the first model the server lists (GET /v1/models)")
    c = st.columns(4)
    levels_text = c[0].text_input("Levels", "1,2,4,8", help="concurrency levels, or request rates in requests/s, "
                                  "comma-separated")
    n_requests = whole_number_input(c[1], "Requests per level", 1, 1000, 8)
    new_tokens = whole_number_input(c[2], "New tokens per request", 1, 4096, 32)
    prompt_set = c[3].selectbox("Prompts", ["every shipped workload", *shipped])
    c = st.columns([2, 3, 2])
    arrival = c[0].selectbox("Levels are", ["requests kept in flight", "arrivals per second (Poisson)"])
    shared_prefix = whole_number_input(c[2], "Shared prefix (tokens, 0 = none)", 0, MAX_INPUT_TOKENS, 0,
                                       help="every prompt opens with the same preamble of this many tokens, as requests "
                                            "sharing a long system prompt do: a server with a prefix cache finds it "
                                            "after the first request, and the first-token time shows what that saves "
                                            "(`load --shared-prefix-tokens`)")
    slo_text = c[1].text_input("Latency target (SLO), optional", "", placeholder="ttft_ms=500,tpot_ms=50",
                               help="milliseconds per metric: ttft_ms, tpot_ms, itl_ms, e2e_ms; a request is good "
                                    "when it meets every one")
    start = st.form_submit_button("Start the sweep", type="primary")


RATES = arrival.startswith("arrivals")


def sweep_options() -> list[str]:
    """`load`'s options for the form: the levels, lengths, prompts and target, and where the requests go."""
    options = ["--rate" if RATES else "--concurrency", levels_text, "--requests", str(int(n_requests)),
               "--max-new-tokens", str(int(new_tokens))]
    if slo_text.strip():
        options += ["--slo", slo_text.strip()]
    if prompt_set != "every shipped workload":
        options += ["--prompts", prompt_set]
    if shared_prefix:
        options += ["--shared-prefix-tokens", str(int(shared_prefix))]
    if local:
        options += ["--local", "--model", model_id.strip() or "default", "--weights", weights,
                    "--max-batch", str(int(max_batch))]
        return (options + (["--kv-budget-mb", f"{kv_budget:g}"] if kv_budget else [])
                + (["--prefix-cache-mb", f"{prefix_cache:g}"] if prefix_cache else []))
    options += ["--endpoint", endpoint]
    if model.strip():
        options += ["--served-model", model.strip()]
    return options + (["--api-key-env", key_env.strip()] if key_env.strip() else [])


def check_target() -> None:
    """The target answers (a server and its model) or may run here (a local model); else one sentence."""
    if local:
        if not access.model_choice_allowed(model_id):
            raise access.AccessError(access.refusal(model_id))
        return
    names = served.list_models(endpoint, key_env.strip() or None)
    if model.strip() and model.strip() not in names:
        raise ServedError(f"The server has no model '{model.strip()}'; it serves: {', '.join(names[:8])}.")


if start:
    try:  # the quick checks here, so a mistake reads as one sentence before anything starts
        (parse_rates if RATES else parse_concurrency)(levels_text)
        if slo_text.strip():
            parse_slo(slo_text)
        load_prompts(None if prompt_set == "every shipped workload" else prompt_set)
        check_target()
    except (ServedError, UserError) as exc:
        st.error(md_escape(str(exc)))
    else:
        st.session_state["load"] = jobs.start(sweep_options(), store.path)


# redrawn each second only while a sweep runs: each redraw drops the files downloads made since the last one,
# so a panel that redraws with nothing to show would cancel every "Download report" a moment after the click
@st.fragment(run_every=1.0 if "load" in st.session_state else None)
def progress_panel() -> None:
    job = st.session_state.get("load")
    if not job:
        return
    state = job.state()
    running = job.process.poll() is None
    left = f", about {state['eta_s']:.0f} s left" if running and state.get("eta_s") is not None else ""
    st.progress(min(state["done"] / max(state["total"], 1), 1.0),
                text=f"{state['done']} of {state['total']} requests{left}"
                     + ("" if running else f" · sweep {state.get('sweep_id')} {state.get('status', 'ended')}"))
    if running and st.button("Stop", help="cut the requests in flight and keep every request that finished"):
        job.process.terminate()
    if not running:
        if job.error():
            st.session_state["load_error"] = job.error()
        job.remove()  # the sweep's folder in the temp directory (a page that never sees the end: the next start)
        st.session_state.pop("load")
        st.rerun()


progress_panel()
if "load_error" in st.session_state:
    st.error(md_escape(st.session_state.pop("load_error")))

frame = served_store.sweeps(store)
if frame.empty:
    st.info("No load sweep stored yet.")
    st.stop()
label = {r.sweep_id: f"#{r.sweep_id} {r.server_model} " + ("on this machine" if r.endpoint == "local" else
                                                            f"at {r.endpoint}")
                    + f" · {r.status} · {r.started_at:%Y-%m-%d %H:%M}" for r in frame.itertuples()}
chosen = st.multiselect("Sweeps to show (the first in detail, all on the per-user against per-GPU curve)", list(label),
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
try:  # the command comes from the sweep's stored parameters, as `load --from-sweep` reads them
    st.caption(f"The command that makes sweep #{first} again (or `python -m engine load --from-sweep {first}`):")
    st.code(sweep_command(store, int(first), db=store.path), language="bash", wrap_lines=True)
except ReproduceError as exc:
    st.caption(md_escape(str(exc)))
st.download_button("Download trace", lambda: trace_json(store, sweep_ids=sorted(int(s) for s in chosen)),
                   mime="application/json", file_name=f"tokenpath-load-sweep-trace-{first}.json", on_click="ignore",
                   help="The chosen sweeps as a Chrome trace-event file for ui.perfetto.dev or chrome://tracing: a "
                        "track per request with each chunk, the server's gauges as counters (also `python -m engine "
                        f"trace --load-sweep {first} --out FILE.json`).")

st.subheader("Per level")
# the figures people compare at a glance (the level's label names its concurrency or rate); the rest on request
# each latency's median and tail in one cell ("6.8 / 11.7", ms), so the glance reads whole in a window 1024 px wide;
# a level's completed requests are the requests per level less the failed ones
PAIRS = {"TTFT p50 / p99": ("ttft p50 ms", "ttft p99 ms"), "TPOT p50 / p99": ("tpot p50 ms", "tpot p99 ms")}
LEVEL_GLANCE = ["level", "failed", *PAIRS, "e2e p50 ms", "output tokens/s", "requests/s", "goodput req/s", "attainment"]
PERCENT = ("attainment", "KV cache max", "prefix cache hit rate")


def level_cell(column: str, value) -> str:
    """A level's figure as text: a share as a percentage, a measurement to three significant digits, and a
    missing one blank (the legend under the table says when a figure is missing)."""
    if value is None or value != value:
        return ""
    if column in PERCENT:
        return f"{value:.0%}"
    return f"{figure(value):g}" if isinstance(value, float) else str(value)


def readable_levels(levels_table: pd.DataFrame) -> pd.DataFrame:
    """The level table with every column that misses a figure as text, so a missing figure is a blank cell and
    never the word None; columns with every figure stay numbers. Each latency's median and tail are also one
    cell (PAIRS), for the glance."""
    out = levels_table.copy()
    for column in out.columns:
        if out[column].isna().any():
            out[column] = [level_cell(column, v) for v in out[column]]
    for name, (median, tail) in PAIRS.items():
        out[name] = [f"{a:.1f} / {b:.1f}" if pd.notna(a) and pd.notna(b) else ""  # as the ms columns show them
                     for a, b in zip(levels_table[median], levels_table[tail])]
    return out


def level_headers(table: pd.DataFrame) -> dict:
    """Each column's header help from the metric definitions, and its format where the column holds numbers."""
    help_for = {"ttft": "TTFT", "itl": "ITL", "tpot": "TPOT", "e2e": "E2E", "requests/s": "requests/s",
                "output tokens/s": "output tokens/s"}
    helps = {col: DEFINITIONS[help_for[key]] for col in table.columns for key in help_for if col.startswith(key)}
    helps.update({
        "attainment": "the share of the level's requests that met every target",
        "goodput req/s": "requests that met every target, per second of the level",
        "KV cache max": "the server's KV-cache use at its highest in the level",
        "prefix cache hit rate": "the share of the level's prompt tokens the server found in its prefix cache (its "
                                 "/metrics counters before and after the level)",
        "physical p50 ms": "the median request's time on the network: connect (with its name lookup), TLS, request "
                           "sent and the wait for the first byte, from the HTTP client's trace hooks",
        "connections reused": "the level's requests that rode a kept-alive connection, so paid no connect",
        "completed": "the level's requests that completed", "failed": "the level's requests that failed or were cut",
        **{name: f"{DEFINITIONS[name.split()[0]]}; the median and the 99th percentile (ms)" for name in PAIRS}})
    formats = {"goodput req/s": "%.2f", "physical p50 ms": "%.2f", "connections reused": "%d", "completed": "%d",
               "failed": "%d", **{col: "percent" for col in PERCENT}}
    labels = {"completed": "done", "output tokens/s": "output tok/s", "goodput req/s": "goodput",
              "attainment": "attained"}  # narrower, so the glance fits
    columns = {}
    for col, text in helps.items():
        if col not in table.columns:
            continue
        label = labels.get(col, col)
        if pd.api.types.is_numeric_dtype(table[col]):
            columns[col] = st.column_config.NumberColumn(label, format=formats.get(col, "%.1f"), help=text)
        else:
            columns[col] = st.column_config.TextColumn(label, help=text)
    return columns


table = levels[label[first]]
every_figure = st.toggle("Every figure of each level", False, help="the concurrency and rate, the completed requests, "
                         "every percentile of TTFT, ITL, TPOT and E2E each in its own column, and the server's figures: "
                         "queue, KV cache, prefix cache, its own means")
shown = readable_levels(table)
glance = [col for col in LEVEL_GLANCE if (shown[col] != "").any()]  # an SLO's columns only with an SLO
if "attainment" in glance:  # room for the SLO's columns: goodput is the rate that counts, E2E is behind the toggle
    glance = [col for col in glance if col not in ("e2e p50 ms", "requests/s")]
st.dataframe(shown, hide_index=True, width="stretch", column_config=level_headers(shown),
             column_order=[col for col in shown.columns if col not in PAIRS] if every_figure else glance)
st.caption("Client figures are measured by Tokenpath's clock; the 'server ... mean' columns are the server's own "
           "histograms (sum / count between the level's first and last scrape of /metrics). A blank cell has no "
           "figure: a concurrency level has no rate and a rate level no concurrency, a sweep without an SLO no goodput "
           "or attainment, a server without vLLM's /metrics no queue, cache or server means, and a level where no "
           "request completed no latency.")

sweep_row = rows[first]
result = json.loads(sweep_row.result) if isinstance(getattr(sweep_row, "result", None), str) else None
if result:
    st.success(describe(result))  # built from validated figures and metric names only
if table["rate"].notna().any():
    by_rate = table[table["completed"] > 0].sort_values("rate")
    fig = go.Figure()
    latencies = by_rate[[f"{m} p{q} ms" for m in ("ttft", "tpot", "e2e") for q in (50, 99)]].to_numpy().ravel()
    for metric, dash in (("ttft", "solid"), ("tpot", "dot"), ("e2e", "dash")):
        for q in (50, 99):
            fig.add_scatter(x=by_rate["rate"], y=by_rate[f"{metric} p{q} ms"], mode="lines+markers",
                            name=f"{metric.upper()} p{q}", line=dict(dash=dash, width=3 if q == 50 else 1))
    if by_rate["goodput req/s"].notna().any():
        fig.add_scatter(x=by_rate["rate"], y=by_rate["goodput req/s"], name="goodput (req/s)", yaxis="y2",
                        mode="lines+markers", line=dict(color="black"))
    if result and result.get("capacity_requests_per_s"):
        fig.add_vline(x=result["capacity_requests_per_s"], line_dash="dash", line_color="green",
                      annotation_text=f"capacity {result['capacity_requests_per_s']:.3g} req/s")
    fig.update_layout(title="Latency percentiles and goodput against request rate", xaxis_title="offered requests/s",
                      # goodput's own round ticks, not ticks placed on the log axis' lines
                      yaxis=dict(title="ms", type="log", **log_ticks(latencies)), yaxis2=dict(title="good requests/s", overlaying="y",
                                                                       side="right", rangemode="tozero",
                                                                       tickmode="auto", showgrid=False),
                      height=440, margin=dict(l=40, r=40, t=60, b=90), legend=LEGEND_BELOW)
    st.plotly_chart(fig, width="stretch")

gpus = whole_number_input(st, "GPUs behind the server", 1, 4096, 1, help="divides the server's output tokens/s, for the "
                              "per-GPU axis below (1 for a sweep of this machine's engine: the axis is then per "
                              "machine)")
fig = go.Figure()
for name, frame in levels.items():
    rates = sweep_views.user_and_server_rates(frame, int(gpus))
    fig.add_scatter(x=rates["tokens/s per GPU"], y=rates["tokens/s per user"], mode="lines+markers+text",
                    name=plot_escape(name), text=list(rates["level"]), textposition="top center")
# both axes from zero: a figure nearly constant across levels stays a flat line, not noise drawn large
fig.update_layout(title="Tokens/s per user against tokens/s per GPU", xaxis_title="output tokens/s per GPU, all users",
                  yaxis_title="tokens/s one user sees (1000 / TPOT p50)", height=380,
                  xaxis_rangemode="tozero", yaxis_rangemode="tozero",
                  margin=dict(l=40, r=10, t=60, b=40), legend=LEGEND_BELOW)
st.plotly_chart(fig, width="stretch")

requests = served_store.sweep_requests(store, first)
if requests.empty:
    st.info("This sweep stored no requests.")
    st.stop()
DELIVERY_GAP_MS = 1.0  # chunks closer than this came in one read of the stream: one delivery


def completed_by_level(requests):
    """The completed requests grouped by their level's label, in sweep order."""
    ok = requests[requests["status"] == "ok"]
    # a Series, not a list: pandas keys the groups of a one-item list by tuples (a stopped sweep's one request)
    return ok.groupby(pd.Series([sweep_views.request_level(r) for r in ok.itertuples()], index=ok.index, dtype=object),
                      sort=False)


def chunk_gaps(requests) -> dict:
    """Per level, every gap between consecutive chunks of the completed requests (ms)."""
    return {level: [b - a for r in part.itertuples() for a, b in zip(list(r.chunk_ms), list(r.chunk_ms)[1:])]
            for level, part in completed_by_level(requests)}


def delivery_table(requests, levels_table, gaps: dict) -> pd.DataFrame:
    """Per level, what the client's inter-token latency measures: chunks per delivery, the share of gaps
    under a millisecond, the client's ITL p50 beside the server's own inter-token mean and TPOT."""
    rows = []
    for level, part in completed_by_level(requests):
        chunks = sum(len(r.chunk_ms) for r in part.itertuples())
        deliveries = len(part) + sum(g >= DELIVERY_GAP_MS for g in gaps[level])
        level_row = levels_table[levels_table["level"] == level]
        pick = (lambda col: figure(level_row[col].iloc[0]) if not level_row.empty and col in level_row else None)
        rows.append({"level": level, "chunks per delivery": figure(chunks / deliveries),
                     "gaps under 1 ms (%)": figure(100 * sum(g < DELIVERY_GAP_MS for g in gaps[level])
                                                   / len(gaps[level])) if gaps[level] else None,
                     "client ITL p50 (ms)": pick("itl p50 ms"),
                     "server inter-token mean (ms)": server_figure(pick("server itl mean ms")),
                     "TPOT p50 (ms)": pick("tpot p50 ms")})
    return pd.DataFrame(rows)


def server_figure(value) -> str:
    """The server's own inter-token mean as text, or what is missing in words."""
    return "not published" if value is None or value != value else f"{value:g}"


st.subheader("What the inter-token latency measures")
gaps = chunk_gaps(requests)
st.dataframe(delivery_table(requests, table, gaps), hide_index=True, width="stretch")
st.caption("ITL is the gap between chunks as this client reads them. Under load the server's chunks arrive several "
           "per read, so most gaps are near zero and the ITL p50 can read far below the time of a token: the time "
           "per token is TPOT (and the server's own inter-token figure where its /metrics has one).")
hist = go.Figure()
for level, values in gaps.items():
    hist.add_histogram(x=values, name=level, opacity=0.6, nbinsx=40)
hist.update_layout(barmode="overlay", xaxis_title="gap between chunks as read (ms)", yaxis_title="gaps", height=300,
                   margin=dict(l=40, r=10, t=30, b=40), legend=LEGEND)
st.plotly_chart(hist, width="stretch")

c = st.columns(2)
itl = sweep_views.itl_by_position(requests)
fig = go.Figure()
for level, part in itl.groupby("level", sort=False):
    fig.add_scatter(x=part["position"], y=part["mean ms"], mode="lines", name=level)
fig.update_layout(title="ITL by output position (mean over requests)", xaxis_title="output chunk position",
                  yaxis_title="gap before the chunk (ms)", height=340, margin=dict(l=40, r=10, t=60, b=40))
c[0].plotly_chart(fig, width="stretch")

spans = sweep_views.timeline(requests)
fig = go.Figure()
for level, part in spans.groupby("level", sort=False):
    fig.add_bar(y=part["label"], x=part["end_s"] - part["start_s"], base=part["start_s"], orientation="h",
                name=level, hovertext=part["status"])
fig.add_scatter(y=spans["label"], x=spans["first_s"], mode="markers", marker=dict(symbol="line-ns-open", size=10),
                name="first token")
fig.update_layout(title="Requests over time", xaxis_title="seconds since the sweep started", yaxis=dict(
    showticklabels=False, autorange="reversed"), height=340, margin=dict(l=10, r=10, t=60, b=40), barmode="overlay")
c[1].plotly_chart(fig, width="stretch")

# each request's network parts, as the HTTP client's trace hooks timed them: the name lookup lies inside the connect
REQUEST_COLUMNS = {"idx": "request", "status": "status", "connection": "connection", "ttft_ms": "TTFT (ms)",
                   "e2e_ms": "E2E (ms)", "physical_ms": "physical (ms)"}
NETWORK_COLUMNS = {"dns_ms": "name lookup (ms)", "connect_ms": "connect (ms)", "tls_ms": "TLS (ms)",
                   "send_ms": "request sent (ms)", "first_byte_ms": "first byte (ms)"}


def request_table(requests, every_column: bool) -> pd.DataFrame:
    """One row per request with its level; every column adds the network's parts and the token counts. Requests sent
    in process (a local sweep) have no network: its columns are left out."""
    names = {**REQUEST_COLUMNS, **(NETWORK_COLUMNS if every_column else {})}
    if not over_network(requests):
        names = {k: v for k, v in names.items() if k not in ("connection", "physical_ms", *NETWORK_COLUMNS)}
    if every_column:
        names.update({"n_prompt_tokens": "prompt tokens", "n_output_tokens": "output tokens"})
    table = requests[list(names)].rename(columns=names)
    table.insert(0, "level", [sweep_views.request_level(r) for r in requests.itertuples()])
    return table


def over_network(requests) -> bool:
    """Whether the requests went over HTTP (a server's sweep), which times each one's connection."""
    return bool(requests["connection"].notna().any())


st.subheader("Requests")
every_column = st.toggle("All columns", False, help="each request's network parts too: name lookup, connect, TLS, "
                         "request sent, first byte, and its token counts")
request_formats = {name: st.column_config.NumberColumn(name, format="%.1f") for name in ("TTFT (ms)", "E2E (ms)")}
request_formats.update({name: st.column_config.NumberColumn(name, format="%.2f")
                        for name in ("physical (ms)", *NETWORK_COLUMNS.values())})
st.dataframe(request_table(requests, every_column), hide_index=True, width="stretch", column_config=request_formats)
st.caption("Physical is the request's time on the network, each part counted once: the connect (a host name's lookup "
           "inside it), TLS, sending the request and the wait for the server's first byte. A request on a kept-alive "
           "connection ('reused') pays no lookup, connect or TLS. Parts are shown to 0.01 ms; the lookup is 0 for "
           "an address." if over_network(requests) else
           "These requests went straight into this machine's engine, in process: no network, so no physical part.")

samples = served_store.sweep_samples(store, first)
if samples.empty:
    st.caption("This sweep stored no samples over time.")
else:
    fig = go.Figure()
    t_s = samples["t_ms"] / 1e3
    if "in_flight" in samples and samples["in_flight"].notna().any():
        fig.add_scatter(x=t_s, y=samples["in_flight"], name="in flight (client)", mode="lines")
    for column, name in (("running", "running (server)"), ("waiting", "waiting (server queue)")):
        if samples[column].notna().any():
            fig.add_scatter(x=t_s, y=samples[column], name=name, mode="lines")
    gauges = samples[["running", "waiting"]].notna().any().any()
    if samples["kv_cache_usage"].notna().any():
        fig.add_scatter(x=t_s, y=samples["kv_cache_usage"] * 100, name="KV cache used (%)", mode="lines", yaxis="y2")
    elif gauges:
        st.caption("No KV-cache gauge was published: the requests running and waiting are drawn without it.")
    else:
        st.caption("The server publishes no queue or KV-cache gauges on /metrics: only the client's count is drawn.")
    fig.update_layout(title="Requests in flight, the server's queue and KV cache over time",
                      xaxis_title="seconds since the sweep started", yaxis_title="requests",
                      yaxis2=dict(title="KV cache %", overlaying="y", side="right", rangemode="tozero",
                                  tickmode="auto", showgrid=False),
                      height=320, margin=dict(l=40, r=40, t=60, b=40), legend=LEGEND_BELOW)
    st.plotly_chart(fig, width="stretch")
failed = requests[requests["status"] != "ok"]
if not failed.empty:
    reasons = "; ".join(sorted(set(failed["error"].dropna()))[:3])
    st.warning(md_escape(f"{len(failed)} request(s) did not complete: {reasons}"))  # server text, never Markdown
