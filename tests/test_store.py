"""The DuckDB store: schema, crash recovery, concurrent writers, refusing files that are not ours."""
import json
import math
import os
import subprocess
import tempfile
import textwrap
from pathlib import Path

import duckdb
import pytest

from engine.store import db, journal
from engine.store.db import SCHEMA_VERSION, Store, StoreError
from commands import run_python, start_python


def run_code(code: str, timeout=300) -> subprocess.CompletedProcess:
    return run_python("-c", textwrap.dedent(code), timeout=timeout)


def test_new_database_has_the_current_schema(store):
    version = store.query("SELECT value FROM tokenpath_meta WHERE key = 'schema_version'").iloc[0, 0]
    assert int(version) == SCHEMA_VERSION
    tables = set(store.query("SELECT table_name FROM information_schema.tables")["table_name"])
    assert {"runs", "steps", "tokens", "telemetry", "calibration"} <= tables


def test_reopening_keeps_every_run(tmp_path):
    path = tmp_path / "runs.duckdb"
    first = Store(path)
    ids = [first.start_run(model="m", device="cpu", dtype="float32", config={}, hardware={}, prompt=f"p{i}")
           for i in range(3)]
    for run_id in ids:
        first.finish_run(run_id, status="ok", output="x", token_ids=[1, 2])
    again = Store(path)
    assert sorted(again.runs()["run_id"]) == sorted(ids)


def test_runs_ended_together_each_keep_their_own_ending(store):
    """The writer ends many runs in one statement for those that set the same columns: each run's values, its
    missing metrics NULL, and extra columns only where given (a column set before stays where an ending has none)."""
    from engine.store.sql import complete_runs

    ids = [store.start_run(model="m", device="cpu", dtype="float32", config={}, hardware={}, prompt=f"p{i}")
           for i in range(3)]
    with store.connect() as con:
        con.execute("UPDATE runs SET energy_j = 7.0 WHERE run_id = ?", [ids[0]])
    first = {"ttft_ms": 5.0, "n_new_tokens": 2, "distances_ms": {"memory": 1.5}}
    endings = [(ids[0], {"status": "ok", "output": "one", "token_ids": [1, 2], "metrics": first, "error": None}),
               (ids[1], {"status": "error", "output": "", "token_ids": [], "metrics": None, "error": "boom",
                         "finished_at": "2026-01-02T03:04:05"}),
               (ids[2], {"status": "ok", "output": "three", "token_ids": [7], "metrics": {"ttft_ms": 9.0},
                         "error": None, "columns": {"energy_j": 2.5, "not_a_column": 1}})]
    with store.connect() as con:
        complete_runs(con, endings)
    rows = store.query("SELECT *, ttft_ms IS NULL AS no_ttft FROM runs ORDER BY run_id").set_index("run_id")
    assert list(rows["status"]) == ["ok", "error", "ok"] and list(rows["output"]) == ["one", "", "three"]
    assert [list(t) for t in rows["token_ids"]] == [[1, 2], [], [7]]
    assert rows.loc[ids[0], "ttft_ms"] == 5.0 and rows.loc[ids[0], "memory_ms"] == 1.5
    assert list(rows["no_ttft"]) == [False, True, False] and rows.loc[ids[1], "error"] == "boom"
    assert str(rows.loc[ids[1], "finished_at"]) == "2026-01-02 03:04:05"
    assert rows.loc[ids[0], "energy_j"] == 7.0 and rows.loc[ids[2], "energy_j"] == 2.5
    assert json.loads(rows.loc[ids[0], "metrics"])["n_new_tokens"] == 2


def test_a_crashed_run_is_marked_interrupted(tmp_path):
    path = tmp_path / "runs.duckdb"
    crashed = run_code(f"""
        import os
        from engine.store.db import Store
        s = Store({str(path)!r})
        print(s.start_run(model="m", device="cpu", dtype="float32", config={{}}, hardware={{}}, prompt="p"))
        os._exit(9)
    """)
    run_id = int(crashed.stdout.strip())
    store = Store(path)
    row = store.run(run_id)
    assert row["status"] == "interrupted"
    assert "ended" in row["error"]
    # killed before its journal: no tokens, and buckets that add up to nothing
    assert row["n_new_tokens"] == 0 and list(row["token_ids"]) == [] and row["finished_at"] is not None
    assert row["memory_ms"] == 0 and math.isnan(row["total_ms"])


