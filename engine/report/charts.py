"""Plotly figures of the five buckets that the pages and the report share, in one palette
(Okabe-Ito, colour-blind safe) with fonts large enough to read on a projector."""
from __future__ import annotations

import textwrap

import plotly.graph_objects as go

from engine.measure.distances import BUCKETS

# Okabe & Ito's palette: its colours stay apart under red-green and blue-yellow colour blindness
# (tests/test_report.py checks every pair under simulated deficiencies); its yellow is left out
# because it vanishes on a white projector screen.
BUCKET_COLOURS = {"physical": "#CC79A7", "memory": "#0072B2", "compute": "#009E73", "time": "#E69F00",
                  "decision": "#D55E00"}
# a served run's server time when no GPU is named to split it into memory and compute
SERVER_WORK = ("server work (not split)", "server_work_ms", "#999999")
FONT_SIZE = 16
TITLE_SIZE = 20
LEGEND = dict(orientation="h", yanchor="bottom", y=1.02, x=0, traceorder="normal", font=dict(size=FONT_SIZE))


def plot_escape(text) -> str:
    """Text made literal in a Plotly label, which reads <b>, <a href> and entities."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# characters of a title's line that fit a chart in the main column of a window 1024 px wide at TITLE_SIZE
TITLE_LINE = 48


def heading(title: str | None) -> tuple[dict | None, int]:
    """A chart's title, literal, at the top edge (so a legend wrapped onto two lines in a narrow window stays
    below it), broken at words into lines that a narrow window shows whole (Plotly never wraps a title), and
    the top margin (px) that holds it above the legend."""
    if not title:
        return None, 60
    lines = textwrap.wrap(str(title), TITLE_LINE, break_long_words=False, break_on_hyphens=False)
    # Plotly anchors a title's first line, the lines after it grow upward: pad its top by them
    return (dict(text="<br>".join(plot_escape(line) for line in lines), y=0.98, yanchor="top",
                 pad=dict(t=26 * (len(lines) - 1))), 74 + 26 * len(lines))


def readable(fig: go.Figure, **layout) -> go.Figure:
    """Projector-sized fonts and the legend above the plot; layout entries override."""
    fig.update_layout(font=dict(size=FONT_SIZE), title_font_size=TITLE_SIZE, legend=LEGEND,
                      hoverlabel=dict(font_size=FONT_SIZE), **layout)
    return fig


def _given(value) -> bool:
    """Whether a stored field holds something (a served run leaves the local switches empty: None or NaN)."""
    return value is not None and value == value and value != ""


def run_switches(row) -> list[str]:
    """The switches a run was made with, in words: weights, KV cache, sparsity, speculation, sampling;
    a served run names its server instead of the switches the server decides."""
    if getattr(row, "backend", "local") == "served":
        switches = ["served"]
    else:
        switches = [row.weights if _given(row.weights) else "fp32", "KV cache" if row.kv_cache else "no KV cache"]
        if _given(row.sparsity) and row.sparsity:
            switches.append(f"sparsity {row.sparsity:.0%} {row.sparsity_mode}")
        speculative = getattr(row, "speculative", None)
        if _given(speculative) and speculative != "none":
            switches.append(speculative)
    if _given(row.temperature) and row.temperature:
        switches.append(f"T={row.temperature:g}")
    return switches


def run_label(row) -> str:
    """A run in one line: number, model, switches, size, status."""
    tokens = int(row.n_new_tokens) if _given(row.n_new_tokens) else 0
    return f"#{row.run_id} {row.model} · {' · '.join(run_switches(row))} · {tokens} tokens · {row.status}"


def series(token_rows: list[dict]) -> list[tuple[str, str, str]]:
    """(name, row key, colour) of what a per-token picture stacks: the five buckets, and a served run's
    unsplit server work when its rows carry one."""
    drawn = [(b, f"{b}_ms", BUCKET_COLOURS[b]) for b in BUCKETS]
    if any(row.get("memory_ms") is None and row.get("server_work_ms") is not None for row in token_rows):
        drawn.append(SERVER_WORK)
    return drawn


def bucket_chart(token_rows: list[dict], title: str = "Where each token's time went",
                 clip_prefill: bool = False) -> go.Figure:
    """Per-token stacked bars of the five buckets (ms), the title taken literally. clip_prefill scales the axis to the decode
    tokens and writes the first token's height on it, since the prefill can dwarf them."""
    fig = go.Figure()
    xs = [row["idx"] for row in token_rows]
    drawn = series(token_rows)
    for name, key, colour in drawn:
        fig.add_bar(x=xs, y=[row[key] or 0.0 for row in token_rows], name=name, marker_color=colour,
                    hovertemplate=f"token %{{x}}: {name} %{{y:.2f}} ms<extra></extra>")
    heights = [sum(row[key] or 0.0 for _, key, _ in drawn) for row in token_rows]
    if clip_prefill and len(heights) > 1 and heights[0] > 2 * max(heights[1:]):
        top = 1.15 * max(heights[1:])
        fig.update_yaxes(range=[0, top])
        fig.add_annotation(x=xs[0], y=top, text=f"first token (prefill): {heights[0]:,.0f} ms, off the scale",
                           showarrow=False, xanchor="left", yanchor="top", font=dict(size=FONT_SIZE))
    title, top = heading(title)
    return readable(fig, barmode="stack", title=title, xaxis_title="token index", yaxis_title="ms per token",
                    height=280 + top, margin=dict(l=60, r=10, t=top, b=50))


def wrapped_label(label: str, width: int = 34) -> str:
    """A run label made literal for Plotly and broken between its " · " parts into lines of about `width`
    characters, so a narrow window keeps room for the bars."""
    lines: list[str] = []
    for part in str(label).split(" · "):
        if lines and len(lines[-1]) + 3 + len(part) <= width:
            lines[-1] += " · " + part
        else:
            lines.append(part)
    return "<br>".join(plot_escape(line) for line in lines)


def totals_chart(labels: list[str], rows: list[dict], per_token: bool = True, title: str | None = None) -> go.Figure:
    """One horizontal stacked bar per run (rows carry the run's `{bucket}_ms` totals and
    `n_new_tokens`), in ms per token or ms per run; the first run is drawn at the top."""
    fig = go.Figure()
    for b in BUCKETS:
        values = [(row[f"{b}_ms"] or 0.0) / ((row["n_new_tokens"] or 1) if per_token else 1) for row in rows]
        fig.add_bar(y=[wrapped_label(label) for label in labels], x=values, name=b, orientation="h",
                    marker_color=BUCKET_COLOURS[b],
                    hovertemplate=f"%{{y}}<br>{b}: %{{x:.2f}} ms<extra></extra>")
    unit = "ms per token" if per_token else "ms per run"
    title, top = heading(title)
    return readable(fig, barmode="stack", title=title, xaxis_title=unit, yaxis=dict(autorange="reversed"),
                    height=100 + top + 48 * len(rows), margin=dict(l=10, r=10, t=top, b=50))
