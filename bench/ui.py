"""What the page costs: the same greedy generation streamed through the Live generation page in a
real browser (Debian's Chromium) and run from the command line, alternating in one run. Compares
decode tokens/s (1000 / TPOT) of the recorded runs. The page runs once per round for each choice of
"Draw the tokens while they stream" given with --redraw (by default the page's default, every 2
seconds, and at the end only): drawn against not drawn isolates what the drawing costs from what
differs between the page's generation process (engine/run/worker.py) and a fresh command-line process.

By default the page is loaded once and each run is a new click on Generate, as a person at the page
would do. With --reload every run starts from a fresh load of the page: the browser then collects the
previous page's JavaScript heap while the first tokens are generated, which the figure includes.

    .venv/bin/python bench/ui.py [--rounds 3] [--tokens 64] [--reload] [--redraw "every second" ...]

With --first-click it measures instead what a person meets who starts the app as `make run` does
(python -m engine.access, which starts the warm start with the server), opens the Live page
--open-after-s seconds later and clicks Generate --read-s seconds after that or, if later, once the page
says Ready (the first token after the model is ready), on a fresh database: the
time from the server's start to the page's "Ready", and from the click to the first token (the run's
start plus its TTFT), each with the load average. The warm start reuses a recent calibration of this
device from the machine's calibration cache, or with --empty-cache finds none and measures one after
loading the model.
"""
import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timezone
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parent.parent
from browser import browser_page, serve_app
from common import recorded
from engine.paths import CACHE_ENV
from engine.measure import hardware
from engine.model.loader import pick_device
from engine.store.db import Store

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
    if not page.get_by_label("Max new tokens").is_visible():
        page.get_by_text("More settings", exact=True).click()
    page.get_by_label("Max new tokens").fill(str(tokens))
    page.get_by_role("combobox", name="Draw the tokens while they stream").click()
    page.get_by_role("option", name=redraw, exact=True).click()
    caption = page.get_by_text(re.compile(r"^Run #\d+, stopped by"))  # drawn when a run has ended
    previous = caption.first.inner_text() if caption.count() else None
    page.evaluate(WATCH_RUN_END, [previous, timeout_s * 1000])
    page.get_by_role("button", name="Generate").click()
    page.evaluate("() => window.__runEnded")
    new = store.runs(1000)
    return int(new[~new["run_id"].isin(before)]["run_id"].iloc[0])


def from_cli(db, store, tokens):
    subprocess.run([sys.executable, "-m", "engine", "generate", "--prompt", PROMPT, "--max-new-tokens", str(tokens),
                    "--json", "--db", str(db)], cwd=ROOT, capture_output=True, text=True, check=True)
    return int(store.runs(1)["run_id"].iloc[0])


class PageCpu:
    """CPU seconds used by the page's side, Chromium's processes and the Streamlit server (not the
    generation worker, not the command line, not Playwright's driver), summed over processes and
    sampled every 0.1 s in a thread (about 0.5 ms of CPU a sample). Needs no steady machine: it
    counts work, where tokens/s drift with everything else the host runs."""

    def __init__(self, every_s: float = 0.1):
        self.samples = []  # (wall-clock seconds, CPU seconds so far)
        self._last = {}  # pid -> its CPU seconds at the previous sample
        self._total = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(every_s,), daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @staticmethod
    def _page_side(proc) -> bool:
        cmdline = " ".join(proc.cmdline())
        return "chrom" in proc.name() or ("streamlit" in cmdline and "engine.run.worker" not in cmdline)

    def _sample(self, every_s: float) -> None:
        procs, found_at = [], 0.0
        while not self._stop.wait(every_s):
            if time.monotonic() - found_at > 2.0:  # Chromium starts and ends helper processes
                procs = [p for p in psutil.Process().children(recursive=True) if self._safe(self._page_side, p)]
                found_at = time.monotonic()
            for p in procs:
                cpu = self._safe(lambda p: sum(p.cpu_times()[:2]), p)
                if cpu is not None:
                    self._total += max(cpu - self._last.get(p.pid, cpu), 0.0)
                    self._last[p.pid] = cpu
            self.samples.append((time.time(), self._total))

    @staticmethod
    def _safe(read, proc):
        try:
            return read(proc)
        except psutil.Error:
            return None

    def during(self, start: float, end: float) -> float:
        """CPU seconds between two wall-clock times, interpolated between samples."""
        times = [t for t, _ in self.samples]
        totals = [c for _, c in self.samples]
        return float(np.interp(end, times, totals) - np.interp(start, times, totals))


def decode_window(store, run_id: int) -> tuple[float, float]:
    """Wall-clock seconds from the run's first token to its last: its decode."""
    started = store.run(run_id)["started_at"].replace(tzinfo=timezone.utc).timestamp()
    t_ms = store.tokens(run_id)["t_ms"]
    return started + t_ms.min() / 1e3, started + t_ms.max() / 1e3


