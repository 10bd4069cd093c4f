"""A load sweep started from the dashboard: `python -m engine load ...` in a process of its own, its progress
file and error log in a folder under one parent in the temp directory. Each start first removes the folders
of sweeps whose process is gone (it ended, was killed, or its page was closed before it saw the end), so no
sweep leaves its folder behind for long, however it ends."""
from __future__ import annotations

import getpass
import json
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from engine import launch
from engine.store.recovery import process_alive

# an ended sweep's page reads its last progress and error line within a second or two; a folder is kept
# this long after its process is gone, so the page that started it still finds them
GRACE_S = 60.0
OWNER = "owner.json"


def jobs_root() -> Path:
    """The one folder every dashboard-started sweep's folder lives under (one per user of the machine)."""
    return Path(tempfile.gettempdir()) / f"tokenpath-load-{getpass.getuser()}"


@dataclass
class LoadJob:
    process: subprocess.Popen | launch.ForkedProcess
    folder: Path

    @property
    def progress(self) -> Path:
        return self.folder / "progress.json"

    @property
    def log(self) -> Path:
        return self.folder / "progress.log"

    def state(self) -> dict:
        """The sweep's last progress (requests done and in all, its id and status once known)."""
        try:
            return json.loads(self.progress.read_text())
        except (OSError, ValueError):  # not written yet, or already pruned
            return {"done": 0, "total": 1, "eta_s": None}

    def error(self) -> str | None:
        """The sentence the sweep ended with when it failed (its last line on stderr), else None."""
        if self.process.poll() in (0, None):
            return None
        try:
            lines = self.log.read_text().strip().splitlines()
        except OSError:
            return None
        return lines[-1].removeprefix("error: ") if lines else None

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def start(arguments: list[str], db: str | Path) -> LoadJob:
    """`python -m engine load ARGUMENTS --db DB` in its own process, writing progress into a fresh folder."""
    prune()
    root = jobs_root()
    root.mkdir(mode=0o700, exist_ok=True)
    folder = Path(tempfile.mkdtemp(dir=root))
    command = ["-m", "engine", "load", *arguments, "--db", str(db), "--progress", str(folder / "progress.json"),
               "--json"]
    with open(folder / "progress.log", "w") as log:
        process = launch.start_python(command, stdout=subprocess.DEVNULL, stderr=log)
    try:
        started = psutil.Process(process.pid).create_time()
    except psutil.NoSuchProcess:  # ended already: the folder is pruned as a dead sweep's
        started = None
    (folder / OWNER).write_text(json.dumps({"pid": process.pid, "pid_started": started}))
    return LoadJob(process, folder)


def _age_s(folder: Path) -> float:
    """Seconds since anything in the folder last changed."""
    times = [p.stat().st_mtime for p in (folder, *folder.iterdir())]
    return time.time() - max(times)


def _running(folder: Path) -> bool:
    try:
        owner = json.loads((folder / OWNER).read_text())
    except (OSError, ValueError):
        return False
    return process_alive(owner.get("pid"), owner.get("pid_started"))


def prune(grace_s: float | None = None) -> list[Path]:
    """Remove the folders of sweeps whose process is gone and that have not changed for grace_s (GRACE_S);
    returns those removed."""
    grace_s = GRACE_S if grace_s is None else grace_s
    root = jobs_root()
    if not root.is_dir():
        return []
    removed = []
    for folder in root.iterdir():
        try:
            if folder.is_dir() and not _running(folder) and _age_s(folder) >= grace_s:
                shutil.rmtree(folder)
                removed.append(folder)
        except OSError:  # pruned by another session at the same moment, or not ours to remove
            continue
    return removed
