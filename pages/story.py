"""The story: the four distances as four chapters, each one button that runs its lever against its baseline
live through the generation process, drawn as the five buckets side by side with the measured speedup."""
import time

import pandas as pd
import streamlit as st

from engine import access
from engine.report import story
from engine.report import story_capacity as capacity
from engine.serve.client import ServedError, api_root
from engine.run.worker import WorkerFailed, WorkerRefused
from ui import (bucket_chart, default_model_id, md_escape, open_store, page_setup, ratio_cell, run_in_worker,
                worker_request)

page_setup("Story")
st.title("The four distances")
st.markdown(
    "How fast a model answers is decided less by raw compute than by how far information travels before each "
    "computation. Four chapters make the argument on this machine: each runs a lever against its baseline, live, "
    "and splits every token's time into the five buckets. Results are stored as ordinary runs (tagged "
    "`story:<chapter>`), so they are here on the next visit; any chapter can be played again. A last chapter asks "
    "how many users this machine serves at a latency target, predicted by the planner and then measured.")
store = open_store()
if store is None:
    st.stop()
model = default_model_id()
SERVER_KEY = "story_server_url"


def server_url() -> str:
    """The served run's URL, if one was given; none in shared mode, which sends no requests to servers."""
    return "" if access.shared_mode() else st.session_state.get(SERVER_KEY, "").strip()


def play(chapters, bar) -> list[str]:
    """Run the chapters' experiments in order through the queue; returns the sentences of runs refused."""
    specs = [(c, s) for c in chapters for s in story.chapter_specs(c, model)]
    url = server_url()
    if story.BY_KEY["physical"] in chapters and url:
        specs.append((story.BY_KEY["physical"], story.served_spec(url)))
    total, problems = len(specs), []
    started = time.monotonic()
    for i, (chapter, spec) in enumerate(specs):
        bar.progress(i / total, text=f"{chapter.title}: {spec.tag.split(':')[2]} ({i + 1} of {total})")
        try:
            run_in_worker(worker_request(spec, store), on_wait=lambda pos: bar.progress(
                i / total, text=f"Waiting: {pos} generation(s) ahead."))
        except (WorkerRefused, WorkerFailed) as exc:
            problems.append(f"{chapter.title}, {spec.tag.split(':')[2]}: {exc}")
            st.error(md_escape(problems[-1]))
    bar.progress(1.0, text=f"{total - len(problems)} of {total} runs in {time.monotonic() - started:.0f} s")
    return problems


def server_url_problem(url: str) -> str | None:
    try:
        api_root(url)
    except ServedError as exc:
        return str(exc)
    return None


top = st.columns([1, 1, 2])
play_all = top[0].button("Run the whole story", type="primary", help=f"{sum(len(story.chapter_specs(c)) for c in story.CHAPTERS)} "
                         f"short runs of {story.NEW_TOKENS} tokens each ({story.REPEATS} interleaved repeats of every "
                         "arm), one after another, plus the served run when "
                         "a server URL is given below, then the capacity search.")


def measure_capacity() -> bool:
    """The capacity search in a process of its own (never in this server), from the planner's capacity; False
    (and the sentence why shown) where it gave no answer."""
    start = capacity.predict(capacity.stored_calibration(store), model).get("capacity_requests_per_s")
    with st.spinner("Measuring the local engine's capacity, level by level..."):
        try:
            capacity.measure(str(store.path), start, model)
        except capacity.CapacityChapterError as exc:
            st.error(md_escape(str(exc)))
            return False
    return True


if play_all:
    play(story.CHAPTERS, st.progress(0.0, text="Starting..."))
    measure_capacity()
if story.story_run_ids(store) or capacity.latest(store):  # the report is built when the button is pressed, not at every redraw
    top[1].download_button("Download report", lambda: story.story_report(store), file_name="tokenpath-story.html",
                           mime="text/html", on_click="ignore",
                           help="One HTML file with every chapter's runs; it opens without a network.")


