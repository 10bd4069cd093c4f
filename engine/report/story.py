"""The story: the seed's four distances as four chapters of experiments, each a lever against its baseline.

Each chapter's runs are RunSpecs tagged story:<chapter>:<arm>, REPEATS of each arm interleaved, run through the
normal worker and stored as ordinary runs; a lever's speed ratio comes with its 95% interval over the repeats. The
physical chapter adds the planner's deployment estimates and, given a server, one served run."""
from __future__ import annotations

import html
import statistics

import plotly.io as pio
from dataclasses import dataclass, field

from engine.plan import planner as plan
from engine.report import story_capacity as capacity
from engine.report.charts import totals_chart
from engine.measure.distances import BUCKETS
from engine.report.html import (FIGURE_CONFIG, ReportError, Section, build_html, definitions_section, fmt, latest_quality,
                     load_runs, run_sections, table)
from engine.measure.compare import compare, interleaved, usable
from engine.store.sql import utcnow
from engine.spec import GenConfig, RunSpec

TAG = "story"
# Three interleaved repeats of 6 tokens decode about as many tokens per arm as one run of 16 did, so a play
# costs about the same decode time plus two more prefills and run starts per arm; the repeats give the interval.
REPEATS = 3
NEW_TOKENS = 6
SHORT_PROMPT = "Name three colours of the sea."
# a prompt the answer copies from: prompt lookup finds its continuation in it
COPY_PROMPT = ("Repeat this list exactly:\nred apples, green pears, yellow lemons, purple plums, orange peaches.\n"
               "red apples, green pears, yellow lemons, purple plums, orange peaches.")
SERVED_TOKENS = 16


@dataclass(frozen=True)
class Arm:
    """One run of a comparison: its key in the tag, its label, and what differs from plain fp32 greedy."""
    key: str
    label: str
    weights: str = "fp32"
    kv_cache: bool = True
    prompt: str = SHORT_PROMPT
    sparsity: float = 0.0
    sparsity_mode: str = "mask"
    gen: dict = field(default_factory=dict)  # speculative settings (GenConfig fields)
    users: int = 1  # sequences decoded together in one batch: each repeat is one batch of this many runs


@dataclass(frozen=True)
class Comparison:
    """A lever against its baseline, and the figures that tell what it changed."""
    title: str
    measures: str
    baseline: Arm
    levers: tuple[Arm, ...]
    figures: tuple[str, ...]

    @property
    def arms(self) -> tuple[Arm, ...]:
        return (self.baseline, *self.levers)


@dataclass(frozen=True)
class Chapter:
    key: str
    title: str
    thesis: str
    lever: str
    comparisons: tuple[Comparison, ...] = ()


