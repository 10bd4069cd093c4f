"""The report in Debian's Chromium: opened from disk with every request but the file itself refused,
it draws every Plotly figure and attempts no network request (screenshot in test-artifacts/); and
the Runs page's Download report gives the file of the ticked runs."""
import os

import pytest

from browser import CHROMIUM, REPO, browser_page, open_offline, serve_app
from engine.report.html import runs_report
from engine.store.db import Store
from test_report import make_runs, plotly_divs

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason=f"{CHROMIUM} is not installed (apt-get install chromium)")


def test_the_report_renders_offline_in_chromium(tmp_path, tiny_lm, calibration):
    store = Store(tmp_path / "runs.duckdb")
    ids = make_runs(store, tiny_lm, calibration)
    path = tmp_path / "report.html"
    path.write_text(runs_report(store, ids), encoding="utf-8")
    figures = plotly_divs(path.read_text())
    with browser_page(width=1400, height=1000) as page:
        attempted, errors = open_offline(page, path, figures)
        bars = page.locator(".js-plotly-plot .trace.bars path").count()
        assert page.locator("h2", has_text="Comparison").count() == 1
        for run_id in ids:
            assert page.get_by_text(f"#{run_id}:", exact=False).count() >= 1
        artifacts = REPO / "test-artifacts"
        artifacts.mkdir(exist_ok=True)
        page.screenshot(path=str(artifacts / "report.png"), full_page=True)
    assert attempted == [] and errors == []
    assert figures == 1 + len(ids) and bars > 5 * len(ids)


def test_download_report_on_the_runs_page_gives_the_selected_runs(tmp_path, tiny_lm, calibration):
    db = tmp_path / "runs.duckdb"
    ids = make_runs(Store(db), tiny_lm, calibration)
    with serve_app(db) as url, browser_page(width=1400, height=1000) as page:
        page.goto(url + "/runs")
        grid = page.locator("[data-testid='stDataFrame']").first
        grid.wait_for(timeout=90_000)
        for row in (1, 2):  # the row-selection checkboxes of the two newest runs (the table is newest first)
            grid.click(position={"x": 18, "y": 35 * row + 17})
        page.get_by_text("2 selected").wait_for(timeout=30_000)
        with page.expect_download(timeout=120_000) as download:
            page.get_by_role("button", name="Download report").click()
        saved = tmp_path / "downloaded.html"
        download.value.save_as(saved)
        name = download.value.suggested_filename
    text = saved.read_text()
    assert name == f"tokenpath-report-{ids[1]}-{ids[2]}.html"
    assert plotly_divs(text) == 3 and f"Tokenpath: runs #{ids[1]}, #{ids[2]}" in text