def test_a_live_run_of_this_process_stays_running(store):
    run_id = store.start_run(model="m", device="cpu", dtype="float32", config={}, hardware={}, prompt="p")
    assert store.recover() == 0
    assert store.run(run_id)["status"] == "running"


def test_two_processes_record_runs_into_one_file(tmp_path):
    path = tmp_path / "runs.duckdb"
    Store(path)
    code = f"""
        from engine.measure import hardware
        from engine.run.generate import Generation, GenConfig
        from engine.model.loader import tiny_model
        from engine.store.db import Store
        import torch
        lm = tiny_model()
        store = Store({str(path)!r})
        cal = hardware.calibration_for(torch.device("cpu"))  # the suite's fixed one (TOKENPATH_CALIBRATION)
        for i in range(6):
            Generation(lm, GenConfig("count " + str(i), raw=True, max_new_tokens=70), store=store,
                       calibration=cal).run()
    """
    procs = [start_python("-c", textwrap.dedent(code), stdout=subprocess.DEVNULL) for _ in range(2)]
    for p in procs:
        assert p.wait(timeout=600) == 0, p.stderr.read()[-2000:]
    store = Store(path)
    runs = store.runs(100)
    assert len(runs) == 12
    assert set(runs["status"]) == {"ok"}
    counts = store.query("SELECT run_id, count(*) AS n FROM tokens GROUP BY run_id")
    assert len(counts) == 12
    merged = runs.merge(counts, on="run_id")
    assert (merged["n"] == merged["n_new_tokens"]).all()


def test_a_corrupt_file_is_refused_and_left_untouched(tmp_path):
    path = tmp_path / "runs.duckdb"
    path.write_bytes(b"not a database at all" * 100)
    before = path.read_bytes()
    with pytest.raises(StoreError, match="not a readable DuckDB database"):
        Store(path)
    assert path.read_bytes() == before


def test_a_foreign_duckdb_file_is_refused_and_left_untouched(tmp_path):
    path = tmp_path / "other.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE invoices (id INTEGER)")
    con.execute("INSERT INTO invoices VALUES (42)")
    con.close()
    with pytest.raises(StoreError, match="something else"):
        Store(path)
    con = duckdb.connect(str(path))
    assert con.execute("SELECT * FROM invoices").fetchall() == [(42,)]
    assert con.execute("SELECT count(*) FROM information_schema.tables").fetchone()[0] == 1
    con.close()


def test_a_folder_at_the_path_is_refused(tmp_path):
    with pytest.raises(StoreError, match="folder"):
        Store(tmp_path)


def test_delete_removes_a_run_with_its_rows_and_keeps_the_others(tiny_lm, calibration, store):
    from engine.run.generate import Generation, GenConfig

    ids = [Generation(tiny_lm, GenConfig(f"run {i}", raw=True, max_new_tokens=3), store=store,
                      calibration=calibration).run()["run_id"] for i in range(2)]
    assert store.delete_runs([ids[0]]) == 1
    assert list(store.runs()["run_id"]) == [ids[1]]
    assert store.tokens(ids[0]).empty and store.steps(ids[0]).empty
    assert len(store.tokens(ids[1])) > 0


def test_the_steps_and_tokens_tables_have_the_row_types_columns(store):
    from dataclasses import fields

    from engine.store.rows import ServedStepRow, ServedTokenRow, StepRow, TokenRow

    for table, rows in (("steps", (StepRow, ServedStepRow)), ("tokens", (TokenRow, ServedTokenRow))):
        columns = set(store.query(f"SELECT * FROM {table} LIMIT 0").columns)
        assert columns == {f.name for row in rows for f in fields(row)} | {"run_id"}, table


