"""Batching: aggregate decode tokens/s of B identical requests decoded together against one alone, at fp32, at the
fastest level alone (int4-dyn) and at the level whose products batch best (int8-dyn, on AMX tiles where the CPU
has them), and one sequence through the batch engine against the plain decode loop, in lockstep.

Each round measures every (level, batch) once, the order rotating from round to round, so a burst of load on
a shared machine does not favour one of them. A batch's decode rate is B tokens over the median step once every
sequence is past its prefill; per user it is one token over that step. On a machine shared with other work a
step's wall time is mostly waiting for a core, so each step's CPU time (the process's, both threads) is printed
beside it: tokens per CPU second compare the work a token costs at each batch. The single-sequence check advances the
plain loop (engine.run.generate) and a one-user batch engine one token each in turn (bench/common.py's in_turn)
and compares their median decode tokens. Each level's steps are also fitted with a line in the batch, a fixed part
and a part per sequence, printed beside the weights' trip at the calibrated bandwidth: the gain that line allows at
eight sequences, and the per-sequence share four times would take.

Under load, the same identical request (the prompt, --tokens new tokens, greedy) goes out at each concurrency of
--load, --load-requests of them a level (at least the level's concurrency), through Tokenpath's own load tools
(engine.serve.load.Sweep): to the local engine in process at each level of --levels (its batch cap --load's largest
level, at most the engine's largest batch, beyond which requests wait in its queue), with --prefix-cache-mb also
keeping prompts for reuse as vLLM does by default and --kv-dtype keeping its caches in another precision (bf16, as
vLLM's CPU build keeps its own), and, with --peers, to vLLM's CPU build (started once, --threads OpenMP threads, the
local engine's batch cap as its --max-num-seqs) and llama.cpp's server (llama-cpp-python, `make peers`) on the same
model. For each, the highest concurrency whose p90 first token is within 1 s and p90 time per output token within
100 ms (every request finished), over --load-rounds rounds that alternate the peers: the last level before the first
that fails, where a level that fails is measured once more at once and counts as failing only when it fails again
(one noisy level, a spike of other work on the shared cores, does not end a runner's search early); the levels
beyond it are not measured.
Beside it, the most requests a second each finished at a level measured, as the FLOP rate of the model's forwards
that is, against this machine's calibrated rate of the arithmetic it multiplies with: how far from its compute roof
each engine runs near the most load it holds, which bounds how far apart the concurrencies they hold can be.
Writes bench/results/batching.md.

    .venv/bin/python bench/batching.py [--tokens 48] [--rounds 3] [--batches 1,2,4,8] [--levels fp32,int4-dyn]
        [--load 1,2,4,8,16] [--load-requests 16] [--load-rounds 1] [--peers vllm,llamacpp | --no-peers] [--threads 2]
        [--prefix-cache-mb 256] [--kv-dtype bf16]
"""
import argparse
import contextlib
import importlib.util
import statistics
import tempfile
import time
from pathlib import Path

from common import (PROMPT, highest_holding, idle_cpu_share, in_turn, llama_cpp_server,  # first: the engine sets
                    local_target, ratio, recorded)  # OpenMP's wait policy before torch loads
from engine.dtypes import KV_CHOICES
from engine.cli.serving import level_table
from engine.measure import hardware
from engine.measure.accounting import forward_work, model_shape
from engine.model.loader import default_gguf_path, load_model
from engine.run.batch import BatchEngine, BatchError, budget_bytes
from engine.run.generate import GenConfig, Generation, collector_spared
from engine.run.text import prompt_ids
from engine.serve.load import Sweep, SweepConfig
from engine.serve.vllm import VLLMError, VLLMServer, vllm_python
from engine.spec import MAX_BATCH
from engine.store.db import Store
from engine.switches.quant import quantize

TTFT_MS, TPOT_MS = 1000.0, 100.0  # the target under load, at the 90th percentile
PEERS = ("vllm", "llamacpp")
# the arithmetic each peer multiplies with, as the calibration names it: llama.cpp's Q4_1 is int4-dyn's (int4 weights
# in blocks of 32 with a scale and a minimum, the activations in int8 blocks)
PEER_ARITHMETIC = {"vLLM bf16": "bfloat16", "llama.cpp Q4_1": "int4-dyn"}


def request(n: int) -> GenConfig:
    return GenConfig(PROMPT, max_new_tokens=n, ignore_eos=True)


