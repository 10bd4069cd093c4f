"""The whole story played in Debian's Chromium: streamlit run app.py on a free localhost port, a tiny model and
a small streaming server on loopback; a screenshot of each chapter goes to test-artifacts/, and the downloaded
story report opens with every request but the file itself refused and holds every chapter's runs and the
capacity chapter's search."""
import os
from pathlib import Path

import pytest

from browser import CHROMIUM, REPO, browser_page, open_offline, serve_app
from engine.report import story
from engine.report import story_capacity
from engine.store.db import Store
from test_served import stream_server  # noqa: F401 (a fixture: a small real streaming server)

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is not installed (apt-get install chromium)")]
ARTIFACTS = REPO / "test-artifacts"


@pytest.fixture
def server_url(stream_server):
    url, _ = stream_server("ok", delay=0.01)  # returns once the server takes connections
    return url


def chapter_shot(page, number: int, title: str, key: str) -> Path:
    """The chapter's heading scrolled to the top of a tall viewport, then a screenshot."""
    heading = page.get_by_role("heading", name=f"{number}. {title}")
    heading.evaluate("el => el.scrollIntoView({block: 'start'})")
    page.wait_for_timeout(1500)
    path = ARTIFACTS / f"story-{number}-{key}.png"
    page.screenshot(path=str(path))
    return path


def test_the_whole_story_plays_in_the_browser_and_its_report_opens_offline(tmp_path, tiny_folder, server_url):
    db = tmp_path / "story.duckdb"
    ARTIFACTS.mkdir(exist_ok=True)
    with serve_app(db, env={"TOKENPATH_MODEL": str(tiny_folder)}) as url, browser_page(height=1500) as page:
        page.goto(url)
        page.get_by_role("link", name="Story").first.click()
        page.get_by_text("Not played yet").first.wait_for(timeout=120_000)
        page.get_by_label("Server URL").fill(server_url)
        page.get_by_label("Server URL").press("Enter")
        page.wait_for_timeout(1500)
        page.get_by_role("button", name="Run the whole story").click()
        page.get_by_text(" runs in ").wait_for(timeout=1_500_000)
        # then the capacity search, stopped at its budget at the latest
        page.get_by_role("button", name="Download report").wait_for(timeout=(story_capacity.BUDGET_S + 300) * 1000)
        # the five comparisons, the two deployments and the served run drawn (the per-token ones wait, folded)
        page.wait_for_function("[...document.querySelectorAll('.js-plotly-plot .main-svg')]"
                               ".filter(e => e.getBoundingClientRect().height > 0).length >= 8", timeout=120_000)
        assert page.locator("[data-testid='stException']").count() == 0
        # the rerun after the story redraws chapter by chapter: wait for it to reach the last one
        page.wait_for_function("!document.body.innerText.includes('Not played yet')", timeout=180_000)
        for number, chapter in enumerate(story.CHAPTERS, start=1):
            assert chapter_shot(page, number, chapter.title, chapter.key).stat().st_size > 20_000
        assert "Not measured yet" not in page.inner_text("body")  # the capacity chapter's search is shown
        assert chapter_shot(page, len(story.CHAPTERS) + 1, story.CAPACITY_TITLE, "capacity").stat().st_size > 20_000
        with page.expect_download(timeout=300_000) as download:
            page.get_by_role("button", name="Download report").click()
        report = tmp_path / "story.html"
        download.value.save_as(report)
    runs = Store(db).all_runs()
    runs = runs[runs["tag"].str.startswith("story:")]  # the capacity search's requests are runs tagged load:...
    assert set(runs["status"]) == {"ok"}
    expected = {s.tag for c in story.CHAPTERS for s in story.chapter_specs(c)} | {"story:physical:served"}
    assert set(runs["tag"]) == expected
    with browser_page(width=1400, height=1000) as page:
        attempted, errors = open_offline(page, report, 8)
        for title in [c.title for c in story.CHAPTERS] + [story.CAPACITY_TITLE]:
            assert page.locator("h2", has_text=f"Story: {title}").count() == 1
        text = page.inner_text("body")
        page.screenshot(path=str(ARTIFACTS / "story-report.png"), full_page=True)
    assert attempted == [] and errors == []
    reported = story.story_run_ids(Store(db))  # the latest repeat of each arm (older repeats stay in the store)
    assert reported and all(f"#{run_id}" in text for run_id in reported)