def test_a_database_cut_short_is_refused_in_one_sentence(tmp_path):
    path = tmp_path / "runs.duckdb"
    store = Store(path)
    for i in range(3):
        store.start_run(model="m", device="cpu", dtype="float32", config={}, hardware={}, prompt="p" * 1000)
    whole = path.read_bytes()
    refused = 0
    for cut in range(16384, len(whole), len(whole) // 12):
        short = tmp_path / f"cut-{cut}.duckdb"
        short.write_bytes(whole[:cut])
        try:
            opened = Store(short)
        except StoreError as exc:
            assert "damaged or cut short" in str(exc) or "not a readable DuckDB database" in str(exc)
            refused += 1
            continue
        # a cut that only lost free blocks still records
        opened.start_run(model="m", device="cpu", dtype="float32", config={}, hardware={}, prompt="x")
    assert refused >= 6


def test_reading_opens_the_file_without_writing_it(tmp_path):
    path = tmp_path / "runs.duckdb"
    Store(path).start_run(model="m", device="cpu", dtype="float32", config={}, hardware={}, prompt="p")
    before = (path.read_bytes(), path.stat().st_mtime_ns)
    frame = Store(path, read_only=True).runs()
    assert list(frame["prompt"]) == ["p"] and frame["status"].iloc[0] == "running"
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs.duckdb", "runs.duckdb.lock"]  # the writers' turns


JOURNAL_WRITER = """
import os, sys
from pathlib import Path
from engine.store.journal import Journal
folder, first, count = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
lost = 0
for run_id in range(first, first + count):
    j = Journal(folder / f"run-{run_id}.jsonl")
    j.write("run", {"run_id": run_id})
    j.flush()
    mine = os.fstat(j._file.fileno()).st_ino
    try:
        lost += os.stat(j.path).st_ino != mine
    except FileNotFoundError:
        lost += 1
    j.close(remove=True)
print(lost)
"""

JOURNAL_RECOVERER = """
import sys
from pathlib import Path
from engine.store import journal
folder = Path(sys.argv[1])
taken = 0
while not (folder.parent / "stop").exists():
    for path in folder.glob("run-*.jsonl"):
        with journal.claimed(path) as kept:
            taken += kept is not None
print(taken)
"""


def test_a_journal_keeps_what_orjson_refuses_and_ignores_a_line_cut_within_a_character(tmp_path):
    """Rows orjson will not write (a lone surrogate, which a server's JSON can carry; an integer beyond 64 bits) go
    through the json module; a last line cut short within a character of several bytes is ignored, as any line a
    kill cut short is."""
    path = tmp_path / "run-1.jsonl"
    kept = journal.Journal(path)
    kept.write("run", {"run_id": 1, "n_prompt_tokens": 3})
    kept.write("token", {"idx": 0, "piece": "caf\u00e9", "token_id": 2 ** 70})
    kept.write("token", {"idx": 1, "piece": "\ud83d", "token_id": 5})
    kept.write("step", {"step": 0, "text": "\u00e9t\u00e9"})
    kept.flush()
    rows = journal.read(path)
    assert [(t["piece"], t["token_id"]) for t in rows["tokens"]] == [("caf\u00e9", 2 ** 70), ("\ud83d", 5)]
    assert rows["text"] == "\u00e9t\u00e9"
    path.write_bytes(path.read_bytes()[:-4])  # the last line now ends within its last "\u00e9"
    cut = journal.read(path)
    assert len(cut["tokens"]) == 2 and cut["steps"] == [] and cut["text"] == ""
    kept.close()


def test_no_recovery_takes_a_journal_its_writer_is_creating(tmp_path):
    """Writers create, fill and remove journals as fast as they can while recoverers claim every journal
    they see without a live owner: none may ever be taken from a live writer."""
    folder = tmp_path / "runs.duckdb.journal"
    folder.mkdir()

    def start(code, *args):
        return start_python("-c", code, folder, *args)

    recoverers = [start(JOURNAL_RECOVERER) for _ in range(3)]
    writers = [start(JOURNAL_WRITER, 1 + 100_000 * i, 1000) for i in range(4)]
    results = [p.communicate(timeout=600) for p in writers]
    (tmp_path / "stop").touch()
    results += [p.communicate(timeout=600) for p in recoverers]
    assert all(p.returncode == 0 for p in writers + recoverers), [err for _, err in results]
    lost = [int(out) for out, _ in results[:len(writers)]]
    taken = [int(out) for out, _ in results[len(writers):]]
    assert lost == [0] * len(writers) and taken == [0] * len(recoverers)
    assert list(folder.iterdir()) == []


def test_a_database_of_the_earlier_schema_keeps_its_runs_under_the_new_column_names(tmp_path):
    """Schema 12 named the weight level `quant` and the speculative method `spec`, as columns and in a run's
    stored settings; opening the file renames the columns, and each run's command comes back in today's words."""
    from datetime import datetime

    from engine.run.reproduce import arguments, stored_spec
    from engine.spec import GenConfig, RunSpec
    from engine.store.schema import MIGRATIONS

    path = tmp_path / "old.duckdb"
    con = duckdb.connect(str(path))
    for version in range(1, 13):
        for statement in MIGRATIONS[version]:
            con.execute(statement)
    con.execute("INSERT INTO tokenpath_meta VALUES ('schema_version', '12')")
    gen = {"prompt": "hi", "max_new_tokens": 5, "spec": "draft", "spec_k": 3, "draft_model": "self-int8"}
    settings = {"model": "default", "quant": "int4-wo g64", **gen}
    for config in ({**settings, "run_spec": {"gen": gen, "weights": "int4-wo", "group_size": 64}}, settings):
        con.execute("INSERT INTO runs (started_at, status, model, quant, spec, config, prompt) VALUES "
                    "(?, 'ok', 'default', 'int4-wo g64', 'draft', ?, 'hi')", [datetime(2026, 1, 2), json.dumps(config)])
    con.close()

    store = Store(path)
    runs = store.runs()
    assert {"weights", "speculative"} <= set(runs.columns) and not {"quant", "spec"} & set(runs.columns)
    assert list(runs["weights"]) == ["int4-wo g64"] * 2 and list(runs["speculative"]) == ["draft"] * 2
    made = RunSpec(gen=GenConfig("hi", max_new_tokens=5, speculative="draft", speculative_k=3, draft_model="self-int8"),
                   weights="int4-wo", group_size=64)
    for run_id in (1, 2):
        spec = stored_spec(store, run_id)
        assert spec == made
        words = arguments(spec)
        assert words[words.index("--weights") + 1] == "int4-wo" and words[words.index("--speculative") + 1] == "draft"
        assert words[words.index("--speculative-k") + 1] == "3" and "--quant" not in words and "--spec" not in words


def test_a_journal_that_cannot_be_written_records_the_run_as_an_error_in_one_sentence(tiny_folder, tmp_path,
                                                                                    monkeypatch, capsys):
    """The journal folder beside the database refuses the file (a full disk, an immutable folder): the run's row,
    written already, is completed as an error with the reason, and the command says so in one sentence, exit 2."""
    from engine.cli.main import main
    from engine.store import record

    def refuse(path):
        raise PermissionError(1, "Operation not permitted", str(path))

    monkeypatch.setattr(record, "Journal", refuse)
    db = tmp_path / "runs.duckdb"
    code = main(["generate", "--model", str(tiny_folder), "--prompt", "hi", "--raw", "--max-new-tokens", "2",
                 "--db", str(db)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0, err
    assert err.startswith("error: Run 1 was recorded as an error before its first token: its journal cannot be "
                          "written beside the database (Operation not permitted: ")
    runs = Store(db).runs()
    assert list(runs["status"]) == ["error"] and "journal cannot be written" in runs["error"].iloc[0]


def opened_elsewhere(path: Path) -> bool:
    """Whether another process can open the file now."""
    return run_python("-c", f"import duckdb; duckdb.connect({str(path)!r}).close()").returncode == 0


def test_a_file_is_attached_once_and_held_until_its_last_connection_closes(store):
    with store.connect() as outer:
        with store.connect() as inner:  # nested: the same attachment
            assert inner.execute("SELECT count(*) FROM runs").fetchone() == (0,)
        with Store(Path(os.path.relpath(store.path))).connect() as spelled:  # the same file spelled otherwise
            assert spelled.execute("SELECT count(*) FROM runs").fetchone() == (0,)
        assert outer.execute("SELECT count(*) FROM runs").fetchone() == (0,)
        assert not opened_elsewhere(store.path)
    assert opened_elsewhere(store.path)
    assert db._instance().execute("SELECT count(*) FROM duckdb_databases() WHERE path = ?",
                                  [os.path.realpath(store.path)]).fetchone() == (0,)
    spill = db._instance().execute("SELECT current_setting('temp_directory')").fetchone()[0]
    assert Path(spill).parent == Path(tempfile.gettempdir()) and str(os.getpid()) in spill