def decode_step_ms(lm, users: int, n: int, calibration) -> tuple[list[float], list[float]]:
    """The wall time and the process's CPU time (all its threads) of each step of `users` identical requests
    once all of them decode (no prefill in it), in ms; the cycle collector spared as the engine's run() spares it."""
    engine = BatchEngine(lm, max_batch=users, calibration=calibration)
    seqs = [engine.submit(request(n)) for _ in range(users)]
    wall, cpu = [], []
    with collector_spared():
        while True:
            all_decoding = all(s.phase == "decode" for s in seqs)
            start, start_cpu = time.perf_counter(), time.process_time()
            if not engine.step():
                return wall, cpu
            if all_decoding:
                wall.append((time.perf_counter() - start) * 1e3)
                cpu.append((time.process_time() - start_cpu) * 1e3)


def step_line(lm, batches: list[int], medians: list[float], calibration) -> str:
    """A step's cost as a line in the batch, fixed + per_sequence * B (least squares through the median steps), what
    that line allows batch 8 to gain over batch 1, and the weights' trip beside the fixed part: where the fixed
    part is the weights' trip and the per-sequence part is compute, the line is the ceiling batching has here."""
    per_sequence, fixed = statistics.linear_regression(batches, medians)
    weights = model_shape(lm.model).weight_bytes
    trip_ms = weights / (calibration["memory_gbps"] * 1e9) * 1e3
    most = 8 * (fixed + per_sequence) / (fixed + 8 * per_sequence)
    return (f"  a step: {fixed:.2f} ms + {per_sequence:.2f} ms a sequence (the line through the median steps of batches "
            f"{', '.join(map(str, batches))}); the weights' trip alone, {weights / 1e6:.0f} MB at the calibrated "
            f"{calibration['memory_gbps']:.1f} GB/s, is {trip_ms:.2f} ms; on that line 8 sequences decode "
            f"{most:.2f}x one sequence's tokens a second, and 4x would take a sequence's own share of a step below "
            f"{fixed / 6:.2f} ms")


def engine_tokens(lm, n: int, calibration):
    """A one-user batch engine as an iterator: one item per step, as a Generation yields one per token, the cycle
    collector spared as both spare it."""
    engine = BatchEngine(lm, max_batch=1, calibration=calibration)
    engine.submit(request(n))
    with collector_spared():
        while engine.step():
            yield True


def holds(level: dict) -> bool:
    """Every request of the level finished, p90 first token within TTFT_MS and p90 time per output token within
    TPOT_MS."""
    ttft, tpot = level["ttft_ms"]["p90"], level["tpot_ms"]["p90"]
    return (level.get("status", "ok") == "ok" and not level["failed"] and ttft is not None and tpot is not None
            and ttft <= TTFT_MS and tpot <= TPOT_MS)


def highest_load(levels, again) -> int:
    """The highest concurrency that holds the target, a failing level measured `again` before it counts as failing
    (bench/common.py highest_holding; levels may be measured as they are asked for); 0 where even the first level
    does not hold."""
    best = highest_holding(levels, holds, again)
    return best["concurrency"] if best else 0


def load_config(args, endpoint: str | None, concurrency: list[int] | None = None) -> SweepConfig:
    # a level below its concurrency in requests would never have that many in flight
    concurrency = concurrency or args.load
    return SweepConfig(endpoint, concurrency=concurrency, requests=max(args.load_requests, *concurrency),
                       prompts=[("story", PROMPT)], max_new_tokens=args.tokens, output_tokens=args.tokens, seed=1,
                       poll_s=0.5)


def search(args, store, name: str, url: str | None, target, notes: list[str]) -> tuple[int, list[dict]]:
    """The highest concurrency of --load the runner holds and the levels measured: each level swept on its own in
    rising order, a failing one once more at once (a line in `notes` says how it ended), the search ending at the
    first that fails again (the levels beyond it are not measured)."""
    measured = []

    def sweep(concurrency: int) -> dict:
        return Sweep(load_config(args, url, [concurrency]), store, target=target).run()["levels"][0]

    def levels():
        for concurrency in args.load:
            measured.append(sweep(concurrency))
            yield measured[-1]

    def again(level: dict) -> dict:
        measured[-1] = sweep(level["concurrency"])
        notes.append(f"{name}: concurrency {level['concurrency']} failed the target, measured again: "
                     f"{'held' if holds(measured[-1]) else 'failed again'}")
        return measured[-1]
    return highest_load(levels(), again), measured


def request_gflop(lm, prompt_tokens: int, output_tokens: int, reused: float = 0) -> float:
    """GFLOP of one request's forwards as the model's shapes count them (products and attention): the prompt's (less
    the `reused` tokens a prefix cache supplied), its head for the last position alone, then one a further output
    token over the cache it grows."""
    shape = model_shape(lm.model)
    flops = forward_work(shape, prompt_tokens - reused, reused).flops
    flops += sum(forward_work(shape, 1, prompt_tokens + i).flops for i in range(output_tokens - 1))
    return flops / 1e9


