"""How long the Story page's "Run the whole story" takes: every chapter's runs, in order, through one
generation worker (the page's path), then the capacity chapter's search in its own process, on a fresh
database. The first play pays once for what a fresh database and worker lack (the calibration, the quantized
variants, the sparsity thresholds); the second play, in the same worker, is what a presenter meets on re-running
the story. Each chapter runs its arms' repeats interleaved (engine.report.story.REPEATS, A B A B), and after each
play every lever is set against its baseline as the page does: the ratio of their decode speeds over that play's
repeats with its 95% interval (bench/common.py ratio). Writes bench/results/story.md.

    .venv/bin/python bench/story.py [--plays 2]
"""
import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from common import ratio, recorded  # first: the engine sets OpenMP's wait policy before torch loads
from engine.report import story
from engine.report import story_capacity
from engine.run.worker import GenerationWorker
from engine.store.db import Store


def play(worker: GenerationWorker, db: str) -> list[tuple[str, float, dict]]:
    """Every story run in order: (tag, seconds from request to done, the run's summary or, for the capacity
    chapter, the search's)."""
    rows = []
    for chapter in story.CHAPTERS:
        for spec in story.chapter_specs(chapter):
            start = time.monotonic()
            for kind, payload in worker.generate({"db": db, "spec": spec.to_dict()}, every_s=60):
                if kind == "done":
                    rows.append((spec.tag, time.monotonic() - start, payload["result"]))
    start = time.monotonic()
    found = story_capacity.measure(db)
    rows.append(("story:capacity", time.monotonic() - start, found))
    return rows


def capacity(found: dict) -> str:
    """The capacity search's capacity in requests/s."""
    rate = found["capacity_requests_per_s"]
    return f"{rate:.3g} req/s" if rate is not None else "none found"


def comparisons(db: str) -> list[str]:
    """Every lever against its baseline over the latest play's repeats (engine.report.story.arm_rates): the arms'
    decode tokens/s (every user's together; the geometric means the ratio divides) and the ratio with its interval."""
    store = Store(db, read_only=True)
    lines = []
    for chapter in story.CHAPTERS:
        for comparison in chapter.comparisons:
            baseline = comparison.baseline
            base = story.arm_rates(store, story.tag(chapter, baseline), baseline.users)
            for lever in comparison.levers:
                rates = story.arm_rates(store, story.tag(chapter, lever), lever.users)
                against = ratio(base, rates) if base and rates else "no decode speed to compare"
                speeds = (f"{statistics.geometric_mean(rates):.1f} against {statistics.geometric_mean(base):.1f} "
                          "decode tok/s" if base and rates else "")
                lines.append(f"- {chapter.key}: {lever.label} against {baseline.label}: {speeds}, {against}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plays", type=int, default=2)
    args = parser.parse_args()
    if args.plays < 1:
        parser.error("--plays must be at least 1")
    db = str(Path(tempfile.mkdtemp()) / "story.duckdb")
    worker = GenerationWorker()  # its process ends with this one
    plays = []
    for _ in range(args.plays):
        start = time.monotonic()
        rows = play(worker, db)
        plays.append((rows, time.monotonic() - start, comparisons(db)))
    print(f"The whole story ({story.NEW_TOKENS} new tokens a run, {story.REPEATS} interleaved repeats of each arm, "
          f"default model) through one worker on a fresh database; load average {os.getloadavg()[0]:.1f} at the end."
          "\n")
    print("| run | " + " | ".join(f"play {i + 1} s" for i in range(len(plays))) + " |")
    print("| --- |" + " ---: |" * len(plays))
    for i, (tag, _, _) in enumerate(plays[0][0]):
        print(f"| {tag} | " + " | ".join(f"{rows[i][1]:.1f}" for rows, _, _ in plays) + " |")
    print("| **whole story** | " + " | ".join(f"**{total:.1f}**" for _, total, _ in plays) + " |")
    for i, (rows, _, lines) in enumerate(plays):
        print(f"\nplay {i + 1}: capacity chapter {capacity(rows[-1][2])}; each lever against its baseline over the "
              f"play's {story.REPEATS} repeats per arm (95% interval; \"no measurable difference\" where it "
              "includes 1):")
        print("\n".join(lines))


if __name__ == "__main__":
    with recorded("story"):
        main()