def figures_tables(rows: list[dict], comparison) -> list[pd.DataFrame]:
    """The comparison's figures in short cells, the quality figures in a table of their own so each reads whole
    1024 px wide: the ratio against the baseline with its interval (its verdict is the line under each arm's speed
    above; the run numbers are in the picture's bar labels)."""
    def cell(row: dict, name: str) -> str:
        if name == "vs baseline" and row["against"]:
            return ratio_cell(row["against"])
        return story.show(name, row[name])  # the baseline itself reads "the baseline"
    speed = [n for n in comparison.figures if n not in story.QUALITY]
    quality = [n for n in comparison.figures if n in story.QUALITY]
    return [pd.DataFrame([{"arm": r["arm"], **{n: cell(r, n) for n in names}} for r in rows])
            for names in (speed, quality) if names]


# short headers, each with its full name as the header's help, so a comparison reads whole 1024 px wide
FIGURE_HEADERS = {name: st.column_config.TextColumn(short, help=full) for name, (short, full) in story.HEADERS.items()}


def per_token(comparison, runs: dict) -> None:
    """Each arm's per-token buckets side by side, on one y scale so their heights compare."""
    arms = [arm for arm in comparison.arms if arm.key in runs]
    token_rows = {arm.key: store.tokens(runs[arm.key]["run_id"]).to_dict("records") for arm in arms}
    top_ms = max((sum(row[f"{b}_ms"] or 0.0 for b in story.BUCKETS) for rows in token_rows.values() for row in rows),
                 default=1.0)
    for column, arm in zip(st.columns(len(arms)), arms):
        fig = bucket_chart(token_rows[arm.key], f"{arm.label}: each token")
        fig.update_layout(height=320, yaxis_range=[0, top_ms * 1.05], showlegend=False)
        column.plotly_chart(fig, width="stretch", key=f"tok-{comparison.title}-{arm.key}")


def comparison_view(comparison, runs: dict) -> None:
    st.subheader(comparison.title)
    st.caption(f"Measures {comparison.measures}. Each arm: decode tokens per second, the geometric mean of "
               f"{story.REPEATS} interleaved repeats (a batch's: every user's together); against the baseline, the "
               "ratio of those means with its 95% interval; where the interval includes 1 there is no measurable "
               "difference.")
    rows = story.comparison_rows(store, comparison, runs)
    if not rows:
        st.info("Not played yet: press the chapter's button.")
        return
    cols = st.columns(len(rows))
    for column, row in zip(cols, rows):
        column.metric(row["arm"], f"{story.show('decode tok/s', row['decode tok/s'])} tok/s")
        if row.get("vs baseline"):  # a ratio and its interval: a metric's delta arrow would claim a direction
            column.caption(row["vs baseline"])
    st.plotly_chart(story.picture(store, comparison, runs, rows), width="stretch", key=f"tot-{comparison.title}")
    for table in figures_tables(rows, comparison):
        st.dataframe(table, hide_index=True, width="stretch", column_config=FIGURE_HEADERS)
    for level in story.missing_quality(rows, comparison):
        st.caption(f"No quality figures stored for {level}: `{story.quality_command(level, model)}` measures them.")
    with st.expander("Per token, side by side"):
        per_token(comparison, runs)


