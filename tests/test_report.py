"""The handover report: every selected run with its settings and figures, one palette that stays
readable under colour blindness, bad input as one sentence on the command line and the page."""
import html
import itertools
import json
import re

import numpy as np
import pytest

from engine.run import quality
from engine.report.charts import BUCKET_COLOURS, bucket_chart, totals_chart
from engine.report.definitions import BUCKET_MEANING, METRICS
from engine.run.generate import Generation, GenConfig
from engine.switches.quant import variant
from engine.report.html import ReportError, Section, runs_report
from engine.measure.compare import NO_DIFFERENCE, compare
from engine.measure.distances import BUCKETS
from engine.store.db import Store
from commands import run_engine


def make_runs(store, lm, calibration) -> list[int]:
    """Three real runs on the tiny model: fp32 with and without the KV cache, int8 with it."""
    ids = []
    for model, kv in [(lm, True), (lm, False), (variant(lm, "int8-dyn"), True)]:
        cfg = GenConfig("Name a colour.", max_new_tokens=5, kv_cache=kv, ignore_eos=True)
        ids.append(Generation(model, cfg, store=store, calibration=calibration).run()["run_id"])
    return ids


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, tiny_lm, calibration):
    """A database with three runs and a quality measurement of the int8 variant."""
    store = Store(tmp_path_factory.mktemp("report") / "runs.duckdb")
    ids = make_runs(store, tiny_lm, calibration)
    quality.measure(tiny_lm, variant(tiny_lm, "int8-dyn"), "int8-dyn", calibration, store=store)
    return store, ids


def plotly_divs(page: str) -> int:
    return len(re.findall(r'<div id="[^"]+" class="plotly-graph-div"', page))


def test_the_report_holds_every_run_its_settings_and_figures(recorded):
    store, ids = recorded
    page = runs_report(store, ids)
    for run_id in ids:
        run = store.run(run_id)
        assert f"#{run_id}" in page
        assert json.loads(run["config"])["max_new_tokens"] == 5
    assert "<td>max_new_tokens</td><td>5</td><td>5</td><td>5</td>" in page
    assert "<td>kv_cache</td><td>true</td><td><b>false</b></td><td>true</td>" in page  # differences in bold
    assert "<td>weights</td><td>fp32</td><td>fp32</td><td><b>int8-dyn</b></td>" in page
    assert plotly_divs(page) == 1 + len(ids)  # the totals, then one per-token chart per run
    assert page.count("function(") > 1000 and page.count("<script src=") == 0  # plotly.js inlined, nothing linked
    for name, _ in METRICS:
        assert name in page
    for bucket in BUCKETS:
        assert html.escape(BUCKET_MEANING[bucket]) in page and BUCKET_COLOURS[bucket] in page


def test_the_comparison_has_every_run_and_the_stored_quality(recorded):
    store, ids = recorded
    page = runs_report(store, ids)
    comparison = page[page.index("<h2>Comparison</h2>"):page.index("<h2>The five buckets</h2>")]
    rows = re.findall(r"<tr><td>#(\d+)</td>(.*?)</tr>", comparison)
    assert [int(r[0]) for r in rows] == ids
    measured = store.query("SELECT perplexity FROM quality").iloc[0, 0]
    assert f"{measured:.3f}" in rows[2][1] and f"{measured:.3f}" not in rows[0][1]


def test_quality_scored_on_another_text_stays_out_of_the_comparison(tmp_path, tiny_lm, calibration):
    store = Store(tmp_path / "runs.duckdb")
    ids = make_runs(store, tiny_lm, calibration)
    own = tmp_path / "own.txt"
    own.write_text("The harbour lights came on one by one as the fog rolled in from the sea. " * 20)
    result = quality.measure(tiny_lm, variant(tiny_lm, "int8-dyn"), "int8-dyn", calibration, store=store, text=own)
    assert result["eval_text"] == str(own) and result["n_tokens"] > 100
    page = runs_report(store, ids)
    comparison = page[page.index("<h2>Comparison</h2>"):page.index("<h2>The five buckets</h2>")]
    assert f"{result['perplexity']:.3f}" not in comparison  # its figures are not comparable with eval.txt's


def setting_rows(page: str) -> list[list[str]]:
    """The cells of the comparison's table of settings (the first table of the section)."""
    comparison = page[page.index("<h2>Comparison</h2>"):page.index("<h2>The five buckets</h2>")]
    first = comparison[:comparison.index("</table>")]
    return [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in re.findall(r"<tr>(<td.*?)</tr>", first)]


def test_single_runs_of_different_settings_claim_no_difference(recorded):
    store, ids = recorded
    rows = setting_rows(runs_report(store, ids))
    assert [r[1] for r in rows] == [f"#{i}" for i in ids]
    for row in rows:
        assert row[4].endswith("single runs: no interval, so no difference can be claimed")
        assert row[5].endswith("single runs: no interval, so no difference can be claimed")


