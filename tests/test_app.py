"""The home page through Streamlit's AppTest."""
import json

import pytest
from streamlit.testing.v1 import AppTest

from engine.run.generate import Generation, GenConfig
from engine.store.db import Store

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
    assert {"weights", "sparsity", "speculative", "tag", "time per output token (ms)"} <= set(table.columns)


def test_home_links_every_page_in_the_pages_folder(page_db):
    from pathlib import Path

    at = AppTest.from_file("../app.py", default_timeout=60).run()
    linked = {link.proto.page.strip("/") for link in at.main.get("page_link")}  # the body, not the sidebar
    pages = {p.stem for p in (Path(__file__).parents[1] / "pages").glob("*.py")}
    assert pages and pages <= linked, pages - linked


def test_the_runs_tables_carry_three_significant_digits_and_say_what_differs():
    import pandas as pd

    from ui import readable_runs

    runs = pd.DataFrame([{"run_id": 7, "started_at": pd.Timestamp("2026-12-02 10:00"), "status": "ok", "model": "m",
                          "weights": "int8-wo", "kv_cache": True, "sparsity": 0.5, "sparsity_mode": "skip",
                          "speculative": "prompt-lookup", "tag": "story:memory:int8", "n_new_tokens": 20,
                          "ttft_ms": 30.048952999999994, "tpot_ms": 19.4444, "tokens_per_s": 1234.5678}])
    row = readable_runs(runs).iloc[0]
    assert row["time to first token (ms)"] == 30.0 and row["time per output token (ms)"] == 19.4
    assert row["tokens/s"] == 1230.0
    assert [row["weights"], row["sparsity"], row["speculative"], row["tag"]] == [
        "int8-wo", "50% skip", "prompt-lookup", "story:memory:int8"]
    # a sequence decoded beside others says which user of how many it was
    batched = {**runs.iloc[0].to_dict(), "sparsity": 0.0, "speculative": "none",
               "config": json.dumps({"batch": {"prompts": ["a", "b", "c"], "user": 1, "prompts_file": None}})}
    assert readable_runs(pd.DataFrame([batched])).iloc[0]["settings"] == "int8-wo · user 2 of 3 in a batch"
    assert readable_runs(pd.DataFrame([{**batched, "config": "{}"}])).iloc[0]["settings"] == "int8-wo"


def test_a_served_run_beside_local_ones_has_a_label_without_nan():
    import math
    from types import SimpleNamespace

    from engine.report.charts import run_label

    served = SimpleNamespace(run_id=3, model="qwen", backend="served", weights=None, kv_cache=math.nan,
                             sparsity=math.nan, sparsity_mode=None, speculative=None, temperature=math.nan,
                             n_new_tokens=math.nan, status="ok")
    assert run_label(served) == "#3 qwen · served · 0 tokens · ok"


def svg_text(picture: str) -> str:
    """The SVG inside a live_bars picture."""
    import base64
    import re

    return base64.b64decode(re.search(r"base64,([^\"]+)", picture).group(1)).decode()


def svg_columns(picture: str) -> dict[int, list[float]]:
    """The stacked heights of each column of a live_bars picture, keyed by x."""
    import re

    heights = {}
    for d in re.findall(r'<path fill="[^"]+" d="([^"]+)"', svg_text(picture)):
        for x, h in re.findall(r"M(\d+) [\d.]+h\d+v([\d.]+)", d):
            heights.setdefault(int(x), []).append(float(h))
    return heights


def test_the_live_bars_are_one_picture_whose_columns_stack_the_buckets(page_db, tiny_lm, calibration):
    import re

    from ui import BUCKET_COLOURS, live_bars

    gen = Generation(tiny_lm, GenConfig("Hello", raw=True, max_new_tokens=5, ignore_eos=True), calibration=calibration)
    gen.run()
    picture = live_bars(gen.tokens, height_px=150)
    assert picture.count("<img") == 1 and "<div style=\"width" not in picture
    heights = svg_columns(picture)
    assert len(heights) == 5  # one column per token
    assert max(sum(h) for h in heights.values()) == pytest.approx(150, abs=0.3)  # the tallest token fills the height
    assert set(re.findall(r'<path fill="([^"]+)"', svg_text(picture))) <= set(BUCKET_COLOURS.values())


def test_long_runs_draw_means_of_neighbouring_tokens_in_a_bounded_picture():
    from engine.measure.distances import BUCKETS
    from ui import live_bars

    rows = [{"idx": i, **{f"{b}_ms": 0.0 for b in BUCKETS}} for i in range(7)]
    for i, ms in enumerate([1, 2, 3, 4, 5, 6, 30]):
        rows[i]["compute_ms"] = float(ms)
    picture = live_bars(rows, height_px=100, max_columns=3)  # 3 tokens a column: means 2, 5 and 30
    heights = sorted(svg_columns(picture).items())
    assert [sum(h) for _, h in heights] == pytest.approx([100 * 2 / 30, 100 * 5 / 30, 100], abs=0.1)
    assert "mean of 3 tokens" in picture and "the tallest column is 30.0 ms" in picture
