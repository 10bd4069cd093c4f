"""What the benchmarks share: the prompt, decode rates that resist a shared machine's spikes, a ratio of two
settings with its 95% interval over the rounds, and the result file each benchmark writes (bench/results/<name>.md, stamped with date, machine, command, commit)."""
import contextlib
import io
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

from engine.measure.compare import compare
from engine.run.generate import Generation, GenConfig
from engine.measure.hardware import cpu_facts
from engine.paths import REPO_ROOT, RESULTS

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def lockstep(runs: dict, calibration) -> dict:
    """Run every (model, GenConfig) of `runs` with the generations advanced one token each in turn,
    so that a burst of load on a shared machine slows them all alike (alternating whole runs leaves
    each to its own stretch of luck). Returns, per key, the finished Generation and the time spent
    inside it for each token (its step, selection and bookkeeping; the first includes the prefill)."""
    gens = {k: Generation(lm, cfg, calibration=calibration, telemetry=False) for k, (lm, cfg) in runs.items()}
    token_ms = in_turn({k: iter(g) for k, g in gens.items()})
    return {k: (gens[k], token_ms[k]) for k in gens}


def in_turn(iterators: dict) -> dict[str, list[float]]:
    """Advance every iterator one item each in turn until all are exhausted; the milliseconds each
    item took, per key (None ends an iterator, as a Generation's end does)."""
    running = dict(iterators)
    token_ms = {k: [] for k in iterators}
    while running:
        for k in list(running):
            start = time.perf_counter()
            if next(running[k], None) is None:
                del running[k]
            else:
                token_ms[k].append((time.perf_counter() - start) * 1e3)
    return token_ms


def lockstep_rates(variants: dict, calibration, n: int, rounds: int) -> tuple[dict, dict]:
    """Decode tokens/s of every variant's greedy generation of n tokens, from the median decode
    token, over rounds of lockstep() (each round starting from the next variant). Returns the rates
    per round and the decode steps of the last round, per variant."""
    keys = list(variants)
    rates = {k: [] for k in keys}
    steps = {}
    for i in range(rounds):
        order = keys[i % len(keys):] + keys[: i % len(keys)]
        done = lockstep({k: (variants[k], GenConfig(PROMPT, max_new_tokens=n, ignore_eos=True)) for k in order},
                        calibration)
        for k, (gen, token_ms) in done.items():
            rates[k].append(1e3 / statistics.median(token_ms[1:]))  # the first token came with the prefill
            steps[k] = [s for s in gen.steps if s["kind"] == "decode"]
    return rates, steps


def ratio(baseline: list[float], candidate: list[float]) -> str:
    """candidate / baseline over the rounds (speeds, one per round; higher is better): the ratio of their
    geometric means with its 95% interval and what it supports, "no measurable difference" where the interval
    includes 1 (engine.measure.compare, as every page says it)."""
    return compare(baseline, candidate).text().replace(" repeats)", " rounds)")


class _Tee(io.TextIOBase):
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self):
        for stream in self.streams:
            stream.flush()


def _commit() -> str:
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + (" (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else "")


@contextlib.contextmanager
def recorded(name: str):
    """Print as usual, and write everything printed to bench/results/<name>.md when the block ends."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(_Tee(sys.stdout, buffer)):
        yield
    cpu = cpu_facts()
    stamp = [f"# bench/{name}.py", "",
             f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- machine: {cpu['model']}, {cpu['physical_cores']} physical / {cpu['logical_cores']} logical cores, "
             f"{cpu['ram_bytes'] / 2**30:.0f} GiB; load average {os.getloadavg()[0]:.1f} at the end",
             f"- OpenMP threads between regions: {cpu['openmp_wait']}",
             f"- command: `python {' '.join(sys.argv)}`",
             f"- commit: {_commit()}", "", "```"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.md").write_text("\n".join(stamp) + "\n" + buffer.getvalue().rstrip() + "\n```\n")