FP32 = Arm("fp32", "fp32 (4 bytes a weight)")
SPECULATIVE_DRAFT = dict(speculative="draft", draft_model="self-int8", speculative_k=3)
CHAPTERS = (
    Chapter("memory", "Memory distance: fewer bytes per token",
            "Generation is a logistics problem: the weights must be carried to the compute units for every token, "
            "and quantization helps only when fewer bytes move and a kernel reads the format.",
            "Fewer bytes per token: the same prompt with 8-bit and 4-bit weights, and eight users sharing each "
            "read of the weights.",
            (Comparison("fp32 against int8 and int4 weights",
                        "bytes read per token, tokens per second, and what the fewer bits cost in quality",
                        FP32, (Arm("int8-dyn", "int8 (int8-dyn)", weights="int8-dyn"),
                               Arm("int4-wo", "int4 (int4-wo)", weights="int4-wo")),
                        ("decode tok/s", "vs baseline", "weights MB per token", "perplexity", "KL", "top-1")),
             Comparison("1 user against 8 users in one batch (fp32)",
                        "weight bytes read per token and decode tokens per second of every user together, when eight "
                        "users' tokens share each trip of the weights",
                        FP32, (Arm("users-8", "8 users, one batch", users=8),),
                        ("decode tok/s", "vs baseline", "decode tok/s per user", "weights MB per token")))),
    Chapter("time", "Time distance: fewer serial steps",
            "A token waits for every serial step before it: recomputing the whole prefix at each step, or one "
            "forward per token when several could be checked in one.",
            "Fewer serial steps: keep the KV cache, and guess tokens the prompt already holds.",
            (Comparison("KV cache off against on", "work per token when each step recomputes the prefix",
                        Arm("kv-off", "KV cache off", kv_cache=False), (Arm("kv-on", "KV cache on"),),
                        ("decode tok/s", "vs baseline", "TPOT ms", "decision share")),
             Comparison("plain greedy against prompt lookup, on a prompt the answer copies",
                        "tokens per target forward: serial steps saved by guesses the model confirms",
                        Arm("greedy", "greedy", prompt=COPY_PROMPT),
                        (Arm("prompt-lookup", "prompt lookup", prompt=COPY_PROMPT, gen=dict(speculative="prompt-lookup")),),
                        ("decode tok/s", "vs baseline", "tokens per forward", "acceptance")))),
    Chapter("decision", "Decision distance: less wasted work",
            "Speculation pays only when guesses are accepted and verification is cheap; sparsity saves time only "
            "when it skips weight loads, not just multiplications.",
            "Less wasted work: count the rejected guesses, and skip the weights a zero would multiply.",
            (Comparison("plain greedy against a speculative draft (self-int8)",
                        "acceptance rate and the drafted tokens thrown away (the decision bucket)",
                        Arm("greedy", "greedy"), (Arm("draft", "draft self-int8, K=3", gen=SPECULATIVE_DRAFT),),
                        ("decode tok/s", "vs baseline", "acceptance", "thrown away", "decision share")),
             Comparison("sparsity 50%: mask (reads every weight) against skip (does not)",
                        "weights read per token and the time the zeros cost",
                        Arm("mask", "mask 50% (reads everything)", sparsity=0.5, sparsity_mode="mask"),
                        (Arm("skip", "skip 50% (skips the loads)", sparsity=0.5, sparsity_mode="skip"),),
                        ("decode tok/s", "vs baseline", "weights MB per token", "decision share")))),
    Chapter("physical", "Physical distance: shorter links",
            "Multi-layer low-loss boards and switches exist to make signal paths short: once a model spans "
            "several GPUs, every token crosses the links between them.",
            "Shorter links: NVSwitch against PCIe in a DGX A100, and a 70B model on 2, 4 and 8 GPUs."),
)
BY_KEY = {chapter.key: chapter for chapter in CHAPTERS}

# (title, [(model, gpu, gpus, interconnect)]): the first configuration is the baseline
DEPLOYMENTS = (
    ("GPT-3 175B on a DGX A100 (8 GPUs): NVSwitch against PCIe",
     (("gpt3-175b", "a100-80gb-sxm", 8, "nvswitch"), ("gpt3-175b", "a100-80gb-pcie", 8, "pcie"))),
    ("Llama-2-70B on 2, 4 and 8 A100 SXM GPUs over NVLink",
     tuple(("llama-2-70b", "a100-80gb-sxm", n, "nvlink") for n in (2, 4, 8))),
)


def tag(chapter: Chapter, arm: Arm | str) -> str:
    return f"{TAG}:{chapter.key}:{arm if isinstance(arm, str) else arm.key}"


def arm_spec(chapter: Chapter, arm: Arm, model: str = "default", device: str = "auto") -> RunSpec:
    gen = GenConfig(arm.prompt, max_new_tokens=NEW_TOKENS, kv_cache=arm.kv_cache, ignore_eos=True, **arm.gen)
    return RunSpec(gen=gen, model=model, device=device, weights=arm.weights, sparsity=arm.sparsity,
                   sparsity_mode=arm.sparsity_mode, tag=tag(chapter, arm), users=arm.users)


def chapter_specs(chapter: Chapter, model: str = "default", device: str = "auto") -> list[RunSpec]:
    """Every run the chapter makes: each arm (an arm in two comparisons is one) REPEATS times, interleaved."""
    arms = {arm.key: arm for comparison in chapter.comparisons for arm in comparison.arms}
    return interleaved([arm_spec(chapter, arm, model, device) for arm in arms.values()], REPEATS)


def arm_rates(store, run_tag: str, users: int = 1) -> list[float]:
    """The decode speeds of an arm's newest REPEATS finished repeats, newest first: the latest play's. A repeat of
    several users is one batch (its users' consecutive runs), its speed every user's tokens per second together."""
    frame = store.query("SELECT decode_tokens_per_s FROM runs WHERE tag = ? AND status = 'ok' ORDER BY run_id DESC "
                        "LIMIT ?", [run_tag, REPEATS * users])
    speeds = list(frame["decode_tokens_per_s"])
    batches = [usable(speeds[i:i + users]) for i in range(0, len(speeds), users)]
    return [sum(batch) for batch in batches if len(batch) == users]


