"""Hostile but fair input on the pages: user text stays literal (no Markdown, links or formulas),
messages survive a rerun, axes read cleanly, and nothing is fetched from outside the machine."""
import os

import pandas as pd
import pytest

from engine.spec import GenConfig, RunSpec
from streamlit.testing.v1 import AppTest

from browser import CHROMIUM, browser_page, serve_app
from engine.measure import hardware
from engine.run.generate import Generation, GenConfig
from engine.store.db import Store
from ui import csv_safe, log_ticks, md_escape, plot_escape

HOSTILE_MODEL = "**bold** [a](https://evil.example) :red[x] $x^2$ <b>b</b> `c`"
HOSTILE_PROMPT = '=HYPERLINK("https://evil.example","click")'


def recorded_run(db, tiny_lm, calibration, model=HOSTILE_MODEL, prompt=HOSTILE_PROMPT, suspect=None):
    store = Store(db)
    stored = {**calibration, **({"suspect": suspect} if suspect else {})}
    store.save_calibration(calibration["device_key"], stored)
    gen = Generation(tiny_lm, GenConfig("Hi", raw=True, max_new_tokens=4, ignore_eos=True), store=store)
    gen.run()
    with store.connect() as con:
        con.execute("UPDATE runs SET model = ?, prompt = ? WHERE run_id = ?", [model, prompt, gen.run_id])
    return gen.run_id


def page(name) -> AppTest:
    at = AppTest.from_file("../app.py", default_timeout=180)
    at.switch_page(name)
    return at.run()


@pytest.mark.parametrize("text", [HOSTILE_MODEL, "www.evil.example a@b.org", "# heading", "- item\n- item", "a\\*b", "1. first", "> quote",
                                  ":material/route:", "&lt;script&gt;", "|a|b|"])
def test_escaped_text_has_no_markdown_left(text):
    escaped = md_escape(text)
    assert "\n" not in escaped
    decoded = escaped.replace("\u2060", "")  # the invisible joiners that keep addresses from becoming links
    plain = "".join(c for c in text.replace("\n", " ") if c.isalnum() or c == " ")
    assert "".join(c for c in decoded if c.isalnum() or c == " ") == plain  # only escapes were added
    i = 0
    while i < len(decoded):  # every character Markdown or Streamlit reads is preceded by a backslash
        if decoded[i] == "\\":
            i += 2
            continue
        assert decoded[i] not in "\\`*_{}[]()#+-.!|<>~$:=^&", (text, escaped)
        i += 1


def test_plot_labels_keep_tags_literal():
    assert plot_escape('<a href="https://evil.example">x</a> &amp;') == \
        '&lt;a href="https://evil.example"&gt;x&lt;/a&gt; &amp;amp;'


def test_csv_export_cells_cannot_run_as_formulas():
    frame = pd.DataFrame({"prompt": ["=1+1", "+SUM(A1)", "-2", "@cmd", "\tx", "plain", None],
                          "ttft_ms": [-1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]})
    safe = csv_safe(frame)
    assert list(safe["prompt"][:6]) == ["'=1+1", "'+SUM(A1)", "'-2", "'@cmd", "'\tx", "plain"]
    assert pd.isna(safe["prompt"].iloc[6])
    assert list(safe["ttft_ms"]) == list(frame["ttft_ms"])  # numbers, negative ones too, stay numbers
    assert list(frame["prompt"][:1]) == ["=1+1"]  # the page's own frame (and the Parquet export) keep the data


@pytest.mark.parametrize("values, labels", [([23.0, 61.0], ["10", "20", "50", "100"]),
                                            ([0.4, 3000.0], ["0.1", "1", "10", "100", "1000", "10000"]),
                                            ([150.0, 900.0], ["100", "200", "500", "1000"])])
def test_log_axis_ticks_are_plain_numbers(values, labels):
    ticks = log_ticks(values)
    assert ticks["ticktext"] == labels
    assert all(float(t) == v for t, v in zip(ticks["ticktext"], ticks["tickvals"]))
    assert log_ticks([0, None, float("nan")]) == {}


