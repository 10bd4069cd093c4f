"""The story: its chapters as RunSpecs, the tag that finds their runs again, the Story page through AppTest
on a tiny model (each chapter's button makes stored, tagged runs and a picture), and its report."""
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from engine.report import story
from engine.report import story_capacity as capacity
from engine.run.generate import Generation
from engine.spec import GenConfig, GenerationError, RunSpec
from engine.store.db import Store
from browser import free_port
from test_served import wait_for_port
from commands import run_engine

REPO = Path(__file__).resolve().parent.parent
LOCAL_COMPARISONS = 6  # every comparison of the three local chapters
SERVER = Path(__file__).with_name("stream_server.py")


@pytest.fixture
def story_page(page_db, tiny_folder, monkeypatch):
    monkeypatch.setenv("TOKENPATH_MODEL", str(tiny_folder))

    def open_page() -> AppTest:
        at = AppTest.from_file("../app.py", default_timeout=600)
        at.switch_page("pages/story.py")
        return at.run()
    return open_page


def click(at: AppTest, label: str) -> AppTest:
    next(b for b in at.button if b.label == label).click().run()
    return at


def test_every_chapter_run_is_a_valid_spec_tagged_with_its_chapter_and_arm():
    for chapter in story.CHAPTERS:
        specs = story.chapter_specs(chapter)
        arms = [s.tag for s in specs[:len(specs) // story.REPEATS]]
        assert len(arms) == len({arm.key for c in chapter.comparisons for arm in c.arms})
        assert [s.tag for s in specs] == arms * story.REPEATS  # A B A B: interleaved repeats
        for spec in specs:
            spec.check()
            assert spec.tag.startswith(f"story:{chapter.key}:") and spec.gen.ignore_eos
    memory = story.chapter_specs(story.BY_KEY["memory"])
    assert [(s.weights, s.users) for s in memory] == [("fp32", 1), ("int8-dyn", 1), ("int4-wo", 1),
                                                      ("fp32", 8)] * story.REPEATS
    assert len({s.gen.prompt for s in memory}) == 1  # the same prompt at every precision
    assert story.served_spec("http://127.0.0.1:8000").tag == "story:physical:served"
    with pytest.raises(GenerationError, match="tag"):
        RunSpec(gen=GenConfig("hi"), tag="").check()


def test_a_runs_tag_is_stored_on_its_row(store, tiny_lm, calibration):
    gen = Generation(tiny_lm, GenConfig("hi", raw=True, max_new_tokens=2), store=store, calibration=calibration,
                     tag="story:memory:fp32")
    gen.run()
    assert store.run(gen.run_id)["tag"] == "story:memory:fp32"
    assert story.latest_runs(store, story.BY_KEY["memory"])["fp32"]["run_id"] == gen.run_id
    assert story.latest_runs(store, story.BY_KEY["time"]) == {}


def test_the_physical_chapters_estimates_are_the_planners_and_say_so():
    (dgx_title, dgx), (scale_title, scale) = story.deployment_results()
    assert [r["interconnect"] for r in dgx] == ["nvswitch", "pcie"] and [r["gpus"] for r in scale] == [2, 4, 8]
    assert all(r["estimate"] for r in dgx + scale)
    # PCIe's slower links show up as a larger physical bucket than NVSwitch's, on the same model and GPU count
    assert dgx[1]["distances_ms"]["physical"] > dgx[0]["distances_ms"]["physical"]
    rows = story.deployment_rows(dgx)
    assert rows[0]["speedup (estimate)"] == pytest.approx(1.0)
    assert "estimate" in story.deployment_picture(dgx_title, dgx).layout.title.text


def test_the_story_page_renders_on_an_empty_database(story_page):
    at = story_page()
    assert not at.exception and not at.error
    assert [h.value for h in at.header] == [f"{i}. {c.title}" for i, c in enumerate(story.CHAPTERS, start=1)] + [
        f"{len(story.CHAPTERS) + 1}. {story.CAPACITY_TITLE}"]
    assert sum("Not played yet" in i.value for i in at.info) == LOCAL_COMPARISONS
    assert any("Estimates, not measurements" in w.value for w in at.warning)
    assert not [b for b in at.get("download_button")]  # nothing to report yet


@pytest.mark.parametrize("number,chapter", [(1, "memory"), (2, "time"), (3, "decision")])
def test_each_chapters_button_stores_tagged_runs_and_draws_them(story_page, page_db, number, chapter):
    at = click(story_page(), f"Play chapter {number}")
    assert not at.exception and not at.error, [e.value for e in at.error]
    runs = Store(page_db).runs()
    expected = {s.tag for s in story.chapter_specs(story.BY_KEY[chapter])}
    assert set(runs["tag"]) == expected and set(runs["status"]) == {"ok"}
    assert (runs["n_new_tokens"] == story.NEW_TOKENS).all()
    # one stacked bar per arm in each comparison's picture, and no "not played" left in this chapter
    comparisons = story.BY_KEY[chapter].comparisons
    titled = [c for c in at.get("plotly_chart")  # a title is broken at words onto lines (charts.heading)
              if any(all(word in c.proto.spec for word in cmp.title.split()) for cmp in comparisons)]
    assert len(titled) >= len(comparisons)
    assert sum("Not played yet" in i.value for i in at.info) == LOCAL_COMPARISONS - len(comparisons)
    # a second visit shows them at once, and replaying the chapter adds new runs, shown in their place
    again = story_page()
    assert not again.exception and any("tok/s" in m.value for m in again.metric)
    click(again, f"Play chapter {number}")
    newest = story.latest_runs(Store(page_db), story.BY_KEY[chapter])
    assert min(r["run_id"] for r in newest.values()) > int(runs["run_id"].max())


def test_the_memory_chapter_shows_stored_quality_or_the_command(story_page, page_db):
    at = click(story_page(), "Play chapter 1")
    captions = " ".join(c.value for c in at.caption)
    assert "python -m engine quality --weights int8-dyn" in captions and "--weights int4-wo" in captions
    quality = next(d.value for d in at.dataframe if "perplexity" in d.value.columns)
    assert list(quality.columns) == ["arm", *story.QUALITY]
    table = next(d.value for d in at.dataframe if "weights MB per token" in d.value.columns)
    assert list(table["arm"]) == list(quality["arm"]) == [a.label for a in story.BY_KEY["memory"].comparisons[0].arms]
    assert table["vs baseline"].iloc[0] == "the baseline"
    # a short cell, the ratio and its interval; the whole verdict is the caption under each arm's speed
    assert all(re.fullmatch(r"\d+\.\d\dx \(\d+\.\d\d-\d+\.\d\d\)", text) for text in table["vs baseline"].iloc[1:])
    verdicts = [c.value for c in at.caption if "95% interval" in c.value and "3 vs 3 repeats" in c.value]
    assert len(verdicts) == sum(len(c.levers) for c in story.BY_KEY["memory"].comparisons)


def test_a_server_that_does_not_answer_is_one_sentence_and_no_run(story_page, page_db):
    at = story_page()
    at.text_input[0].set_value("http://127.0.0.1:9").run()
    click(at, "Play chapter 4")
    assert not at.exception and len(at.error) == 1
    assert at.error[0].value.count(". ") <= 1 and "Traceback" not in at.error[0].value
    assert Store(page_db).runs().empty
    at.text_input[0].set_value("not a url").run()
    click(at, "Play chapter 4")
    assert len(at.error) == 1 and "is not a server address" in at.error[0].value


def test_a_served_run_is_measured_with_its_network_share(story_page, page_db):
    port = free_port()
    server = subprocess.Popen([sys.executable, str(SERVER), str(port), "ok", "0.01"])
    try:
        wait_for_port(port, server)
        at = story_page()
        at.text_input[0].set_value(f"http://127.0.0.1:{port}").run()
        click(at, "Play chapter 4")
        assert not at.exception and not at.error, [e.value for e in at.error]
    finally:
        server.kill()
        server.wait(timeout=30)
    runs = Store(page_db).runs()
    assert list(runs["tag"]) == ["story:physical:served"] and list(runs["backend"]) == ["served"]
    assert any(m.label == "network share (physical bucket)" for m in at.metric)
    assert f"#{int(runs['run_id'].iloc[0])} at http://127.0.0.1:{port}" in story.story_report(Store(page_db))


def test_the_page_plays_the_chapter_and_shows_its_figures(story_page, page_db):
    at = story_page()
    assert not at.exception
    assert at.header[-1].value == f"{len(story.CHAPTERS) + 1}. {story.CAPACITY_TITLE}"
    assert any("Not measured yet" in m.value for m in at.markdown)
    click(at, f"Play chapter {len(story.CHAPTERS) + 1}")
    assert not at.exception and not at.error, [e.value for e in at.error]
    found = capacity.latest(Store(page_db))
    assert found is not None
    assert any(m.label == "capacity (measured)" and m.value.endswith(" req/s") for m in at.metric)
    levels = next(d.value for d in at.dataframe if "rate req/s" in d.value.columns)
    assert len(levels) == len(found["levels"])
    assert any(capacity.verdict(Store(page_db), found)[:40] in m.value.replace("\\", "").replace("\u2060", "")
               for m in at.markdown)
    assert any(f"sweep {found['sweep_id']}, took" in c.value for c in at.caption)
    assert at.get("download_button")  # the report now holds the chapter


def test_the_story_report_holds_every_chapters_runs(store, tiny_lm, calibration, tmp_path):
    made = {}
    for chapter in story.CHAPTERS[:3]:
        spec = story.chapter_specs(chapter)[0]
        gen = Generation(tiny_lm, spec.gen, store=store, calibration=calibration, tag=spec.tag)
        gen.run()
        made[chapter.key] = gen.run_id
    page = story.story_report(store)
    for chapter in story.CHAPTERS:
        assert f"Story: {chapter.title}" in page
    for run_id in made.values():
        assert f"#{run_id}" in page
    assert "Not played yet" in page  # the levers were not run, and the report says so rather than inventing them
    out = tmp_path / "story.html"
    done = run_engine("report", "--story", "--out", out, "--db", store.path)
    assert done.returncode == 0 and out.read_text().count("Story: ") >= 4


def test_a_story_report_with_no_story_runs_is_one_sentence(tmp_path):
    db, out = tmp_path / "empty.duckdb", tmp_path / "none.html"
    Store(db)
    done = run_engine("report", "--story", "--out", out, "--db", db)
    assert done.returncode == 2 and not out.exists()
    assert done.stderr.strip() == "error: No story runs are stored yet: play the story on the Story page first."


def test_a_lever_is_called_a_difference_only_when_its_repeats_show_one(store):
    """Story rows read each arm's newest repeats: a synthetic arm within the baseline's noise is no win, one
    well outside it is faster."""
    comparison = story.BY_KEY["memory"].comparisons[0]
    rates = {"fp32": [9.0, 20.0, 21.0, 19.5], "int8-dyn": [30.0, 31.0, 29.6], "int4-wo": [20.5, 19.0, 21.2]}
    for arm, values in rates.items():  # the first fp32 run is an older play's: only the newest three count
        for rate in values:
            run_id = store.start_run(model="synthetic", device="cpu", dtype="float32", config={"weights": arm},
                                     hardware={}, prompt=story.SHORT_PROMPT, tag=story.tag(story.BY_KEY["memory"], arm))
            store.finish_run(run_id, status="ok", metrics={"decode_tokens_per_s": rate, "n_new_tokens": 6})
    runs = story.latest_runs(store, story.BY_KEY["memory"])
    found = {r["arm"]: r for r in story.comparison_rows(store, comparison, runs)}
    assert found["fp32 (4 bytes a weight)"]["vs baseline"] == "the baseline"
    assert found["int8 (int8-dyn)"]["measurable"] and found["int8 (int8-dyn)"]["vs baseline"].endswith("faster")
    assert not found["int4 (int4-wo)"]["measurable"]
    assert found["int4 (int4-wo)"]["vs baseline"].endswith("no measurable difference")


def test_a_batch_of_users_is_one_repeat_with_every_users_tokens_per_second(store):
    """The batching lever reads each repeat as one batch of eight runs: its speed is their decode speeds together,
    so eight users at just under one user's speed each are a measurable gain in tokens per second."""
    memory = story.BY_KEY["memory"]
    comparison = memory.comparisons[1]
    assert [(a.key, a.users) for a in comparison.arms] == [("fp32", 1), ("users-8", 8)]

    def stored(arm: str, rate: float) -> None:
        run_id = store.start_run(model="synthetic", device="cpu", dtype="float32", config={"weights": "fp32"},
                                 hardware={}, prompt=story.SHORT_PROMPT, tag=story.tag(memory, arm))
        store.finish_run(run_id, status="ok", metrics={"decode_tokens_per_s": rate, "n_new_tokens": 6})

    for repeat in range(story.REPEATS):
        stored("fp32", 20.0 + repeat)
        for user in range(8):
            stored("users-8", 15.0 + repeat + user / 10)
    assert story.arm_rates(store, story.tag(memory, "users-8"), 8) == pytest.approx(
        [8 * (15.0 + r) + 2.8 for r in (2, 1, 0)])  # newest batch first
    found = {r["arm"]: r for r in story.comparison_rows(store, comparison, story.latest_runs(store, memory))}
    batch = found["8 users, one batch"]
    # the repeats' geometric mean: its ratio to the baseline's is the ratio the verdict gives
    assert batch["decode tok/s"] == pytest.approx(statistics.geometric_mean([8 * (15.0 + r) + 2.8 for r in range(3)]))
    assert batch["speedup"] == pytest.approx(batch["decode tok/s"] / statistics.geometric_mean([20.0, 21.0, 22.0]))
    # a user's share of the batch's speed, not the newest run's own (17.7, the last user's)
    assert batch["decode tok/s per user"] == pytest.approx(batch["decode tok/s"] / 8)
    assert batch["measurable"] and batch["vs baseline"].endswith("faster") and "3 vs 3 repeats" in batch["vs baseline"]
