"""Run rows of many runs written together: one short connection for all that came due, off the decoding thread.

A busy engine starts and ends runs every few steps, and opening the database file costs tens of milliseconds of a
core each time, so the continuous-batching engine hands its runs' rows to a Writer instead of writing them itself.
The Writer takes run ids from the database's sequence ahead of time (a run's id is known when it is submitted,
before its row exists), and a thread of its own writes, at most once every flush_s(), every run row that started and
every run that ended since the last write, in one transaction of one connection; the file is held only for that
write, so other processes open it between writes as before.

Nothing waits in memory alone: a run's journal (engine.store.journal) holds its row as it starts, its steps and
tokens as they happen and its ending, and is removed only once the write that holds its ending is committed. A
process killed between writes leaves journals whose owner is gone, and the next store opened on the file folds
them in, row included (engine.store.recovery)."""
from __future__ import annotations

import os
import threading
import time
from collections import deque

import duckdb

from engine.store.db import Store, StoreError
from engine.store.record import RecordDeferred
from engine.store.sql import complete_runs, insert_batches


def flush_s() -> float:
    """The longest a started or ended run waits before its rows are written."""
    return float(os.environ.get("TOKENPATH_WRITE_EVERY_S", "1"))


class Writer:
    """The rows of one engine's runs, written together. Recorder(store, writer) hands it a run's row as the run
    starts (start) and its rows and ending as it ends (end); a thread writes them, and write() does now. It keeps
    ids_ahead run ids in hand, taken by ready() (or the first run that starts) and topped up by each write of its
    thread, so that starting a run takes no connection of its own; none is taken before a run could start, so a
    request refused first leaves the database's sequence as it was."""

    def __init__(self, store: Store, ids_ahead: int, top_up: bool = True):
        self.store, self.ids_ahead = store, ids_ahead
        self.top_up = top_up  # False for a fixed set of runs: ids taken after its last start would leave a gap
        self._ids: deque[int] = deque()
        self._rows: list[dict] = []  # run rows to insert
        self._ends: list[tuple] = []  # (recorder, batches, ending) of each ended run
        self._since: float | None = None  # when the oldest waiting row came
        self._state = threading.Condition()  # guards the lists above; never held while connecting
        self._writing = threading.Lock()  # one write at a time, so a run's ending never lands before its row
        self._thread: threading.Thread | None = None

    def ready(self) -> None:
        """Take run ids now where none are in hand, before the runs' clocks start."""
        with self._state:
            if self._ids:
                return
        ids = self.store.reserve_run_ids(self.ids_ahead)
        with self._state:
            self._ids.extend(ids)

    def run_id(self) -> int:
        """A run id of the database's sequence for a run about to start; it takes a connection only when none is
        in hand. Runs start on one thread, the engine's, so the ids ready() leaves are there to take."""
        self.ready()
        with self._state:
            return self._ids.popleft()

    def start(self, row: dict) -> None:
        """A run row (with its run_id) to insert at the next write."""
        self._queue(self._rows, row)

    def end(self, recorder, batches: dict[str, list[dict]], ending: dict) -> None:
        """A run's rows ({table: rows}) and ending (engine.store.sql.complete_run's arguments) to write at the next
        write; once it is committed, recorder.stored() removes the run's journal."""
        self._queue(self._ends, (recorder, batches, ending))

    def write(self) -> None:
        """Write what waits now, in this thread, taking no run ids ahead: its callers write as their runs end, and
        ids taken then and never used would leave gaps in the runs' numbering. RecordDeferred when the database
        cannot be reached or the write is interrupted: the ended runs not written stay in their journals, for the
        next store opened on the file."""
        try:
            self._flush(top_up=False)
        except (duckdb.Error, StoreError, KeyboardInterrupt) as exc:
            with self._state:  # the ended runs are left to their journals; the rows of runs still going wait
                ends, self._ends = self._ends, []
                ended = {recorder.run_id for recorder, _, _ in ends}
                self._rows = [row for row in self._rows if row["run_id"] not in ended]
            for recorder, _, _ in ends:
                recorder.journal.close()
            why = "the write was interrupted" if isinstance(exc, (KeyboardInterrupt, duckdb.InterruptException)) \
                else f"it could not be written ({exc})"
            raise RecordDeferred(
                f"Runs {', '.join(str(r.run_id) for r, _, _ in ends)} ended but are not in the database yet: {why}; "
                f"their rows are kept in their journals beside {self.store.path} and go into the database the next "
                "time Tokenpath opens it.") from None

    def _queue(self, pending: list, item) -> None:
        with self._state:
            pending.append(item)
            self._since = self._since or time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="tokenpath-writer", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        """Write every flush_s() while rows wait; the thread ends when none do."""
        while True:
            with self._state:
                if self._since is None:
                    self._thread = None
                    return
                due = self._since + flush_s() - time.monotonic()
            if due > 0:
                time.sleep(due)
            try:
                self._flush(top_up=True)
            except Exception:  # tried again flush_s() later (write() says what still fails); the journals hold the rows
                continue

    def _flush(self, top_up: bool) -> None:
        with self._writing:
            self._write(top_up)

    def _write(self, top_up: bool) -> None:
        with self._state:
            rows, ends = self._rows, self._ends
            self._rows, self._ends, self._since = [], [], None
            short = max(0, self.ids_ahead - len(self._ids)) if top_up and self.top_up else 0
        if not rows and not ends:
            return
        try:
            with self.store.connect() as con:
                con.execute("BEGIN")
                insert_batches(con, {"runs": rows})
                insert_batches(con, {table: [row for _, batches, _ in ends for row in batches.get(table, [])]
                                     for table in {t for _, batches, _ in ends for t in batches}})
                complete_runs(con, [(recorder.run_id, ending) for recorder, _, ending in ends])
                ids = self.store.reserve_run_ids(short, con) if short else []
                con.execute("COMMIT")
        except BaseException:
            with self._state:  # back in front of what came meanwhile, in their order
                self._rows, self._ends = rows + self._rows, ends + self._ends
                self._since = self._since or time.monotonic()
            raise
        with self._state:
            self._ids.extend(ids)
        for recorder, _, _ in ends:
            recorder.stored()