def test_repeats_of_a_setting_give_each_ratio_its_interval(store, tiny_lm, calibration):
    """Interleaved repeats of two settings: each row states compare()'s ratio, interval and verdict over the
    stored runs, the first setting against itself 1 with no measurable difference."""
    ids = []
    for kv in [True, False] * 3:
        cfg = GenConfig("Name a colour.", max_new_tokens=5, kv_cache=kv, ignore_eos=True)
        ids.append(Generation(tiny_lm, cfg, store=store, calibration=calibration).run()["run_id"])
    rows = setting_rows(runs_report(store, ids))
    assert [r[1] for r in rows] == [", ".join(f"#{i}" for i in ids[0::2]), ", ".join(f"#{i}" for i in ids[1::2])]
    assert [r[2] for r in rows] == ["3", "3"]
    stored = {i: store.run(i) for i in ids}
    for key, column in (("decode_tokens_per_s", 4), ("tokens_per_s", 5)):
        on, off = ([stored[i][key] for i in ids[k::2]] for k in (0, 1))
        assert rows[0][column] == html.escape(compare(on, on).text())
        assert rows[0][column].startswith("1.00x (95% interval ") and rows[0][column].endswith(NO_DIFFERENCE)
        assert rows[1][column] == html.escape(compare(on, off).text())
        assert "95% interval" in rows[1][column] and "3 vs 3 repeats" in rows[1][column]


def test_repeats_that_differ_in_prompt_length_or_status_are_said_to(store, tiny_lm, calibration):
    alike = [Generation(tiny_lm, GenConfig("Name a colour.", max_new_tokens=5, ignore_eos=True), store=store,
                        calibration=calibration).run()["run_id"] for _ in range(2)]
    page = runs_report(store, alike)
    assert "are taken as repeats of one setting but differ" not in page
    other = Generation(tiny_lm, GenConfig("Tell me a story.", max_new_tokens=7, ignore_eos=True), store=store,
                       calibration=calibration).run()["run_id"]
    page = runs_report(store, [*alike, other])
    assert (f"Runs #{alike[0]}, #{alike[1]}, #{other} are taken as repeats of one setting but differ in prompt and "
            "number of new tokens: the interval holds that difference too.") in html.unescape(page)


def test_a_roofline_ratio_above_the_peak_carries_its_sentence(tmp_path, tiny_lm, calibration):
    store = Store(tmp_path / "runs.duckdb")
    ids = make_runs(store, tiny_lm, calibration)
    metrics = json.loads(store.run(ids[1])["metrics"])
    with store.connect() as con:
        con.execute("UPDATE runs SET metrics = ? WHERE run_id = ?",
                    [json.dumps({**metrics, "roofline_ratio_decode": 1.6}), ids[1]])
    page = runs_report(store, ids)
    comparison = page[page.index("<h2>Comparison</h2>"):page.index("<h2>The five buckets</h2>")]
    assert ">160%<" in comparison and f"#{ids[1]}: 160% is above 100%" in comparison
    for run_id in map(int, re.findall(r"#(\d+): \d+% is above 100%", comparison)):  # only runs above the peak
        assert json.loads(store.run(run_id)["metrics"])["roofline_ratio_decode"] > 1.05


def test_the_machine_and_calibration_each_run_was_attributed_with(recorded):
    store, ids = recorded
    page = runs_report(store, ids)
    machine = page[page.index("<h2>Machine and calibration</h2>"):]
    calibration = json.loads(store.run(ids[0])["metrics"])["calibration"]
    assert calibration["device_key"] in machine and f"{calibration['memory_gbps']:.1f} GB/s" in machine
    assert ", ".join(f"#{i}" for i in ids) in machine  # one machine for all three


def test_extra_sections_go_before_the_definitions(recorded):
    store, ids = recorded
    page = runs_report(store, ids[:1], title="Story", extra=[Section("Chapter one", "<p>fewer bytes</p>",
                                                                     [totals_chart(["a"], [store.run(ids[0])])])])
    assert "<title>Story</title>" in page
    assert page.index("Chapter one") < page.index("<h2>Definitions</h2>")
    assert plotly_divs(page) == 3


def test_unknown_or_no_runs_are_one_sentence(recorded):
    store, ids = recorded
    with pytest.raises(ReportError, match=r"^No runs #998, #999 in .*lists the runs it holds\.$"):
        runs_report(store, [ids[0], 998, 999])
    with pytest.raises(ReportError, match="^No runs to report"):
        runs_report(store, [])


def cli(*args):
    return run_engine("report", *args, timeout=300)


def test_cli_writes_the_report_and_refuses_bad_input_with_exit_2(recorded, tmp_path):
    store, ids = recorded
    out = tmp_path / "report.html"
    done = cli("--runs", ",".join(map(str, ids)), "--out", str(out), "--db", str(store.path))
    assert done.returncode == 0, done.stderr
    assert plotly_divs(out.read_text()) == 1 + len(ids)
    for runs, message in [("12345", "No run #12345 in"), ("", "No runs to report"), ("3,x", "--runs takes run ids")]:
        bad = tmp_path / "bad.html"
        done = cli("--runs", runs, "--out", str(bad), "--db", str(store.path))
        assert done.returncode == 2 and done.stderr.startswith(f"error: {message}") and "Traceback" not in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and not bad.exists()


