"""One verdict on the calibration, decided in the engine and shown the same on every page that
uses the calibration; a ratio above 100% of a peak never stands without the sentence explaining it."""
import pytest
import torch
from streamlit.testing.v1 import AppTest

from engine.measure import hardware
from engine.run.generate import Generation, GenConfig
from engine.store.db import Store

pytestmark = pytest.mark.integration

CALIBRATED_PAGES = ["pages/hardware.py", "pages/distances.py", "pages/live.py", "pages/planner.py"]


def verdict_on(page: str) -> tuple[list[str], list[str]]:
    at = AppTest.from_file("../app.py", default_timeout=180)
    at.switch_page(page)
    at.run()
    assert not at.exception, page
    boxes = [e.value for e in [*at.warning, *at.success] if "Calibration:" in e.value]
    return boxes, [b.label for b in at.button]


def test_a_calibration_beaten_by_a_run_gets_one_verdict_on_every_page(page_db, tiny_lm, calibration):
    store = Store(page_db)
    # any real decode moves more than this, from memory or from the cache the tiny model's weights fit
    low = {**calibration, "memory_gbps": 1e-9, "cache_read": {**calibration["cache_read"], "gbps": 1e-9}}
    store.save_calibration(hardware.device_key(torch.device("cpu")), low)
    Generation(tiny_lm, GenConfig("Hi", raw=True, max_new_tokens=4, ignore_eos=True), store=store,
               calibration=low).run()
    verdict = hardware.calibration_verdict(store, hardware.device_key(torch.device("cpu")))
    assert not verdict.trustworthy and "reads low" in verdict.headline and verdict.action
    shown = {page: verdict_on(page) for page in CALIBRATED_PAGES}
    for page, (boxes, buttons) in shown.items():
        assert len(boxes) == 1 and "reads low" in boxes[0], page
        assert verdict.action in buttons, page
    assert len({boxes[0] for boxes, _ in shown.values()}) == 1  # word for word the same


def test_a_quiet_calibration_is_trustworthy_and_asks_for_nothing(store, calibration):
    key = hardware.device_key(torch.device("cpu"))
    assert not hardware.calibration_verdict(store, key).trustworthy  # nothing stored yet
    store.save_calibration(key, calibration)
    verdict = hardware.calibration_verdict(store, key)
    assert verdict.trustworthy and verdict.action is None
    assert verdict.calibration["memory_gbps"] == calibration["memory_gbps"]


def test_a_ratio_above_a_peak_carries_its_explanation():
    assert hardware.above_peak_sentence(0.8) is None
    assert hardware.above_peak_sentence(None) is None
    sentence = hardware.above_peak_sentence(1.59)
    assert sentence.startswith("159% is above 100%") and "calibrate again" in sentence
