"""The same prompts through the local engine and through vLLM on this machine, the client's TTFT and
ITL against vLLM's own histograms for the same requests, and a load sweep; writes bench/results/serving.md.

vLLM starts once (its idle CPU use is printed); then each round runs every workload through the local engine and
through vLLM in turn, the order alternating from round to round (A B, B A), so a drift of the shared machine falls
on both; each run starts once vLLM's threads have stopped spinning after the last request. vLLM against the local engine is the ratio of their speeds over the rounds (decode: one over the time per
output token; first token: one over the time to it) with its 95% interval (bench/common.py ratio).

python bench/serving.py [--tokens 32] [--rounds 3] [--levels 1,2,4,8] [--requests 8] [--dtype float32] [--threads 1]"""
import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from common import idle_cpu_share, ratio  # first: the engine sets OpenMP's wait policy before torch loads
from engine.measure import hardware
from engine.run.generate import Generation, GenConfig
from engine.run.open import open_run
from engine.spec import RunSpec
from engine.serve.load import Sweep, SweepConfig, load_prompts, parse_concurrency
from engine.paths import workloads
from engine.model.loader import load_model
from engine.paths import REPO_ROOT
from engine.cli.serving import level_table
from engine.store.db import Store
from engine.serve.vllm import VLLMServer

WORKLOADS = ("passage question", "summary", "code edit")


def local_run(lm, calibration, prompt: str, tokens: int) -> dict:
    """The prompt greedy through the local engine: its result."""
    return Generation(lm, GenConfig(prompt, max_new_tokens=tokens), calibration=calibration, telemetry=False).run()


def served_run(url: str, prompt: str, store, tokens: int) -> dict:
    """The prompt greedy through vLLM: the run's result, vLLM's figures for that request alone under "server"."""
    run = open_run(RunSpec(gen=GenConfig(prompt, max_new_tokens=tokens), backend="served", endpoint=url), store)
    for _ in run:
        pass
    return run.result


# after a request the server's threads may still spin for a while, taking a core from whatever runs next
SETTLED_CORES = 0.1
SETTLE_MAX_S = 15.0


def settle(pid: int) -> float:
    """Wait until the server takes under SETTLED_CORES over half a second (at most SETTLE_MAX_S); the seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < SETTLE_MAX_S and idle_cpu_share(pid, 0.5) > SETTLED_CORES:
        pass
    return time.monotonic() - start


def both_rounds(lm, calibration, url: str, pid: int, store, tokens: int, rounds: int) -> tuple[dict, list[float]]:
    """{workload: [(local result, served result) per round]}, the two engines in turn, the order alternating, each
    run started once the server has settled; and the seconds each settling took."""
    shipped = workloads()
    pairs, waits = {name: [] for name in WORKLOADS}, []
    for r in range(rounds):
        for name in WORKLOADS:
            prompt = shipped[name]["prompt"]
            runs = {"local": lambda: local_run(lm, calibration, prompt, tokens),
                    "served": lambda: served_run(url, prompt, store, tokens)}
            done = {}
            for k in ("local", "served") if r % 2 == 0 else ("served", "local"):
                waits.append(settle(pid))
                done[k] = runs[k]()
            pairs[name].append((done["local"], done["served"]))
    return pairs, waits


def median(values) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def per_second(ms_values) -> list[float]:
    """Speeds (one a second) of times in ms: what the ratio compares, higher being better."""
    return [1e3 / v for v in ms_values if v]


def workload_row(name: str, pairs: list[tuple[dict, dict]]) -> dict:
    """The workload's figures, medians over the rounds, and vLLM's speeds against the local engine's."""
    local, served = [p[0] for p in pairs], [p[1] for p in pairs]
    servers = [r["server"] or {} for r in served]
    client_itl = [sum(r["itl_ms"]) / len(r["itl_ms"]) if r["itl_ms"] else None for r in served]
    server_itl = [s["itl_ms"] / s["itl_count"] if s.get("itl_count") else None for s in servers]
    return {"workload": name, "same tokens": all(a["token_ids"] == b["token_ids"] for a, b in pairs),
            "n": served[-1]["n_new_tokens"], "local TTFT": median(r["ttft_ms"] for r in local),
            "local TPOT": median(r["tpot_ms"] for r in local), "served TTFT": median(r["ttft_ms"] for r in served),
            "served TPOT": median(r["tpot_ms"] for r in served),
            "server TTFT": median(s.get("ttft_ms") for s in servers),
            "client ITL": median(client_itl), "server ITL": median(server_itl),
            "rtt": median(r["rtt_ms"] for r in served),
            "decode": ratio(per_second(r["tpot_ms"] for r in local), per_second(r["tpot_ms"] for r in served)),
            "first token": ratio(per_second(r["ttft_ms"] for r in local), per_second(r["ttft_ms"] for r in served))}


