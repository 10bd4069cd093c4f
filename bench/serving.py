"""The same prompts through the local engine and through vLLM on this machine, the client's TTFT and
ITL against vLLM's own histograms for the same requests, and a load sweep; writes bench/results/serving.md.

python bench/serving.py [--tokens 32] [--levels 1,2,4,8] [--requests 8] [--dtype float32] [--threads 1]"""
import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

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


def local_runs(lm, calibration, tokens: int) -> dict:
    """Each workload greedy through the local engine, before vLLM starts: an idle vLLM's OpenMP thread
    still takes a core, which would slow the local engine's two threads."""
    shipped = workloads()
    return {name: Generation(lm, GenConfig(shipped[name]["prompt"], max_new_tokens=tokens), calibration=calibration,
                             telemetry=False).run() for name in WORKLOADS}


def compare_runs(url: str, local_results: dict, store, tokens: int) -> list[dict]:
    """Each workload greedy through vLLM beside the local result; vLLM's figures are for that request alone."""
    rows = []
    shipped = workloads()
    for name in WORKLOADS:
        prompt, local = shipped[name]["prompt"], local_results[name]
        run = open_run(RunSpec(gen=GenConfig(prompt, max_new_tokens=tokens), backend="served", endpoint=url), store)
        for _ in run:
            pass
        r, srv = run.result, run.result["server"] or {}
        client_itl = sum(r["itl_ms"]) / len(r["itl_ms"]) if r["itl_ms"] else None
        server_itl = srv["itl_ms"] / srv["itl_count"] if srv.get("itl_count") else None
        rows.append({"workload": name, "same tokens": local["token_ids"] == r["token_ids"],
                     "n": r["n_new_tokens"], "local TTFT": local["ttft_ms"], "local TPOT": local["tpot_ms"],
                     "served TTFT": r["ttft_ms"], "served TPOT": r["tpot_ms"], "server TTFT": srv.get("ttft_ms"),
                     "client ITL": client_itl, "server ITL": server_itl, "rtt": r["rtt_ms"],
                     "queue": srv.get("queue_ms"), "prefill": srv.get("prefill_ms")})
    return rows


def fmt(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def report(args, rows, sweep, seconds, start_s) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=REPO_ROOT).stdout.strip()
    cpu = hardware.cpu_facts()
    lines = [
        "# Serving: the local engine against vLLM's CPU build, and vLLM under load", "",
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; commit {commit}",
        f"- machine: {cpu['model']}, {cpu['logical_cores']} logical cores, {cpu['ram_bytes'] / 2**30:.0f} GiB RAM, "
        f"{platform.system()} {platform.release()}; load average {os.getloadavg()[0]:.1f} as the report was written",
        f"- command: `python bench/serving.py {' '.join(sys.argv[1:])}`",
        f"- vLLM {args.dtype}, {args.threads} OpenMP thread(s), started in {start_s:.0f} s; local engine fp32; "
        f"greedy, {args.tokens} new tokens; the local runs before vLLM started; the machine's cores are shared "
        "with other work", "",
        "## Same prompts, both engines (ms)", "",
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
    p.add_argument("--levels", default="1,2,4,8")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    store = Store(Path(tempfile.mkdtemp(prefix="tokenpath-bench-")) / "serving.duckdb")
    lm = load_model()
    calibration = hardware.calibration_for(lm.device, store)
    local = local_runs(lm, calibration, args.tokens)
    server = VLLMServer(dtype=args.dtype, threads=args.threads)
    t0 = time.monotonic()
    try:
        url = server.start()
        start_s = time.monotonic() - t0
        rows = compare_runs(url, local, store, args.tokens)
        t1 = time.monotonic()
        sweep = Sweep(SweepConfig(url, parse_concurrency(args.levels), args.requests, args.tokens,
                                  load_prompts(None)), store).run()
        seconds = time.monotonic() - t1
    finally:
        server.stop()
    text = report(args, rows, sweep, seconds, start_s)
    out = REPO_ROOT / "bench" / "results" / "serving.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
