"""What every page shares: the store, the generation queue and process, bucket colours.
Pages stay thin: they send model work to the generation process and read DuckDB through these."""
from __future__ import annotations

import base64
import json
import os
import re
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import streamlit as st

from engine import access
from engine.measure import hardware
from engine.report.charts import BUCKET_COLOURS, LEGEND, bucket_chart, plot_escape, run_label, series  # noqa: F401 (pages read them from here)
from engine.report.definitions import BUCKET_MEANING  # noqa: F401
from engine.measure.distances import BUCKETS
from engine.model.loader import pick_device
from engine.switches.quant import LEVELS, level_info
from engine.spec import DEFAULTS as SPEC_DEFAULTS
from engine.spec import LIMITS, GenConfig, RunSpec
from engine.store.db import Store, StoreError, store_at
from engine.run.worker import GenerationWorker, WorkerFailed, WorkerRefused

# (file, label, what it is for) of every page, in the order the sidebar and the home page list them
PAGES = [("app.py", "Home", "the thesis, this machine, the latest runs"),
         ("pages/story.py", "Story", "the four distances, measured live on this machine, in about a minute"),
         ("pages/live.py", "Live generation", "run a prompt with every switch and watch each token's time split live"),
         ("pages/distances.py", "Distances", "where the time went, per token and per run, against the roofline"),
         ("pages/runs.py", "Runs", "every recorded run: filter, compare, export, delete"),
         ("pages/sweeps.py", "Sweeps", "a grid of settings on one workload, and what limits this machine"),
         ("pages/serving.py", "Serving", "a served model under load: latency and throughput as concurrency grows"),
         ("pages/hardware.py", "Hardware", "calibration, telemetry, links, and the path data travels in a DGX A100"),
         ("pages/kv_calculator.py", "KV calculator", "KV-cache and weights memory against GPUs"),
         ("pages/planner.py", "Planner", "a deployment's time per token split into the five buckets, before buying it")]


ICON = Path(__file__).resolve().parent / "assets" / "favicon.png"  # a file, so no page load fetches a font


def page_setup(title: str) -> None:
    """Page config, the access gate and the sidebar's page links (Streamlit's own list would call the
    home page 'app'). Every page calls this first, so no page works before the gate lets it."""
    st.set_page_config(page_title=f"{title} · Tokenpath" if title != "Tokenpath" else title,
                       page_icon=str(ICON), layout="wide")
    access_gate()
    warm_up()
    with st.sidebar:
        for path, label, _ in PAGES:
            st.page_link(path, label=label)
        if access.shared_mode() and st.button("Sign out", key="_sign_out"):
            st.session_state.pop("_signed_in", None)
            st.rerun()


def access_gate() -> None:
    """Stop the page unless this server may be reached: a loopback address, or a signed-in session
    when a token is set (engine.access). The token itself is never kept, only the fact of a match."""
    address = st.get_option("server.address")
    if not access.shared_mode():
        if not access.is_loopback(address):
            st.error(f"This server listens on {md_escape(address or 'every interface')} without a token, so it "
                     f"serves nothing: start it with `make share` and {access.TOKEN_ENV} set, or on 127.0.0.1.")
            st.stop()
        return
    if st.session_state.get("_signed_in") is True:
        return
    st.title("Tokenpath")
    with st.form("_sign_in", clear_on_submit=True):
        given = st.text_input("Access token", type="password",
                              help=f"The secret this server was started with (${access.TOKEN_ENV}).")
        submitted = st.form_submit_button("Sign in", type="primary")
    if submitted:
        client = st.context.ip_address or "an unknown address"
        wait = access.SIGN_IN.wait_s(client)
        if wait > 0:  # no token is checked while this address waits, so parallel guesses gain nothing
            st.error(f"Too many wrong tokens from this address: try again in {wait:.0f} s.")
        elif access.token_matches(given):
            access.SIGN_IN.succeeded(client)
            st.session_state["_signed_in"] = True
            st.rerun()
        else:
            access.SIGN_IN.failed(client)
            time.sleep(1.0)  # a wrong guess costs the guesser a second
            st.error("That is not this server's access token.")
    st.info("This dashboard is shared on the network: sign in with its access token to use it.")
    st.stop()