def test_a_message_set_before_a_rerun_is_seen_after_it():
    def script():
        import streamlit as st

        from ui import flash, show_flash

        show_flash()
        if st.button("Delete"):
            flash("Deleted 2 run(s): #1, #2.")
            st.rerun()

    at = AppTest.from_function(script).run()
    at.button[0].click().run()
    assert [s.value for s in at.success] == ["Deleted 2 run(s): #1, #2."]
    at.run()
    assert not at.success  # shown once


@pytest.mark.integration
def test_distances_keeps_a_hostile_model_name_literal_and_names_the_calibration(page_db, tiny_lm, calibration):
    recorded_run(page_db, tiny_lm, calibration, suspect="Its memory bandwidth was low.")
    at = page("pages/distances.py")
    assert not at.exception and not at.error
    heading = next(s.value for s in at.subheader if "bold" in s.value)
    assert "**bold**" not in heading and "](https" not in heading and md_escape(HOSTILE_MODEL) in heading
    notes = [c.value for c in at.caption if c.value.startswith("Attributed with the calibration measured")]
    assert len(notes) == 1 and f"{calibration['memory_gbps']:.1f} GB/s" in notes[0]
    verdicts = [w.value for w in at.warning if "Calibration:" in w.value]
    assert len(verdicts) == 1 and "busy machine" in verdicts[0]  # the one verdict, above the runs


@pytest.mark.integration
def test_runs_shows_each_runs_calibration(page_db, tiny_lm, calibration):
    recorded_run(page_db, tiny_lm, calibration)
    at = page("pages/runs.py")
    assert not at.exception and not at.error
    assert at.dataframe[0].value["model"].iloc[0] == HOSTILE_MODEL  # in words first: the model as typed
    next(t for t in at.toggle if t.label == "All columns").set_value(True).run()
    table = at.dataframe[0].value
    assert table["calibration"].iloc[0].startswith(f"{calibration['memory_gbps']:.1f} GB/s")


def test_hardware_warns_of_a_flagged_newest_calibration(page_db, calibration):
    store = Store(page_db)
    key = hardware.device_key(__import__("torch").device("cpu"))
    store.save_calibration(key, {**calibration, "device_key": key})
    low = {**calibration, "device_key": key, "memory_gbps": calibration["memory_gbps"] * 0.3}
    store.save_calibration(key, {**low, "suspect": hardware.disagreement(low, hardware.recent_calibrations(store, key))})
    at = page("pages/hardware.py")
    assert not at.exception and not at.error
    assert any("taken on a busy machine and is not used" in c.value for c in at.caption)
    assert any("agrees with the recent runs" in b.value for b in at.success)
    assert f"{calibration['memory_gbps']:.1f} GB/s" in at.dataframe[0].value["value"].tolist()


@pytest.mark.integration
@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is not installed")
def test_in_chromium_the_text_stays_literal_and_nothing_leaves_the_machine(tmp_path, tiny_lm, calibration):
    db = tmp_path / "hostile.duckdb"
    recorded_run(db, tiny_lm, calibration)
    outside = []
    with serve_app(db) as url, browser_page() as page:
        page.route("**/*", lambda route: (outside.append(route.request.url), route.abort())
                   if not route.request.url.startswith(url) else route.continue_())
        page.goto(url + "/distances")
        page.get_by_text("Attributed with the calibration").first.wait_for(timeout=90_000)
        page.locator(".js-plotly-plot").nth(1).wait_for(timeout=60_000)
        page.wait_for_timeout(1500)
        page.set_viewport_size({"width": 1400, "height": 2000})
        page.screenshot(path="/tmp/hostile-distances.png", full_page=True)
        heading = page.locator("h3").filter(has_text="bold").first
        assert "**bold** [a](https://evil.example) :red[x]" in heading.inner_text().replace("\u2060", "")
        assert page.locator("a[href*='evil.example']").count() == 0
        assert page.locator("h3 strong, h3 b").count() == 0
        assert "<b>b</b>" in page.locator(".js-plotly-plot .ytick text").first.text_content()  # Plotly: literal too
        icon = page.locator("link[rel~='icon']").first.get_attribute("href")
        assert icon and not icon.startswith("http") or icon.startswith(url), icon
        labels = page.locator(".js-plotly-plot").nth(2).locator(".ytick text").all_text_contents()
        assert labels and all(label.replace(".", "", 1).isdigit() for label in labels), labels
    assert outside == [], outside