def median_interval(values: list[float], resamples: int = 2000) -> tuple[float, float]:
    """A 90% bootstrap interval for the median: how far the machine's noise leaves the figure open."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[resamples // 20], medians[-resamples // 20 - 1]


def launched(port: int) -> list[str]:
    """The server as `make run` starts it."""
    return [sys.executable, "-m", "engine.access", "--host", "127.0.0.1", "--port", str(port)]


STATUS = re.compile(r"^(Loading the default model|Calibrating this device|Ready)")
READY = re.compile(r"^Ready\W")


def first_click(tokens: int, open_after_s: float, read_s: float, empty_cache: bool) -> None:
    """The first Live run of a freshly started app on a fresh database: server start to "Ready" and click to
    first token, printed with the load average and whether the machine's calibration cache held a
    calibration of this device the warm start could reuse."""
    db = Path(tempfile.mkdtemp()) / "first-click.duckdb"
    store = Store(db)
    env = {CACHE_ENV: tempfile.mkdtemp()} if empty_cache else {}
    cached = not empty_cache and hardware.reused_calibration(pick_device("auto")) is not None
    print(f"load average at the start: {os.getloadavg()[0]:.1f}; the machine's calibration cache "
          + ("holds a recent calibration of this device" if cached else "holds none it reuses (the warm start calibrates)"))
    started = time.time()
    with serve_app(db, env=env, command=launched) as url, browser_page() as page:
        page.set_default_timeout(600_000)  # a busy machine
        time.sleep(max(0.0, open_after_s - (time.time() - started)))
        opened = time.time()
        page.goto(url + "/live")
        page.get_by_label("Prompt text").fill(PROMPT)
        status = page.get_by_text(STATUS)
        status.first.wait_for()
        on_opening = status.first.inner_text()
        page.get_by_text(READY).wait_for()
        ready = time.time()
        when = "already when the page opened" if READY.match(on_opening) else \
            f"shown {ready - started:.1f} s after the server start"
        print(f"server started; page opened {opened - started:.1f} s later, saying: {on_opening}")
        print(f"Ready {when} (load average {os.getloadavg()[0]:.1f})")
        page.get_by_text("More settings", exact=True).click()
        page.get_by_label("Max new tokens").fill(str(tokens))
        time.sleep(max(0.0, read_s - (time.time() - opened)))
        said = status.first.inner_text()
        load_at_click = os.getloadavg()[0]
        clicked = time.time()
        page.get_by_role("button", name="Generate").click()
        page.get_by_text(re.compile(r"^Generating: [1-9]\d* of at most")).wait_for()  # drawn with the first token
        shown = time.time()
        page.get_by_text(re.compile(r"^Run #\d+, stopped by")).wait_for()
    run = store.runs(1).iloc[0]
    run_started = run["started_at"].replace(tzinfo=timezone.utc).timestamp()
    first_token = run_started + run["ttft_ms"] / 1e3
    print(f"first Live run, clicked {clicked - opened:.1f} s after the page opened ({clicked - started:.1f} s after the "
          f"server start; load average {load_at_click:.1f}): {first_token - clicked:.2f} s from the click to the first "
          f"token: {run_started - clicked:.2f} s to the run's start, then TTFT {run['ttft_ms']:.0f} ms; "
          f"load average at the end {os.getloadavg()[0]:.1f}")
    print(f"the first token shown on the page {shown - clicked:.2f} s after the click")
    print(f"at the click the page said: {said}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reload", action="store_true", help="load the page afresh before every run")
    parser.add_argument("--redraw", action="append", choices=REDRAWS,
                        help="a choice of 'Draw the tokens while they stream' to run (repeatable); "
                             "default: every 2 seconds and at the end only")
    parser.add_argument("--first-click", action="store_true",
                        help="time the first Live run's click to first token on a freshly started app")
    parser.add_argument("--open-after-s", type=float, default=15.0,
                        help="with --first-click: seconds from the server's start to opening the page")
    parser.add_argument("--read-s", type=float, default=10.0,
                        help="with --first-click: seconds from opening the page to the click (at the "
                             "earliest: the click waits for the page's Ready)")
    parser.add_argument("--empty-cache", action="store_true",
                        help="with --first-click: start from an empty calibration cache, as on a machine never "
                             "calibrated (the warm start then measures one after loading the model)")
    args = parser.parse_args()
    if args.first_click:
        return first_click(args.tokens, args.open_after_s, args.read_s, args.empty_cache)
    redraws = args.redraw or ["every 2 seconds", NOT_DRAWN]
    db = Path(tempfile.mkdtemp()) / "ui.duckdb"
    store = Store(db)
    runs = {f"page, {how}": (lambda how=how: through_page(page, url, store, args.tokens, args.reload, how))
            for how in redraws}
    runs["command line"] = lambda: from_cli(db, store, args.tokens)
    rates = {name: [] for name in runs}
    page_cpu = {name: [] for name in runs}  # ms of the page side's CPU per second of decode
    with serve_app(db) as url, browser_page() as page, PageCpu() as cpu:
        through_page(page, url, store, 4, args.reload, redraws[0])  # the first page run starts the worker
        names = list(runs)
        for i in range(args.rounds):
            for name in names[i % len(names):] + names[:i % len(names)]:
                run_id = runs[name]()
                rates[name].append(1e3 / store.run(run_id)["tpot_ms"])
                time.sleep(0.3)  # a sample after the decode's end
                start, end = decode_window(store, run_id)
                page_cpu[name].append(1e3 * cpu.during(start, end) / (end - start))
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
    print("CPU of the page's side (Chromium's processes and the Streamlit server) during each run's decode, "
          "ms per second of decode (psutil, every 0.1 s); with the command line the page sat idle:")
    for name, ms in page_cpu.items():
        print(f"{name + ':':<31} median {statistics.median(ms):.0f} ms/s (runs {min(ms):.0f}-{max(ms):.0f})")


if __name__ == "__main__":
    with recorded("ui-first-click" if "--first-click" in sys.argv else "ui"):
        main()
