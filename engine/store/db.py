"""The DuckDB run store: every run, step, token, telemetry sample and calibration.

Connections are short (open, write, close) so the app and the command line can both record; a writer
that finds the file locked by another process waits and retries. A connection attaches the file to the process's
one in-memory DuckDB and detaches it after: a new DuckDB instance takes about ten milliseconds to start, an
attachment about one. A run's rows live in its journal
(engine.store.journal) until the run ends, when one transaction writes them and completes the run row; a run
whose process died is folded in from its journal by the next Store opened on the file."""
from __future__ import annotations

import fcntl
import itertools
import json
import os
import signal
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import duckdb

from engine.store import recovery
from engine.errors import UserError
from engine.paths import default_db_path
from engine.store.schema import MIGRATIONS, SCHEMA_VERSION
from engine.store.sql import complete_run, insert_batches, start_row, utcnow

# One thread at a time holds a connection in this process: its connections share one DuckDB instance and the
# counts below, and a load sweep's request threads each open, write and close their own. (Threads that opened
# the file at once also raced DuckDB's registration of its pandas scan: "Table Function with name pandas_scan
# does not exist".)
_connection = threading.RLock()
_turns: set = set()  # the side files this process holds the turn of (Store._turn), guarded by _connection
_attached: dict = {}  # database file -> [its name in this process's DuckDB, connections open on it], likewise
_names = itertools.count()
_memory: duckdb.DuckDBPyConnection | None = None


def lock_wait_s() -> float:
    """How long a writer waits for a database file that another process holds (read at each connection, so that a
    process forked from one that has imported this module reads its own)."""
    return float(os.environ.get("TOKENPATH_LOCK_WAIT_S", "60"))


class StoreError(UserError):
    """The database cannot be used."""


def lock_path(db_path: Path) -> Path:
    """The side file whose flock gives one process at a time the database (Store._turn)."""
    return db_path.with_name(db_path.name + ".lock")


