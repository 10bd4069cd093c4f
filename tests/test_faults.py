"""Faults: real command-line runs killed, terminated and interrupted at any moment of their life, and
a database held by another process; every started run stays present and consistent."""
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import duckdb
import pytest

from engine.store import journal
from engine.store.db import Store
from commands import start_engine
from test_served import stream_server  # noqa: F401 (a fixture: a small real streaming server)


def start(db: Path, model: Path, tokens: int = 4000, fresh: bool = False, **env):
    return start_engine("generate", "--prompt", "Count the stars", "--raw", "--model", model, "--max-new-tokens",
                        tokens, "--db", db, stdout=subprocess.DEVNULL, env={**os.environ, **env}, fresh=fresh)


def tokens_in_journal(db: Path) -> int:
    paths = list(journal.journal_dir(db).glob("run-*.jsonl")) if journal.journal_dir(db).is_dir() else []
    return sum(len(journal.read(p)["tokens"]) for p in paths)


def wait_for_tokens(db: Path, proc, n: int, timeout_s: float = 300, may_end: bool = False) -> int | None:
    """The journal's token count once it holds n; None where may_end and the process ended first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        seen = tokens_in_journal(db)
        if seen >= n:
            return seen
        time.sleep(0.05)
    if may_end and proc.poll() is not None:
        return None
    raise AssertionError(f"the run did not reach {n} tokens (exit code {proc.poll()})")


def held(db: Path, timeout_s: float = 120):
    """A connection to the file (any other connection holds it), opened once no other process has it open."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return duckdb.connect(str(db), read_only=True)
        except duckdb.IOException:
            assert time.monotonic() < deadline, "the database stayed locked"
            time.sleep(0.01)


def ended_with_database_held(db: Path, proc, interrupt: int | None = None) -> tuple[int, str]:
    """(exit code, stderr) of a run whose database another process holds from its first token on; with
    `interrupt`, that signal is sent once the run has ended and waits for the database."""
    wait_for_tokens(db, proc, 1)
    holder = held(db)
    try:
        if interrupt is not None:
            deadline = time.monotonic() + 300
            while not any(journal.read(p)["finish"] for p in journal.journal_dir(db).glob("run-*.jsonl")):
                assert time.monotonic() < deadline and proc.poll() is None, "the run did not end"
                time.sleep(0.05)
            proc.send_signal(interrupt)
        code = proc.wait(timeout=300)
        return code, proc.stderr.read()
    finally:
        holder.close()


def assert_consistent(db: Path) -> list[dict]:
    """Every run's tokens, steps and totals agree; returns the runs."""
    store = Store(db)
    runs = store.runs(1000).to_dict("records")
    for run in runs:
        assert run["status"] in ("ok", "cancelled", "interrupted"), run
        tokens, steps = store.tokens(run["run_id"]), store.steps(run["run_id"])
        assert run["n_new_tokens"] == len(tokens) == steps["n_emitted"].sum(), run["run_id"]
        assert list(tokens["idx"]) == list(range(len(tokens)))
        if len(tokens):
            assert run["total_ms"] == pytest.approx(tokens["t_ms"].iloc[-1])
            assert run["memory_ms"] == pytest.approx(steps["memory_ms"].sum())
            assert list(run["token_ids"]) == list(tokens["token_id"])
    assert not list(journal.journal_dir(db).glob("*.jsonl")), "a journal was left after folding"
    return runs


def test_kill_9_at_random_moments_keeps_every_started_run_whole(long_tiny_folder, tmp_path):
    db = tmp_path / "runs.duckdb"
    Store(db)
    rng = random.Random(7)
    kept_at_kill = []
    for i in range(6):
        proc = start(db, long_tiny_folder, tokens=rng.choice([3, 60, 4000]))
        if i % 2:  # during decode, once tokens are flowing (a short run may end first: the kill lands after it)
            seen = wait_for_tokens(db, proc, rng.randint(1, 30), may_end=True)
        else:  # any moment: loading, prefill, decode or the final write
            time.sleep(rng.uniform(0.0, 6.0))
            seen = tokens_in_journal(db)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        kept_at_kill.append(seen)
    runs = assert_consistent(db)
    interrupted = [r for r in runs if r["status"] == "interrupted"]
    assert interrupted, "no kill landed inside a run"
    assert all(r["error"] for r in interrupted)


