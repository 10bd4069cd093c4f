"""vLLM's CPU build on this machine under open-loop arrivals: a short profiling probe (a few requests at
two batch sizes), a measured sweep over request rates with goodput at an SLO, and a capacity search;
writes bench/results/capacity.md.

python bench/capacity.py [--rates 0.25,0.5,1,2] [--requests 8] [--input-tokens 64] [--output-tokens 32]
                         [--slo ttft_ms=3000,tpot_ms=300] [--duration 16] [--dtype float32] [--threads 1]"""
import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from engine.cli.serving import level_table
from engine.measure import hardware
from engine.measure.slo import format_slo, parse_slo
from engine.paths import REPO_ROOT
from engine.serve import capacity
from engine.serve.arrivals import parse_rates
from engine.serve.load import Sweep, SweepConfig
from engine.serve.vllm import VLLMServer
from engine.store.db import Store


def config(args, url: str, **levels) -> SweepConfig:
    return SweepConfig(url, requests=args.requests, input_tokens=args.input_tokens, output_tokens=args.output_tokens,
                       slo=parse_slo(args.slo), seed=1, poll_s=0.5, **levels)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rates", default="0.25,0.5,1,2")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--input-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--slo", default="ttft_ms=3000,tpot_ms=300")
    p.add_argument("--duration", type=float, default=16.0, help="seconds of arrivals per capacity level")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    store = Store(Path(tempfile.mkdtemp(prefix="tokenpath-bench-")) / "capacity.duckdb")
    server = VLLMServer(dtype=args.dtype, threads=args.threads)
    t0 = time.monotonic()
    try:
        url = server.start()
        start_s = time.monotonic() - t0
        probe = Sweep(config(args, url, concurrency=[1, 4], warmup=1), store).run()
        t1 = time.monotonic()
        sweep = Sweep(config(args, url, rates=parse_rates(args.rates)), store).run()
        sweep_s = time.monotonic() - t1
        t2 = time.monotonic()
        cfg = config(args, url, rates=[parse_rates(args.rates)[1]], duration_s=args.duration)
        found = capacity.search(Sweep(cfg, store), attainment=0.9, start_rate=cfg.rates[0], steps=2)
        search_s = time.monotonic() - t2
    finally:
        server.stop()
    text = report(args, start_s, probe, sweep, sweep_s, found, search_s)
    out = REPO_ROOT / "bench" / "results" / "capacity.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text(text)
    print(text)


def report(args, start_s, probe, sweep, sweep_s, found, search_s) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=REPO_ROOT).stdout.strip()
    cpu = hardware.cpu_facts()
    lines = [
        "# Capacity: vLLM's CPU build under open-loop arrivals", "",
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; commit {commit}",
        f"- machine: {cpu['model']}, {cpu['logical_cores']} logical cores, {cpu['ram_bytes'] / 2**30:.0f} GiB RAM, "
        f"{platform.system()} {platform.release()}; load average {os.getloadavg()[0]:.1f} as the report was written; "
        "the cores are shared with other work, so every figure is slower and noisier than on a quiet machine",
        f"- command: `python bench/capacity.py {' '.join(sys.argv[1:])}`",
        f"- vLLM {args.dtype}, {args.threads} OpenMP thread(s), started in {start_s:.0f} s; synthetic prompts of "
        f"{args.input_tokens} tokens, {args.output_tokens} output tokens (ignore_eos); SLO {format_slo(parse_slo(args.slo))}",
        "", "## Profiling probe: 1 and 4 requests in flight", "", "```", level_table(probe["levels"]), "```", "",
        f"## Measured sweep: Poisson arrivals, {args.requests} requests per rate ({sweep_s:.0f} s)", "",
        "```", level_table(sweep["levels"]), "```", "",
        f"## Capacity search: bracket, then 2 bisections, {args.duration:g} s of arrivals per level ({search_s:.0f} s)",
        "", "```", level_table(found["levels"]), "```", "", capacity.describe(found), "",
        "## Planned beside measured", "",
        "Not here yet: the planner's queueing simulation is not part of this copy, so its prediction for these rates "
        "is not printed beside the measured sweep.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
