"""Helpers for real-browser tests: serve the app on a free localhost port, drive Debian's Chromium."""
import contextlib
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from engine import launch

REPO = Path(__file__).resolve().parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_app(db_path: Path, timeout_s: float = 90, env: dict | None = None, command=None):
    """The app on a free loopback port, started by the launcher the environment names (engine.launch), if any;
    `command(port)` gives another way to start it, as [python, ARGS...] (env is added)."""
    port = free_port()
    env = dict(os.environ, TOKENPATH_DB=str(db_path), **(env or {}))
    argv = command(port)[1:] if command else ["-m", "streamlit", "run", "app.py", "--server.address", "127.0.0.1",
                                              "--server.port", str(port), "--server.headless", "true"]
    proc = launch.start_python(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if urllib.request.urlopen(url + "/_stcore/health", timeout=2).read() == b"ok":
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("streamlit did not start: " + (proc.stdout.read() or "")[-2000:])
                time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextlib.contextmanager
def browser_page(width=1400, height=1000, args=()):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[*CHROMIUM_ARGS, *args])
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            yield page
        finally:
            browser.close()


def open_offline(page, path: Path, figures: int, timeout_ms: int = 120_000) -> tuple[list, list]:
    """Open a file with every request but the file itself refused; wait for `figures` Plotly figures.
    Returns (the refused request URLs, the page's script errors)."""
    attempted, errors = [], []

    def refuse_the_network(route):
        if route.request.url.startswith("file://"):
            return route.continue_()
        attempted.append(route.request.url)
        return route.abort()

    page.route("**/*", refuse_the_network)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(path.as_uri())
    page.wait_for_function(f"document.querySelectorAll('.js-plotly-plot .main-svg').length >= {figures}",
                           timeout=timeout_ms)
    return attempted, errors
