"""One self-contained HTML report of stored runs, to hand over: the machine and calibration, each
run's settings, the five-bucket pictures, a comparison with speedups and quality, every definition.

The page is built from sections (a title, HTML, Plotly figures), so a sweep, a load sweep or a
story can add sections of their own; Plotly's JavaScript is inlined once and nothing is fetched."""
from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import plotly.io as pio
from plotly.offline import get_plotlyjs

from engine.errors import UserError
from engine.run.reproduce import run_command
from engine.report.advisor import against, arms, mixed_repeats
from engine.report.charts import BUCKET_COLOURS, bucket_chart, run_label, run_switches, totals_chart
from engine.report.definitions import BUCKET_MEANING, BUCKET_NOTE, METRICS
from engine.measure.distances import FORMULAS
from engine.measure.distances import BUCKETS
from engine.paths import text_digest
from engine.store.sql import utcnow

FIGURE_CONFIG = {"displaylogo": False, "responsive": True}
STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; font-size: 18px;
       line-height: 1.45; color: #111; max-width: 1280px; margin: 2rem auto; padding: 0 1.5rem; }
h1 { font-size: 2.1rem; } h2 { font-size: 1.6rem; margin-top: 2.5rem; border-bottom: 2px solid #ddd; }
h3 { font-size: 1.25rem; }
table { border-collapse: collapse; margin: 0.8rem 0; font-size: 16px; }
th, td { border: 1px solid #ccc; padding: 0.3rem 0.6rem; text-align: left; vertical-align: top;
         overflow-wrap: anywhere; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
th { background: #f2f2f2; }
pre { white-space: pre-wrap; overflow-wrap: anywhere; background: #f7f7f7; padding: 0.6rem; font-size: 15px; }
summary { overflow-wrap: anywhere; }
.swatch { display: inline-block; width: 1em; height: 1em; vertical-align: -0.15em; margin-right: 0.3em; }
.note { color: #444; }
"""


class ReportError(UserError):
    """The report cannot be made; the message is one sentence for the user."""


@dataclass
class Section:
    """One part of a report: a heading, trusted HTML, then figures."""
    title: str
    html: str = ""
    figures: list = field(default_factory=list)


def build_html(title: str, sections: list[Section], intro: str = "") -> str:
    """The whole report as one HTML document that opens without a network."""
    body = []
    for section in sections:
        body.append(f'<section><h2>{html.escape(section.title)}</h2>{section.html}')
        body += [pio.to_html(fig, include_plotlyjs=False, full_html=False, config=FIGURE_CONFIG)
                 for fig in section.figures]
        body.append("</section>")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<link rel="icon" href="data:,"><style>{STYLE}</style>'
            f'<script type="text/javascript">{get_plotlyjs()}</script></head>'
            f'<body><h1>{html.escape(title)}</h1>{intro}{"".join(body)}</body></html>\n')


def _clean(value):
    """None for the missing values pandas and DuckDB hand back (NaN, NaT)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return value


def load_runs(store, run_ids: list[int]) -> list[dict]:
    """The runs, in the order asked for, with their JSON columns decoded."""
    ids = list(dict.fromkeys(int(i) for i in run_ids))
    if not ids:
        raise ReportError("No runs to report: choose one or more run ids.")
    marks = ", ".join("?" for _ in ids)
    frame = store.query(f"SELECT * EXCLUDE (token_ids) FROM runs WHERE run_id IN ({marks})", ids)
    found = {int(row["run_id"]): {k: _clean(v) for k, v in row.items()} for row in frame.to_dict("records")}
    missing = [i for i in ids if i not in found]
    if missing:
        runs = "runs" if len(missing) > 1 else "run"
        raise ReportError(f"No {runs} {', '.join(f'#{i}' for i in missing)} in {store.path}: "
                          "`python -m engine runs` lists the runs it holds.")
    runs = [found[i] for i in ids]
    for run in runs:
        for column in ("config", "hardware", "metrics"):
            run[column] = json.loads(run[column]) if run[column] else {}
    return runs


def quality_variant(run: dict) -> str:
    """The variant name the quality table stores for a run's weights and sparsity."""
    weights = run["weights"] or "fp32"
    return weights + (f" sparsity {run['sparsity']:g} {run['sparsity_mode']}" if run["sparsity"] else "")


def latest_quality(store, runs: list[dict]) -> dict[int, dict]:
    """The newest stored quality measurement of each run's model and variant on the shipped evaluation text (figures
    scored on a user's own text are not comparable with it), by run id."""
    frame = store.query("SELECT * FROM quality WHERE eval_text_sha = ? ORDER BY created_at DESC", [text_digest()])
    rows = frame.to_dict("records")
    found = {}
    for run in runs:
        match = next((r for r in rows if r["model"] == run["model"] and r["variant"] == quality_variant(run)), None)
        if match:
            found[run["run_id"]] = match
    return found


def fmt(value, spec: str = ".1f", suffix: str = "") -> str:
    value = _clean(value)
    return "–" if value is None else f"{value:{spec}}{suffix}"


def table(header: list[str], rows: list[list[str]], numeric_from: int | None = None) -> str:
    """An HTML table of already formatted, already escaped cells; columns from numeric_from on are
    right-aligned numbers."""
    head = "".join(f"<th>{h}</th>" for h in header)
    numeric = numeric_from if numeric_from is not None else len(header)
    body = "".join("<tr>" + "".join(("<td class=n>" if i >= numeric else "<td>") + f"{c}</td>"
                                    for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def label(run: dict) -> str:
    return run_label(SimpleNamespace(**run))


def switches(run: dict) -> str:
    return " · ".join(run_switches(SimpleNamespace(**run)))


def _ratio(value, base):
    return value / base if _clean(value) and _clean(base) else None


def comparison_section(runs: list[dict], quality: dict[int, dict]) -> Section:
    header = ["run", "settings", "status", "new tokens", "TTFT ms", "TPOT ms", "decode tok/s",
              "tok/s end to end", "weights read per forward MB", "KV bytes per token",
              "roofline / measured forward", "acceptance rate", "tokens per target forward", "perplexity",
              "KL divergence (nats)", "top-1 agreement"]
    rows = []
    for run in runs:
        m, speculative, q = run["metrics"], run["metrics"].get("speculative", {}), quality.get(run["run_id"], {})
        rows.append([f"#{run['run_id']}", html.escape(switches(run)), html.escape(run["status"]),
                     fmt(run["n_new_tokens"], "d"), fmt(run["ttft_ms"]), fmt(run["tpot_ms"]),
                     fmt(run["decode_tokens_per_s"]), fmt(run["tokens_per_s"]),
                     fmt(_ratio(m.get("weight_bytes_per_forward"), 1e6)), fmt(m.get("kv_bytes_per_token"), ",d"),
                     fmt(m.get("roofline_ratio_decode"), ".0%"), fmt(speculative.get("acceptance_rate"), ".0%"),
                     fmt(speculative.get("tokens_per_target_forward", 1.0 if run["n_new_tokens"] else None), ".2f"),
                     fmt(q.get("perplexity"), ".3f"), fmt(q.get("kl_mean"), ".5f"), fmt(q.get("top1_agreement"), ".1%")])
    from engine.measure.hardware import above_peak_sentence  # torch comes with it: only when a report is made

    above = [f"#{run['run_id']}: {html.escape(sentence)}" for run in runs
             if (sentence := above_peak_sentence(run["metrics"].get("roofline_ratio_decode")))]
    note = ('<p class="note">Quality is the newest stored '
            "measurement of the same model and variant (<code>python -m engine quality</code>), teacher-forced on "
            "data/eval.txt against fp32 dense; – where none is stored. Memory and compute buckets and the roofline "
            "are estimates from the calibration; every time is measured.</p>"
            + "".join(f'<p class="note">{line}</p>' for line in above))
    return Section("Comparison", settings_compared(runs) + note + table(header, rows, numeric_from=3))


def settings_compared(runs: list[dict]) -> str:
    """Each setting's speed against the first run's setting, its runs taken as repeats: the ratio with its 95%
    interval, "no measurable difference" where the interval includes 1 (engine.measure.compare)."""
    groups = arms(runs)
    base = groups[0]
    rows = [[html.escape(a["label"]), ", ".join(f"#{i}" for i in a["run_ids"]), str(a["repeats"]),
             fmt(a["decode_tokens_per_s"]), html.escape(against(base["decode_rates"], a["decode_rates"])),
             html.escape(against(base["end_to_end_rates"], a["end_to_end_rates"]))] for a in groups]
    header = ["setting", "runs", "repeats", "decode tok/s (mean)", "decode against the first setting",
              "end to end against the first setting"]
    return (f'<p class="note">Each setting against the first run\'s ({html.escape(base["label"])}), the runs of one '
            "setting taken as its repeats. The 95% interval is Welch's t over the repeats' log speeds; where it "
            "includes 1 there is no measurable difference, and single runs give no interval.</p>"
            + "".join(f'<p class="note">{html.escape(line)}</p>' for line in mixed_repeats(groups))
            + table(header, rows, numeric_from=2))


def machine_section(runs: list[dict]) -> Section:
    """Each distinct machine and calibration, with the runs attributed with it."""
    groups: dict[str, list[dict]] = {}
    for run in runs:
        key = json.dumps([run["hardware"], run["metrics"].get("calibration")], sort_keys=True)
        groups.setdefault(key, []).append(run)
    parts = []
    for members in groups.values():
        hw, cal = members[0]["hardware"], members[0]["metrics"].get("calibration") or {}
        cpu, gpus = hw.get("cpu") or {}, (hw.get("gpu") or {}).get("gpus", [])  # a served run names no local GPU
        rows = [["runs", ", ".join(f"#{r['run_id']}" for r in members)], ["device", hw.get("device", "–")],
                ["CPU", f"{cpu.get('model', '–')}, {cpu.get('physical_cores', '–')} cores "
                        f"({cpu.get('logical_cores', '–')} logical), torch uses {cpu.get('torch_threads', '–')} threads"],
                ["RAM", fmt(_ratio(cpu.get("ram_bytes"), 2**30), ".1f", " GiB")],
                ["GPU", "; ".join(str(g.get("name", g)) for g in gpus) or hw.get("cuda_device") or "none"],
                ["torch", hw.get("torch", "–")], ["calibration", cal.get("device_key", "none stored with the run")],
                ["memory bandwidth (GEMV, cold weights)", fmt(cal.get("memory_gbps"), ".1f", " GB/s")]]
        rows += [[f"matmul peak {dtype}", fmt(gflops, ".3g", " GFLOP/s")]
                 for dtype, gflops in (cal.get("matmul_gflops") or {}).items()]
        rows.append(["dispatch overhead per op", fmt(cal.get("dispatch_us"), ".1f", " µs")])
        parts.append(table(["", ""], [[html.escape(k), html.escape(str(v))] for k, v in rows]))
    return Section("Machine and calibration", "".join(parts))


def pictures_section(runs: list[dict], token_rows: dict[int, list[dict]]) -> Section:
    labels = [label(run) for run in runs]
    figures = [totals_chart(labels, runs, per_token=True, title="Where the time went, per run (ms per token)")]
    figures += [bucket_chart(token_rows[run["run_id"]], f"#{run['run_id']}: where each token's time went",
                            clip_prefill=True)
                for run in runs if token_rows[run["run_id"]]]
    legend = " ".join(f'<span class="swatch" style="background:{BUCKET_COLOURS[b]}"></span>{b}' for b in BUCKETS)
    return Section("The five buckets", f"<p>{legend}</p>", figures)


def settings_section(runs: list[dict]) -> Section:
    """Every setting of every run side by side, values that differ from the first run in bold;
    then each run's prompt and output."""
    keys = list(dict.fromkeys(k for run in runs for k in run["config"] if k not in ("prompt", "run_spec")))

    def cell(run, key):
        value = run["config"].get(key)
        text = html.escape(value if isinstance(value, str) else json.dumps(value))
        return f"<b>{text}</b>" if value != runs[0]["config"].get(key) else text

    rows = [[html.escape(key), *(cell(run, key) for run in runs)] for key in keys]
    rows.append(["started (UTC)", *(run["started_at"].isoformat(sep=" ", timespec="seconds") if run["started_at"]
                                    else "–" for run in runs)])
    texts = []
    for run in runs:
        error = f"<p><b>error:</b> {html.escape(run['error'])}</p>" if run["error"] else ""
        texts.append(f"<details><summary>{html.escape(label(run))}: prompt and output</summary>{error}"
                     f"<p>prompt</p><pre>{html.escape(run['prompt'] or '')}</pre>"
                     f"<p>output</p><pre>{html.escape(run['output'] or '')}</pre>"
                     f"<p>the command that makes it again</p><pre>{html.escape(run_command(run))}</pre></details>")
    note = '<p class="note">Values that differ from the first run are in bold.</p>'
    return Section("Each run's settings", note + table(["setting", *(f"#{run['run_id']}" for run in runs)], rows)
                   + "".join(texts))


def definitions_section() -> Section:
    buckets = "".join(f'<li><span class="swatch" style="background:{BUCKET_COLOURS[b]}"></span><b>{b}</b>: '
                      f"{html.escape(BUCKET_MEANING[b])}</li>" for b in BUCKETS)
    metrics = "".join(f"<li><b>{html.escape(name)}</b>: {html.escape(text)}</li>" for name, text in METRICS)
    return Section("Definitions", f"<h3>The five buckets</h3><ul>{buckets}</ul><p>Per step, in milliseconds:</p><pre>{html.escape(FORMULAS)}</pre><p>{html.escape(BUCKET_NOTE)}</p>"
                                  f"<h3>Metrics</h3><ul>{metrics}</ul>")


def run_sections(store, run_ids: list[int]) -> list[Section]:
    """The standard sections for these runs; raises ReportError for none or unknown ids."""
    runs = load_runs(store, run_ids)
    tokens = {run["run_id"]: store.tokens(run["run_id"]).to_dict("records") for run in runs}
    return [comparison_section(runs, latest_quality(store, runs)), pictures_section(runs, tokens),
            machine_section(runs), settings_section(runs)]


def runs_report(store, run_ids: list[int], title: str | None = None, extra: list[Section] = ()) -> str:
    """The report of these runs; `extra` sections (a sweep's, a story's) come before the definitions."""
    sections = run_sections(store, run_ids)
    ids = ", ".join(f"#{i}" for i in dict.fromkeys(int(i) for i in run_ids))
    intro = (f'<p class="note">Tokenpath report of runs {ids}, made {utcnow():%Y-%m-%d %H:%M} UTC from '
             f"{html.escape(store.path.name)}. Every figure below comes from the stored runs.</p>")
    return build_html(title or f"Tokenpath: runs {ids}", [*sections, *extra, definitions_section()], intro)