def served_spec(endpoint: str, served_model: str | None = None) -> RunSpec:
    return RunSpec(gen=GenConfig(SHORT_PROMPT, max_new_tokens=SERVED_TOKENS), backend="served", endpoint=endpoint,
                   served_model=served_model or None, tag=tag(BY_KEY["physical"], "served"))


def latest_runs(store, chapter: Chapter) -> dict[str, dict]:
    """The newest finished run of each of the chapter's arms, by arm key, JSON columns decoded."""
    frame = store.query("SELECT run_id, tag FROM runs WHERE tag LIKE ? AND status = 'ok' ORDER BY run_id DESC",
                        [f"{TAG}:{chapter.key}:%"])
    newest: dict[str, int] = {}
    for run_id, run_tag in frame.itertuples(index=False):
        newest.setdefault(run_tag.split(":", 2)[2], int(run_id))
    runs = load_runs(store, list(newest.values())) if newest else []
    return {run["tag"].split(":", 2)[2]: run for run in runs}


def story_run_ids(store) -> list[int]:
    return sorted(run["run_id"] for chapter in CHAPTERS for run in latest_runs(store, chapter).values())


def bucket_total(run: dict) -> float:
    """The run's attributed time: the five buckets, plus a served run's server work when no GPU split it."""
    return sum(run[f"{b}_ms"] or 0.0 for b in BUCKETS) + (run.get("server_work_ms") or 0.0)


def share(run: dict, bucket: str) -> float | None:
    total = bucket_total(run)
    return (run[f"{bucket}_ms"] or 0.0) / total if total else None


def weight_bytes_per_token(store, run_id: int) -> float | None:
    """Weight bytes the decode steps read per token they emitted: a skip-sparse step reads fewer."""
    frame = store.query("SELECT sum(weight_bytes) AS b, sum(n_emitted) AS n FROM steps WHERE run_id = ? AND "
                        "kind = 'decode'", [run_id])
    read, emitted = frame["b"].iloc[0], frame["n"].iloc[0]
    return float(read) / float(emitted) if emitted and emitted == emitted else None


def figures(run: dict, baseline: dict | None, quality: dict | None, weight_bytes: float | None = None) -> dict:
    """Every figure a comparison may show for one run, by the names Comparison.figures uses."""
    m = run["metrics"]
    speculative = m.get("speculative") or {}
    rate, base = run["decode_tokens_per_s"], baseline and baseline["decode_tokens_per_s"]
    q = quality or {}
    return {"decode tok/s": rate, "speedup": rate / base if rate and base else None, "TPOT ms": run["tpot_ms"],
            "TTFT ms": run["ttft_ms"],
            "weights MB per token": (weight_bytes or m.get("weight_bytes_per_forward") or 0) / 1e6 or None,
            "tokens per forward": speculative.get("tokens_per_target_forward", 1.0 if run["n_new_tokens"] else None),
            "acceptance": speculative.get("acceptance_rate"),
            "thrown away": speculative["drafted"] - speculative["accepted"] if "drafted" in speculative else None,
            "decision share": share(run, "decision"), "network share": share(run, "physical"),
            "perplexity": q.get("perplexity"), "KL": q.get("kl_mean"), "top-1": q.get("top1_agreement")}


FORMATS = {"decode tok/s": ".1f", "decode tok/s per user": ".1f", "speedup": ".2f", "TPOT ms": ".1f", "TTFT ms": ".1f", "weights MB per token": ".0f",
           "tokens per forward": ".2f", "acceptance": ".0%", "thrown away": "d", "decision share": ".0%",
           "network share": ".0%", "perplexity": ".3f", "KL": ".5f", "top-1": ".1%"}


