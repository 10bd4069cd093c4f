"""What the Live page says the generation process is doing while the dashboard warms up: loading the
model, calibrating (only where no calibration of this device can be reused), ready."""
import json
import time
from datetime import datetime, timezone

import torch
from streamlit.testing.v1 import AppTest

import ui
from engine.measure import hardware
from engine.paths import CACHE_ENV, DATA
from engine.store.db import Store


def test_each_state_of_the_warm_start_is_one_sentence():
    started = time.monotonic() - 4
    assert ui.warm_up_words({"state": "loading", "started": started}).startswith(
        "Loading the default model in the generation process (4 s so far")
    calibrating = ui.warm_up_words({"state": "calibrating", "started": started})
    assert calibrating.startswith("Calibrating this device (4 s so far)") and "The model is loaded" in calibrating
    assert ui.warm_up_words({"state": "ready", "seconds": 2.5}) == \
        "Ready: the default model is loaded in the generation process (in 2.5 s)."
    assert "could not load" in ui.warm_up_words({"state": "failed", "message": "No model folder x."})
    assert ui.warm_up_words({"state": "off"}) is None


def test_the_live_page_says_loading_then_ready_with_a_calibration_reused_from_the_machine_cache(
        page_db, tiny_folder, tmp_path, monkeypatch):
    monkeypatch.delenv("TOKENPATH_WARM")
    monkeypatch.setenv("TOKENPATH_MODEL", str(tiny_folder))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(hardware.FIXED_CALIBRATION_ENV)
    device = torch.device("cpu")
    cached = {**json.loads((DATA / "test_calibration.json").read_text()), "device_key": hardware.device_key(device),
              "other_work_share": 0.0,  # measured while the machine was quiet, as every cached one is
              "measured_at": datetime.now(timezone.utc).replace(tzinfo=None).isoformat(timespec="seconds")}
    hardware.remember_calibration(device, cached)
    ui.warm_up.clear(), ui.generation_worker.clear()  # a fresh server: its warm start begins on the first page
    try:
        at = AppTest.from_file("../app.py", default_timeout=300)
        at.switch_page("pages/live.py")
        at.run()
        assert any(i.value.startswith("Loading the default model in the generation process") for i in at.info)
        for _ in range(60):  # a person opening the page again a little later
            ready = [c.value for c in at.caption if c.value.startswith("Ready")]
            if ready:
                break
            time.sleep(2)
            at.run()
        assert ready, [e.value for e in [*at.info, *at.warning, *at.caption]]
        # the verdict above it names the calibration's origin
        assert any("reused from its calibration cache" in c.value for c in at.caption)
        stored = hardware.recent_calibrations(Store(page_db), hardware.device_key(device))
        assert [c["memory_gbps"] for c in stored] == [cached["memory_gbps"]] and stored[0]["reused_from"]
        assert not any("Calibrating" in i.value for i in at.info)
    finally:
        ui.warm_up.clear(), ui.generation_worker.clear()
