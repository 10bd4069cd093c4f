"""The KV calculator page through AppTest."""
import pytest
from streamlit.testing.v1 import AppTest



def open_page(timeout=60) -> AppTest:
    at = AppTest.from_file("../app.py", default_timeout=timeout)
    at.switch_page("pages/kv_calculator.py")
    return at.run()


pytestmark = pytest.mark.usefixtures("page_db")


def test_preset_renders_with_formula_and_charts():
    at = open_page()
    assert not at.exception
    assert "GPT-3 175B" in at.subheader[0].value
    formula = " ".join(m.value for m in at.markdown)
    assert "9,663,676,416 bytes" in formula
    assert any(m.label == "KV cache at 2,048 tokens x 1" and m.value == "9.66 GB" for m in at.metric)
    assert any(c.value == "9.00 GiB" for c in at.caption)


def test_custom_shape_and_bad_input():
    at = open_page()
    at.radio[0].set_value("Custom shape").run()
    at.number_input[0].set_value(0).run()
    assert not at.exception
    assert "layers must be" in at.error[0].value
    at.number_input[0].set_value(30).run()
    at.number_input[2].set_value(3).run()
    at.number_input[3].set_value(64).run()
    assert not at.error


@pytest.mark.integration
def test_live_model_measurement_matches_the_prediction():
    at = open_page(180)
    at.button[0].click().run()
    assert not at.exception
    table = at.dataframe[-1].value
    assert len(table) == 1 and bool(table["equal"].iloc[0])