QUALITY = ("perplexity", "KL", "top-1")  # what fewer bits cost: a page shows them in a table of their own
# the short header a table gives each figure (so its row reads whole in a window 1024 px wide), and its full name
HEADERS = {
    "decode tok/s": ("tok/s", "decode tokens per second, every user's together: the geometric mean of the play's "
                     "repeats, the figure the ratio against the baseline divides"),
    "vs baseline": ("vs baseline", "decode tokens per second against the baseline: the ratio of the repeats' geometric "
                    "means and its 95% interval; where the interval includes 1 there is no measurable difference"),
    "decode tok/s per user": ("per user", "decode tokens per second of one user's sequence: every user's together "
                              "over the users"),
    "weights MB per token": ("MB/token", "megabytes of weights read per token"),
    "TPOT ms": ("TPOT (ms)", "time per output token (ms)"),
    "tokens per forward": ("tok/forward", "tokens produced per forward pass of the target model"),
    "acceptance": ("accepted", "share of the drafted tokens the target model accepted"),
    "thrown away": ("rejected", "drafted tokens the target model rejected: thrown away"),
    "decision share": ("decision", "share of the token's time in the decision bucket"),
    "perplexity": ("perplexity", "perplexity on the evaluation text, data/eval.txt (lower is better)"),
    "KL": ("KL", "mean KL divergence (nats) of the next-token distribution from the fp32 model's"),
    "top-1": ("top-1", "share of positions where the most likely next token agrees with the fp32 model's"),
    "GPUs": ("GPUs", "the GPUs and their link; every row runs the model the table's title names"),
    "ms per token (estimate)": ("ms/token", "ms per decode token, the planner's estimate"),
    "tokens/s (estimate)": ("tok/s", "decode tokens per second, the planner's estimate"),
    "speedup (estimate)": ("speedup", "against the first configuration, the planner's estimate"),
    "physical share (estimate)": ("physical", "share of a token's time on the links between GPUs (the physical "
                                  "bucket), the planner's estimate"),
}


def show(name: str, value) -> str:
    if name == "vs baseline":  # already a phrase: the ratio, its interval and the verdict
        return value
    return fmt(value, FORMATS[name], "x" if name == "speedup" else "")


def comparison_rows(store, comparison: Comparison, runs: dict[str, dict]) -> list[dict]:
    """One row per stored arm: its label, run, and the comparison's figures (raw values)."""
    present = [arm for arm in comparison.arms if arm.key in runs]
    quality = latest_quality(store, [runs[arm.key] for arm in present])
    baseline = runs.get(comparison.baseline.key)
    base_rates = arm_rates(store, baseline["tag"], comparison.baseline.users) if baseline else []
    rows = []
    for arm in present:
        run = runs[arm.key]
        values = figures(run, baseline, quality.get(run["run_id"]), weight_bytes_per_token(store, run["run_id"]))
        rates = arm_rates(store, run["tag"], arm.users)
        # the repeats' geometric mean, every user's together: the figure the ratio against the baseline divides
        values["decode tok/s"] = statistics.geometric_mean(rates) if rates else None
        # and a user's share of it: one user's newest run alone was the one left to decode once the others ended
        values["decode tok/s per user"] = values["decode tok/s"] / arm.users if rates else None
        against = compare(base_rates, rates) if base_rates and rates and arm is not comparison.baseline else None
        values["speedup"] = against.ratio if against else values["speedup"]
        values["vs baseline"] = "the baseline" if arm is comparison.baseline else (
            against.text() if against else "no decode speed to compare")
        rows.append({"arm": arm.label, "run": run["run_id"], "speedup": values["speedup"], "against": against,
                     "measurable": bool(against and against.measurable),
                     **{name: values[name] for name in comparison.figures}})
    return rows


def missing_quality(rows: list[dict], comparison: Comparison) -> list[str]:
    """The weight levels of a comparison that show quality figures but have none stored."""
    if "perplexity" not in comparison.figures:
        return []
    levels = {arm.label: arm.weights for arm in comparison.arms}
    return [levels[row["arm"]] for row in rows if row["perplexity"] is None and levels[row["arm"]] != "fp32"]


def quality_command(level: str, model: str = "default") -> str:
    return f"python -m engine quality --weights {level}" + ("" if model == "default" else f" --model {model}")


def batch_bar(store, run: dict, users: int) -> tuple[str, dict]:
    """What an arm's bar draws: a lone run as it is; for an arm of several users its newest batch, each bucket
    the mean of its users' runs spread over every user's tokens, so the bar is the time per token of all users
    together (what its speed ratio compares) rather than one user's, which holds its wait for the batch."""
    if users == 1:
        return f"#{run['run_id']}", run
    buckets = ", ".join(f"{b}_ms" for b in BUCKETS)
    frame = store.query(f"SELECT run_id, n_new_tokens, {buckets} FROM runs WHERE tag = ? AND status = 'ok' AND "
                        "run_id <= ? ORDER BY run_id DESC LIMIT ?", [run["tag"], run["run_id"], users])
    if len(frame) < users:
        return f"#{run['run_id']}", run
    bar = {f"{b}_ms": float(frame[f"{b}_ms"].fillna(0.0).mean()) for b in BUCKETS}
    return (f"#{frame['run_id'].min()}-#{frame['run_id'].max()}, all {users} users",
            {**bar, "n_new_tokens": int(frame["n_new_tokens"].sum())})