def arithmetic_peak(arithmetic: str, calibration: dict) -> tuple[str, float] | None:
    """(what was timed, GFLOP/s): this machine's calibrated rate for a runner's arithmetic, None where the calibration
    has none (an integer level without the project's kernels). Float matmuls are PyTorch's at their best shape; the
    integer levels' are one layer's products at the count of rows (of those timed) that ran fastest, its weights in
    the caches: neither counts the weights' trip from memory."""
    if arithmetic in calibration.get("matmul_gflops", {}):
        return f"{arithmetic} matmul", calibration["matmul_gflops"][arithmetic]
    if arithmetic in calibration.get("prefill_gflops", {}):
        rows, rate = max(calibration["prefill_gflops"][arithmetic].items(), key=lambda item: item[1])
        return f"{arithmetic} products at {rows} rows", rate
    return None


def at_most_line(levels: list[dict], gflop_of, arithmetic: str, calibration: dict) -> str:
    """The most requests a second a runner finished at any level it was measured at, the FLOP rate that is
    (gflop_of(reused): a request's GFLOP where its prefix cache supplied `reused` prompt tokens on average, as the
    runner counts them), and its share of the calibrated rate of the runner's arithmetic."""
    top = max(levels, key=lambda level: level["requests_per_s"] or 0)
    reused = (top.get("prefix_cache_hits") or 0) / max(top["completed"], 1)
    rate = (top["requests_per_s"] or 0) * gflop_of(reused)
    line = (f"at its most: {top['requests_per_s'] or 0:.2f} requests a second ({top['concurrency']} at once), "
            f"{rate:.0f} GFLOP/s of the model's forwards"
            + (f" (its prefix cache supplied {reused:.1f} tokens of a prompt)" if reused else ""))
    peak = arithmetic_peak(arithmetic, calibration)
    if peak is None:
        return f"{line}; no calibrated rate of {arithmetic} here to set it against"
    return f"{line}, {rate / peak[1]:.0%} of this machine's calibrated {peak[0]} ({peak[1]:.0f} GFLOP/s)"


def local_cap(args) -> int:
    """The local engine's batch cap under load: --load's largest level, at most the engine's largest batch."""
    return min(max(args.load), MAX_BATCH)


def peer_urls(args, stack: contextlib.ExitStack) -> dict:
    """{name: URL} of each requested peer that started (each started once, stopped when `stack` closes); a line
    says why for each that is not measured."""
    urls = {}
    # vLLM's CPU build caches prompts in whole blocks of 128 tokens by default, none of a shorter prompt: where the
    # local engine keeps prompts, vLLM is measured with 32-token blocks as well
    blocks = {"vLLM bf16": [], **({"vLLM bf16, 32-token blocks": ["--block-size", "32"]} if args.prefix_cache_bytes
                                  else {})}
    for name, extra in blocks.items() if "vllm" in args.peers else ():
        try:
            vllm_python()
            # the local engine's cap on the sequences a step takes, so that the two meet at the same most
            server = VLLMServer(dtype="bfloat16", threads=args.threads, extra_args=extra,
                                max_num_seqs=local_cap(args))
            t0 = time.monotonic()
            urls[name] = server.start()
            stack.callback(server.stop)
            print(f"{name}: vLLM's CPU build ({args.threads} OpenMP threads, --max-num-seqs {server.max_num_seqs}"
                  f"{', ' if extra else ''}{' '.join(extra)}) started in {time.monotonic() - t0:.0f} s; idle, it takes "
                  f"{idle_cpu_share(server.process.pid):.2f} cores (while the others are measured too)")
        except VLLMError as exc:
            print(f"{name} is not measured under load: {exc}")
    if "llamacpp" in args.peers:
        if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("uvicorn") is None:
            print("llama.cpp's server is not measured under load: llama-cpp-python with its server is not installed "
                  "here (`make peers` installs it).")
        else:
            try:
                urls["llama.cpp Q4_1"] = stack.enter_context(llama_cpp_server(default_gguf_path(), args.threads))
            except RuntimeError as exc:
                print(f"llama.cpp's server is not measured under load: {exc}")
    return urls