def fmt(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def report(args, rows, sweep, seconds, start_s, idle, waits) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=REPO_ROOT).stdout.strip()
    cpu = hardware.cpu_facts()
    lines = [
        "# Serving: the local engine against vLLM's CPU build, and vLLM under load", "",
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; commit {commit}",
        f"- machine: {cpu['model']}, {cpu['logical_cores']} logical cores, {cpu['ram_bytes'] / 2**30:.0f} GiB RAM, "
        f"{platform.system()} {platform.release()}; load average {os.getloadavg()[0]:.1f} as the report was written",
        f"- command: `python bench/serving.py {' '.join(sys.argv[1:])}`",
        f"- vLLM {args.dtype}, {args.threads} OpenMP thread(s), started in {start_s:.0f} s, taking {idle:.2f} cores "
        f"while idle (so while the local engine runs); local engine fp32; greedy, {args.tokens} new tokens; "
        f"{args.rounds} rounds, each workload through both engines in turn, the order alternating, each run started "
        f"once vLLM took under {SETTLED_CORES} cores over half a second (waits of {min(waits):.1f}-{max(waits):.1f} s); "
        "the machine's cores are shared with other work", "",
        "## Same prompts, both engines (ms, medians over the rounds)", "",
        "| workload | same tokens | tokens | local TTFT | local TPOT | served TTFT | served TPOT | vLLM TTFT | "
        "client ITL mean | vLLM ITL mean | ITL diff | TTFT diff | round trip |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        itl_diff = r["client ITL"] - r["server ITL"] if r["client ITL"] and r["server ITL"] else None
        ttft_diff = r["served TTFT"] - r["server TTFT"] if r["server TTFT"] else None
        lines.append(f"| {r['workload']} | {'yes' if r['same tokens'] else 'no'} | {r['n']} | {fmt(r['local TTFT'])} | "
                     f"{fmt(r['local TPOT'])} | {fmt(r['served TTFT'])} | {fmt(r['served TPOT'])} | "
                     f"{fmt(r['server TTFT'])} | {fmt(r['client ITL'], '.2f')} | {fmt(r['server ITL'], '.2f')} | "
                     f"{fmt(itl_diff, '+.2f')} | {fmt(ttft_diff, '+.1f')} | {fmt(r['rtt'], '.2f')} |")
    lines += ["", "vLLM against the local engine over the rounds (speeds: one over the time per output token, one over "
              "the time to the first token; 95% interval, \"no measurable difference\" where it includes 1):", ""]
    lines += [f"- {r['workload']}: decode {r['decode']}; first token {r['first token']}" for r in rows]
    lines += ["", "TTFT diff: the client's TTFT less vLLM's `vllm:time_to_first_token_seconds` for the same request "
              "(HTTP, request parsing, tokenising the prompt and the network). ITL diff: the client's mean gap between "
              "chunks less vLLM's `vllm:inter_token_latency_seconds` mean (sum / count), what streaming each chunk "
              "to the client costs.", "", f"## Load sweep ({args.requests} requests per level, {args.tokens} new "
              f"tokens, {seconds:.0f} s)", "", "```", level_table(sweep["levels"]), "```", "",
              "| concurrency | client TTFT mean | vLLM TTFT mean | client ITL mean | vLLM ITL mean | vLLM queue mean |",
              "|---|---|---|---|---|---|"]
    for lv in sweep["levels"]:
        s = lv["server"] or {}
        mean = lambda k: s[f"{k}_ms"] / s[f"{k}_count"] if s.get(f"{k}_count") else None  # noqa: E731
        lines.append(f"| {lv['concurrency']} | {fmt(lv['ttft_ms']['mean'])} | {fmt(mean('ttft'))} | "
                     f"{fmt(lv['itl_ms']['mean'], '.2f')} | {fmt(mean('itl'), '.2f')} | {fmt(mean('queue'), '.2f')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="rounds of the workloads through both engines")
    p.add_argument("--levels", default="1,2,4,8")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    if args.rounds < 1 or args.tokens < 2:
        p.error("--rounds must be at least 1 and --tokens at least 2 (a time per output token needs two)")
    store = Store(Path(tempfile.mkdtemp(prefix="tokenpath-bench-")) / "serving.duckdb")
    lm = load_model()
    calibration = hardware.calibration_for(lm.device, store)
    server = VLLMServer(dtype=args.dtype, threads=args.threads)
    t0 = time.monotonic()
    try:
        url = server.start()
        start_s = time.monotonic() - t0
        idle = idle_cpu_share(server.process.pid)
        pairs, waits = both_rounds(lm, calibration, url, server.process.pid, store, args.tokens, args.rounds)
        rows = [workload_row(name, pairs[name]) for name in WORKLOADS]
        t1 = time.monotonic()
        sweep = Sweep(SweepConfig(url, parse_concurrency(args.levels), args.requests, args.tokens,
                                  load_prompts(None)), store).run()
        seconds = time.monotonic() - t1
    finally:
        server.stop()
    text = report(args, rows, sweep, seconds, start_s, idle, waits)
    out = REPO_ROOT / "bench" / "results" / "serving.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
