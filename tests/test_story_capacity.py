"""The Story's capacity chapter: the planner's prediction and the measured capacity search of the local engine
(in a process of its own, into the story's database), set side by side in words the figures support, on the
page and in the report; a search that finds no holding rate is a sentence."""
import pytest

from engine.report import story
from engine.report import story_capacity as capacity
from engine.store.db import Store


def test_the_default_model_is_measured_beside_the_planners_capacity(store):
    summary = capacity.measure(str(store.path), model="default")
    assert summary["status"] in ("ok", "stopped") and summary["levels"]  # stopped: at its budget, on a busy machine
    found = capacity.latest(store)
    assert found["sweep_id"] == summary["sweep_id"] and found["seconds"] > 0
    assert {lv["rate"] for lv in found["levels"]} == {row["rate req/s"] for row in capacity.level_rows(found)}
    text = capacity.verdict(store, found)
    if summary["capacity_requests_per_s"] is not None:
        assert f"Measured: {summary['capacity_requests_per_s']:.3g} requests/s held" in text
    if summary["first_failing_rate"] is not None:
        assert capacity.EXPLAINED[summary["limiting_metric"]] in text and "ms per output token" in text
    rows = {r["figure"]: r for r in capacity.side_by_side(capacity.predict(capacity.stored_calibration(store)), found)}
    assert rows["capacity req/s"]["measured"] == summary["capacity_requests_per_s"]
    assert rows["metric that failed first"]["measured"] == summary["limiting_metric"]
    assert f"sweep {found['sweep_id']}, took" in capacity.cost_text(found)
    page = story.story_report(store)  # no chapter runs, the capacity sweep alone
    assert f"Story: {story.CAPACITY_TITLE}" in page and f"Measured levels, sweep {found['sweep_id']}" in page


@pytest.mark.subprocess
def test_a_search_that_finds_no_holding_rate_is_a_sentence(store, tiny_folder, monkeypatch):
    monkeypatch.setattr(capacity, "SLO", {"ttft_ms": 0.001, "tpot_ms": 0.001})  # no request can meet it
    # from 4 requests/s the search halves the rate after each failing level (3, 3 and 4 s of arrivals) until one
    # whose requests each ran alone, or until the budget stops it with those levels kept
    summary = capacity.measure(str(store.path), start_rate=4.0, model=str(tiny_folder), budget_s=25)
    assert summary["capacity_requests_per_s"] is None
    assert summary["status"] == "stopped" or summary["failed_alone"]
    found = capacity.latest(store)
    text = capacity.verdict(store, found)
    assert text.startswith("No rate tried held 90% of requests within ttft_ms=0.001,tpot_ms=0.001: even ")
    assert "Traceback" not in text
    assert "No rate tried held" in story.capacity_section(store).html


@pytest.mark.subprocess
def test_a_command_that_refuses_is_one_sentence(store):
    with pytest.raises(capacity.CapacityChapterError, match=r"^The capacity search gave no answer: .*\.$") as e:
        capacity.measure(str(store.path), model="no-such-model-folder")
    assert "Traceback" not in str(e.value) and capacity.latest(store) is None


def test_the_prediction_is_the_planners_capacity_or_a_sentence(calibration):
    planned = capacity.predict(calibration)
    text = capacity.prediction_text(planned)
    if "capacity_requests_per_s" in planned:
        assert f"predicts {planned['capacity_requests_per_s']:.3g} requests/s" in text
        assert f"Beyond it {planned['limiting_metric']} fails first" in text
        assert planned["tpot_ms_p50"] > 0 and 0 < planned["attainment"] <= 1
    else:  # the calibration misses the target even at almost no load: the planner says which metric and bucket
        assert text.startswith("The planner finds no rate that holds") and planned["limiting_bucket"] in text
    assert capacity.prediction_text(capacity.predict(None)).endswith("playing the chapter measures one.")
    assert capacity.predict(calibration, model="no-such-model-folder")["why"].startswith("Unknown model")