def test_the_report_reads_the_database_without_writing_it_and_writes_its_file_whole_or_not_at_all(recorded, tmp_path):
    store, ids = recorded
    runs = ",".join(map(str, ids))
    before = store.path.read_bytes()
    done = cli("--runs", runs, "--out", str(tmp_path / "r.html"), "--db", str(store.path))
    assert done.returncode == 0, done.stderr
    assert store.path.read_bytes() == before  # opened read-only: a read-only file serves as well
    kept = tmp_path / "kept.html"
    kept.write_text("the report of last week")
    (tmp_path / "kept.html.partial").mkdir()  # where the new file would be written first: the write fails
    absent = tmp_path / "absent.duckdb"
    for out, db, words in [(kept, store.path, "Cannot write"), (store.path, store.path, "is the database"),
                           (tmp_path / "x.html", absent, "does not exist")]:
        done = cli("--runs", runs, "--out", str(out), "--db", str(db))
        assert done.returncode == 2 and done.stderr.startswith("error: ") and words in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
    assert kept.read_text() == "the report of last week" and store.path.read_bytes() == before
    assert not absent.exists() and not (tmp_path / "x.html").exists()


def runs_page(db, selected_rows=None):
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file("../app.py", default_timeout=120)
    at.switch_page("pages/runs.py")
    if selected_rows is not None:
        at.session_state["runs_table_0_False"] = {"selection": {"rows": selected_rows, "columns": []}}
    return at.run()


def report_buttons(at) -> list:
    return [b for b in at.get("download_button") if b.label == "Download report"]


def test_the_runs_page_offers_the_report_only_for_a_selection(recorded, tmp_path, monkeypatch):
    store, ids = recorded
    monkeypatch.setenv("TOKENPATH_DB", str(store.path))
    at = runs_page(store.path, [0, 1])
    assert not at.exception and len(report_buttons(at)) == 1
    at = runs_page(store.path)
    assert not at.exception and not report_buttons(at)
    assert "Tick one or more rows" in at.info[0].value
    monkeypatch.setenv("TOKENPATH_DB", str(tmp_path / "empty.duckdb"))
    at = runs_page(tmp_path / "empty.duckdb")
    assert not at.exception and not report_buttons(at) and "No runs recorded yet" in at.info[0].value


def rgb(hex_colour: str) -> np.ndarray:
    return np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)]) / 255


@pytest.mark.parametrize("deficiency", [None, "deuteranomaly", "protanomaly", "tritanomaly"])
def test_every_pair_of_bucket_colours_stays_apart_under_colour_blindness(deficiency):
    """CAM02-UCS distance between simulated colours (Machado et al. 2009, full severity); the
    tab10 colours the charts used before come as close as 1.6 under protanopia."""
    colorspacious = pytest.importorskip("colorspacious")
    colours = {b: rgb(c) for b, c in BUCKET_COLOURS.items()}
    if deficiency:
        space = {"name": "sRGB1+CVD", "cvd_type": deficiency, "severity": 100}
        colours = {b: np.clip(colorspacious.cspace_convert(c, space, "sRGB1"), 0, 1) for b, c in colours.items()}
    for a, b in itertools.combinations(BUCKETS, 2):
        assert colorspacious.deltaE(colours[a], colours[b], input_space="sRGB1") > 10, (a, b)


def test_every_chart_uses_the_one_palette_and_projector_fonts():
    rows = [{"idx": 0, **{f"{b}_ms": 1.0 for b in BUCKETS}}]
    for fig in (bucket_chart(rows), totals_chart(["#1"], [{**rows[0], "n_new_tokens": 1}])):
        assert [t.marker.color for t in fig.data] == [BUCKET_COLOURS[b] for b in BUCKETS]
        assert fig.layout.font.size >= 16 and fig.layout.legend.font.size >= 16


def test_a_prefill_that_dwarfs_the_decode_tokens_is_written_on_the_clipped_axis():
    rows = [{"idx": i, **{f"{b}_ms": (100.0 if i == 0 else 1.0) for b in BUCKETS}} for i in range(4)]
    fig = bucket_chart(rows, clip_prefill=True)
    assert fig.layout.yaxis.range[1] < 500 and "500 ms, off the scale" in fig.layout.annotations[0].text
    assert bucket_chart(rows).layout.yaxis.range is None  # the pages keep the whole scale


def test_the_runs_page_says_when_repeats_of_a_setting_differ_in_prompt(store, tiny_lm, calibration, monkeypatch):
    for prompt in ("Name a colour.", "Tell me a story."):
        Generation(tiny_lm, GenConfig(prompt, max_new_tokens=5, ignore_eos=True), store=store,
                   calibration=calibration).run()
    Generation(tiny_lm, GenConfig("Name a colour.", max_new_tokens=5, ignore_eos=True, kv_cache=False), store=store,
               calibration=calibration).run()
    monkeypatch.setenv("TOKENPATH_DB", str(store.path))
    at = runs_page(store.path, [0, 1, 2])
    assert not at.exception
    assert [w.value for w in at.warning] == [
        "Runs #1, #2 are taken as repeats of one setting but differ in prompt: the interval holds that difference too."]
