"""The Sweeps page stores the sweep it runs with its full specification and shows the exact command that
makes it again; a grid with nothing in it is one message and nothing stored."""
import re
import shlex

from streamlit.testing.v1 import AppTest

from engine.cli.main import build_parser
from engine.cli.sweeping import spec_from_args
from engine.store.db import Store
from engine.sweep import SweepSpec, stored, stored_ids


def open_sweeps(timeout=300) -> AppTest:
    at = AppTest.from_file("../app.py", default_timeout=timeout)
    at.switch_page("pages/sweeps.py")
    return at.run()


def test_a_sweep_made_on_the_page_shows_the_command_that_makes_it_again(page_db, tiny_folder, monkeypatch):
    monkeypatch.setenv("TOKENPATH_MODEL", str(tiny_folder))
    at = open_sweeps()
    at.multiselect[0].set_value(["fp32", "bf16"])
    at.number_input[0].set_value(4)
    at.number_input[1].set_value(2)  # repeats
    at.button[0].click().run()
    assert not at.exception and not at.error
    store = Store(page_db)
    [sweep_id] = stored_ids(store)
    spec = stored(store, sweep_id)
    assert spec == SweepSpec(at.selectbox[0].value, ["fp32", "bf16"], new_tokens=4, repeat=2, model=str(tiny_folder),
                             device="auto")
    shown = [c.value for c in at.code]
    assert shown == [spec.command()]
    assert spec_from_args(build_parser().parse_args(shlex.split(shown[0])[3:])) == spec
    runs = store.runs().sort_values("run_id")
    assert [q.split()[0] for q in runs["weights"]] == ["fp32", "bf16", "fp32", "bf16"]  # interleaved
    # the ratio with its interval in the table, and each setting's verdict in words under it
    figures = next(df.value for df in at.dataframe if "decode vs baseline" in df.value.columns)
    assert all(re.fullmatch(r"\d+\.\d\dx \((\d+\.\d\d-\d+\.\d\d|single runs)\)", cell)
               for cell in figures["decode vs baseline"])
    assert any("bf16" in m.value and "2 vs 2 repeats" in m.value for m in at.markdown)
    assert not any("A batch's bar" in c.value for c in at.caption)


def test_a_sweep_of_batches_says_what_a_batch_s_bar_is(page_db, tiny_folder, monkeypatch):
    monkeypatch.setenv("TOKENPATH_MODEL", str(tiny_folder))
    at = open_sweeps()
    next(m for m in at.multiselect if m.label == "Users").set_value([1, 2])
    at.number_input[0].set_value(4)
    at.button[0].click().run()
    assert not at.exception and not at.error
    assert stored(Store(page_db), stored_ids(Store(page_db))[0]).users == [1, 2]
    assert any("A batch's bar is one user's time per token" in c.value for c in at.caption)


def test_an_empty_grid_is_one_message_and_nothing_is_stored(page_db, tiny_folder, monkeypatch):
    monkeypatch.setenv("TOKENPATH_MODEL", str(tiny_folder))
    at = open_sweeps()
    at.multiselect[0].set_value(["int8-dyn"])
    at.multiselect[2].set_value(["mask-50"])
    at.button[0].click().run()
    assert not at.exception
    assert len(at.error) == 1 and at.error[0].value.startswith("The grid is empty")
    assert stored_ids(Store(page_db)) == [] and Store(page_db).runs().empty