def physical_view(runs: dict) -> None:
    st.warning("Estimates, not measurements: the planner (engine/plan/planner.py) from data-sheet peaks and fitted "
               "efficiency factors. The Planner page shows the formulas and lets you change every setting.")
    for title, results in story.deployment_results():
        st.plotly_chart(story.deployment_picture(title, results), width="stretch", key=f"dep-{title}")
        frame = pd.DataFrame([{"GPUs": story.deployment_setup(result),  # the model is in the title
                               "ms per token (estimate)": f"{r['ms per token (estimate)']:.2f}",
                               "tokens/s (estimate)": f"{r['tokens/s (estimate)']:.1f}",
                               "speedup (estimate)": f"{r['speedup (estimate)']:.2f}x",
                               "physical share (estimate)": f"{r['physical share (estimate)']:.0%}",
                               "fits": "yes" if r["fits"] else "no"}
                              for r, result in zip(story.deployment_rows(results), results)])
        st.dataframe(frame, hide_index=True, width="stretch", column_config=FIGURE_HEADERS)
    st.subheader("Measured: one served run")
    if access.shared_mode():
        st.info(access.SERVED_REFUSAL)
    else:
        st.text_input("Server URL (an OpenAI-compatible server such as vLLM; empty: none)", key=SERVER_KEY,
                      placeholder="http://127.0.0.1:8000")
    served = runs.get("served")
    if served:
        values = story.figures(served, None, None)
        c = st.columns(3)
        c[0].metric("network share (physical bucket)", story.show("network share", values["network share"]))
        c[1].metric("TTFT", f"{story.show('TTFT ms', values['TTFT ms'])} ms")
        c[2].metric("decode tokens/s", story.show("decode tok/s", values["decode tok/s"]))
        st.plotly_chart(bucket_chart(store.tokens(served["run_id"]).to_dict("records"),
                                     f"#{served['run_id']} at {served['endpoint']}: each chunk"), width="stretch",
                        key="served-tokens")
    else:
        st.caption("No served run stored: give a server's URL and press the chapter's button.")


for number, chapter in enumerate(story.CHAPTERS, start=1):
    st.header(f"{number}. {chapter.title}", divider="gray")
    st.markdown(f"{chapter.thesis}  \n**Lever:** {chapter.lever}")
    if st.button(f"Play chapter {number}", key=f"play-{chapter.key}"):
        url = server_url()
        problem = server_url_problem(url) if chapter.key == "physical" and url else None
        if problem:
            st.error(md_escape(problem))
        elif not chapter.comparisons and not url:
            st.info("The estimates need no run: give a server URL below to measure a served run as well.")
        elif not play([chapter], st.progress(0.0, text="Starting...")):
            st.rerun()  # the report button above then holds the new runs too
    runs = story.latest_runs(store, chapter)
    for comparison in chapter.comparisons:
        comparison_view(comparison, runs)
    if chapter.key == "physical":
        physical_view(runs)


def capacity_view() -> None:
    """The planner's prediction first, then the measured search beside it and what ended it."""
    planned, found = capacity.predict(capacity.stored_calibration(store), model), capacity.latest(store)
    st.subheader("Predicted (estimate)")
    st.markdown(md_escape(capacity.prediction_text(planned)))
    if found is not None:
        st.subheader(f"Planned beside measured (sweep {found['sweep_id']})")
        c = st.columns(3)
        result = found["result"]
        c[0].metric("capacity (measured)", f"{capacity.cell(result.get('capacity_requests_per_s'))} req/s")
        c[1].metric("users (Little's law)", capacity.cell(result.get("users")))
        c[2].metric("failed first", capacity.cell(result.get("limiting_metric")))
        st.dataframe(pd.DataFrame([{"figure": r["figure"], "planned (estimate)": capacity.cell(r["planned"]),
                                    "measured": capacity.cell(r["measured"])}
                                   for r in capacity.side_by_side(planned, found)]), hide_index=True, width="stretch")
        levels = [{k: capacity.cell(v) for k, v in row.items()} for row in capacity.level_rows(found)]
        st.dataframe(pd.DataFrame(levels), hide_index=True, width="stretch")
    st.markdown(f"**{md_escape(capacity.verdict(store, found))}**")
    st.caption(capacity.cost_text(found))


number = len(story.CHAPTERS) + 1
st.header(f"{number}. {story.CAPACITY_TITLE}", divider="gray")
st.markdown(story.CAPACITY_THESIS)
if st.button(f"Play chapter {number}", key="play-capacity") and measure_capacity():
    st.rerun()  # the report button above then holds the new sweep too
capacity_view()