def picture(store, comparison: Comparison, runs: dict[str, dict], rows: list[dict]):
    """The comparison's newest runs as one stacked bar each (ms per token, prefill included), baseline on top; an
    arm of several users as its batch (batch_bar). A label's ratio is the decode speed's over the repeats, as the
    figures above the picture give it, not the bar's."""
    bars = [batch_bar(store, runs[arm.key], arm.users) for arm in comparison.arms if arm.key in runs]
    labels = [f"{row['arm']} · {name}" + (f" · decode {row['speedup']:.2f}x over {REPEATS} repeats"
                                          if row.get("speedup") else "")
              + ("" if row.get("measurable") or row["arm"] == comparison.baseline.label else " (no measurable difference)")
              for row, (name, _) in zip(rows, bars)]
    return totals_chart(labels, [bar for _, bar in bars], per_token=True, title=comparison.title)


def deployment_results(efficiency: plan.Efficiency | None = None) -> list[tuple[str, list[dict]]]:
    """The planner's estimates of each deployment comparison (one dict per configuration)."""
    out = []
    for title, configs in DEPLOYMENTS:
        results = []
        for model, gpu, gpus, link in configs:
            setup = plan.Setup(model=plan.resolve_model(model), gpu=plan.get_gpu(gpu), gpus=gpus, interconnect=link,
                               efficiency=efficiency or plan.Efficiency())
            results.append(plan.plan(setup))
        out.append((title, results))
    return out


def deployment_setup(result: dict) -> str:
    """The GPUs and their link, what the configurations of one deployment comparison differ by."""
    return f"{result['gpus']} x {result['gpu']} · {result['interconnect']}"


def deployment_label(result: dict) -> str:
    return f"{result['model'].split(' (')[0]} · {deployment_setup(result)}"


def deployment_picture(title: str, results: list[dict]):
    """The planner's buckets per configuration as the same stacked bars (ms per decode token, estimates)."""
    rows = [{**{f"{b}_ms": r["distances_ms"][b] for b in BUCKETS}, "n_new_tokens": 1} for r in results]
    base = results[0]["decode_ms_per_token"]
    labels = [f"{deployment_label(r)} · {base / r['decode_ms_per_token']:.2f}x" for r in results]
    fig = totals_chart(labels, rows, per_token=True, title=f"{title} (estimate)")
    fig.update_layout(xaxis_title="ms per decode token (planner estimate)")
    return fig


def deployment_rows(results: list[dict]) -> list[dict]:
    base = results[0]["decode_ms_per_token"]
    return [{"configuration": deployment_label(r), "ms per token (estimate)": r["decode_ms_per_token"],
             "tokens/s (estimate)": r["tokens_per_s_per_user"], "speedup (estimate)": base / r["decode_ms_per_token"],
             "physical share (estimate)": r["distances_ms"]["physical"] / r["decode_ms_per_token"], "fits": r["fits"]}
            for r in results]


def chapter_section(store, chapter: Chapter) -> Section:
    """A chapter of the story report: its thesis, each comparison's figures and picture."""
    parts = [f"<p>{html.escape(chapter.thesis)}</p><p><b>Lever:</b> {html.escape(chapter.lever)}</p>"]
    runs = latest_runs(store, chapter)
    for comparison in chapter.comparisons:
        rows = comparison_rows(store, comparison, runs)
        parts.append(f"<h3>{html.escape(comparison.title)}</h3><p class=note>Measures {html.escape(comparison.measures)}."
                     f" Each arm: decode tokens/s, the geometric mean of {REPEATS} interleaved repeats; against the "
                     "baseline, the ratio of those means with its 95% interval (Welch's t on the log speeds); where the "
                     "interval includes 1 there is no measurable difference.</p>")
        if not rows:
            parts.append("<p>Not played yet.</p>")
            continue
        parts.append(table(["arm", "run", *comparison.figures],
                           [[html.escape(r["arm"]), f"#{r['run']}", *(show(n, r[n]) for n in comparison.figures)]
                            for r in rows], numeric_from=2))
        parts += [f"<p class=note>No quality stored for {html.escape(level)}: run "
                  f"<code>{html.escape(quality_command(level))}</code>.</p>" for level in missing_quality(rows, comparison)]
        parts.append(figure_html(picture(store, comparison, runs, rows)))
    if chapter.key == "physical":
        parts.append(physical_html(store))
    return Section(f"Story: {chapter.title}", "".join(parts))


