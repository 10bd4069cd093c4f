"""A load sweep started as the Serving page starts one (engine.serve.jobs): a real `python -m engine load`
process per sweep, its folder under one parent in the temp directory. A sweep still running keeps its folder;
one that ended unseen (its page closed), was stopped, or was killed with SIGKILL loses it at the next start."""
import json
import os
import signal
import tempfile
import time

from engine.serve import jobs
from engine.serve import records as served_store
from engine.store.db import Store

from test_page_serving import slow_stream_url  # noqa: F401  (the small streaming server)


def long_sweep(url: str) -> list[str]:
    return ["--endpoint", url, "--concurrency", "1", "--requests", "1000", "--max-new-tokens", "12"]


def wait_for_a_request(job, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while job.state()["done"] < 1:
        assert job.process.poll() is None and time.monotonic() < deadline, job.log.read_text()
        time.sleep(0.2)


def test_a_sweep_folder_goes_however_the_sweep_ends(tmp_path, monkeypatch, slow_stream_url):  # noqa: F811
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the temp directory, for this test alone
    db, url = tmp_path / "runs.duckdb", slow_stream_url
    short = ["--endpoint", url, "--concurrency", "1", "--requests", "1", "--max-new-tokens", "2"]
    ended = jobs.start(short, db)  # its page closed before it saw the end
    running, killed = jobs.start(long_sweep(url), db), jobs.start(long_sweep(url), db)
    try:
        assert ended.process.wait(timeout=300) == 0, ended.log.read_text()
        for job in (running, killed):
            wait_for_a_request(job)
        killed.process.send_signal(signal.SIGKILL)
        assert killed.process.wait(timeout=60) == -signal.SIGKILL
        folders = [job.folder for job in (ended, running, killed)]
        assert all(f.parent == jobs.jobs_root() and f.is_dir() for f in folders)
        # just ended: kept a while, so a page that polls each second still reads its last progress and error
        assert jobs.prune() == [] and all(f.is_dir() for f in folders)
        monkeypatch.setattr(jobs, "GRACE_S", 0.0)
        last = jobs.start(short, db)
        assert [f.is_dir() for f in folders] == [False, True, False]  # the next start pruned every dead one
        assert last.process.wait(timeout=300) == 0 and json.loads(last.progress.read_text())["status"] == "ok"
        running.process.terminate()  # the page's Stop
        assert running.process.wait(timeout=60) == 0
        assert set(jobs.prune()) == {running.folder, last.folder} and not list(jobs.jobs_root().iterdir())
    finally:
        for job in (running, killed):
            if job.process.poll() is None:
                job.process.kill()
    status = served_store.sweeps(Store(db)).set_index("pid")["status"]
    assert status[killed.process.pid] == "interrupted" and status[running.process.pid] == "stopped"
    assert not os.path.exists(killed.progress)