def under_load(args, lm, calibration: dict) -> None:
    """Each runner's concurrency sweep once a round (the order rotating), its table, the highest load that holds the
    target and the most requests a second it finished against its arithmetic's calibrated rate, with the local
    engine's figures against each peer's."""
    store = Store(Path(tempfile.mkdtemp(prefix="tokenpath-bench-")) / "batching.duckdb")
    highest, most, tables, notes = {}, {}, {}, []
    arithmetic = {}
    n_prompt = len(prompt_ids(lm, PROMPT, raw=False))
    gflop_of = lambda reused: request_gflop(lm, n_prompt, args.tokens, reused)  # noqa: E731
    gflop = gflop_of(0)
    prefix_caches = [None] + ([args.prefix_cache_bytes] if args.prefix_cache_bytes else [])
    with contextlib.ExitStack() as stack:
        runners = {}
        for weights in args.levels.split(","):
            for prefix_cache in prefix_caches:
                local = local_target(load_config(args, None), store, max_batch=local_cap(args),
                                     weights=weights, prefix_cache_bytes=prefix_cache, kv_dtype=args.kv_dtype)
                stack.callback(local.close)
                name = (f"Tokenpath {weights}" + (f", {args.kv_dtype} KV cache" if args.kv_dtype != "auto" else "")
                        + (", prefix cache" if prefix_cache else ""))
                runners[name] = (None, local)
                arithmetic[name] = "float32" if weights == "fp32" else weights
        ours = list(runners)
        for name, url in peer_urls(args, stack).items():
            runners[name] = (url, None)
            arithmetic[name] = PEER_ARITHMETIC[name.split(",")[0]]
        names = list(runners)
        for r in range(args.load_rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                url, target = runners[name]
                held, tables[name] = search(args, store, f"{name}, round {r + 1}", url, target, notes)
                highest.setdefault(name, []).append(held)
                most.setdefault(name, []).append(max(level["requests_per_s"] or 0 for level in tables[name]))
    print(f"\nunder load: identical requests ({args.tokens} new tokens, greedy), concurrency {args.load}, "
          f"{args.load_requests} requests a level (at least its concurrency), {args.load_rounds} round(s); target: p90 first token within "
          f"{TTFT_MS:.0f} ms and p90 time per output token within {TPOT_MS:.0f} ms, every request finished; the "
          "highest level holding it is the last before the first that fails, a failing level measured once more "
          "and counted as failing only when it fails again, the levels beyond it not measured; a request's "
          f"forwards are {gflop:.2f} GFLOP as the model's shapes count them, less the prompt tokens a prefix cache "
          "supplied where the runner counts them (llama.cpp's server does not: its requests count whole); "
          + (f"'prefix cache': the local engine keeps prefilled prompts ({args.prefix_cache_mb:g} MiB), so a request "
             "repeating one prefills only its last token; vLLM's CPU build keeps prompts by default too, in whole "
             "blocks of 128 tokens (none of this prompt's), and is measured with blocks of 32 as well; llama.cpp's "
             "server reuses what a prompt shares with its slot's last" if args.prefix_cache_bytes
             else "the local engine keeps no prompts for reuse")
          + (f"; the local engine keeps every KV cache in {args.kv_dtype} (vLLM's CPU build keeps its own in its "
             "model's bf16)" if args.kv_dtype != "auto" else ""))
    print("\n".join(["levels measured again:", *notes] if notes else ["no level was measured again"]))
    for name in runners:
        print(f"\n{name} (last round):\n{level_table(tables[name])}\n"
              f"highest concurrency holding the target: {highest[name]} (one per round); "
              f"{at_most_line(tables[name], gflop_of, arithmetic[name], calibration)}")
    for mine in ours:
        for name in names[len(ours):]:
            held, theirs = highest[mine], highest[name]
            against = ratio(theirs, held) if min(held + theirs) > 0 else "no ratio: a side held no level in some round"
            ceiling = " (the highest level tried: a ratio censored there)" if max(args.load) in held + theirs else ""
            rates = ratio(most[name], most[mine]) if min(most[mine] + most[name]) > 0 else "no ratio"
            print(f"{mine} against {name}: highest concurrency {statistics.median(held):g} against "
                  f"{statistics.median(theirs):g}, {against}{ceiling}; the most requests a second at a level measured "
                  f"{statistics.median(most[mine]):.2f} against {statistics.median(most[name]):.2f}, {rates}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--levels", default="fp32,int4-dyn,int8-dyn")
    parser.add_argument("--load", default="1,2,4,8,16", help="concurrency levels of the load sweep")
    parser.add_argument("--load-requests", type=int, default=16, help="requests a concurrency level")
    parser.add_argument("--load-rounds", type=int, default=1)
    parser.add_argument("--peers", default=",".join(PEERS),
                        help=f"measured under load beside Tokenpath: {', '.join(PEERS)}")
    parser.add_argument("--no-peers", action="store_true", help="the local engine alone under load")
    parser.add_argument("--threads", type=int, default=2, help="OpenMP threads of vLLM and llama.cpp")
    parser.add_argument("--kv-dtype", choices=KV_CHOICES, default="auto",
                        help="under load, the precision the local engine keeps every KV cache in (auto: the weights' "
                             "float32)")
    parser.add_argument("--prefix-cache-mb", type=float, default=256,
                        help="under load, each level also with the local engine keeping prompts for reuse, in this "
                             "many MiB (0: without only)")
    args = parser.parse_args()
    args.load = [int(c) for c in args.load.split(",")]
    if not all(1 <= c <= 256 for c in args.load):
        parser.error("--load levels are concurrencies from 1 to 256")
    args.peers = [] if args.no_peers else [p for p in args.peers.split(",") if p]
    unknown = set(args.peers) - set(PEERS)
    if unknown:
        parser.error(f"unknown peer(s) {', '.join(sorted(unknown))}: choose from {', '.join(PEERS)}")
    try:  # the engine's own check of a MiB count; 0: the local engine without kept prompts only
        args.prefix_cache_bytes = (budget_bytes(args.prefix_cache_mb, "--prefix-cache-mb") if args.prefix_cache_mb
                                   else None)
    except BatchError as exc:
        parser.error(str(exc))
    batches = [int(b) for b in args.batches.split(",")]
    base = load_model()
    variants = {lv: base if lv == "fp32" else quantize(base, lv) for lv in args.levels.split(",")}
    calibration = hardware.calibration_for(base.device)
    cells = [(lv, b) for lv in variants for b in batches]
    step_ms = {cell: [] for cell in cells}
    cpu_ms = {cell: [] for cell in cells}
    for r in range(args.rounds):
        for lv, b in cells[r % len(cells):] + cells[:r % len(cells)]:
            wall, cpu = decode_step_ms(variants[lv], b, args.tokens, calibration)
            step_ms[(lv, b)].append(statistics.median(wall))
            cpu_ms[(lv, b)].append(statistics.median(cpu))
    print(f"model {base.name} on {base.device}, greedy, {args.tokens} new tokens per request, identical requests, "
          f"{args.rounds} rounds, every (level, batch) once a round in rotating order; the machine is shared "
          "with other work, so compare figures within one round")
    per_s = lambda ms_table, lv, b: [b * 1e3 / ms for ms in ms_table[(lv, b)]]  # noqa: E731 (tokens a second)
    for lv in variants:
        print(f"\n{lv}:")
        one = per_s(step_ms, lv, batches[0])
        for b in batches:
            rates = per_s(step_ms, lv, b)
            against = [rate / base for rate, base in zip(rates, one)]
            print(f"  batch {b:2d}: {statistics.median(rates):7.1f} tok/s in total, "
                  f"{statistics.median(rates) / b:6.1f} per user, median step {statistics.median(step_ms[(lv, b)]):6.2f} ms; "
                  f"against the total of batch {batches[0]} {ratio(one, rates)} "
                  f"(per round: {', '.join(f'{x:.2f}' for x in against)}); "
                  f"CPU time {statistics.median(cpu_ms[(lv, b)]):6.2f} ms a step, "
                  f"tokens per CPU second against batch {batches[0]}'s {ratio(per_s(cpu_ms, lv, batches[0]), per_s(cpu_ms, lv, b))}")
        if len(batches) > 1:
            print(step_line(variants[lv], batches, [statistics.median(step_ms[(lv, b)]) for b in batches], calibration))
    plain, batched = [], []
    for r in range(args.rounds):
        runs = {"plain": iter(Generation(base, request(args.tokens), calibration=calibration, telemetry=False)),
                "engine": engine_tokens(base, args.tokens, calibration)}
        order = dict(reversed(runs.items())) if r % 2 else runs
        token_ms = in_turn(order)
        plain.append(statistics.median(token_ms["plain"][1:]))
        batched.append(statistics.median(token_ms["engine"][1:]))
    ratios = [p / b for p, b in zip(plain, batched)]
    speed = lambda ms: [1e3 / x for x in ms]  # noqa: E731
    print(f"\none sequence, fp32, in lockstep: plain decode loop median {statistics.median(plain):.2f} ms a token, "
          f"batch engine with one user {statistics.median(batched):.2f} ms; engine speed against plain speed "
          f"{ratio(speed(plain), speed(batched))} (per round: {', '.join(f'{x:.3f}' for x in ratios)})")
    under_load(args, base, calibration)


if __name__ == "__main__":
    with recorded("batching"):
        main()
