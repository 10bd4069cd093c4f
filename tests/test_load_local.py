"""`load --local` and `capacity --local` on the tiny model: arrivals go straight into the continuous-batching
engine, every request is stored as a request and as a recorded run tagged with its key, bad input is refused."""
import json

import pytest

from engine.cli.main import main
from engine.serve import records as served_store
from engine.store.db import Store

LENGTHS = ["--input-tokens", "8", "--output-tokens", "6"]


def stored(db, sweep_id: int):
    """The sweep's requests joined to the runs they became (through the run's tag), and its samples."""
    store = Store(db)
    joined = store.query(
        "SELECT q.level, q.idx, q.status, q.n_output_tokens, q.ttft_ms, q.chunk_tokens, r.run_id, "
        "r.status AS run_status, r.n_new_tokens, r.ttft_ms AS run_ttft_ms FROM requests q LEFT JOIN runs r "
        "ON r.tag = 'load:' || q.sweep_id || ':' || q.level || ':' || q.idx WHERE q.sweep_id = ?", [sweep_id])
    samples = store.query("SELECT * FROM load_samples WHERE sweep_id = ?", [sweep_id])
    return joined, samples, len(store.query("SELECT run_id FROM runs"))


def run_json(capsys, *argv) -> tuple[int, dict]:
    code = main(list(argv))
    return code, json.loads(capsys.readouterr().out)


def test_a_rate_sweep_on_the_local_engine_stores_every_request_as_a_request_and_a_run(
        tiny_folder, calibration, tmp_path, capsys):
    db = tmp_path / "runs.duckdb"
    code, out = run_json(capsys, "load", "--local", "--model", str(tiny_folder), "--max-batch", "4", "--rate", "20,50",
                         "--requests", "6", *LENGTHS, "--slo", "ttft_ms=600000,tpot_ms=600000", "--seed", "3",
                         "--db", str(db), "--json")
    assert code == 0 and out["status"] == "ok" and out["requests_ok"] == 12 and out["requests_failed"] == 0
    for level in out["levels"]:
        # a target no request can miss on this machine: every request is good, and goodput is throughput
        assert level["completed"] == level["good"] == 6 and level["attainment"] == 1.0
        assert level["goodput_requests_per_s"] == pytest.approx(level["requests_per_s"])
        assert level["in_flight_mean"] is not None and level["ttft_ms"]["p50"] > 0
    joined, samples, runs = stored(db, out["sweep_id"])
    assert len(joined) == runs == 12 and joined["run_id"].notna().all() and joined["run_id"].is_unique
    assert set(joined["run_status"]) == {"ok"} and set(joined["status"]) == {"ok"}
    # each request's tokens one a chunk, timed by its run's rows: both saw the same first token
    assert (joined["n_output_tokens"] == 6).all() and (joined["n_new_tokens"] == 6).all()
    assert all(list(c) == [1] * 6 for c in joined["chunk_tokens"])
    assert (joined["ttft_ms"] - joined["run_ttft_ms"]).abs().max() < 1.0
    assert len(samples) and {"running", "waiting", "in_flight"} <= set(samples.columns)
    assert json.loads(served_store.sweeps(Store(db)).iloc[0]["server"])["kind"] == "local"


def test_a_concurrency_sweep_on_the_local_engine_shares_steps_between_its_requests(
        tiny_folder, calibration, tmp_path, capsys):
    db = tmp_path / "runs.duckdb"
    code, out = run_json(capsys, "load", "--local", "--model", str(tiny_folder), "--max-batch", "4",
                         "--concurrency", "1,3", "--requests", "6", *LENGTHS, "--db", str(db), "--json")
    assert code == 0 and [lv["completed"] for lv in out["levels"]] == [6, 6]
    joined, _, runs = stored(db, out["sweep_id"])
    assert len(joined) == runs == 12 and joined["run_id"].notna().all() and set(joined["run_status"]) == {"ok"}
    batches = Store(db).query("SELECT r.tag, max(s.batch) AS batch FROM steps s JOIN runs r USING (run_id) "
                              "GROUP BY r.tag")
    level = batches["tag"].str.split(":").str[2].astype(int)
    # one request at a time decodes alone; three at once share the weights' trip
    assert batches[level == 0]["batch"].max() == 1 and batches[level == 1]["batch"].max() > 1
    # the stored sweep names the local engine, its model and its cap, so it can be made again
    code, again = run_json(capsys, "load", "--from-sweep", str(out["sweep_id"]), "--db", str(db), "--json")
    assert code == 0 and [lv["concurrency"] for lv in again["levels"]] == [1, 3]
    assert json.loads(served_store.sweeps(Store(db)).set_index("sweep_id").loc[again["sweep_id"], "server"]) == {
        "kind": "local", "model": again["server_model"], "weights": "fp32", "max_batch": 4, "kv_budget_bytes": None,
        "prefix_cache_bytes": None, "kv_dtype": "auto"}


