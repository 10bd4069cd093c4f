"""How long the Story page's "Run the whole story" takes: every chapter's runs, in order, through one
generation worker (the page's path), then the capacity chapter's search in its own process, on a fresh
database. The first play pays once for what a fresh database and worker lack (the calibration, the quantized
variants, the sparsity thresholds); the second play, in the same worker, is what a presenter meets on re-running
the story. Writes bench/results/story.md.

    .venv/bin/python bench/story.py [--plays 2]
"""
import argparse
import os
import tempfile
import time
from pathlib import Path

from common import recorded
from engine.report import story
from engine.report import story_capacity
from engine.run.worker import GenerationWorker


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


def figure(result: dict) -> str:
    """A run's decode tokens/s, or the capacity search's capacity in requests/s."""
    if "decode_tokens_per_s" in result:
        return f"{result['decode_tokens_per_s']:.1f}"
    found = result["capacity_requests_per_s"]
    return f"({found:.3g})" if found is not None else "(none found)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plays", type=int, default=2)
    args = parser.parse_args()
    db = str(Path(tempfile.mkdtemp()) / "story.duckdb")
    worker = GenerationWorker()  # its process ends with this one
    plays = []
    for _ in range(args.plays):
        start = time.monotonic()
        plays.append((play(worker, db), time.monotonic() - start))
    print(f"The whole story ({story.NEW_TOKENS} new tokens a run, default model) through one worker on a fresh "
          f"database; load average {os.getloadavg()[0]:.1f} at the end.\n")
    header = " | ".join(f"play {i + 1} s | play {i + 1} decode tok/s (capacity req/s)" for i in range(len(plays)))
    print(f"| run | {header} |")
    print("| --- |" + " ---: |" * 2 * len(plays))
    for i, (tag, _, _) in enumerate(plays[0][0]):
        cells = " | ".join(f"{rows[i][1]:.1f} | {figure(rows[i][2])}" for rows, _ in plays)
        print(f"| {tag} | {cells} |")
    totals = " | ".join(f"**{total:.1f}** | " for _, total in plays)
    print(f"| **whole story** | {totals}")


if __name__ == "__main__":
    with recorded("story"):
        main()
