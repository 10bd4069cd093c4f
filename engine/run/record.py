"""A run's record: its row when it starts, its journal while it runs, one transaction when it ends.

Every step and token goes to the journal (engine.store.journal) as it happens, so neither a kill nor a
database that another process holds loses them; the database is written once, at the end, so no
token waits for it."""
from __future__ import annotations

from engine.store.journal import Journal, journal_path
from engine.run.rows import columns
from engine.store.db import Store, StoreError


class RecordDeferred(StoreError):
    """The run ended but its rows could not reach the database; they wait in the journal."""


class Recorder:
    def __init__(self, store: Store):
        self.store = store
        self.run_id: int | None = None
        self.journal: Journal | None = None

    def start(self, *, n_prompt_tokens: int, **run) -> int:
        self.run_id = self.store.start_run(**run)
        self.journal = Journal(journal_path(self.store.path, self.run_id))
        self.journal.write("run", {"run_id": self.run_id, "n_prompt_tokens": n_prompt_tokens})
        self.journal.flush()
        return self.run_id

    def add(self, step_row, token_rows, text: str) -> None:
        """One step's rows and the text it added, handed to the operating system at once."""
        self.journal.write("step", {**columns(step_row), "text": text})
        for row in token_rows:
            self.journal.write("token", columns(row))
        self.journal.flush()

    def finish(self, *, status: str, output: str, token_ids: list[int], metrics: dict, error: str | None,
               steps: list[dict], tokens: list[dict], telemetry: list[dict]) -> None:
        """Write the run's rows and ending in one transaction. If the database cannot be reached, the
        ending goes to the journal too and RecordDeferred says so."""
        ending = {"status": status, "output": output, "token_ids": list(token_ids), "metrics": metrics,
                  "error": error}
        self.journal.write("finish", {**ending, "telemetry": telemetry})
        self.journal.flush()
        batches = {name: [{"run_id": self.run_id, **r} for r in rows]
                   for name, rows in (("steps", steps), ("tokens", tokens), ("telemetry", telemetry))}
        try:
            self.store.finish_run(self.run_id, batches=batches, **ending)
        except StoreError as exc:
            self.journal.close()
            raise RecordDeferred(
                f"Run {self.run_id} ended ({status}, {len(token_ids)} tokens) but could not be written to the "
                f"database ({exc}); its rows are kept in {self.journal.path} and go into the database the next "
                "time Tokenpath opens it.") from None
        self.journal.close(remove=True)