def test_a_local_sweep_runs_every_request_at_its_weight_level_and_kv_precision_and_is_made_again_at_them(
        tiny_folder, calibration, tmp_path, capsys):
    db = tmp_path / "runs.duckdb"
    # int4-wo names itself with its group size ("int4-wo g32"); the command that makes it again names the level
    code, out = run_json(capsys, "load", "--local", "--model", str(tiny_folder), "--weights", "int4-wo",
                         "--kv-dtype", "bf16", "--max-batch", "4", "--concurrency", "2", "--requests", "4", *LENGTHS,
                         "--db", str(db), "--json")
    assert code == 0 and out["requests_ok"] == 4
    code, again = run_json(capsys, "load", "--from-sweep", str(out["sweep_id"]), "--db", str(db), "--json")
    assert code == 0 and again["requests_ok"] == 4
    store = Store(db)
    runs = store.query("SELECT config, metrics FROM runs")
    configs = [json.loads(c) for c in runs["config"]]
    assert len(configs) == 8 and {c["weights"] for c in configs} == {"int4-wo g32"}
    assert {json.loads(m)["kv_dtype"] for m in runs["metrics"]} == {"bf16"}
    servers = [json.loads(s) for s in served_store.sweeps(store)["server"]]
    assert [(s["weights"], s["kv_dtype"]) for s in servers] == [("int4-wo g32", "bf16")] * 2


def test_capacity_on_the_local_engine_stores_its_levels_and_every_request_as_a_run(
        tiny_folder, calibration, tmp_path, capsys):
    db = tmp_path / "runs.duckdb"
    code, out = run_json(capsys, "capacity", "--local", "--model", str(tiny_folder), "--slo", "e2e_ms=600000",
                         "--start-rate", "1000", "--duration", "0.004", "--requests", "4", "--steps", "0",
                         "--burstiness", "4", *LENGTHS, "--db", str(db), "--json")
    assert code == 0 and out["status"] == "ok" and out["levels"]
    joined, _, runs = stored(db, out["sweep_id"])
    assert len(joined) == runs == 4 * len(out["levels"]) and joined["run_id"].notna().all()
    stored_sweep = served_store.sweeps(Store(db)).iloc[0]
    assert stored_sweep["kind"] == "capacity" and len(json.loads(stored_sweep["levels"])) == len(out["levels"])


@pytest.mark.parametrize("args, words", [
    (["--local", "--max-batch", "0"], "1 to 256"),
    (["--local", "--max-batch", "257"], "1 to 256"),
    (["--local", "--kv-budget-mb", "0"], "--kv-budget-mb"),
    (["--local", "--endpoint", "http://127.0.0.1:9"], "not both"),
    ([], "--local"),
    (["--local", "--requests", "0"], "--requests"),
    (["--local", "--weights", "int3"], "Unknown quantization level 'int3'"),
    (["--endpoint", "http://127.0.0.1:9", "--weights", "int4-dyn"], "--weights"),
    (["--endpoint", "http://127.0.0.1:9", "--weights", "fp32"], "--weights"),
    (["--endpoint", "http://127.0.0.1:9", "--kv-dtype", "bf16"], "--kv-dtype"),
])
def test_bad_local_load_input_is_one_sentence_exit_2_and_nothing_stored(args, words, tiny_folder, tmp_path, capsys):
    db = tmp_path / "x.duckdb"
    for command in (["load", "--rate", "1"], ["capacity", "--slo", "ttft_ms=500"]):
        code = main([*command, "--model", str(tiny_folder), *LENGTHS, *args, "--db", str(db)])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("error: ") and words in err and err.count("\n") == 1, (command, err)
    if db.exists():
        store = Store(db)
        assert served_store.sweeps(store).empty and store.query("SELECT run_id FROM runs").empty


@pytest.mark.parametrize("case, words", [
    ("budget", "smaller than one sequence needs"),
    ("beyond the context", "positions"),
    ("not text", "cannot be read as UTF-8 text"),
])
def test_a_request_the_engine_would_refuse_is_refused_before_the_sweep_stores_anything(
        case, words, tiny_folder, tmp_path, capsys):
    """A sweep none of whose requests could run, as generate --users refuses its batch: one sentence, exit 2, no
    sweep, request or run stored (where some could, the others fail one by one, as a server refuses them)."""
    prompts = tmp_path / "prompts.txt"
    if case == "not text":
        prompts.write_bytes(bytes(range(128, 256)) * 4)
    else:
        prompts.write_text("\n\n".join([("word " * (2000 if case == "beyond the context" else 3))] * 2))
    budget = ["--kv-budget-mb", "0.0001"] if case == "budget" else []
    db = tmp_path / "x.duckdb"
    for command in (["load", "--concurrency", "2", "--requests", "2"], ["capacity", "--slo", "ttft_ms=500"]):
        code = main([*command, "--local", "--model", str(tiny_folder), "--prompts", str(prompts),
                     "--max-new-tokens", "4", *budget, "--db", str(db)])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("error: ") and words in err and err.count("\n") == 1, (command, err)
    if db.exists():
        store = Store(db)
        assert served_store.sweeps(store).empty and store.query("SELECT run_id FROM runs").empty
        assert store.query("SELECT * FROM requests").empty


def test_ctrl_c_stops_a_local_sweep_keeps_what_finished_and_exits_130(tiny_folder, calibration, tmp_path):
    """Ctrl-C cuts the requests in flight, as the page's Stop does, and the command ends as an interrupted one."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    db, progress = tmp_path / "runs.duckdb", tmp_path / "progress.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "engine", "load", "--local", "--model", str(tiny_folder), "--max-batch", "4", "--rate",
         "5", "--requests", "400", *LENGTHS, "--progress", str(progress), "--db", str(db)],
        cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=os.environ.copy())
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if json.loads(progress.read_text())["done"] >= 2:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=300)
    assert process.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("sweep") and " stopped: " in err
    sweep = served_store.sweeps(Store(db)).iloc[0]
    assert sweep["status"] == "stopped"
    joined, _, _ = stored(db, int(sweep["sweep_id"]))
    assert (joined["status"] == "ok").sum() >= 2 and len(joined) < 400