def test_a_killed_run_keeps_every_token_its_journal_had(long_tiny_folder, tmp_path):
    db = tmp_path / "runs.duckdb"
    proc = start(db, long_tiny_folder)
    seen = wait_for_tokens(db, proc, 25)
    proc.kill()
    proc.wait(timeout=60)
    (run,) = assert_consistent(db)
    assert run["status"] == "interrupted" and run["n_new_tokens"] >= seen
    assert run["ttft_ms"] is not None and run["output"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_sigint_record_a_cancelled_run_with_its_tokens(long_tiny_folder, tmp_path, sig):
    db = tmp_path / "runs.duckdb"
    proc = start(db, long_tiny_folder)
    seen = wait_for_tokens(db, proc, 10)
    proc.send_signal(sig)
    assert proc.wait(timeout=120) == 130
    assert "Traceback" not in proc.stderr.read()
    (run,) = assert_consistent(db)
    assert run["status"] == "cancelled" and run["n_new_tokens"] >= seen


def test_a_database_held_by_another_process_defers_the_record_and_loses_nothing(tiny_folder, tmp_path):
    db = tmp_path / "runs.duckdb"
    Store(db)
    proc = start(db, tiny_folder, tokens=400, TOKENPATH_LOCK_WAIT_S="2")
    code, message = ended_with_database_held(db, proc)
    assert code == 1 and "could not be written" in message and "recorded as run" not in message
    (run,) = assert_consistent(db)  # the next open folds the journal in, with the run's own ending
    assert run["status"] == "ok" and run["n_new_tokens"] > 0


def test_a_truncated_database_is_refused_before_anything_runs(tiny_folder, tmp_path):
    db = tmp_path / "runs.duckdb"
    Store(db)
    data = db.read_bytes()
    db.write_bytes(data[: len(data) // 3])
    proc = start(db, tiny_folder)
    assert proc.wait(timeout=300) == 2
    message = proc.stderr.read()
    assert message.startswith("error: ") and "Traceback" not in message and "run None" not in message


def start_served(db: Path, url: str, tokens: int = 4000, **env):
    return start_engine("generate", "--endpoint", url, "--prompt", "Count the stars", "--max-new-tokens", tokens,
                        "--db", db, stdout=subprocess.DEVNULL, env={**os.environ, **env})


def assert_served_consistent(db: Path) -> dict:
    """The one served run: its tokens and steps agree with its row, and no journal is left."""
    store = Store(db)
    (run,) = store.runs(10).to_dict("records")
    tokens, steps = store.tokens(run["run_id"]), store.steps(run["run_id"])
    assert run["backend"] == "served" and run["n_new_tokens"] == len(tokens) == steps["n_emitted"].sum()
    assert list(tokens["idx"]) == list(range(len(tokens))) and run["output"] == "".join(tokens["piece"])
    assert not list(journal.journal_dir(db).glob("*.jsonl")), "a journal was left after folding"
    return run


def test_a_killed_served_run_keeps_every_token_streamed_so_far(stream_server, tmp_path):
    db = tmp_path / "runs.duckdb"
    url, _ = stream_server("forever", delay=0.2)
    proc = start_served(db, url)
    seen = wait_for_tokens(db, proc, 3)
    proc.kill()
    proc.wait(timeout=60)
    run = assert_served_consistent(db)
    assert run["status"] == "interrupted" and run["n_new_tokens"] >= seen


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_sigint_end_a_served_run_cancelled_with_its_tokens(stream_server, tmp_path, sig):
    db = tmp_path / "runs.duckdb"
    url, _ = stream_server("forever", delay=0.2)
    proc = start_served(db, url)
    seen = wait_for_tokens(db, proc, 3)
    proc.send_signal(sig)
    assert proc.wait(timeout=120) == 130
    message = proc.stderr.read()
    run = assert_served_consistent(db)
    assert run["status"] == "cancelled" and run["n_new_tokens"] >= seen
    assert f"interrupted: run {run['run_id']} recorded as cancelled with {run['n_new_tokens']} tokens" in message
    assert "Traceback" not in message


@pytest.mark.parametrize("every_s", ["1", "600"])  # some requests written before the kill, or none
def test_a_killed_load_sweep_keeps_every_request_that_finished(stream_server, tmp_path, every_s):
    from engine.serve import records as served_store

    db, progress = tmp_path / "runs.duckdb", tmp_path / "progress.json"
    url, _ = stream_server("ok", delay=0.1)
    proc = start_engine("load", "--endpoint", url, "--concurrency", "1", "--requests", "50", "--max-new-tokens", "4",
                        "--progress", progress, "--db", db, stdout=subprocess.DEVNULL,
                        env={**os.environ, "TOKENPATH_WRITE_EVERY_S": every_s})
    deadline, done = time.monotonic() + 300, 0
    while done < 3:
        assert time.monotonic() < deadline and proc.poll() is None, "the sweep finished no request"
        time.sleep(0.05)
        try:
            done = json.loads(progress.read_text())["done"]
        except (OSError, ValueError, KeyError):
            pass
    proc.kill()
    proc.wait(timeout=60)
    store = Store(db)  # folds in the rows the sweep's journal kept
    (sweep,) = served_store.sweeps(store).to_dict("records")
    requests = served_store.sweep_requests(store, sweep["sweep_id"])
    assert sweep["status"] == "interrupted" and 3 <= len(requests) < 50
    assert set(requests["status"]) == {"ok"} and (requests["n_output_tokens"] > 0).all()
    assert sorted(requests["idx"]) == list(range(len(requests)))  # each once, none lost between
    assert not journal.sweep_journal_path(db, sweep["sweep_id"]).exists()


def test_a_held_database_defers_a_served_run_and_loses_nothing(stream_server, tmp_path):
    db = tmp_path / "runs.duckdb"
    Store(db)
    url, _ = stream_server("ok", delay=0.3)
    proc = start_served(db, url, tokens=12, TOKENPATH_LOCK_WAIT_S="2")
    code, message = ended_with_database_held(db, proc)
    assert code == 1 and "could not be written" in message and "Traceback" not in message
    run = assert_served_consistent(db)  # folded in with the run's own ending
    assert run["status"] == "ok" and run["n_new_tokens"] == 12


def test_ctrl_c_while_a_finished_run_waits_for_the_database_says_where_its_rows_are(tiny_folder, tmp_path):
    db = tmp_path / "runs.duckdb"
    Store(db)
    proc = start(db, tiny_folder, tokens=400, TOKENPATH_LOCK_WAIT_S="120")
    code, message = ended_with_database_held(db, proc, interrupt=signal.SIGINT)
    assert code == 1 and "ended (ok, " in message and "the write was interrupted" in message
    assert "cancelled" not in message and "Traceback" not in message
    (run,) = assert_consistent(db)  # folded in as the run ended: ok, every token
    assert run["status"] == "ok" and run["n_new_tokens"] > 0


def test_sigterm_as_the_journal_appears_says_what_became_of_the_run(long_tiny_folder, tmp_path):
    db = tmp_path / "runs.duckdb"
    Store(db)
    proc = start(db, long_tiny_folder)
    deadline = time.monotonic() + 300
    while not list(journal.journal_dir(db).glob("run-*.jsonl")):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    code, message = proc.wait(timeout=120), proc.stderr.read()
    (run,) = assert_consistent(db)
    assert "run None" not in message and "Traceback" not in message
    # A busy machine may hold this process back until the run has decoded its whole budget: the signal
    # then lands in the final write (the run is kept in its journal, folded in above) or after it.
    if code == 1:
        assert run["status"] == "ok" and f"ended (ok, {run['n_new_tokens']} tokens)" in message, message
    elif code != 130:  # it landed after every word was said (and is ignored from then on)
        assert code in (0, -signal.SIGTERM) and run["status"] == "ok" and f"run {run['run_id']}: " in message, message
    else:
        assert run["status"] == "cancelled", message
        assert f"interrupted: run {run['run_id']} recorded as cancelled with {run['n_new_tokens']} token" in message


def test_sigterm_before_a_run_starts_says_so(tiny_folder, tmp_path):
    db = tmp_path / "runs.duckdb"
    proc = start(db, tiny_folder, fresh=True)
    time.sleep(1.5)  # importing the engine or loading the model
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 130
    assert "cancelled: interrupted before the command finished" in proc.stderr.read()


def finished_journal(db: Path) -> dict | None:
    """The ending in a run's journal once it is written there; None before (or once the journal is gone)."""
    for path in journal.journal_dir(db).glob("run-*.jsonl") if journal.journal_dir(db).is_dir() else []:
        try:
            finish = journal.read(path)["finish"]
        except FileNotFoundError:  # folded into the database and removed as we looked
            continue
        if finish:
            return finish
    return None


def test_a_double_ctrl_c_right_after_the_last_token_says_what_became_of_the_run(tiny_folder, tmp_path):
    """Two Ctrl-C a millisecond apart as the run's ending reaches its journal: whatever moment they land
    in (the final write, the message, the exit), what is printed is true and the stored run agrees."""
    for attempt in range(3):
        db = tmp_path / f"runs-{attempt}.duckdb"
        Store(db)
        proc = start(db, tiny_folder, tokens=40)
        deadline = time.monotonic() + 300
        while True:
            finish = finished_journal(db)
            if finish is not None or proc.poll() is not None:
                break
            assert time.monotonic() < deadline, "the run did not end"
            time.sleep(0.002)
        for _ in range(2):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.001 * attempt)
        code, message = proc.wait(timeout=120), proc.stderr.read()
        (run,) = assert_consistent(db)  # a run left in its journal is folded in here, with its own ending
        n = run["n_new_tokens"]
        assert run["status"] == "ok" and n > 0 and (finish is None or n == len(finish["token_ids"])), (run, message)
        for false in ("Traceback", "Query interrupted", "cancelled", "no run was recorded"):
            assert false not in message, message
        if code == 1:  # the write was cut short: the run waits in its journal
            assert f"ended (ok, {n} tokens)" in message and "the write was interrupted" in message, message
        elif code == 130:  # the run was written, or is kept in its journal, and the message says which
            assert (f"interrupted: run {run['run_id']} recorded as ok with {n} tokens" in message
                    or f"interrupted: run {run['run_id']} is kept in its journal" in message), message
        else:  # both landed after every word was said, and were ignored
            assert code == 0 and f"run {run['run_id']}: {n} tokens" in message, (code, message)
