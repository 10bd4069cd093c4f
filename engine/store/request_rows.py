"""A load sweep's finished requests: each row in the sweep's journal the moment its request ends, in the database in
batches.

A connection to the database costs several milliseconds of a core, which a write per request would take from the
server the sweep measures, on the same cores when it is this machine. So the rows are written together, at most
flush_s() after the first of them ended (engine.store.writer), and at the end of each level; until then the
sweep's journal (engine.store.journal) holds them, and a sweep killed between writes leaves it to the next store
opened on the file, which folds in the rows the database lacks (engine.store.recovery)."""
from __future__ import annotations

import threading
import time

from engine.store.journal import Journal, sweep_journal_path
from engine.store.writer import flush_s


class RequestRows:
    """The requests of one sweep: add() each as it ends, from any thread; write() writes what waits now, close()
    writes the rest and removes the journal."""

    def __init__(self, store, sweep_id: int):
        self.store = store
        self.journal = Journal(sweep_journal_path(store.path, sweep_id))  # the file's name says whose it is
        self._rows: list[dict] = []
        self._since: float | None = None  # when the oldest waiting row came
        self._lock = threading.Lock()

    def add(self, row: dict) -> None:
        with self._lock:
            self.journal.write("request", row)
            self.journal.flush()
            self._rows.append(row)
            self._since = self._since or time.monotonic()
            due = time.monotonic() - self._since >= flush_s()
        if due:
            self.write()

    def write(self) -> None:
        with self._lock:
            rows, self._rows, self._since = self._rows, [], None
        if not rows:
            return
        try:
            self.store.insert({"requests": rows})
        except BaseException:  # back in front, to be written with the next; the journal holds them meanwhile
            with self._lock:
                self._rows, self._since = rows + self._rows, self._since or time.monotonic()
            raise

    def close(self) -> None:
        """Write what waits; the journal goes once every row is in the database, and stays for recovery if not."""
        try:
            self.write()
        except BaseException:
            self.journal.close()
            raise
        self.journal.close(remove=True)