def session_signed_in(session_id: str) -> bool:
    """Whether this open session of the server has signed in (its own _signed_in, set by access_gate)."""
    from streamlit.runtime import Runtime

    info = Runtime.instance()._session_mgr.get_active_session_info(session_id)
    state = info.session.session_state if info is not None else {}
    return "_signed_in" in state and state["_signed_in"] is True


def refuse_uploads_before_sign_in() -> None:
    """Streamlit's upload endpoint stores a file for any open session, whether or not its page ever
    drew an uploader; on a shared dashboard the server itself answers 403 to a session that has not
    signed in, so nothing is kept for it. Idempotent: the share's launcher calls it before the server
    starts (so even the first session is covered), and importing this module calls it again."""
    from starlette.exceptions import HTTPException
    from streamlit.runtime.memory_uploaded_file_manager import MemoryUploadedFileManager

    store = MemoryUploadedFileManager.add_file
    if getattr(store, "signed_in_only", False):
        return

    def add_file(self, session_id, file):
        if access.shared_mode() and not session_signed_in(session_id):
            raise HTTPException(status_code=403, detail="Sign in with the access token before uploading.")
        store(self, session_id, file)

    add_file.signed_in_only = True
    MemoryUploadedFileManager.add_file = add_file


refuse_uploads_before_sign_in()

_MARKDOWN_SPECIAL = re.compile(r"([\\`*_{}\[\]()#+\-.!|<>~$:=^&])")
# GFM makes links of bare https://..., www.... and e-mail addresses even when their characters are
# backslash-escaped; an invisible word joiner before the colon, the at sign and www's dot stops that
_AUTOLINK = re.compile(r"(?=\\:)|(?=@)|(?<=www)(?=\\\.)", re.IGNORECASE)


def md_escape(text) -> str:
    """User text made literal inside Markdown (st.error, st.markdown, subheaders): every character
    Markdown, Streamlit's directives (:red[...], :material/...:) or LaTeX ($) read is escaped, line
    breaks become spaces, and nothing becomes a link."""
    escaped = _MARKDOWN_SPECIAL.sub(r"\\\1", " ".join(str(text).splitlines()))
    return _AUTOLINK.sub("\u2060", escaped)


_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_safe(frame: pd.DataFrame) -> pd.DataFrame:
    """A copy whose text cells cannot run as a spreadsheet formula: a cell starting with = + - @ (or a
    tab or carriage return) gets a leading apostrophe, which spreadsheets show as text. Numbers stay."""
    out = frame.copy()
    for column in out.columns:
        if out[column].dtype == object or pd.api.types.is_string_dtype(out[column]):
            out[column] = out[column].map(lambda v: f"'{v}" if isinstance(v, str) and v.startswith(_FORMULA_START)
                                          else v)
    return out


SIGNIFICANT = 3  # a timing repeated on this machine varies by a few percent: three figures carry it


def figure(value) -> float | None:
    """A measured number rounded to the digits the measurement supports."""
    if value is None or value != value:
        return None
    return float(f"{float(value):.{SIGNIFICANT}g}")


def _given(value) -> bool:
    """Whether a stored field holds something: a served run leaves the local switches empty (None or NaN)."""
    return value is not None and value == value and value != ""


def _sparsity_words(row) -> str:
    if _given(row.get("sparsity")) and row["sparsity"]:
        return f"{row['sparsity']:.0%} {row['sparsity_mode']}"
    return "dense"


def _settings_words(row) -> str:
    """A run's settings in a few words: its weights, then only what differs from a plain run (no KV cache,
    sparsity, a speculative method); a served run is 'served', its server decides the rest."""
    if row.get("backend") == "served":
        return "served"
    words = [row.get("weights") or row.get("dtype") or "fp32"]
    if _given(row.get("kv_cache")) and not row["kv_cache"]:
        words.append("no KV cache")
    if _given(row.get("sparsity")) and row["sparsity"]:
        words.append(_sparsity_words(row))
    if _given(row.get("speculative")) and row["speculative"] != "none":
        words.append(row["speculative"])
    batch = _batch_of(row)
    if batch:
        words.append(f"user {batch['user'] + 1} of {len(batch['prompts'])} in a batch")
    return " · ".join(words)


