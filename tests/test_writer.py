"""Rows of many runs written together: a batch's runs reach the database in one connection, off the stepping
thread, with every step and token; a local load keeps every request as a whole run; a kill before or between
the writes loses nothing that was emitted."""
import json
import os
import signal
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from engine.run.batch import BatchEngine
from engine.spec import GenConfig
from engine.store import journal
from engine.store.db import Store
from test_faults import assert_consistent
from commands import start_engine

PROMPTS = ["Count the stars", "Name three rivers in Europe and say which is longest", "Hi",
           "Write a haiku about a kettle that sings in the morning before anyone wakes"]


class CountingStore(Store):
    """The real store, counting the connections it opens."""
    opened = 0

    @contextmanager
    def connect(self):
        self.opened += 1
        with super().connect() as con:
            yield con


def whole(store: Store, run_id: int, token_ids: list[int]) -> dict:
    """The stored run, after checking it holds a step row and a token row for each of its tokens."""
    run = store.run(run_id)
    tokens, steps = store.tokens(run_id), store.steps(run_id)
    assert run["n_new_tokens"] == len(token_ids) == len(tokens) == steps["n_emitted"].sum() == len(steps)
    assert list(tokens["token_id"]) == list(run["token_ids"]) == token_ids
    return run


def test_a_batchs_runs_are_written_together_in_one_connection_with_every_step_and_token(
        tiny_lm, calibration, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENPATH_WRITE_EVERY_S", "600")  # no write comes due while the batch decodes
    store = CountingStore(tmp_path / "runs.duckdb")
    engine = BatchEngine(tiny_lm, store, max_batch=4, calibration=calibration)
    engine.ready()  # the run ids, taken before the runs start
    store.opened = 0
    seqs = [engine.submit(GenConfig(p, max_new_tokens=5 + i, ignore_eos=True, temperature=1.0, seed=i))
            for i, p in enumerate(PROMPTS)]
    while engine.step():
        pass
    assert store.opened == 0  # nothing was written while they decoded: each journal holds its run's row and end
    kept = [journal.read(journal.journal_path(store.path, s.run_id)) for s in seqs]
    assert all(k["run"]["row"]["prompt"] == s.cfg.prompt and k["finish"] for k, s in zip(kept, seqs))
    engine.write()
    assert store.opened == 1
    for seq in seqs:
        run = whole(store, seq.run_id, seq.token_ids)
        assert run["status"] == "ok" and run["output"] == seq.text and run["prompt"] == seq.cfg.prompt
    assert not list(journal.journal_dir(store.path).glob("*.jsonl"))


def test_a_run_whose_row_was_never_written_is_folded_in_from_its_journal(tiny_lm, calibration, tmp_path,
                                                                         monkeypatch):
    """What a process killed before its first write leaves: journals holding rows the database never saw."""
    monkeypatch.setenv("TOKENPATH_WRITE_EVERY_S", "600")
    store = Store(tmp_path / "runs.duckdb")
    engine = BatchEngine(tiny_lm, store, max_batch=2, calibration=calibration)
    seqs = [engine.submit(GenConfig(p, max_new_tokens=6, ignore_eos=True)) for p in PROMPTS[:3]]
    for _ in range(4):
        engine.step()
    for seq in seqs:  # the lock a dead process's journals no longer hold
        seq.recorder.journal.close()
    assert store.query("SELECT * FROM runs").empty
    Store(store.path)
    for seq in seqs:
        run = whole(store, seq.run_id, seq.token_ids)
        assert run["status"] == "interrupted" and run["prompt"] == seq.cfg.prompt and run["pid"] == os.getpid()
    assert [len(s.token_ids) > 0 for s in seqs] == [True, True, False]  # the third was still waiting for a slot
    assert not list(journal.journal_dir(store.path).glob("*.jsonl"))


def load(db: Path, model: Path, *args: str, **env):
    return start_engine("load", "--local", "--model", model, "--max-batch", "4", "--input-tokens", "8", "--db", db,
                        *args, env={**os.environ, **env})


def test_a_local_load_records_every_request_as_a_whole_run(tiny_folder, tmp_path):
    db = tmp_path / "runs.duckdb"
    proc = load(db, tiny_folder, "--concurrency", "3", "--requests", "7", "--output-tokens", "9",
                "--length-spread", "0.5", "--json")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    requests = Store(db).query("SELECT q.n_output_tokens, r.run_id, r.status FROM requests q JOIN runs r "
                               "ON r.tag = 'load:' || q.sweep_id || ':' || q.level || ':' || q.idx")
    assert json.loads(out)["requests_ok"] == len(requests) == 7 and set(requests["status"]) == {"ok"}
    runs = {r["run_id"]: r for r in assert_consistent(db)}
    assert set(runs) == set(requests["run_id"])
    for request in requests.to_dict("records"):
        assert runs[request["run_id"]]["n_new_tokens"] == request["n_output_tokens"]


def in_journals(db: Path) -> int:
    """The tokens the live journals hold (a journal removed as it is read, its run written, counts none)."""
    count = 0
    for path in journal.journal_dir(db).glob("run-*.jsonl"):
        try:
            count += len(journal.read(path)["tokens"])
        except FileNotFoundError:
            pass
    return count


def unfinished(db: Path) -> set[int]:
    """The runs whose journals hold no ending: in progress when their process died."""
    return {int(path.stem.removeprefix("run-")) for path in journal.journal_dir(db).glob("run-*.jsonl")
            if not journal.read(path)["finish"]}


def finished(progress: Path) -> int:
    try:
        return json.loads(progress.read_text())["done"]
    except (OSError, ValueError, KeyError):
        return 0


@pytest.mark.parametrize("every_s, tokens, ended", [("600", "3000", 0), ("1", "60", 3)])
def test_a_load_killed_mid_request_keeps_every_token_it_emitted(long_tiny_folder, tmp_path, every_s, tokens, ended):
    """Killed before any write (every 600 s: every row is still in a journal) or between writes (every 1 s, once
    requests have ended: some runs are written, the latest are not): every run is whole, with each token it
    emitted."""
    db, progress = tmp_path / "runs.duckdb", tmp_path / "progress.json"
    Store(db)
    proc = load(db, long_tiny_folder, "--concurrency", "4", "--requests", "40", "--output-tokens", tokens,
                "--length-spread", "0.9", "--progress", str(progress), TOKENPATH_WRITE_EVERY_S=every_s)
    deadline = time.monotonic() + 600
    while (seen := in_journals(db)) < 20 or finished(progress) < ended:
        assert time.monotonic() < deadline and proc.poll() is None, f"the load ended or stalled: {proc.poll()}"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    cut = unfinished(db)
    runs = assert_consistent(db)
    statuses = {r["status"] for r in runs}
    assert sum(r["n_new_tokens"] for r in runs) >= seen and statuses <= {"ok", "interrupted"}
    assert {r["run_id"] for r in runs if r["status"] == "interrupted"} == cut
    # a busy machine may be between one request's end and the next one's start when the kill lands: then
    # nothing is in progress, which only a load that has ended requests can be
    assert ("ok" in statuses) == bool(ended) and (cut or ended)
    assert all(r["tag"].startswith("load:") for r in runs)
