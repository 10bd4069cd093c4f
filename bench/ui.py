"""What the page costs: the same greedy generation streamed through the Live generation page in a
real browser (Debian's Chromium) and run from the command line, alternating in one run. Compares
decode tokens/s (1000 / TPOT) of the recorded runs. Each round also runs the page with "Draw the
tokens while they stream" off, in the same server process: live against quiet isolates what the
drawing costs from what differs between the server process and a fresh command-line process (on
a noisy machine the latter alone has ranged 0.81-1.03).

By default the page is loaded once and each run is a new click on Generate, as a person at the page
would do. With --reload every run starts from a fresh load of the page: the browser then collects the
previous page's JavaScript heap while the first tokens are generated, which the figure includes.

    .venv/bin/python bench/ui.py [--rounds 3] [--tokens 64] [--reload]
"""
import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from browser import browser_page, serve_app  # noqa: E402
from engine.store import Store  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def wait_until(check, what: str, timeout_s: float = 300) -> None:
    """Poll every half second from here: Playwright's own waiting polls the page every frame, and
    a database query runs on every core; either would take CPU time from the run being measured."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen in {timeout_s:.0f} s")
        time.sleep(0.5)


def through_page(page, url, store, tokens, reload, quiet):
    before = set(store.runs(1000)["run_id"])
    if reload or not page.url.endswith("/live"):
        page.goto(url + "/live")
    page.get_by_label("Prompt text").fill(PROMPT)
    page.get_by_label("Max new tokens").fill(str(tokens))
    page.get_by_role("checkbox", name="Draw the tokens while they stream").set_checked(not quiet, force=True)
    caption = page.get_by_text(re.compile(r"^Run #\d+, stopped by"))  # drawn when a run has ended
    previous = caption.first.inner_text() if caption.count() else None
    page.get_by_role("button", name="Generate").click()
    wait_until(lambda: caption.count() > 0 and caption.first.inner_text() != previous, "the run's result")
    new = store.runs(1000)
    row = new[~new["run_id"].isin(before)].iloc[0]
    return 1e3 / row["tpot_ms"]


def from_cli(db, tokens):
    out = subprocess.run([sys.executable, "-m", "engine", "generate", "--prompt", PROMPT, "--max-new-tokens",
                          str(tokens), "--json", "--db", str(db)], cwd=ROOT, capture_output=True, text=True, check=True)
    return 1e3 / json.loads(out.stdout)["tpot_ms"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reload", action="store_true", help="load the page afresh before every run")
    args = parser.parse_args()
    db = Path(tempfile.mkdtemp()) / "ui.duckdb"
    store = Store(db)
    rates = {"page, drawn while streaming": [], "page, drawing off": [], "command line": []}
    runs = {"page, drawn while streaming": lambda: through_page(page, url, store, args.tokens, args.reload, False),
            "page, drawing off": lambda: through_page(page, url, store, args.tokens, args.reload, True),
            "command line": lambda: from_cli(db, args.tokens)}
    with serve_app(db) as url, browser_page() as page:
        through_page(page, url, store, 4, args.reload, False)  # the first page run loads the model into the server
        names = list(runs)
        for i in range(args.rounds):
            for name in names[i % 3:] + names[:i % 3]:
                rates[name].append(runs[name]())
    how = "the page loaded afresh for every run" if args.reload else "the page loaded once, Generate clicked per run"
    print(f"greedy fp32, up to {args.tokens} new tokens, {args.rounds} rounds rotating, browser open throughout; {how}")
    medians = {name: statistics.median(r) for name, r in rates.items()}
    for name, r in rates.items():
        print(f"{name + ':':<29} median {medians[name]:.2f} decode tok/s ({', '.join(f'{x:.2f}' for x in r)})")
    live, quiet, cli = medians.values()
    print(f"page drawn while streaming / command line: {live / cli:.3f} (the page costs {1 - live / cli:.1%})")
    print(f"page with drawing off / command line:      {quiet / cli:.3f}")
    print(f"drawn / drawing off, same server process:  {live / quiet:.3f} (the drawing costs {1 - live / quiet:.1%})")


if __name__ == "__main__":
    main()