def _batch_of(row) -> dict | None:
    """The batch a run was decoded in (generate --users, the Live page's Users), as its config stores it."""
    config = row.get("config")
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError:
            return None
    batch = config.get("batch") if isinstance(config, dict) else None
    return batch if isinstance(batch, dict) and "user" in batch and batch.get("prompts") else None


# the columns people compare, in words a person would say, each from a runs row: the figures first, then the
# settings that tell runs apart, then the rest
RUN_COLUMNS = {
    "run": lambda r: f"#{int(r['run_id'])}",
    "time to first token (ms)": lambda r: figure(r.get("ttft_ms")),
    "time per output token (ms)": lambda r: figure(r.get("tpot_ms")),
    "tokens/s": lambda r: figure(r.get("tokens_per_s")),
    "settings": _settings_words,
    "weights": lambda r: r.get("weights") or r.get("dtype") or "",
    "KV cache": lambda r: "on" if r.get("kv_cache") else "off",
    "sparsity": _sparsity_words,
    "speculative": lambda r: r.get("speculative") or "none",
    "tag": lambda r: r.get("tag") or "",
    "new tokens": lambda r: int(r["n_new_tokens"] or 0),
    "status": lambda r: r["status"],
    "started (UTC)": lambda r: r["started_at"].strftime("%Y-%m-%d %H:%M") if r.get("started_at") is not None else "",
    "model": lambda r: r["model"],
}


# what a runs table shows at a glance: every one reads whole in a window 1024 px wide; the rest behind "All columns"
RUN_GLANCE = ["run", "time to first token (ms)", "time per output token (ms)", "tokens/s", "settings", "tag"]
# short headers for the long names, each with its full name as the header's help
RUN_HEADERS = {
    "time to first token (ms)": st.column_config.NumberColumn("TTFT (ms)", help="time to first token (ms)"),
    "time per output token (ms)": st.column_config.NumberColumn("TPOT (ms)", help="time per output token (ms)"),
    "tokens/s": st.column_config.NumberColumn("tokens/s", help="tokens per second, end to end"),
    "settings": st.column_config.TextColumn("settings", help="the weights, then what differs from a plain run: "
                                            "no KV cache, sparsity, a speculative method, a batch of users"),
}


def runs_table(table: pd.DataFrame, every_column: bool = False, **options):
    """A readable_runs table: at a glance its figures, settings and tag, or every readable column."""
    return st.dataframe(table, hide_index=True, width="stretch", column_config=RUN_HEADERS,
                        column_order=None if every_column else RUN_GLANCE, **options)


def ratio_cell(against) -> str:
    """A speed against the baseline's (engine.measure.compare) in a few characters: the ratio and its 95% interval,
    so a table's row reads whole; its verdict goes in a line beside the table."""
    span = f"{against.low:.2f}-{against.high:.2f}" if against.low is not None else "single runs"
    return f"{against.ratio:.2f}x ({span})"


def readable_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """Runs as people read them: human column names with units, rounded figures, the settings that
    tell runs apart (weights, KV cache, sparsity, speculative method, tag), text made safe to export."""
    rows = [{name: get(row) for name, get in RUN_COLUMNS.items()} for row in runs.to_dict("records")]
    return csv_safe(pd.DataFrame(rows, columns=list(RUN_COLUMNS)))


def log_ticks(values, thousands: bool = False) -> dict:
    """Tick values and labels for a log axis over these values: one tick a decade when the data
    spans three or more, else the 1-2-5 steps between, each labelled as a plain number (with
    thousands: 1k, 10k, 1M for counts such as tokens)."""
    import math

    positive = [float(v) for v in values if v is not None and v == v and v > 0]
    if not positive:
        return {}
    low, high = math.floor(math.log10(min(positive))), math.ceil(math.log10(max(positive)))
    high = max(high, low + 1)
    steps = (1,) if high - low >= 3 else (1, 2, 5)
    ticks = [m * 10 ** e for e in range(low, high + 1) for m in steps]
    ticks = [t for t in ticks if t <= 10 ** high]
    return {"tickvals": ticks, "ticktext": [count_label(t) if thousands else f"{t:g}" for t in ticks]}


