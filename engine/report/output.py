"""The files commands write for the user (a report, a trace): whole or not at all, never over the database they
read or its side files, and never replacing something that is not a file (/dev/stdout, a pipe, a device), which is
written to as it is."""
from __future__ import annotations

import contextlib
from pathlib import Path

from engine.errors import UserError
from engine.store.db import lock_path
from engine.store.journal import journal_dir


class OutputError(UserError):
    """The --out path cannot take the file; one sentence."""


def write_output(path: str | Path, text: str, db_path: str | Path) -> None:
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{path} is a folder: give --out a file name.")
    if not path.parent.is_dir():
        raise OutputError(f"The folder {path.parent} does not exist: create it or choose another --out.")
    db = Path(db_path).resolve()
    side_files = (db.with_name(db.name + ".wal"), lock_path(db))
    if path.resolve() in (db, *side_files) or path.resolve().parent == journal_dir(db):
        raise OutputError(f"{path} is the database this command reads (or one of its side files): choose another --out.")
    special = path.exists() and not path.is_file()
    partial = path if special else path.with_name(path.name + ".partial")
    try:
        partial.write_text(text, encoding="utf-8")
        if not special:
            partial.replace(path)
    except OSError as exc:
        if not special:
            with contextlib.suppress(OSError):  # a folder of that name, say: nothing of ours to remove
                partial.unlink(missing_ok=True)
        raise OutputError(f"Cannot write {path}: {exc.strerror}; choose another --out.") from None
