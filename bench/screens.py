"""Screenshots of every page at 1400 and 1024 px wide, after a set of runs a presenter would have made:
the story, a sweep, a served run and a load sweep (against tests/stream_server.py, a small real
OpenAI-style server), in a fresh database. They go to bench/screens/ (not committed), to look at.

    .venv/bin/python bench/screens.py [--out bench/screens] [--tokens 8] [--skip-runs DB] [--quick] [--pages a,b]

--quick replaces the story and the sweep by one local run from the command line (a busy machine); --pages shoots
only the pages named (file stems, 'home' for the home page). A page taller than the window is shot whole: the
window grows to the page's height for its picture.
"""
import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from browser import browser_page, free_port, serve_app  # noqa: E402
from playwright.sync_api import TimeoutError as PlaywrightTimeout  # noqa: E402
from ui import PAGES  # noqa: E402

WIDTHS = (1400, 1024)
HEIGHT = 2600  # tall enough that most pages fit in one picture (Streamlit scrolls inside its own element)


def engine(*args: str, db: Path) -> None:
    subprocess.run([sys.executable, "-m", "engine", *args, "--db", str(db)], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)


def served_runs(db: Path, tokens: int) -> None:
    """One served run and one load sweep against a small real streaming server."""
    port = free_port()
    server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "stream_server.py"), str(port), "ok", "0.02"])
    try:
        time.sleep(1.5)
        url = f"http://127.0.0.1:{port}"
        engine("generate", "--endpoint", url, "--prompt", "Why does decoding wait on memory?",
               "--max-new-tokens", str(tokens), db=db)
        engine("load", "--endpoint", url, "--concurrency", "1,2,4", "--requests", "4", "--max-new-tokens",
               str(tokens), db=db)
    finally:
        server.terminate()
        server.wait()


def page_runs(url: str, tokens: int) -> None:
    """The story and a sweep, played through their pages as a presenter would."""
    with browser_page(1400, 1200) as page:
        page.set_default_timeout(600_000)  # a busy machine draws a page slowly
        page.goto(url + "/sweeps")
        page.get_by_label("New tokens per run").fill(str(tokens))
        page.get_by_role("button", name="Run the sweep").click()
        page.get_by_text("bound by").first.wait_for(timeout=1_200_000)
        page.goto(url + "/story")
        page.get_by_role("button", name="Run the whole story").click()
        page.get_by_text("runs in").first.wait_for(timeout=1_800_000)


# no element still waits for its code to load, every chart has drawn its picture and every table its grid
DRAWN = """() => !document.querySelector('[data-testid^=stSkeleton], [data-testid=stSkeleton]')
    && [...document.querySelectorAll('[data-testid=stPlotlyChart]')].every(c => c.querySelector('.main-svg'))
    && [...document.querySelectorAll('[data-testid=stDataFrame]')].every(d => d.querySelector('canvas'))"""
MAIN_HEIGHT = "() => document.querySelector('[data-testid=stMain]').scrollHeight"
TALLEST = 16000  # px: a picture Chromium still takes


IDLE = "[data-testid=stApp][data-test-script-state=notRunning]"  # the page's script has ended


def settle(page) -> None:
    """Wait until the page's script has ended and its charts and tables have drawn: no element waits for its
    code, and the page no longer grows. A page that never settles, such as one redrawn every second, is shot
    after three minutes."""
    page.wait_for_selector("h1", timeout=600_000)  # the page's title: its script has run this far
    height, deadline = -1, time.monotonic() + 180
    while time.monotonic() < deadline:
        page.wait_for_selector(IDLE, timeout=600_000)
        try:
            page.wait_for_function(DRAWN, timeout=120_000)
        except PlaywrightTimeout:
            pass
        time.sleep(3)  # Plotly lays out after Streamlit has drawn
        now = page.evaluate(MAIN_HEIGHT)
        if now == height and page.query_selector(IDLE):
            return
        height = now


def shoot(url: str, out: Path, stems: set[str] | None = None) -> list[Path]:
    taken = []
    for width in WIDTHS:
        with browser_page(width, HEIGHT) as page:
            page.set_default_timeout(600_000)  # a busy machine draws slowly; a picture late is still a picture
            for path, label, _ in PAGES:
                stem = "" if path == "app.py" else Path(path).stem
                if stems and (stem or "home") not in stems:
                    continue
                page.set_viewport_size({"width": width, "height": HEIGHT})
                page.goto(f"{url}/{stem}")
                settle(page)
                height = page.evaluate(MAIN_HEIGHT)
                if height > HEIGHT:  # Streamlit scrolls inside its own element: the window grows to hold it all
                    page.set_viewport_size({"width": width, "height": min(height, TALLEST)})
                    settle(page)
                name = out / f"{width}-{stem or 'home'}.png"
                page.screenshot(path=str(name))
                taken.append(name)
    return taken


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "screens")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--skip-runs", type=Path, help="an existing database to show, instead of making the runs")
    parser.add_argument("--quick", action="store_true", help="one local run instead of the story and the sweep")
    parser.add_argument("--pages", help="only these pages, comma-separated file stems ('home' for the home page)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    db = args.skip_runs or Path(tempfile.mkdtemp()) / "screens.duckdb"
    if not args.skip_runs:
        served_runs(db, args.tokens)
        if args.quick:
            engine("generate", "--prompt", "Why does decoding wait on memory?", "--max-new-tokens", str(args.tokens),
                   db=db)
    with serve_app(db, timeout_s=300) as url:
        if not args.skip_runs and not args.quick:
            page_runs(url, args.tokens)
        for name in shoot(url, args.out, set(args.pages.split(",")) if args.pages else None):
            print(name)
    print(f"database: {db}")


if __name__ == "__main__":
    main()