@contextmanager
def signals_deferred():
    """Ctrl-C and SIGTERM wait until the block is done, then interrupt as usual: for what must happen whole (a run
    row and its journal, a file's attachment and its count), in the main thread, where Python delivers signals.
    The first one that came goes to the handler the block put aside, as it would have without the block: one that
    notes the interrupt and ignores the next ones (a command's interrupt_once) keeps doing so, and an ignored
    signal stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if caught:
            handler = previous[caught[0]]
            if callable(handler):
                handler(caught[0], None)
            elif handler != signal.SIG_IGN:
                raise KeyboardInterrupt


def _instance() -> duckdb.DuckDBPyConnection:
    """This process's in-memory DuckDB, to which each connection attaches its file. What a query spills goes to a
    folder of this process's own in the system's temporary folder (made only if a query spills), not to `.tmp` in
    whatever folder the process runs in."""
    global _memory
    if _memory is None:
        spill = os.path.join(tempfile.gettempdir(), f"tokenpath-duckdb-{os.getpid()}")
        _memory = duckdb.connect(config={"temp_directory": spill})
    return _memory


def _is_lock_error(exc: Exception) -> bool:
    text = str(exc).lower()
    return "lock" in text and ("could not set" in text or "conflicting" in text)


class Store:
    def __init__(self, path: str | Path | None = None, read_only: bool = False):
        """read_only: for commands that only read (an existing file is then opened without write access, so a
        read-only folder or file serves, and runs whose process died are left for the next writer to fold)."""
        self.path = Path(path) if path else default_db_path()
        self.file = os.path.realpath(self.path)  # the file however its path is spelled: one lock and attachment each
        self.read_only = read_only and self.path.is_file()
        try:
            self._prepare()
            if not self.read_only:
                self.recover()
        except duckdb.Error as exc:  # a file cut short or damaged: found before anything is loaded or run
            raise StoreError(f"{self.path} is damaged or cut short, so it is not a readable DuckDB database "
                             f"({str(exc).splitlines()[0][:160]}); point --db or TOKENPATH_DB at another file.") from None

    @contextmanager
    def connect(self):
        with _connection, self._connected() as con:
            yield con

    @contextmanager
    def _connected(self):
        deadline = time.monotonic() + lock_wait_s()
        with self._turn(deadline), self._opened(deadline) as con:
            yield con

    @contextmanager
    def _turn(self, deadline: float):
        """This process's turn at the file, from before DuckDB opens it until after it has closed it. DuckDB's own
        lock is a POSIX record lock, which a process drops when it closes any descriptor of the file; with it alone,
        two processes recording into one file now and then lost a committed run. A flock on a side file has no such
        gap. Readers share it; a read-only folder that cannot hold the side file leaves DuckDB's lock alone; a
        connection opened inside another (the same thread, under _connection) already has the turn."""
        path = lock_path(Path(self.file))
        if path in _turns:
            yield
            return
        try:
            f = open(path, "a")
        except OSError:
            try:
                f = open(path)
            except OSError:
                yield
                return
        with f:
            delay = 0.01
            while True:
                try:
                    fcntl.flock(f, (fcntl.LOCK_SH if self.read_only else fcntl.LOCK_EX) | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    delay = self._wait(deadline, delay)
            _turns.add(path)
            try:
                yield
            finally:
                _turns.discard(path)

    def _wait(self, deadline: float, delay: float) -> float:
        """Sleep before trying the locked file again (the next sleep is returned), or refuse once past the deadline."""
        if time.monotonic() >= deadline:
            raise StoreError(f"The database {self.path} stayed locked by another process for {lock_wait_s():.0f} s.")
        time.sleep(delay)
        return min(delay * 2, 0.25)

    @contextmanager
    def _opened(self, deadline: float):
        """A connection whose tables are the file's: the file attached to this process's DuckDB (once, however many
        connections of one thread are open on it), detached, and so released to other processes, after the last."""
        key = self.file
        delay = 0.01
        while key not in _attached:
            try:
                with signals_deferred():  # a Ctrl-C never lands between attaching and counting
                    name = f"store_{next(_names)}"
                    _instance().execute(f"ATTACH ? AS {name}{' (READ_ONLY)' if self.read_only else ''}", [key])
                    _attached[key] = [name, 0]
            except duckdb.Error as exc:
                if not _is_lock_error(exc):
                    raise StoreError(f"{self.path} is not a readable DuckDB database ({str(exc).splitlines()[0]}); "
                                     "point --db or TOKENPATH_DB at another file.") from None
                delay = self._wait(deadline, delay)
        entry = _attached[key]
        entry[1] += 1
        con = _instance().cursor()
        try:
            con.execute(f"USE {entry[0]}")
            yield con
        finally:
            con.close()
            with signals_deferred():
                entry[1] -= 1
                if not entry[1]:
                    _instance().execute(f"DETACH {entry[0]}")
                    del _attached[key]

    def _prepare(self) -> None:
        if self.path.is_dir():
            raise StoreError(f"{self.path} is a folder, not a database file; point --db or TOKENPATH_DB at a file.")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"Cannot create the folder for the database {self.path}: {exc.strerror}.") from None
        with self.connect() as con:
            tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables "
                                                "WHERE table_catalog = current_database()").fetchall()}
            if tables and "tokenpath_meta" not in tables:
                raise StoreError(f"{self.path} is a DuckDB file of something else (it has tables but none of "
                                 "Tokenpath's); it was left untouched, point --db or TOKENPATH_DB at another file.")
            version = 0
            if tables:
                row = con.execute("SELECT value FROM tokenpath_meta WHERE key = 'schema_version'").fetchone()
                version = int(row[0]) if row else 0
            if version > SCHEMA_VERSION:
                raise StoreError(f"{self.path} was written by a newer Tokenpath (schema {version}); update this copy.")
            if self.read_only:
                if not tables:
                    raise StoreError(f"{self.path} holds no Tokenpath tables yet, so there is nothing to read.")
                if version < SCHEMA_VERSION:
                    raise StoreError(f"{self.path} was written by an older Tokenpath (schema {version}): open it once "
                                     "with write access (any command that records) to update it.")
                return
            for v in range(version + 1, SCHEMA_VERSION + 1):
                con.execute("BEGIN")
                for statement in MIGRATIONS[v]:
                    con.execute(statement)
                con.execute("INSERT OR REPLACE INTO tokenpath_meta VALUES ('schema_version', ?)", [str(v)])
                con.execute("COMMIT")
            try:  # a file or folder that can be read but not written fails here, before any run starts
                con.execute("INSERT OR REPLACE INTO tokenpath_meta VALUES ('last_opened', ?)", [utcnow().isoformat()])
                con.execute("CHECKPOINT")
            except duckdb.Error as exc:
                raise StoreError(f"{self.path} cannot be written ({str(exc).splitlines()[0]}); nothing was recorded: "
                                 "point --db or TOKENPATH_DB at a writable file.") from None
            # a run row written and taken back (its id outside the sequence's), so that a file cut short fails
            # here, before a model loads, rather than when the run starts
            con.execute("BEGIN")
            con.execute("INSERT INTO runs (run_id, started_at, status) VALUES (-1, ?, 'probe')", [utcnow()])
            con.execute("ROLLBACK")

    def recover(self) -> int:
        """Fold in the runs whose process died (engine.store.recovery); returns how many changed."""
        return recovery.recover(self)

    def start_run(self, **run) -> int:
        """Write a local run's row as it starts (engine.store.sql.start_row takes the settings); its run_id."""
        row = start_row(**run)
        with self.connect() as con:
            return con.execute(f"INSERT INTO runs ({', '.join(row)}) VALUES ({', '.join('?' for _ in row)}) "
                               "RETURNING run_id", list(row.values())).fetchone()[0]

    def reserve_run_ids(self, n: int, con=None) -> list[int]:
        """n run ids taken from the sequence for rows written later (engine.store.writer); in con when given."""
        if con is None:
            with self.connect() as con:
                return self.reserve_run_ids(n, con)
        return [row[0] for row in con.execute("SELECT nextval('run_ids') FROM range(?)", [n]).fetchall()]

    def finish_run(self, run_id: int, *, status: str, output: str = "", token_ids=(), metrics: dict | None = None,
                   error: str | None = None, batches: dict[str, list[dict]] | None = None,
                   columns: dict | None = None, finished_at=None) -> None:
        """Write the run's rows and complete its row, in one transaction."""
        with self.connect() as con:
            con.execute("BEGIN")
            insert_batches(con, batches or {})
            complete_run(con, run_id, status=status, output=output, token_ids=token_ids, metrics=metrics, error=error,
                         columns=columns, finished_at=finished_at)
            con.execute("COMMIT")

    def insert(self, batches: dict[str, list[dict]]) -> None:
        """Rows for several tables ({table: [row dict, ...]}) in one connection."""
        with self.connect() as con:
            insert_batches(con, batches)

    def query(self, sql: str, params=None):
        """A pandas DataFrame of any read query."""
        with self.connect() as con:
            return con.execute(sql, params or []).df()

    def runs(self, limit: int = 50):
        return self.query("SELECT * EXCLUDE (pid, pid_started) FROM runs ORDER BY run_id DESC LIMIT ?", [limit])

    def all_runs(self):
        """Every run, newest first, without the bulky columns (hardware, token ids, process ids)."""
        return self.query("SELECT * EXCLUDE (pid, pid_started, hardware, token_ids) FROM runs ORDER BY run_id DESC")

    def flagged_calibration_figures(self) -> set[float]:
        """The memory figures of the stored calibrations flagged as taken on a busy machine."""
        results = (json.loads(text) for text in self.query("SELECT results FROM calibration")["results"])
        return {r["memory_gbps"] for r in results if "suspect" in r}

    def cached_runs_of(self, model: str, limit: int):
        """The newest finished runs of a model with a KV cache: their sizes and metrics."""
        return self.query("SELECT run_id, dtype, n_prompt_tokens, n_new_tokens, metrics FROM runs WHERE status = 'ok' "
                          "AND model = ? AND kv_cache ORDER BY run_id DESC LIMIT ?", [model, limit])

    def runs_with_tokens(self, limit: int):
        """The newest runs that produced at least one token."""
        return self.query("SELECT * FROM runs WHERE n_new_tokens > 0 ORDER BY run_id DESC LIMIT ?", [limit])

    def plain_decode_runs(self, limit: int):
        """The newest finished runs that decoded with a KV cache and no speculation (what the planner plans)."""
        return self.query("SELECT * FROM runs WHERE status = 'ok' AND kv_cache AND n_new_tokens > 1 AND "
                          "coalesce(speculative, 'none') = 'none' ORDER BY run_id DESC LIMIT ?", [limit])

    def run(self, run_id: int) -> dict | None:
        frame = self.query("SELECT * FROM runs WHERE run_id = ?", [run_id])
        return None if frame.empty else frame.iloc[0].to_dict()

    def steps(self, run_id: int):
        return self.query("SELECT * FROM steps WHERE run_id = ? ORDER BY step", [run_id])

    def tokens(self, run_id: int):
        return self.query("SELECT * FROM tokens WHERE run_id = ? ORDER BY idx", [run_id])

    def telemetry(self, run_id: int):
        return self.query("SELECT * FROM telemetry WHERE run_id = ? ORDER BY t_ms", [run_id])

    def delete_runs(self, run_ids: list[int]) -> int:
        """Delete these runs with their steps, tokens and telemetry; returns how many runs went."""
        ids = [int(i) for i in run_ids]
        if not ids:
            return 0
        marks = ", ".join("?" for _ in ids)
        with self.connect() as con:
            con.execute("BEGIN")
            for table in ("steps", "tokens", "telemetry"):
                con.execute(f"DELETE FROM {table} WHERE run_id IN ({marks})", ids)
            deleted = con.execute(f"DELETE FROM runs WHERE run_id IN ({marks}) RETURNING run_id", ids).fetchall()
            con.execute("COMMIT")
        return len(deleted)

    def save_quality(self, result: dict) -> None:
        row = {k: result.get(k) for k in ("model", "device", "variant", "perplexity", "kl_mean", "top1_agreement",
                                          "n_tokens", "eval_text_sha", "first_divergence", "seconds")}
        self.insert({"quality": [{**row, "created_at": utcnow(), "settings": json.dumps(result.get("settings", {}))}]})

    def sparsity_thresholds(self, model: str, sparsity: float, text_sha: str) -> dict | None:
        with self.connect() as con:
            row = con.execute("SELECT thresholds FROM sparsity_thresholds WHERE model = ? AND sparsity = ? AND "
                              "text_sha = ? ORDER BY created_at DESC LIMIT 1", [model, sparsity, text_sha]).fetchone()
        return json.loads(row[0]) if row else None

    def save_sparsity_thresholds(self, model: str, sparsity: float, text_sha: str, thresholds: dict) -> None:
        with self.connect() as con:
            con.execute("INSERT INTO sparsity_thresholds VALUES (?, ?, ?, ?, ?)",
                        [model, sparsity, text_sha, utcnow(), json.dumps(thresholds)])

    def save_calibration(self, device_key: str, results: dict) -> None:
        with self.connect() as con:
            con.execute("INSERT INTO calibration VALUES (?, ?, ?)", [device_key, utcnow(), json.dumps(results)])

    def latest_calibration(self, device_key: str) -> dict | None:
        with self.connect() as con:
            row = con.execute("SELECT results, created_at FROM calibration WHERE device_key = ? "
                              "ORDER BY created_at DESC LIMIT 1", [device_key]).fetchone()
        if not row:
            return None
        return {**json.loads(row[0]), "created_at": row[1].isoformat(timespec="seconds")}


# the Store of each database file this process opened, with the file's inode when it was opened
_opened: dict[Path, tuple[Store, int]] = {}


def store_at(path: str | Path | None = None) -> Store:
    """This process's Store of a database file (the default one without a path), opened once (migrated, runs
    of dead processes folded in) and again only when the file was removed or replaced: opening takes several
    connections and a checkpoint, a second or more on a busy machine, that every run's first token and
    every page's rerun would otherwise wait for."""
    path = Path(path) if path else default_db_path()
    held = _opened.get(path)
    try:
        inode = os.stat(path).st_ino
    except OSError:
        inode = None
    if held is None or held[1] != inode:
        store = Store(path)
        held = _opened[path] = (store, os.stat(store.path).st_ino)
    return held[0]


def existing_store(path: str | Path | None = None) -> Store:
    """The database at path (the default one without a path) opened to read, for a command that only reads it: a
    file that is not there is one sentence rather than a new, empty database, and a read-only file serves."""
    path = Path(path) if path else default_db_path()
    if not path.exists():
        raise StoreError(f"{path} does not exist: point --db or TOKENPATH_DB at the database that holds the runs.")
    return Store(path, read_only=True)
