"""A run's record: its row when it starts, its journal while it runs, one transaction when it ends.

Every step and token goes to the journal (engine.store.journal) as it happens, so neither a kill nor a
database that another process holds loses them; the database is written once, at the end, so no
token waits for it. Local and served runs keep their records the same way; a local run also keeps the energy
its device's counters measured from its start to its end (engine.measure.energy). A Recorder given a Writer
(engine.store.writer) hands the run's row and its ending to it, to be written with other runs' rows, and its
journal, which then holds the row as well, stays until they are."""
from __future__ import annotations

import duckdb
import torch

from engine.measure.energy import EnergyMeter
from engine.store.journal import Journal, journal_path
from engine.store.db import Store, StoreError, signals_deferred
from engine.store.sql import start_row, utcnow


class RecordDeferred(StoreError):
    """The run ended but its rows could not reach the database; they wait in the journal."""


class JournalRefused(StoreError):
    """A run's journal cannot be written beside the database: the run is recorded as an error before it begins."""


class Recorder:
    def __init__(self, store: Store, writer=None):
        self.store, self.writer = store, writer
        self.run_id: int | None = None
        self.journal: Journal | None = None
        self.written = False  # the run's ending is in the database
        self.energy: EnergyMeter | None = None  # a local run's, from its start

    def start(self, *, n_prompt_tokens: int, **run) -> int:
        """Write a local run's row (or hand it to the writer), open its journal and read its device's energy
        counters."""
        with signals_deferred():
            if self.writer is None:
                run_id = self.store.start_run(**run)
                try:
                    self.attach(run_id, n_prompt_tokens)
                except OSError as exc:
                    self._refused(run_id, exc)
            else:
                row = {"run_id": self.writer.run_id(), **start_row(**run)}
                run_id = self.attach(row["run_id"], n_prompt_tokens, row)
                self.writer.start(row)
        self.energy = EnergyMeter(torch.device(run["device"]))
        return run_id

    def _refused(self, run_id: int, exc: OSError) -> None:
        why = f"its journal cannot be written beside the database ({exc.strerror}: {exc.filename})"
        self.store.finish_run(run_id, status="error", error=why)
        self.written = True
        raise JournalRefused(f"Run {run_id} was recorded as an error before its first token: {why}; make that "
                             "folder writable.") from None

    def attach(self, run_id: int, n_prompt_tokens: int | None, row: dict | None = None) -> int:
        """Open the journal of a run whose row is written (by start, or by the served backend's own insert), or,
        given the row, is still to be written (by the writer; recovery writes it from the journal if the process
        dies first)."""
        with signals_deferred():
            self.run_id = run_id
            self.journal = Journal(journal_path(self.store.path, run_id))
            self.journal.write("run", {"run_id": run_id, "n_prompt_tokens": n_prompt_tokens,
                                       **({"row": row} if row else {})})
            self.journal.flush()
        return run_id

    def add(self, step: dict, tokens: list[dict], text: str, flush: bool = True) -> None:
        """One step's rows (engine.store.rows.columns of each) and the text it added, handed to the operating system
        at once (flush=False: at the caller's flush())."""
        self.journal.write("step", {**step, "text": text})
        for row in tokens:
            self.journal.write("token", row)
        if flush:
            self.journal.flush()

    def flush(self) -> None:
        """Hand the rows added so far to the operating system."""
        self.journal.flush()

    def finish(self, *, status: str, output: str, token_ids: list[int], metrics: dict, error: str | None,
               steps: list[dict], tokens: list[dict], telemetry: list[dict], run_columns: dict | None = None) -> None:
        """Write the run's rows and ending in one transaction (with a writer: hand them to it). If the database
        cannot be reached, or a Ctrl-C or SIGTERM cuts the write short, the ending stays in the journal and
        RecordDeferred says so."""
        if self.energy is not None:
            run_columns = {**(run_columns or {}), **self.energy.stop()}
        # when the run ended, not when a writer or a locked database lets its rows in
        ending = {"status": status, "output": output, "token_ids": list(token_ids), "metrics": metrics,
                  "error": error, "columns": run_columns, "finished_at": utcnow()}
        self.journal.write("finish", {**ending, "telemetry": telemetry})
        self.journal.flush()
        batches = {name: [{"run_id": self.run_id, **r} for r in rows]
                   for name, rows in (("steps", steps), ("tokens", tokens), ("telemetry", telemetry))}
        if self.writer is not None:
            self.writer.end(self, batches, ending)
            return
        try:
            self.store.finish_run(self.run_id, batches=batches, **ending)
        except (StoreError, KeyboardInterrupt, duckdb.InterruptException) as exc:
            self.journal.close()
            why = "the write was interrupted" if not isinstance(exc, StoreError) else f"it could not be written ({exc})"
            raise RecordDeferred(
                f"Run {self.run_id} ended ({status}, {len(token_ids)} tokens) but is not in the database yet: {why}; "
                f"its rows are kept in {self.journal.path} and go into the database the next time Tokenpath opens "
                "it.") from None
        self.stored()

    def stored(self) -> None:
        """The run's rows and ending are in the database: its journal goes."""
        self.written = True
        self.journal.close(remove=True)