def count_label(value: float) -> str:
    """A count in a few characters: 512, 1k, 10k, 1M."""
    for size, suffix in ((1e6, "M"), (1e3, "k")):
        if value >= size:
            return f"{value / size:g}{suffix}"
    return f"{value:g}"


JS_SAFE_INTEGER = 2**53 - 1  # the largest whole number a browser's number field holds exactly


def whole_number_input(where, label: str, low: int | None = None, high: int | None = None, value: int = 0,
                       step: int = 1, **options) -> int:
    """A number field for a whole number. Streamlit's whole-number field reads what is typed with the
    browser's parseInt, so `1e6` silently becomes 1; this one reads it as a number (1,000,000, or the
    browser's own sentence when that is beyond the range), shows no decimals, and rounds a fraction with
    a line that says so. The range is capped at what the browser holds exactly."""
    high = JS_SAFE_INTEGER if high is None else min(high, JS_SAFE_INTEGER)
    low = -JS_SAFE_INTEGER if low is None else max(low, -JS_SAFE_INTEGER)
    typed = where.number_input(label, float(low), float(high), float(value), float(step), format="%.0f", **options)
    whole = round(typed)
    if whole != typed:
        where.warning(f"{label} takes whole numbers: {typed:g} is read as {whole}.")
    return whole


def setting_input(where, label: str, name: str, step: float | None = None, value=None, help: str | None = None):
    """A number field for a generation setting: its range from engine.spec.LIMITS, its default from
    the run specification's."""
    limit = LIMITS[name]
    default = SPEC_DEFAULTS[name] if value is None else value
    if limit.whole:
        return whole_number_input(where, label, int(limit.low), int(limit.high), int(default), help=help)
    return where.number_input(label, float(limit.low), float(limit.high), float(default), step, help=help)


def flash(message: str) -> None:
    """A success line shown once, on the next run of the page (st.rerun would wipe one shown now)."""
    st.session_state["_flash"] = message


def show_flash() -> None:
    message = st.session_state.pop("_flash", None)
    if message:
        st.success(message)


def level_table(device: str):
    rows = []
    for level in LEVELS:  # the registry: a level registered anywhere shows here
        info = level_info(level, pick_device(device))
        rows.append({"level": level, "kernel": info.kernel,
                     "accelerated": "yes" if info.accelerated else "no (emulated)", "what it means": info.note})
    return pd.DataFrame(rows)


class GenerationQueue:
    """Generations run one at a time, in arrival order, so runs on one device are never interleaved
    (and their timings never share the cores)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._waiting: list[object] = []

    @contextmanager
    def turn(self, on_wait):
        """Wait for this session's turn; on_wait(position) is called while others are ahead."""
        ticket = object()
        with self._cond:
            self._waiting.append(ticket)
        try:
            with self._cond:
                while self._waiting[0] is not ticket:
                    on_wait(self._waiting.index(ticket))
                    self._cond.wait(timeout=0.5)
            yield
        finally:
            with self._cond:
                self._waiting.remove(ticket)
                self._cond.notify_all()


@st.cache_resource(show_spinner=False)
def generation_queue() -> GenerationQueue:
    return GenerationQueue()


@st.cache_resource(show_spinner=False)
def generation_worker() -> GenerationWorker:
    """The process the Live page's generations run in (engine.run.worker): the model's threads then share
    no process with the server's."""
    return GenerationWorker()


