"""The Serving page in Debian's Chromium: Download report of a stored load sweep whose levels completed no
request gives the sweep's HTML report (the file the browser receives), never an exception box; the page's
screenshot goes to test-artifacts/."""
import os
import re

import pytest

from browser import CHROMIUM, REPO, browser_page, serve_app
from test_page_serving import slow_stream_url, store_a_sweep_and_one_that_completed_nothing  # noqa: F401
from test_load import known_server  # noqa: F401 (the fixture)

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason=f"{CHROMIUM} is not installed (apt-get install chromium)")


def test_download_report_of_a_sweep_that_completed_nothing_gives_its_html(tmp_path, slow_stream_url):  # noqa: F811
    db = tmp_path / "runs.duckdb"
    _, cut = store_a_sweep_and_one_that_completed_nothing(db, slow_stream_url)
    with serve_app(db) as url, browser_page(width=1400, height=2200) as page:
        page.goto(url + "/serving")
        page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 5", timeout=120_000)
        button = page.get_by_role("button", name="Download report")
        with page.expect_download(timeout=120_000) as download:
            button.click()
        saved = tmp_path / "downloaded.html"
        download.value.save_as(saved)
        name = download.value.suggested_filename
        page.wait_for_timeout(1000)
        assert page.locator("[data-testid='stException']").count() == 0
        artifacts = REPO / "test-artifacts"
        artifacts.mkdir(exist_ok=True)
        page.screenshot(path=str(artifacts / "serving.png"), full_page=True)
    text = saved.read_text()
    assert name == f"tokenpath-load-sweep-{cut}.html"
    assert text.startswith("<!DOCTYPE html>") and f"<title>Tokenpath: load sweep #{cut}</title>" in text
    rows = [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in re.findall(r"<tr>(<td.*?)</tr>", text)]
    # each level: none completed, both requests failed, and a dash for every figure no request had
    assert [row[:4] for row in rows] == [["1 at once", "0", "2", "-/-/-"], ["2 at once", "0", "2", "-/-/-"]]
    assert "Ended early" not in text and "Made again by <code>python -m engine load --endpoint" in text


def test_at_1024_px_the_form_s_shared_prefix_and_the_request_network_fit_the_page(tmp_path, known_server):  # noqa: F811
    from engine.serve.load import Sweep, SweepConfig
    from engine.store.db import Store

    db = tmp_path / "runs.duckdb"
    url = known_server(slots=1, step_s=0.005)
    Sweep(SweepConfig(url, [1], requests=3, output_tokens=2, input_tokens=8, shared_prefix_tokens=40), Store(db)).run()
    with serve_app(db) as app, browser_page(width=1024, height=2200) as page:
        page.goto(app + "/serving")
        page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 4", timeout=120_000)
        page.get_by_text("All columns").click()
        page.wait_for_timeout(1500)
        assert page.locator("[data-testid='stException']").count() == 0
        assert page.get_by_role("spinbutton", name="Shared prefix (tokens, 0 = none)").is_visible()
        assert page.evaluate("document.documentElement.scrollWidth") <= 1024  # nothing runs off the side
        artifacts = REPO / "test-artifacts"
        artifacts.mkdir(exist_ok=True)
        page.screenshot(path=str(artifacts / "serving-1024.png"), full_page=True)
