"""The KV calculator page through AppTest: every input mode at its defaults, uploads and bad input."""
import json

import pytest
from streamlit.testing.v1 import AppTest

from engine.plan import kvcalc

pytestmark = pytest.mark.usefixtures("page_db")

DEFAULT_CONFIG = (kvcalc.DATA / "models" / "SmolLM2-135M-Instruct" / "config.json").read_bytes()


def open_page(timeout=120) -> AppTest:
    at = AppTest.from_file("../app.py", default_timeout=timeout)
    at.switch_page("pages/kv_calculator.py")
    return at.run()


def upload(at: AppTest, name: str, content: bytes) -> AppTest:
    at.radio[0].set_value("Upload a config.json").run()
    at.file_uploader[0].set_value((name, content, "application/json"))
    return at.run()


def test_preset_renders_with_formula_and_charts():
    at = open_page()
    assert not at.exception
    assert any(at.dataframe[0].value["fits"])  # the first view shows a model that fits somewhere
    next(w for w in at.selectbox if w.label == "Preset").select_index(0).run()
    assert "GPT-3 175B" in at.subheader[0].value.replace("\\", "")
    formula = " ".join(m.value for m in at.markdown)
    assert "9,663,676,416 bytes" in formula
    assert any(m.label == "KV cache at 2,048 tokens x 1" and m.value == "9.66 GB" for m in at.metric)
    assert any(c.value == "9.00 GiB" for c in at.caption)


@pytest.mark.parametrize("mode", ["Preset", "Custom shape", "Upload a config.json", "Project model folder"])
def test_every_input_mode_renders_at_its_defaults(mode):
    at = open_page()
    at.radio[0].set_value(mode).run()
    assert not at.exception and not at.error
    if mode == "Upload a config.json":
        assert "Upload a model's config.json" in at.info[0].value
    else:
        assert at.subheader and at.dataframe


def test_custom_shape_without_parameters_shows_the_kv_cache_alone():
    at = open_page()
    at.radio[0].set_value("Custom shape").run()
    assert any("Parameter count unknown" in c.value for c in at.caption)
    table = at.dataframe[0].value
    assert table["weights read (ms/step)"].isna().all()


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


def test_the_default_models_config_uploads_and_renders():
    at = upload(open_page(), "config.json", DEFAULT_CONFIG)
    assert not at.exception and not at.error
    # escaped: backslashes, and a word joiner that keeps "config.json" from reading as a web address
    assert at.subheader[0].value.replace("\\", "").replace("\u2060", "") == "config.json: GQA"
    assert any(m.label == "Values per token" and m.value == f"{2 * 30 * 3 * 64:,}" for m in at.metric)


@pytest.mark.parametrize("name, content, message", [
    ("config.json", b"{not json", "not valid JSON"),
    ("config.json", b"[1, 2]", "not an object"),
    ("config.json", b'{"num_hidden_layers": "32", "num_attention_heads": 32, "hidden_size": 4096}', "whole number"),
    ("config.json", b'{"num_hidden_layers": NaN, "num_attention_heads": 32, "hidden_size": 4096}', "whole number"),
    ("config.json", b'{"num_hidden_layers": 2.7, "num_attention_heads": 32, "hidden_size": 4096}', "whole number"),
    ("config.json", b'{"num_hidden_layers": true, "num_attention_heads": 32, "hidden_size": 4096}', "whole number"),
    ("big.json", b"{" + b" " * (2 << 20) + b"}", "larger than"),
])
def test_bad_uploads_get_one_sentence(name, content, message):
    at = upload(open_page(), name, content)
    assert not at.exception
    assert message in at.error[0].value.replace("\\", "")


def test_user_text_is_escaped_not_rendered_as_markdown():
    config = json.loads(DEFAULT_CONFIG)
    at = upload(open_page(), "**bold** [a](https:__x).json", json.dumps(config).encode())
    assert not at.exception
    heading = at.subheader[0].value
    assert "\\*\\*bold\\*\\*" in heading and "\\[a\\]\\(https" in heading
    at = upload(open_page(), "**x**.json", b"{not json")
    assert "\\*\\*x\\*\\*" in at.error[0].value


@pytest.mark.integration
def test_live_model_measurement_matches_the_prediction():
    at = open_page(180)
    at.button[0].click().run()
    assert not at.exception
    table = at.dataframe[-1].value
    assert len(table) == 1 and bool(table["equal"].iloc[0])
