"""Every page through Streamlit's AppTest: renders, its widgets drive the engine, the elements appear."""
import pytest
import torch
from streamlit.testing.v1 import AppTest

from engine.measure import hardware
from engine.store.db import Store

pytestmark = pytest.mark.integration


def open_page(page: str, timeout=180) -> AppTest:
    at = AppTest.from_file("../app.py", default_timeout=timeout)
    at.switch_page(page)
    return at.run()


def live_run(prompt="Name a colour.", tokens=5, **widgets) -> AppTest:
    at = open_page("pages/live.py")
    at.text_area[0].set_value(prompt)
    at.number_input[0].set_value(tokens)
    for label, value in widgets.items():
        next(w for w in [*at.selectbox, *at.toggle, *at.slider, *at.checkbox, *at.text_input]
             if w.label == label).set_value(value)
    next(b for b in at.button if b.label == "Generate").click().run()
    return at


def test_every_page_renders_on_an_empty_database(page_db):
    for page in ["pages/live.py", "pages/distances.py", "pages/runs.py", "pages/sweeps.py", "pages/hardware.py",
                 "pages/kv_calculator.py"]:
        at = open_page(page)
        assert not at.exception, page
        assert at.title, page


def test_live_generation_streams_and_records(page_db):
    assert "Not calibrated on this device yet" in open_page("pages/live.py").warning[0].value
    at = live_run()
    assert not at.exception and not at.error
    # the run calibrated the device on a new database: the verdict drawn before it is drawn again
    verdicts = [e.value for e in [*at.warning, *at.success] if e.value.startswith("**Calibration:**")]
    assert len(verdicts) == 1 and "Not calibrated" not in verdicts[0], verdicts
    assert any(m.label == "TTFT" for m in at.metric)
    runs = Store(page_db).runs()
    assert list(runs["status"]) == ["ok"]
    assert len(Store(page_db).tokens(int(runs["run_id"].iloc[0]))) == runs["n_new_tokens"].iloc[0]
    # the button went with the run; a Stop click that landed as the run ended: the page says so, the run stays ok
    assert "Stop" not in [b.label for b in at.button]
    at.session_state["stop_clicked"] = True  # what the button's click sets before its rerun
    at.run()
    assert "had already finished when Stop was clicked" in at.info[0].value
    assert list(Store(page_db).runs()["status"]) == ["ok"]


def test_the_verdict_drawn_after_a_run_offers_a_button_that_calibrates(page_db, calibration):
    # a stored peak that every run moves bytes faster than: the verdict after the run says it reads low
    key = hardware.device_key(torch.device("cpu"))
    Store(page_db).save_calibration(key, {**calibration, "device_key": key,
                                          "memory_gbps": calibration["memory_gbps"] / 1000})
    at = live_run()
    assert any("reads low" in w.value for w in at.warning), [w.value for w in at.warning]
    calibrations = len(Store(page_db).query("SELECT * FROM calibration"))
    # the rerun its click starts draws no run, and so not the button that was clicked
    at.button(key="_calibrate_live-after-run").click().run()
    assert not at.exception and not at.error
    assert len(Store(page_db).query("SELECT * FROM calibration")) == calibrations + 1


def test_live_switches_reach_the_engine_and_the_baseline_runs_too(page_db):
    at = live_run(tokens=4, **{"Weight precision": "int4-wo", "KV cache": False,
                               "Run the fp32 greedy baseline too, on the same prompt, and compare": True,
                               "Draw the tokens while they stream": "at the end only"})
    assert not at.exception and not at.error
    runs = Store(page_db).runs().sort_values("run_id")
    assert list(runs["weights"]) == ["int4-wo g32", "fp32"]
    assert list(runs["kv_cache"]) == [False, True]
    assert any("Speedup" in m.label for m in at.metric)


def test_live_first_view_is_the_four_switches_and_more_settings_are_summarised(page_db):
    at = open_page("pages/live.py")
    assert [e.label for e in at.expander][0] == "More settings"
    settings = lambda: next(c.value for c in at.caption if c.value.startswith("More settings"))  # noqa: E731
    assert "all at their defaults" in settings()
    next(w for w in at.number_input if w.label == "Max new tokens").set_value(9)
    next(w for w in at.toggle if w.label == "Adaptive").set_value(True)
    at.text_area[0].set_value("  ")  # refused at once: no run, but the form's values are submitted
    next(b for b in at.button if b.label == "Generate").click().run()
    assert settings() == "More settings: max new 9, adaptive True"


def test_live_sparsity_switch(page_db):
    at = live_run(tokens=4, **{"Activation sparsity": 0.5, "Sparsity mode": "skip"})
    assert not at.exception and not at.error
    run = Store(page_db).runs().iloc[0]
    assert run["sparsity"] == 0.5 and run["sparsity_mode"] == "skip"


