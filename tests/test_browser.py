"""End to end in a real browser: streamlit run app.py on a free localhost port, Debian's Chromium
driven by Playwright. Screenshots go to test-artifacts/."""
import os
from pathlib import Path

import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from browser import CHROMIUM, REPO, browser_page, serve_app
from engine.store.db import Store

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is not installed (apt-get install chromium)")]
ARTIFACTS = REPO / "test-artifacts"


def shot(page, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    page.set_viewport_size({"width": 1400, "height": 2400})
    page.wait_for_timeout(800)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path))
    page.set_viewport_size({"width": 1400, "height": 1000})
    return path


def test_generate_in_the_browser_and_find_the_run(tmp_path):
    db = tmp_path / "browser.duckdb"
    with serve_app(db) as url, browser_page() as page:
        page.goto(url)
        page.get_by_text("No runs recorded yet").wait_for(timeout=90_000)
        assert shot(page, "home").stat().st_size > 10_000
        page.get_by_role("link", name="Live generation").first.click()
        page.get_by_label("Prompt text").fill("Name three fruits.")
        page.get_by_role("button", name="Generate").click()
        try:
            page.get_by_text("TTFT").wait_for(timeout=180_000)
        except PlaywrightTimeout:  # what the page showed instead, kept for whoever reads the failure
            shot(page, "live-without-ttft")
            pytest.fail("no TTFT 180 s after Generate; the page said: " + page.inner_text("body")[-1500:])
        page.locator(".js-plotly-plot").first.wait_for(timeout=30_000)
        assert "fruit" in page.locator("[data-testid='stMarkdownContainer']").all_inner_texts().__str__().lower() \
            or len(Store(db).runs()["output"].iloc[0]) > 3
        assert page.locator("[data-testid='stException']").count() == 0
        shot(page, "live-after-generate")
        run_id = int(Store(db).runs()["run_id"].iloc[0])

        page.get_by_role("link", name="Runs").first.click()
        page.locator("[data-testid='stDataFrame']").first.wait_for(timeout=60_000)
        page.get_by_text("1 of 1 runs").wait_for(timeout=30_000)
        shot(page, "runs")
        page.get_by_role("link", name="Distances").first.click()
        page.get_by_text(f"#{run_id} ").first.wait_for(timeout=60_000)
        page.locator(".js-plotly-plot").nth(2).wait_for(timeout=60_000)
        assert page.locator("[data-testid='stException']").count() == 0
        shot(page, "distances")

        page.get_by_role("link", name="Live generation").first.click()
        page.get_by_label("Prompt text").fill("Tell a long story about the sea.")
        # the model tells this story for all 4096 tokens: a fast machine must not finish it before the click
        page.get_by_text("More settings", exact=True).click()  # the token budget sits there
        page.get_by_label("Max new tokens").fill("4096")
        page.get_by_role("button", name="Generate").click()
        page.get_by_text("Generating:").wait_for(timeout=60_000)
        page.locator("[data-testid='stButton'] button", has_text="Stop").first.click()
        try:
            page.get_by_text("was stopped and is kept as cancelled").wait_for(timeout=60_000)
        except Exception:
            shot(page, "live-after-stop-failed")
            raise AssertionError(f"no stop message; runs: {Store(db).runs()[['run_id', 'status', 'n_new_tokens']].to_dict('records')}")
        shot(page, "live-after-stop")
    runs = Store(db).runs().sort_values("run_id")
    assert list(runs["status"]) == ["ok", "cancelled"] and runs["prompt"].iloc[0] == "Name three fruits."
    assert 0 < runs["n_new_tokens"].iloc[1] < 4096
