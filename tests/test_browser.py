"""End to end in a real browser: streamlit run app.py on a free localhost port, Debian's Chromium
driven by Playwright. Screenshots go to test-artifacts/."""
import os
from pathlib import Path

import pytest

from browser import CHROMIUM, REPO, browser_page, serve_app
from engine.store import Store

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is not installed (apt-get install chromium)")]
ARTIFACTS = REPO / "test-artifacts"


def shot(page, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    page.set_viewport_size({"width": 1400, "height": 2400})
    page.wait_for_timeout(500)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path))
    return path


def test_generate_in_the_browser_and_find_the_run(tmp_path):
    with serve_app(tmp_path / "browser.duckdb") as url, browser_page() as page:
        page.goto(url)
        page.get_by_text("No runs recorded yet").wait_for(timeout=90_000)
        page.get_by_label("Prompt").fill("Name three fruits.")
        page.get_by_role("button", name="Generate").click()
        page.get_by_text("TTFT").wait_for(timeout=180_000)
        streamed = page.locator("[data-testid='stCode']").first.inner_text()
        assert len(streamed.strip()) > 3
        page.locator(".js-plotly-plot").first.wait_for(timeout=30_000)
        page.get_by_text("Where each token's time went").wait_for(timeout=30_000)
        page.locator("[data-testid='stDataFrame']").wait_for(timeout=30_000)
        assert page.locator("[data-testid='stException']").count() == 0
        assert shot(page, "home-after-generate").stat().st_size > 10_000
    runs = Store(tmp_path / "browser.duckdb").runs()
    assert list(runs["status"]) == ["ok"] and runs["prompt"].iloc[0] == "Name three fruits."
