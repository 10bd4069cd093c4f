"""A run whose decode beat the calibrated memory peak is flagged where its buckets are shown."""
import pytest
from streamlit.testing.v1 import AppTest

from engine.run.generate import Generation, GenConfig
from engine.store.db import Store

pytestmark = pytest.mark.integration


def test_the_distances_page_flags_a_run_faster_than_its_peak(page_db, tiny_lm, calibration):
    gen = Generation(tiny_lm, GenConfig("Hi", raw=True, max_new_tokens=4, ignore_eos=True), store=Store(page_db),
                     calibration={**calibration, "memory_gbps": 1e-9})
    gen.run()
    at = AppTest.from_file("../app.py", default_timeout=180)
    at.switch_page("pages/distances.py")
    at.run()
    assert not at.exception
    assert any("beat the calibrated peak" in c.value for c in at.caption)