@st.cache_resource(show_spinner=False)
def warm_up() -> dict:
    """Once per server, as it starts (engine/access.py's launcher, which make run and make share use) or else
    on the first page anyone opens: start the generation process and load the default model in it, in a thread through the queue, so the first Generate click finds both ready
    (a run clicked sooner waits its turn). The model comes first; a calibration is measured after it
    only where none of this device is stored or reusable from the machine's calibration cache. The
    dict says how far it got (warm_up_words): loading, calibrating, ready, failed, or off where
    TOKENPATH_WARM=0 (tests of pages that run nothing)."""
    if os.environ.get("TOKENPATH_WARM") == "0":
        return {"state": "off"}
    state = {"state": "loading", "started": time.monotonic()}
    queue, worker = generation_queue(), generation_worker()
    try:
        db = str(Store().path)
    except StoreError as exc:
        return {**state, "state": "failed", "message": str(exc)}
    request = {"db": db, "warm": True, "spec": RunSpec(gen=GenConfig("warm"), model=default_model_id()).to_dict()}

    def ending(request: dict) -> dict:
        return next(payload for kind, payload in worker.generate(request, every_s=60.0) if kind == "done")

    def load():
        try:
            with queue.turn(lambda position: None):
                loaded = ending(request)
                if loaded["calibration"] is None:
                    state.update(state="calibrating", started=time.monotonic())
                    ending({"db": db, "device": loaded["device"], "calibrate": True, "missing_only": True})
                state.update(state="ready", seconds=loaded["seconds"])
        except (WorkerRefused, WorkerFailed) as exc:
            state.update(state="failed", message=str(exc))

    threading.Thread(target=load, daemon=True, name="tokenpath-warm-up").start()
    return state


def warm_up_words(state: dict) -> str | None:
    """What the generation process is doing, in one sentence, or None where there is nothing to say."""
    since = f"{time.monotonic() - state.get('started', time.monotonic()):.0f} s"
    if state["state"] == "loading":
        return (f"Loading the default model in the generation process ({since} so far, once per server start): "
                "a run started now begins as soon as it is loaded.")
    if state["state"] == "calibrating":
        return (f"Calibrating this device ({since} so far): measuring its memory bandwidth and compute peaks, "
                "once per machine, since no recent calibration of it is stored or cached. The model is loaded; "
                "a run started now begins when the calibration ends.")
    if state["state"] == "ready":
        return f"Ready: the default model is loaded in the generation process (in {state['seconds']:.1f} s)."
    if state["state"] == "failed":
        return f"The generation process could not load the default model: {state['message']}"
    return None


def show_warm_up() -> None:
    """What the generation process is doing, redrawn every second while it loads or calibrates."""
    busy = warm_up()["state"] in ("loading", "calibrating")

    @st.fragment(run_every=1.0 if busy else None)
    def status():
        state = warm_up()
        words = warm_up_words(state)
        if words is None:
            return
        if state["state"] in ("loading", "calibrating"):
            st.info(md_escape(words), icon=":material/hourglass_top:")
        elif state["state"] == "failed":
            st.warning(md_escape(words))
        else:
            st.caption(md_escape(words))

    status()


def open_store() -> Store | None:
    """The server's Store of the database (opened once, engine.store.db.store_at), with the runs of processes
    that died since the last rerun folded in."""
    try:
        store = store_at()
        store.recover()
        return store
    except StoreError as exc:
        st.error(str(exc))
        return None


@st.cache_data(show_spinner=False)
def device_facts(device: str) -> dict:
    return hardware.hardware_summary(pick_device(device))


def calibration_verdict(store: Store | None) -> hardware.CalibrationVerdict:
    """The engine's verdict on this device's calibration in use (engine.measure.hardware)."""
    return hardware.calibration_verdict(store, hardware.device_key(pick_device("auto")))