def figure_html(fig) -> str:
    """A figure inline, right under its table (the page's one copy of Plotly's script draws it)."""
    fig.update_yaxes(automargin=True)  # room for the run labels: plotly.js leaves none by default
    return pio.to_html(fig, include_plotlyjs=False, full_html=False, config=FIGURE_CONFIG)


def physical_html(store) -> str:
    parts = ["<p><b>Estimates</b> from the planner (engine/plan/planner.py), not measurements.</p>"]
    for title, results in deployment_results():
        rows = deployment_rows(results)
        parts.append(f"<h3>{html.escape(title)} (estimate)</h3>" + table(
            list(rows[0]), [[html.escape(r["configuration"]), fmt(r["ms per token (estimate)"], ".2f"),
                             fmt(r["tokens/s (estimate)"], ".1f"), fmt(r["speedup (estimate)"], ".2f", "x"),
                             fmt(r["physical share (estimate)"], ".0%"), "yes" if r["fits"] else "no"] for r in rows],
            numeric_from=1))
        parts.append(figure_html(deployment_picture(title, results)))
    served = latest_runs(store, BY_KEY["physical"]).get("served")
    if served:
        values = figures(served, None, None)
        parts.append(f"<h3>Measured: one served run, #{served['run_id']} at {html.escape(served['endpoint'] or '')}"
                     f"</h3><p>Network share {show('network share', values['network share'])}, TTFT "
                     f"{show('TTFT ms', values['TTFT ms'])} ms, {show('decode tok/s', values['decode tok/s'])} "
                     "decode tokens/s.</p>")
    return "".join(parts)


def capacity_section(store) -> Section:
    """The capacity chapter: the planner's prediction, then the measured search beside it, and what ended it."""
    planned, found = capacity.predict(capacity.stored_calibration(store)), capacity.latest(store)
    parts = [f"<p>{html.escape(CAPACITY_THESIS)}</p>",
             f"<h3>Predicted (estimate)</h3><p>{html.escape(capacity.prediction_text(planned))}</p>"]
    if found is not None:
        rows = capacity.side_by_side(planned, found)
        parts.append("<h3>Planned beside measured</h3>" + table(
            ["figure", "planned (estimate)", "measured"],
            [[html.escape(r["figure"]), capacity.cell(r["planned"]), capacity.cell(r["measured"])] for r in rows],
            numeric_from=1))
        levels = capacity.level_rows(found)
        parts.append(f"<h3>Measured levels, sweep {found['sweep_id']}</h3>" + table(
            list(levels[0]), [[capacity.cell(v) for v in row.values()] for row in levels], numeric_from=0)
            if levels else "")
    parts.append(f"<p><b>{html.escape(capacity.verdict(store, found))}</b></p>"
                 f"<p class=note>{html.escape(capacity.cost_text(found))}</p>")
    return Section(f"Story: {CAPACITY_TITLE}", "".join(parts))


CAPACITY_TITLE = "Capacity: how many users at a latency promise"
CAPACITY_THESIS = (f"How many users does this machine serve while {capacity.promise()}, and which distance ends "
                   "it? The planner predicts it from this machine's calibration; then the local engine is measured "
                   "under Poisson arrivals, rate by rate, in a process of its own.")


def story_report(store) -> str:
    """The report of the latest story runs: one section per chapter, then the standard sections of its runs."""
    ids = story_run_ids(store)
    if not ids and capacity.latest(store) is None:
        raise ReportError("No story runs are stored yet: play the story on the Story page first.")
    runs = f"runs {', '.join(f'#{i}' for i in ids)}" if ids else "no chapter runs yet"
    intro = (f'<p class="note">The distances played on this machine, made {utcnow():%Y-%m-%d %H:%M} UTC from '
             f"{html.escape(store.path.name)}: {runs}. Every measured figure comes from the stored runs and "
             "sweeps; the planner's figures are estimates.</p>")
    sections = [*(chapter_section(store, chapter) for chapter in CHAPTERS), capacity_section(store),
                *(run_sections(store, ids) if ids else []), definitions_section()]
    return build_html("Tokenpath: the four distances", sections, intro)
