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


def test_the_live_bars_are_one_picture_whose_columns_stack_the_buckets(page_db, tiny_lm, calibration):
    import base64
    import re

    from ui import BUCKET_COLOURS, live_bars

    gen = Generation(tiny_lm, GenConfig("Hello", raw=True, max_new_tokens=5, ignore_eos=True), calibration=calibration)
    gen.run()
    picture = live_bars(gen.tokens, height_px=150)
    assert picture.count("<img") == 1 and "<div style=\"width" not in picture
    svg = base64.b64decode(re.search(r"base64,([^\"]+)", picture).group(1)).decode()
    heights = {}
    for colour, d in re.findall(r'<path fill="([^"]+)" d="([^"]+)"', svg):
        for x, h in re.findall(r"M(\d+) [\d.]+h\d+v([\d.]+)", d):
            heights.setdefault(int(x), []).append(float(h))
    assert len(heights) == 5  # one column per token
    assert max(sum(h) for h in heights.values()) == pytest.approx(150, abs=0.3)  # the tallest token fills the height
    assert {c for c, _ in re.findall(r'<path fill="([^"]+)" d="([^"]+)"', svg)} <= set(BUCKET_COLOURS.values())
