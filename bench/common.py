"""What the benchmarks share: the prompt, decode rates that resist a shared machine's spikes, a ratio of two
settings with its 95% interval over the rounds, and the result file each benchmark writes (bench/results/<name>.md,
stamped with date, machine, memory bandwidth, command, commit)."""
import contextlib
import io
import os
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from engine.measure.compare import compare
from engine.run.generate import Generation, GenConfig
from engine.measure.hardware import cpu_facts, measure_stream_bandwidth
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


def _stream_gbps() -> float:
    import torch  # here, not above: the engine sets OpenMP's wait before torch first loads

    return measure_stream_bandwidth(torch.device("cpu"))


@contextlib.contextmanager
def recorded(name: str):
    """Print as usual, and write everything printed to bench/results/<name>.md when the block ends."""
    buffer = io.StringIO()
    start_gbps, commit = _stream_gbps(), _commit()  # the code that runs is the one there as it starts
    with contextlib.redirect_stdout(_Tee(sys.stdout, buffer)):
        yield
    cpu = cpu_facts()
    stamp = [f"# bench/{name}.py", "",
             f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- machine: {cpu['model']}, {cpu['physical_cores']} physical / {cpu['logical_cores']} logical cores, "
             f"{cpu['ram_bytes'] / 2**30:.0f} GiB; load average {os.getloadavg()[0]:.1f} at the end",
             f"- OpenMP threads between regions: {cpu['openmp_wait']}; freed memory: {cpu['freed_memory']}; "
             f"pages: {cpu['huge_pages']}",
             f"- memory: a streaming read of 1 GiB ran at {start_gbps:.1f} GB/s at the start and {_stream_gbps():.1f} "
             "at the end (the load average does not show other machines on the host drawing on the same memory)",
             f"- command: `python {' '.join(sys.argv)}`",
             f"- commit: {commit}", "", "```"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.md").write_text("\n".join(stamp) + "\n" + buffer.getvalue().rstrip() + "\n```\n")


def local_target(cfg, store, max_batch: int = 8, weights: str = "fp32", prefix_cache_bytes: int | None = None,
                 kv_dtype: str = "auto"):
    """The local continuous-batching engine (the default model at `weights`, its caches in `kv_dtype`, keeping
    prompts for reuse in prefix_cache_bytes where given) as a load sweep's target, as `python -m engine load
    --local` makes it: every request a recorded run in `store`."""
    from engine.run.load_target import LocalTarget

    return LocalTarget.load(cfg, store, weights=weights, max_batch=max_batch, prefix_cache_bytes=prefix_cache_bytes,
                            kv_dtype=kv_dtype)


def highest_holding(levels: list, holds, again) -> object | None:
    """The last of `levels` (in rising load) before the first that does not hold, a level that fails counting as
    failing only when `again(level)`, the same level measured once more, fails too: one noisy measurement does not
    end the search early, and a level that truly fails costs one more measurement. None when the first fails."""
    best = None
    for level in levels:
        if not holds(level) and not holds(again(level)):
            break
        best = level
    return best


def error_pct(planned: float | None, measured: float | None) -> str:
    """The planned figure's error against the measured one, in percent of the measured ('-' where either is missing)."""
    if planned is None or not measured:
        return "-"
    return f"{(planned - measured) / measured:+.0%}"


@contextlib.contextmanager
def llama_cpp_server(gguf, threads: int, timeout_s: float = 300.0):
    """llama-cpp-python's OpenAI-compatible server on the GGUF, in its own process on 127.0.0.1: its URL while
    the block runs (a new request does not cancel the running one), stopped after it."""
    from engine.serve.vllm import HOST, free_port

    port = free_port()
    url, log = f"http://{HOST}:{port}", Path(f"/tmp/tokenpath-llama-cpp-{port}.log")
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", HOST,
                                    "--port", str(port), "--n_threads", str(threads), "--n_threads_batch",
                                    str(threads), "--interrupt_requests", "False"],
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    try:
        while not _lists_models(url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama.cpp's server did not start (log {log}): {log.read_text()[-300:]}")
            time.sleep(1.0)
        yield url
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=30)


def _lists_models(url: str) -> bool:
    import httpx2

    try:
        return httpx2.get(f"{url}/v1/models", timeout=2.0).status_code == 200
    except httpx2.HTTPError:
        return False


def idle_cpu_share(pid: int, seconds: float = 3.0) -> float:
    """The cores' worth of CPU a server's process and its children take over `seconds` with no request in flight
    (a server that polls while idle takes that from whatever shares the machine with it)."""
    import psutil

    def cpu_s() -> float:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        return sum(sum(p.cpu_times()[:2]) for p in procs)
    before = cpu_s()
    time.sleep(seconds)
    return (cpu_s() - before) / seconds
