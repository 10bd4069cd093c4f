"""The home page through Streamlit's AppTest: renders, generates with the real model, records the run."""
import pytest
from streamlit.testing.v1 import AppTest

pytestmark = pytest.mark.integration


@pytest.fixture
def app_db(tmp_path, monkeypatch):
    db = tmp_path / "app.duckdb"
    monkeypatch.setenv("TOKENPATH_DB", str(db))
    return db


def test_home_renders_without_running_anything(app_db):
    at = AppTest.from_file("../app.py", default_timeout=60).run()
    assert not at.exception
    assert at.title[0].value == "Tokenpath"
    assert any("No runs recorded yet" in i.value for i in at.info)


def test_home_generates_and_lists_the_run(app_db):
    at = AppTest.from_file("../app.py", default_timeout=120).run()
    at.text_area[0].set_value("Name a colour.")
    at.number_input[0].set_value(6)
    at.button[0].click().run()
    assert not at.exception
    assert [e.value for e in at.error] == []
    assert at.code and at.code[-1].value.strip()
    assert any(m.label == "TTFT" for m in at.metric)
    table = at.dataframe[-1].value
    assert len(table) == 1 and table["status"].iloc[0] == "ok"


def test_home_runs_a_quantized_level_and_records_it(app_db):
    from engine.store import Store

    at = AppTest.from_file("../app.py", default_timeout=180).run()
    at.text_area[0].set_value("Name a colour.")
    at.number_input[0].set_value(4)
    at.selectbox[0].set_value("int4-wo")
    at.button[0].click().run()
    assert not at.exception and not at.error
    assert list(Store(app_db).runs()["quant"]) == ["int4-wo g32"]


def test_home_shows_one_sentence_for_an_empty_prompt(app_db):
    at = AppTest.from_file("../app.py", default_timeout=120).run()
    at.text_area[0].set_value("   ")
    at.button[0].click().run()
    assert not at.exception
    assert "empty" in at.error[0].value
