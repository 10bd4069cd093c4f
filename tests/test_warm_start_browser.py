"""The warm start begins with the server (`make run`, `make share`: engine.access), not with the first page
view, and the pages then use the generation process it started."""
import os
import re
import sys
import time

import psutil
import pytest

from browser import CHROMIUM, browser_page, serve_app
from engine.store.db import Store

needs_chromium = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is not installed")


def launched(port: int) -> list[str]:
    """The server as `make run` starts it."""
    return [sys.executable, "-m", "engine.access", "--host", "127.0.0.1", "--port", str(port)]


def workers_of_server(port: int) -> list[int]:
    """The process ids of the generation processes the server listening on `port` started."""
    servers = [p for p in psutil.Process().children(recursive=True)
               if f"--server.port {port}" in " ".join(p.cmdline())]
    assert len(servers) == 1, servers
    return [p.pid for p in servers[0].children() if "engine.run.worker" in p.cmdline()]


@needs_chromium
def test_the_server_start_loads_the_model_before_any_page_opens_and_the_live_page_runs_in_that_process(
        tiny_folder, tmp_path):
    db = tmp_path / "warm.duckdb"
    # no launcher (engine.launch): the server starts its generation process itself, as `make run` does
    env = {"TOKENPATH_WARM": "1", "TOKENPATH_MODEL": str(tiny_folder), "TOKENPATH_LAUNCHER": ""}
    with serve_app(db, env=env, command=launched) as url:
        port = int(url.rsplit(":", 1)[1])
        for _ in range(120):  # no page has been opened: only the server's start can have started it
            started = workers_of_server(port)
            if started:
                break
            time.sleep(0.5)
        assert len(started) == 1
        with browser_page() as page:
            page.set_default_timeout(180_000)
            page.goto(url + "/live")
            page.get_by_text(re.compile(r"^Ready\W+the default model is loaded in the generation process")).wait_for()
            page.get_by_label("Prompt text").fill("Once upon a time")
            page.get_by_text("More settings", exact=True).click()
            page.get_by_label("Max new tokens").fill("4")
            page.get_by_role("button", name="Generate").click()
            page.get_by_text(re.compile(r"^Run #\d+, stopped by")).wait_for()
            page.screenshot(path=str(tmp_path / "live-after-warm-start.png"), full_page=True)
        assert workers_of_server(port) == started  # the page's run went to the process the server started
    runs = Store(db).runs(10)
    assert list(runs["status"]) == ["ok"]
