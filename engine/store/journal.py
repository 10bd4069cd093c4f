"""A run's append-only side file: each step and token as a JSON line the moment it exists.

The writer holds an exclusive lock on the file while its run is live, from before the file appears
under its name; the kernel drops the lock when the process dies, even by kill -9, so the next store
opened on the database knows the run has no owner and folds the file in (engine.store.db). Lines reach the operating system at every step, so a
killed process loses nothing the file holds; appending a line costs the decode loop microseconds,
where a database write costs it a core."""
from __future__ import annotations

import fcntl
import json
import os
from contextlib import contextmanager
from pathlib import Path

import orjson


# A line as orjson writes it, in a fifth of the json module's time (a step of many sequences writes a step row and
# a token row for each). NaN and infinities become null, as the store keeps them (NULL); numpy numbers stay numbers.
_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE
_escaped = json.JSONEncoder(default=str).encode


def _line(row: dict) -> bytes:
    try:
        return orjson.dumps(row, default=str, option=_OPTIONS)
    except orjson.JSONEncodeError:  # what orjson refuses (a lone surrogate a server streamed, a 65-bit integer)
        return (_escaped(row) + "\n").encode()


def journal_dir(db_path: Path) -> Path:
    return db_path.with_name(db_path.name + ".journal")


def journal_path(db_path: Path, run_id: int) -> Path:
    return journal_dir(db_path) / f"run-{run_id}.jsonl"


def sweep_journal_path(db_path: Path, sweep_id: int) -> Path:
    """A load sweep's journal: its requests' rows (engine.store.request_rows)."""
    return journal_dir(db_path) / f"sweep-{sweep_id}.jsonl"


def request_key(row: dict) -> tuple:
    """What names a request within its sweep."""
    return row["level"], row["idx"], bool(row["warmup"])


class Journal:
    """The live side file of one run, locked for as long as it is open."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        # created and locked under a name recovery does not look at, then renamed: a file visible
        # under its final name is always locked, so no recovery can take it for a dead run's
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        self._file = open(temporary, "wb")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(temporary, path)
        except BaseException:
            self._file.close()
            temporary.unlink(missing_ok=True)
            raise

    def write(self, kind: str, row: dict) -> None:
        self._file.write(_line({"record": kind, **row}))

    def flush(self) -> None:
        self._file.flush()

    def close(self, remove: bool = False) -> None:
        """Release the lock; with remove, the rows are in the database and the file goes."""
        if remove:
            self.path.unlink(missing_ok=True)
        self._file.close()


def owner_gone(path: Path) -> bool:
    """True when no live process holds the file's lock."""
    try:
        with open(path, encoding="utf-8") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(f, fcntl.LOCK_UN)
        return True
    except BlockingIOError:
        return False


@contextmanager
def claimed(path: Path):
    """The rows of a journal whose owner is gone (as read gives them), its lock held by this process
    until the block ends, when the file is removed; None when a live process holds it or it is gone
    (another recovery took it first). The block's rows are then this process's alone to fold."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        yield None
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            same = os.fstat(f.fileno()).st_ino == os.stat(path).st_ino  # not removed while we opened it
        except (BlockingIOError, FileNotFoundError):
            same = False
        if not same:
            yield None
            return
        yield _rows(f)
        path.unlink(missing_ok=True)


def read(path: Path) -> dict:
    """{"run": header, "steps": [...], "tokens": [...], "text": streamed text, "finish": record or None}, and a load
    sweep's journal's "requests" too. A last line cut short by a kill (even within a character) is ignored."""
    with open(path, "rb") as f:
        return _rows(f)


def _rows(lines) -> dict:
    out = {"run": {}, "steps": [], "tokens": [], "text": "", "finish": None}
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:  # a line cut short: not JSON, or not UTF-8 where it ends within a character
            break
        kind = row.pop("record")
        if kind == "step":
            out["text"] += row.pop("text", "")
            out["steps"].append(row)
        elif kind == "token":
            out["tokens"].append(row)
        elif kind in ("run", "finish"):
            out[kind] = row
        elif kind == "request":  # a load sweep's journal (engine.store.request_rows)
            out.setdefault("requests", []).append(row)
    return out
