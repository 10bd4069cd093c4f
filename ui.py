"""What every page shares: the store, the generation queue and process, bucket colours.
Pages stay thin: they send model work to the generation process and read DuckDB through these."""
from __future__ import annotations

import base64
import os
import threading
from contextlib import contextmanager

import pandas as pd
import streamlit as st

from engine import hardware
from engine.charts import BUCKET_COLOURS, bucket_chart, run_label  # noqa: F401 (pages read them from here)
from engine.definitions import BUCKET_MEANING  # noqa: F401
from engine.distances import BUCKETS
from engine.models import pick_device
from engine.quant import LEVELS, level_info
from engine.spec import RunSpec
from engine.store import Store, StoreError
from engine.worker import GenerationWorker, WorkerFailed

# (file, label) of every page, in the order the sidebar lists them
PAGES = [("app.py", "Home"), ("pages/live.py", "Live generation"), ("pages/distances.py", "Distances"),
         ("pages/runs.py", "Runs"), ("pages/sweeps.py", "Sweeps"), ("pages/serving.py", "Serving"),
         ("pages/hardware.py", "Hardware"), ("pages/kv_calculator.py", "KV calculator"), ("pages/planner.py", "Planner")]


def page_setup(title: str) -> None:
    """Page config and the sidebar's page links (Streamlit's own list would call the home page 'app')."""
    st.set_page_config(page_title=f"{title} · Tokenpath" if title != "Tokenpath" else title,
                       page_icon=":material/route:", layout="wide")
    with st.sidebar:
        for path, label in PAGES:
            st.page_link(path, label=label)


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
    """The process the Live page's generations run in (engine.worker): the model's threads then share
    no process with the server's."""
    return GenerationWorker()


def open_store() -> Store | None:
    try:
        return Store()
    except StoreError as exc:
        st.error(str(exc))
        return None


@st.cache_data(show_spinner=False)
def device_facts(device: str) -> dict:
    return hardware.hardware_summary(pick_device(device))


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
    columns = []
    for start in range(0, len(token_rows), per_column):
        group = token_rows[start:start + per_column]
        columns.append([sum(row[f"{b}_ms"] for row in group) / len(group) for b in BUCKETS])
    top = max(sum(column) for column in columns) or 1.0
    width = max(2, min(12, 900 // len(columns)))
    paths = {b: [] for b in BUCKETS}
    for i, column in enumerate(columns):
        y = float(height_px)
        for b, ms in zip(BUCKETS, column):  # physical at the bottom, as in the Plotly chart
            h = ms / top * height_px
            if h > 0.05:
                y = max(y - h, 0.0)  # the tallest column's top, without rounding error's "-0.0"
                paths[b].append(f"M{i * (width + 1)} {y:.1f}h{width}v{h:.1f}h-{width}z")
    shapes = "".join(f'<path fill="{BUCKET_COLOURS[b]}" d="{"".join(d)}"/>' for b, d in paths.items() if d)
    svg_width = len(columns) * (width + 1)
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{svg_width}" height="{height_px}">{shapes}'
           f'<line x1="0" y1="{height_px}" x2="{svg_width}" y2="{height_px}" stroke="#999"/></svg>')
    legend = " ".join(f'<span style="color:{BUCKET_COLOURS[b]}">&#9632;</span> {b}' for b in BUCKETS)
    picture = base64.b64encode(svg.encode()).decode()
    what = "token" if per_column == 1 else f"mean of {per_column} tokens"
    return (f'<div style="font-size:0.8rem">Where each token\'s time went (ms per token, one column per {what}; '
            f'the tallest column is {top:.1f} ms) &nbsp; {legend}</div>'
            f'<img alt="per-token buckets" src="data:image/svg+xml;base64,{picture}" style="max-width:100%">'
            f'<div style="font-size:0.75rem;color:#666">token index 0 to {token_rows[-1]["idx"]}, growing while '
            f'the run streams</div>')
