"""Reports of a sweep (runs tagged sweep:ID) and of a load sweep against a real local streaming server."""
import html
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cli.main import main
from engine.run.generate import Generation, GenConfig
from engine.serve.load import Sweep, SweepConfig, load_prompts
from engine.switches.quant import variant
from engine.report.html import ReportError
from engine.store.db import Store
from engine.report.sweeps import load_sweep_report, sweep_report, sweep_results, sweep_tag
from engine.measure.compare import compare
from engine.run.open import open_run
from engine.sweep import SweepSpec, start
from engine.serve.vllm import free_port

from test_served import wait_for_port

SERVER = Path(__file__).with_name("stream_server.py")


def test_a_sweep_report_holds_its_tagged_runs_and_the_advisor(tiny_lm, calibration, store):
    ids = []
    for level in ("fp32", "bf16"):
        gen = Generation(variant(tiny_lm, level), GenConfig("Hello there", raw=True, max_new_tokens=4, ignore_eos=True),
                         store=store, calibration=calibration, telemetry=False, tag=sweep_tag("20261201-101500"))
        ids.append(gen.run()["run_id"])
    Generation(tiny_lm, GenConfig("not in the sweep", raw=True, max_new_tokens=2), store=store,
               calibration=calibration, telemetry=False).run()
    page = sweep_report(store, "20261201-101500")
    assert all(f"#{i}" in page for i in ids) and "not in the sweep" not in page
    assert "Advisor" in page and "bound by" in page and "<script src=" not in page
    with pytest.raises(ReportError, match="No finished runs of sweep"):
        sweep_report(store, "19990101-000000")


def test_a_stored_sweep_report_states_each_setting_with_its_interval_and_its_command(tiny_folder, store):
    spec = SweepSpec("summary", ["fp32", "bf16"], new_tokens=4, repeat=2, model=str(tiny_folder), device="cpu")
    sweep_id = start(store, spec)
    for _, run_spec in spec.runs(sweep_id):
        open_run(run_spec, store).run()
    results = sweep_results(store, sweep_id)
    assert [(r["label"], r["repeats"]) for r in results] == [("fp32, KV on", 2), ("bf16, KV on", 2)]
    assert results[0]["decode vs baseline"].startswith("1.00x (95% interval ")
    assert results[1]["decode vs baseline"] == compare(results[0]["decode_rates"], results[1]["decode_rates"]).text()
    page = sweep_report(store, sweep_id)
    assert html.escape(spec.command()) in page and html.escape(results[1]["decode vs baseline"]) in page


def test_a_sweep_of_users_takes_each_batch_as_one_repeat_with_every_users_tokens(tiny_folder, store):
    spec = SweepSpec("summary", new_tokens=4, users=[1, 2], repeat=2, model=str(tiny_folder), device="cpu")
    sweep_id = start(store, spec)
    for _, run_spec in spec.runs(sweep_id):
        open_run(run_spec, store).run()
    runs = store.query("SELECT run_id, decode_tokens_per_s FROM runs ORDER BY run_id")
    assert len(runs) == 2 * (1 + 2)  # each repeat: a lone run, then a batch of two sequences' runs
    rates, ids = list(runs["decode_tokens_per_s"]), list(runs["run_id"])  # a batch's ids come from the sequence ahead
    results = sweep_results(store, sweep_id)
    assert [(r["label"], r["repeats"], r["run_ids"]) for r in results] == [
        ("fp32, KV on", 2, [ids[0], ids[3]]), ("fp32, KV on, 2 users", 2, [ids[1], ids[4]])]
    assert results[1]["decode_rates"] == pytest.approx([rates[1] + rates[2], rates[4] + rates[5]])
    assert results[1]["decode vs baseline"] == compare(results[0]["decode_rates"], results[1]["decode_rates"]).text()
    page = sweep_report(store, sweep_id)  # its table of settings keeps a batch's sequences apart from lone runs
    batch = ", ".join(f"#{ids[i]}" for i in (1, 2, 4, 5))
    assert f"· batch of up to 2</td><td>{batch}</td><td class=n>4</td>" in page


def test_a_load_sweep_report_has_its_levels_and_curve(store, tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SERVER), str(port), "ok", "0.02"])
    try:
        wait_for_port(port, proc)
        summary = Sweep(SweepConfig(f"http://127.0.0.1:{port}", [1, 2], 2, 4, load_prompts("summary")), store).run()
    finally:
        proc.kill()
        proc.wait(timeout=30)
    page = load_sweep_report(store, summary["sweep_id"])
    assert f"load sweep #{summary['sweep_id']}" in page and "Per-user latency against total throughput" in page
    assert "<td>1 at once</td>" in page and "<td>2 at once</td>" in page
    out = tmp_path / "load.html"
    assert main(["report", "--load-sweep", str(summary["sweep_id"]), "--out", str(out), "--db", str(store.path)]) == 0
    assert "<html" in out.read_text()[:300]
    assert main(["report", "--load-sweep", "999", "--out", str(tmp_path / "x.html"), "--db", str(store.path)]) == 2
    assert not (tmp_path / "x.html").exists()


def test_a_load_sweep_report_holds_a_level_that_completed_nothing(store):
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("load_server.py")), str(port), "1", "0.05"])
    try:
        wait_for_port(port, proc)
        cfg = SweepConfig(f"http://127.0.0.1:{port}", rates=[4.0], requests=3, output_tokens=40, input_tokens=5,
                          deadline_s=0.02, slo={"ttft_ms": 100.0})
        summary = Sweep(cfg, store).run()
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert summary["levels"][0]["completed"] == 0 and summary["levels"][0]["deadline_missed"] == 3
    page = load_sweep_report(store, summary["sweep_id"])
    assert "<td>4 req/s</td>" in page and "<td class=n>-</td>" in page and "<td class=n>0%</td>" in page