@pytest.mark.integration
def test_the_report_keeps_a_served_model_id_literal_and_wraps_a_long_prompt(store, tiny_lm, calibration):
    from engine.report.html import runs_report

    run_id = recorded_run(store.path, tiny_lm, calibration, model='<a href="https://evil.example">x</a>',
                          prompt="y" * 3000)
    page = runs_report(store, [run_id])
    assert '<a href="https://evil.example">' not in page and "\\u003ca href" not in page
    assert "&lt;a href=" in page  # in the tables and in the Plotly labels alike
    assert "overflow-wrap: anywhere" in page  # so a 3,000-character word wraps instead of widening the page


def test_count_axes_read_1k_10k_100k():
    ticks = log_ticks([128, 131072], thousands=True)
    assert ticks["ticktext"] == ["100", "1k", "10k", "100k", "1M"]


@pytest.mark.integration
def test_distances_shows_a_served_run_beside_a_local_one_without_an_exception(page_db, tiny_lm, calibration):
    import subprocess
    import sys
    import time
    from pathlib import Path

    from browser import free_port
    from engine.serve import client as served

    local = recorded_run(page_db, tiny_lm, calibration, model="local-model", prompt="Hi")
    port = free_port()
    server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("stream_server.py")), str(port), "ok",
                               "0.01"])
    try:
        for _ in range(100):  # until it listens
            try:
                served.list_models(f"http://127.0.0.1:{port}", None)
                break
            except served.ServedError:
                time.sleep(0.2)
        spec = RunSpec(gen=GenConfig("Say something.", max_new_tokens=6), backend="served",
                       endpoint=f"http://127.0.0.1:{port}")
        run = served.ServedRun(spec, Store(page_db))
        list(run)
    finally:
        server.kill()
        server.wait(timeout=30)
    at = AppTest.from_file("../app.py", default_timeout=180)
    at.switch_page("pages/distances.py")
    at.query_params["run"] = [str(local), str(run.run_id)]
    at.run()
    assert not at.exception
    labels = [s.value for s in at.subheader]
    assert any("served" in label for label in labels) and not any("nan" in label for label in labels)


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is not installed")
def test_in_chromium_a_whole_number_typed_as_1e6_is_a_million_or_refused(tmp_path):
    """A browser's whole-number field read with parseInt turns `1e6` into 1; typed numbers keep their value,
    a fraction is rounded with a line that says so, and one beyond the range is refused in a sentence."""
    with serve_app(tmp_path / "numbers.duckdb") as url, browser_page() as page:
        page.goto(url + "/kv_calculator")
        context = page.get_by_label("Context (tokens)")
        context.wait_for(timeout=90_000)
        context.fill("1e6")
        context.press("Enter")
        page.get_by_text("KV cache at 1,000,000 tokens x 1").wait_for(timeout=30_000)
        batch = page.get_by_label("Batch", exact=True)
        batch.fill("2.7")
        batch.press("Enter")
        page.get_by_text("Batch takes whole numbers: 2.7 is read as 3.").wait_for(timeout=30_000)
        page.get_by_text("KV cache at 1,000,000 tokens x 3").wait_for(timeout=30_000)

        page.goto(url + "/sweeps")
        repeats = page.get_by_role("spinbutton", name="Repeats")
        repeats.wait_for(timeout=90_000)
        repeats.fill("1e6")
        repeats.press("Enter")
        # the browser's own sentence, read aloud by screen readers and shown beside the field
        page.get_by_role("alert").filter(has_text="Please enter a value between 1 and 10.").wait_for(
            state="attached", timeout=30_000)
        assert repeats.get_attribute("aria-invalid") == "true"
        page.screenshot(path="/tmp/whole-numbers.png")
        assert page.locator("[data-testid='stException']").count() == 0
