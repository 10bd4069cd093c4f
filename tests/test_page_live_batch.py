"""The Live page's users switch under Streamlit's AppTest: the prompt decoded beside the workloads' prompts, every
sequence recorded and shown, tokens/s per user against in total and the bytes a decode token moved beside the
planner's prediction; switches that cannot batch are refused in one sentence, with nothing recorded."""
import pytest
from streamlit.testing.v1 import AppTest

from engine.paths import workloads
from engine.store.db import Store

pytestmark = pytest.mark.integration


def live_batch(users: int, prompt: str = "Name a colour.", tokens: int = 5, **widgets) -> AppTest:
    at = AppTest.from_file("../app.py", default_timeout=300)
    at.switch_page("pages/live.py")
    at.run()
    at.text_area[0].set_value(prompt)
    next(w for w in at.number_input if w.label == "Max new tokens").set_value(tokens)
    next(w for w in at.selectbox if w.label == "Users").set_value(users)
    for label, value in widgets.items():
        next(w for w in [*at.selectbox, *at.toggle, *at.slider] if w.label == label).set_value(value)
    next(b for b in at.button if b.label == "Generate").click().run()
    return at


def html_text(at: AppTest) -> str:
    return "".join(element.proto.body for element in at.get("html"))


def test_two_users_decode_together_and_the_page_shows_both_beside_the_plan(page_db):
    at = live_batch(users=2)
    assert not at.exception and not at.error
    runs = Store(page_db).runs().sort_values("run_id")
    assert list(runs["status"]) == ["ok", "ok"] and list(runs["n_new_tokens"]) == [5, 5]
    assert list(runs["prompt"]) == ["Name a colour.", next(iter(workloads().values()))["prompt"]]
    figures = {m.label: m.value for m in at.metric}
    assert figures["Users"] == "2"
    assert float(figures["Tokens/s per user, end to end"]) > 0 and float(figures["Tokens/s in total, end to end"]) > 0
    assert figures["Bytes per decode token, all users"].endswith(" MB")
    shown = html_text(at)
    assert "user 2" in shown and "Decoded beside yours (1 other user," in shown
    other_text = Store(page_db).run(int(runs["run_id"].iloc[1]))["output"]
    assert other_text.strip()[:10] in shown  # the other user's sequence is on the page
    table = at.table[-1].value
    assert list(table.columns) == ["measured", "planned"] and "bytes per decode token of your sequence" in table.index
    assert table.loc["bytes per decode token of your sequence", "measured"].endswith(" MB")
    assert any("the planner at batch" in m.value for m in at.markdown)
    assert any(f"the other user's is run #{runs['run_id'].iloc[1]}," in c.value for c in at.caption)
    assert "Stop" not in [b.label for b in at.button]  # gone with the runs it stopped


@pytest.mark.parametrize("widgets,says", [({"Speculative decoding": "prompt-lookup"}, "Speculative decoding"),
                                          ({"Activation sparsity": 0.5}, "Activation sparsity")])
def test_a_switch_that_cannot_batch_is_one_sentence_and_nothing_is_recorded(page_db, widgets, says):
    at = live_batch(users=4, **widgets)
    assert not at.exception
    assert len(at.error) == 1 and at.error[0].value.startswith(says) and "does not batch" in at.error[0].value
    assert not page_db.exists() or Store(page_db).runs().empty


def test_the_users_limit_in_the_one_table_reaches_the_command_line_the_spec_and_the_live_page(page_db, monkeypatch,
                                                                                               capsys):
    from engine.cli import main as cli
    from engine import spec

    monkeypatch.setitem(spec.LIMITS, "users", spec.Limit(1, 4, True, "users"))
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    assert "--prompts; 1 to 4" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(spec.GenerationError, match="^users must be a whole number between 1 and 4, not 8"):
        spec.RunSpec(gen=spec.GenConfig("x"), users=8).check()
    at = AppTest.from_file("../app.py", default_timeout=300)
    at.switch_page("pages/live.py")
    at.run()
    assert next(w for w in at.selectbox if w.label == "Users").options == ["1", "2", "4"]
