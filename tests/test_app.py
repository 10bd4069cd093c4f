"""The home page through Streamlit's AppTest."""
import pytest
from streamlit.testing.v1 import AppTest

from engine.generate import Generation, GenConfig
from engine.store import Store

pytestmark = pytest.mark.integration


def test_home_renders_without_running_anything(page_db):
    at = AppTest.from_file("../app.py", default_timeout=60).run()
    assert not at.exception
    assert at.title[0].value == "Tokenpath"
    assert any("No runs recorded yet" in i.value for i in at.info)
    assert "memory" in at.expander[0].markdown[1].value + " ".join(m.value for m in at.expander[0].markdown)


def test_home_lists_the_latest_runs(page_db, tiny_lm, calibration):
    Generation(tiny_lm, GenConfig("Hello", raw=True, max_new_tokens=3), store=Store(page_db), calibration=calibration).run()
    at = AppTest.from_file("../app.py", default_timeout=60).run()
    assert not at.exception
    table = at.dataframe[-1].value
    assert len(table) == 1 and table["status"].iloc[0] == "ok"