def test_live_speculative_switch_and_its_distances(page_db):
    at = live_run(prompt="Repeat exactly: one two three four five six.", tokens=12,
                  **{"Speculative decoding": "prompt-lookup"})
    assert not at.exception and not at.error
    assert any(m.label == "Tokens per target forward" for m in at.metric)
    assert Store(page_db).runs()["speculative"].iloc[0] == "prompt-lookup"
    at = open_page("pages/distances.py")
    assert not at.exception


def test_live_bad_input_is_one_sentence(page_db):
    at = live_run(prompt="  ")
    assert not at.exception
    assert "empty" in at.error[0].value
    at = live_run(**{"Weight precision": "int8-wo", "Activation sparsity": 0.5})
    assert "float weights" in at.error[0].value
    at = live_run(**{"Model": "./no-such-model-folder"})  # refused on the page, before a worker loads anything
    shown = at.error[0].value.replace("\\", "")  # the page writes the message as literal text, markdown escaped
    assert not at.exception and shown == "No model folder at './no-such-model-folder'."
    assert Store(page_db).runs().empty


def test_distances_and_runs_show_a_recorded_run(page_db):
    live_run()
    at = open_page("pages/distances.py")
    assert not at.exception
    assert len(at.get("plotly_chart")) >= 3
    at = open_page("pages/runs.py")
    assert not at.exception
    assert len(at.dataframe[0].value) == 1


def test_sweep_runs_the_grid_and_advises(page_db):
    at = open_page("pages/sweeps.py", timeout=300)
    at.multiselect[0].set_value(["fp32", "int4-wo"])
    at.number_input[0].set_value(4)
    at.number_input[1].set_value(2)  # repeats
    at.button[0].click().run()
    assert not at.exception and not at.error
    runs = Store(page_db).runs().sort_values("run_id")
    assert len(runs) == 4 and runs["tag"].nunique() == 1 and runs["tag"].iloc[0].startswith("sweep:")
    assert [q.split()[0] for q in runs["weights"]] == ["fp32", "int4-wo", "fp32", "int4-wo"]  # interleaved
    assert any("x (" in str(df.value) for df in at.dataframe)  # the ratio and its interval, in a cell
    assert any("95% interval" in m.value for m in at.markdown)  # the verdict, in words under the table
    assert any("bound by" in m.value for m in at.markdown)


def test_hardware_page_shows_calibration_after_the_button(page_db):
    at = open_page("pages/hardware.py")
    at.button[0].click().run()
    assert not at.exception
    assert any("GB/s" in str(df.value) for df in at.dataframe)


def test_live_page_served_mode_with_a_server_that_does_not_answer_is_one_sentence(page_db):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    at = open_page("pages/live.py")
    next(r for r in at.radio if r.label == "Where the model runs").set_value("a server").run()
    assert not any(w.label == "Weight precision" for w in at.selectbox)  # the server's own settings
    next(w for w in at.text_input if w.label == "Server URL").set_value(f"http://127.0.0.1:{port}")
    next(b for b in at.button if b.label == "Generate").click().run()
    assert not at.exception
    assert len(at.error) == 1 and at.error[0].value.startswith("Nothing answers at")
    assert Store(page_db).runs().empty
    # a refused run leaves nothing of itself behind: no heading, no Stop button
    assert "Stop" not in [b.label for b in at.button]
    assert "**This run**" not in [m.value for m in at.markdown]


def test_a_limit_changed_in_the_one_table_reaches_the_command_line_and_the_live_page(page_db, monkeypatch, capsys):
    from engine.cli import main as cli
    from engine import spec

    monkeypatch.setitem(spec.LIMITS, "temperature", spec.Limit(0.0, 7.5, False, "temperature (0: greedy)"))
    monkeypatch.setitem(spec.LIMITS, "top_k", spec.Limit(0, 321, True, "top_k (0: off)"))
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    usage = " ".join(capsys.readouterr().out.split())
    assert "0 means greedy; 0 to 7.5" in usage and "0 means off; 0 to 321" in usage
    at = open_page("pages/live.py")
    fields = {w.label: w for w in at.number_input}
    assert fields["Temperature (0 = greedy)"].max == 7.5 and fields["Top-k (0 = off)"].max == 321
    assert fields["Max new tokens"].max == spec.LIMITS["max_new_tokens"].high
    assert fields["Max new tokens"].value == spec.GenConfig("x").max_new_tokens
    with pytest.raises(spec.GenerationError, match="at most|between 0 and 7.5"):
        spec.GenConfig("x", temperature=8.0).check()


def test_the_planner_answers_above_its_settings_and_refuses_efficiency_factors_of_zero(page_db):
    at = open_page("pages/planner.py")
    assert not at.exception
    headings = [s.value for s in at.subheader]
    assert headings.index("Side by side (estimates)") < headings.index("Settings")
    factors = {w.label: w for w in at.number_input if w.key and w.key.startswith("eff-")}
    assert factors["bandwidth"].min == 0.01 and factors["link"].min == 0.01  # 0 or less: the browser refuses it
    assert factors["step_fixed_us"].min == 0.0