def show_calibration_verdict(store: Store | None, where: str, always_offer: bool = False) -> hardware.CalibrationVerdict:
    """The calibration verdict as every page shows it: the sentence, its evidence, and the one action
    (calibrate now, in the generation process) when it is not trustworthy, or always_offer. The button's click
    is kept in the session and acted on at the next draw, so a verdict drawn again later in a run (the Live
    page's, after a generation) offers a button that works too."""
    if st.session_state.pop("_calibrate_requested", False) and store is not None:
        with st.spinner("Measuring memory bandwidth, matmul peak and dispatch cost in the generation process "
                        "(after any generation already queued)..."):
            try:
                run_in_worker({"db": str(store.path), "device": "auto", "calibrate": True})
            except (WorkerRefused, WorkerFailed) as exc:
                st.error(md_escape(str(exc)))
    verdict = calibration_verdict(store)
    box = st.success if verdict.trustworthy else st.warning
    box(f"**Calibration:** {md_escape(verdict.headline)}", icon=":material/speed:")
    st.caption(md_escape(verdict.why))
    action = verdict.action or ("Calibrate again (a few seconds)" if always_offer else None)
    if action and store is not None:
        st.button(action, key=f"_calibrate_{where}",
                  on_click=lambda: st.session_state.update(_calibrate_requested=True))
    return verdict


def default_model_id() -> str:
    return os.environ.get("TOKENPATH_MODEL", "default")


def run_in_worker(request: dict, on_wait=None) -> dict:
    """Run one request (a generation, or a calibration) in the generation process after the queue's
    earlier requests, and return its ending summary; raises WorkerRefused or WorkerFailed with one
    sentence. Model work never runs in the server process."""
    with generation_queue().turn(on_wait or (lambda position: None)):
        for kind, payload in generation_worker().generate(request, every_s=60.0):
            if kind == "done":
                return payload
    raise WorkerFailed("The generation process ended the request without a result.")


def worker_request(spec: RunSpec, store: Store) -> dict:
    return {"db": str(store.path), "spec": spec.to_dict()}


LIVE_BAR_COLUMNS = 300


def live_bars(token_rows: list[dict], height_px: int = 150, max_columns: int = LIVE_BAR_COLUMNS) -> str:
    """The per-token stacked buckets as one SVG picture, for redrawing while a run streams: the
    browser decodes one image where a column of HTML elements per token cost it layout and paint at
    every redraw, time the model on the same cores lost. Past max_columns tokens
    each column is the mean of neighbouring tokens, so a redraw stays the same size however long
    the run grows. The Plotly chart, with its hover values, replaces it at the end."""
    if not token_rows:
        return ""
    per_column = -(-len(token_rows) // max_columns)
    drawn = series(token_rows)
    columns = []
    for start in range(0, len(token_rows), per_column):
        group = token_rows[start:start + per_column]
        columns.append([sum(row[key] or 0.0 for row in group) / len(group) for _, key, _ in drawn])
    top = max(sum(column) for column in columns) or 1.0
    width = max(2, min(12, 900 // len(columns)))
    paths = {name: [] for name, _, _ in drawn}
    for i, column in enumerate(columns):
        y = float(height_px)
        for (name, _, _), ms in zip(drawn, column):  # physical at the bottom, as in the Plotly chart
            h = ms / top * height_px
            if h > 0.05:
                y = max(y - h, 0.0)  # the tallest column's top, without rounding error's "-0.0"
                paths[name].append(f"M{i * (width + 1)} {y:.1f}h{width}v{h:.1f}h-{width}z")
    colours = {name: colour for name, _, colour in drawn}
    shapes = "".join(f'<path fill="{colours[n]}" d="{"".join(d)}"/>' for n, d in paths.items() if d)
    svg_width = len(columns) * (width + 1)
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{svg_width}" height="{height_px}">{shapes}'
           f'<line x1="0" y1="{height_px}" x2="{svg_width}" y2="{height_px}" stroke="#999"/></svg>')
    legend = " ".join(f'<span style="color:{colour}">&#9632;</span> {name}' for name, _, colour in drawn)
    picture = base64.b64encode(svg.encode()).decode()
    what = "token" if per_column == 1 else f"mean of {per_column} tokens"
    return (f'<div style="font-size:0.8rem">Where each token\'s time went (ms per token, one column per {what}; '
            f'the tallest column is {top:.1f} ms) &nbsp; {legend}</div>'
            f'<img alt="per-token buckets" src="data:image/svg+xml;base64,{picture}" style="max-width:100%">'
            f'<div style="font-size:0.75rem;color:#666">token index 0 to {token_rows[-1]["idx"]}, growing while '
            f'the run streams</div>')
