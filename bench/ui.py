"""What the page costs: the same greedy generation streamed through the Live generation page in a
real browser (Debian's Chromium) and run from the command line, alternating in one run. Compares
decode tokens/s (1000 / TPOT) of the recorded runs. The page runs once per round for each choice of
"Draw the tokens while they stream" given with --redraw (by default the page's default, every 2
seconds, and at the end only): drawn against not drawn isolates what the drawing costs from what
differs between the page's generation process (engine/worker.py) and a fresh command-line process.

By default the page is loaded once and each run is a new click on Generate, as a person at the page
would do. With --reload every run starts from a fresh load of the page: the browser then collects the
previous page's JavaScript heap while the first tokens are generated, which the figure includes.

    .venv/bin/python bench/ui.py [--rounds 3] [--tokens 64] [--reload] [--redraw "every second" ...]
"""
import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from browser import browser_page, serve_app  # noqa: E402
from engine.store import Store  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
REDRAWS = ["every second", "every 2 seconds", "every 5 seconds", "at the end only"]  # the page's choices
NOT_DRAWN = REDRAWS[-1]


# Resolves once the page shows a run-ended caption other than the one it showed before: a
# MutationObserver inside the page checks on each change of the page and costs nothing in between.
# Polling from here (Playwright's own waits poll every frame; a query every half second) cost the
# browser and its driver about 0.8 s of CPU in a 9 s run, time a person looking at the page never spends.
WATCH_RUN_END = """([previous, timeoutMs]) => { window.__runEnded = new Promise((resolve, reject) => {
    const ended = () => [...document.querySelectorAll('[data-testid=stCaptionContainer]')]
        .some(e => /^Run #\\d+, stopped by/.test(e.innerText) && e.innerText !== previous);
    const observer = new MutationObserver(() => { if (ended()) { observer.disconnect(); resolve(true); } });
    observer.observe(document.body, {childList: true, subtree: true, characterData: true});
    setTimeout(() => { observer.disconnect(); reject(new Error('the run did not end in time')); }, timeoutMs);
}); }"""


def through_page(page, url, store, tokens, reload, redraw, timeout_s: float = 300):
    before = set(store.runs(1000)["run_id"])
    if reload or not page.url.endswith("/live"):
        page.goto(url + "/live")
    page.get_by_label("Prompt text").fill(PROMPT)
    page.get_by_label("Max new tokens").fill(str(tokens))
    page.get_by_role("combobox", name="Draw the tokens while they stream").click()
    page.get_by_role("option", name=redraw, exact=True).click()
    caption = page.get_by_text(re.compile(r"^Run #\d+, stopped by"))  # drawn when a run has ended
    previous = caption.first.inner_text() if caption.count() else None
    page.evaluate(WATCH_RUN_END, [previous, timeout_s * 1000])
    page.get_by_role("button", name="Generate").click()
    page.evaluate("() => window.__runEnded")
    new = store.runs(1000)
    row = new[~new["run_id"].isin(before)].iloc[0]
    return 1e3 / row["tpot_ms"]


def from_cli(db, tokens):
    out = subprocess.run([sys.executable, "-m", "engine", "generate", "--prompt", PROMPT, "--max-new-tokens",
                          str(tokens), "--json", "--db", str(db)], cwd=ROOT, capture_output=True, text=True, check=True)
    return 1e3 / json.loads(out.stdout)["tpot_ms"]


def median_interval(values: list[float], resamples: int = 2000) -> tuple[float, float]:
    """A 90% bootstrap interval for the median: how far the machine's noise leaves the figure open."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[resamples // 20], medians[-resamples // 20 - 1]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reload", action="store_true", help="load the page afresh before every run")
    parser.add_argument("--redraw", action="append", choices=REDRAWS,
                        help="a choice of 'Draw the tokens while they stream' to run (repeatable); "
                             "default: every 2 seconds and at the end only")
    args = parser.parse_args()
    redraws = args.redraw or ["every 2 seconds", NOT_DRAWN]
    db = Path(tempfile.mkdtemp()) / "ui.duckdb"
    store = Store(db)
    runs = {f"page, {how}": (lambda how=how: through_page(page, url, store, args.tokens, args.reload, how))
            for how in redraws}
    runs["command line"] = lambda: from_cli(db, args.tokens)
    rates = {name: [] for name in runs}
    with serve_app(db) as url, browser_page() as page:
        through_page(page, url, store, 4, args.reload, redraws[0])  # the first page run starts the worker
        names = list(runs)
        for i in range(args.rounds):
            for name in names[i % len(names):] + names[:i % len(names)]:
                rates[name].append(runs[name]())
    how = "the page loaded afresh for every run" if args.reload else "the page loaded once, Generate clicked per run"
    print(f"greedy fp32, up to {args.tokens} new tokens, {args.rounds} rounds rotating, browser open throughout; {how}")
    for name, r in rates.items():
        print(f"{name + ':':<31} median {statistics.median(r):.2f} decode tok/s ({', '.join(f'{x:.2f}' for x in r)})")
    # each round's own ratio: the machine's speed drifts between rounds more than within one
    pairs = [(f"page, {how} / command line", f"page, {how}", "command line",
              "the page costs" if how != NOT_DRAWN else None) for how in redraws]
    if NOT_DRAWN in redraws:
        pairs += [(f"{how} / at the end only", f"page, {how}", f"page, {NOT_DRAWN}", "the drawing costs")
                  for how in redraws if how != NOT_DRAWN]
    for what, a, b, cost in pairs:
        ratios = [x / y for x, y in zip(rates[a], rates[b])]
        middle = statistics.median(ratios)
        low, high = median_interval(ratios)
        note = f" ({cost} {1 - middle:.1%})" if cost else ""
        print(f"{what + ':':<46} median of rounds {middle:.3f}{note}, 90% interval {low:.3f}-{high:.3f}; "
              f"rounds {', '.join(f'{r:.2f}' for r in ratios)}")


if __name__ == "__main__":
    main()
