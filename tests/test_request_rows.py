"""A load sweep's requests reach the database in batches, each kept in the sweep's journal from the moment it
ends until a write holds it; a write that fails keeps them for the next, and recovery folds in what was never
written."""
import pytest

from engine.serve import records as served_store
from engine.store import journal, recovery
from engine.store.db import StoreError
from engine.store.request_rows import RequestRows


def request(sweep_id: int, idx: int, level: int = 0) -> dict:
    return {"sweep_id": sweep_id, "level": level, "idx": idx, "warmup": level < 0, "status": "ok", "chunk_ms": [1.5, 2.0],
            "chunk_tokens": [1, 1], "n_output_tokens": 2}


def stored(store, sweep_id: int) -> list[tuple]:
    return store.query("SELECT level, idx FROM requests WHERE sweep_id = ? ORDER BY level, idx",
                       [sweep_id]).values.tolist()


def new_sweep(store) -> int:
    return served_store.start_sweep(store, endpoint="http://127.0.0.1:1", server_model="m", config={}, kind="concurrency")


def test_rows_wait_in_the_journal_until_a_write_takes_them_all_in_one(store, monkeypatch):
    monkeypatch.setenv("TOKENPATH_WRITE_EVERY_S", "600")
    sweep_id = new_sweep(store)
    rows = RequestRows(store, sweep_id)
    inserts = []
    monkeypatch.setattr(store, "insert", lambda batches, insert=store.insert: inserts.append(batches) or insert(batches))
    for i in range(5):
        rows.add(request(sweep_id, i))
    assert stored(store, sweep_id) == [] and inserts == []
    assert [r["idx"] for r in journal.read(journal.sweep_journal_path(store.path, sweep_id))["requests"]] == [0, 1, 2, 3, 4]
    rows.write()
    assert stored(store, sweep_id) == [[0, i] for i in range(5)] and len(inserts) == 1
    rows.add(request(sweep_id, 0, level=1))
    rows.close()
    assert stored(store, sweep_id)[-1] == [1, 0] and len(inserts) == 2
    assert not journal.sweep_journal_path(store.path, sweep_id).exists()


def test_a_row_older_than_the_write_interval_writes_every_waiting_row(store, monkeypatch):
    monkeypatch.setenv("TOKENPATH_WRITE_EVERY_S", "0")
    sweep_id = new_sweep(store)
    rows = RequestRows(store, sweep_id)
    rows.add(request(sweep_id, 0))
    assert stored(store, sweep_id) == [[0, 0]]
    rows.close()


def test_a_failed_write_keeps_its_rows_for_the_next_and_recovery_adds_only_the_missing(store, monkeypatch):
    monkeypatch.setenv("TOKENPATH_WRITE_EVERY_S", "600")
    sweep_id = new_sweep(store)
    rows = RequestRows(store, sweep_id)
    rows.add(request(sweep_id, 0))
    rows.write()
    rows.add(request(sweep_id, 1))
    rows.add(request(sweep_id, 2))
    monkeypatch.setattr(store, "insert", lambda batches: (_ for _ in ()).throw(StoreError("held by another process")))
    with pytest.raises(StoreError):
        rows.close()
    monkeypatch.undo()
    path = journal.sweep_journal_path(store.path, sweep_id)
    assert path.exists() and stored(store, sweep_id) == [[0, 0]]  # the journal, released, waits for recovery
    assert recovery.recover(store) == 2
    assert stored(store, sweep_id) == [[0, 0], [0, 1], [0, 2]] and not path.exists()
