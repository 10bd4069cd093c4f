"""Tokenpath at each weight level against llama.cpp (llama-cpp-python) on the same GGUF the default
model is converted from: same prompt tokens, thread count and token count, greedy.

Each peer runs in its own process (this script again, with --one PEER), one whole run each in turn, the
order rotating from round to round (A B A B), so no two thread pools share the cores inside one process
and a peer that crashes (llama.cpp's AMX path did on a Xeon) costs its row, recorded with how it ended,
not the table. A run loads its model, warms up, then times a greedy generation token by token. Prefill
tokens/s is the prompt's length over the first token's time (the prompt's forward and the first pick),
decode tokens/s the inverse of the median later token; both are measured the same way on both sides.
Tokenpath's loop is the instrumented one (timing and attribution on, the telemetry sampler off). Where
vLLM's CPU build is installed (`make vllm`), it is a further peer: its server starts before the rounds (its
idle CPU use is printed) and each round sends it the same prompt, token count and thread count as one
streamed request in its turn, timed the same way from the client (the first token's time includes the
request's round trip). Every runner is set against llama.cpp as the ratio of its speeds over the rounds with
their 95% interval (bench/common.py ratio). Writes bench/results/peers.md.

    .venv/bin/python bench/peers.py [--tokens 64] [--rounds 3] [--levels fp32,int8-dyn,...] [--no-vllm]

llama-cpp-python is this benchmark's own dependency (`make peers` installs it into .venv); without it the
benchmark refuses.
"""
import argparse
import contextlib
import importlib.util
import json
import signal
import statistics
import subprocess
import sys
import time

from common import (PROMPT, idle_cpu_share, in_turn, ratio,  # first: the engine sets OpenMP's wait policy
                    recorded)  # before torch loads
from engine.measure import hardware
from engine.measure.compare import NO_DIFFERENCE

import httpx2
import numpy as np
import openai
import torch
from engine.run.generate import Generation, GenConfig
from engine.model.loader import default_gguf_path, load_model
from engine.run.text import prompt_ids as chat_ids
from engine.switches.quant import available_levels, quantize
from engine.serve.client import StreamResult, explain, make_client, open_stream, read_stream, request_body
from engine.serve.vllm import VLLMError, VLLMServer, vllm_python

LLAMA_CPP_PIN = "llama-cpp-python==0.3.36"
PEER = "llama.cpp Q4_1"
VLLM_DTYPE = "bfloat16"  # the dtype vLLM's CPU build is fastest at here
SERVED = "vLLM bf16"
RUN_TIMEOUT_S = 600.0  # one peer's whole run, its model's loading included


def load_llama_cpp(gguf, threads: int, context: int):
    """llama.cpp's model on the GGUF (llama_cpp is imported only here: the module loads without it)."""
    from llama_cpp import Llama

    return Llama(model_path=str(gguf), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                 n_batch=512, verbose=False)


def llama_greedy(llm, prompt_ids: list[int], n: int):
    """llama.cpp's greedy tokens, one per next(): the first evaluates the prompt, each later one a token."""
    import llama_cpp

    llm.reset()
    llm.eval(prompt_ids)
    for i in range(n):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
        token = int(np.argmax(logits))
        yield token
        if i < n - 1:
            llm.eval([token])


def timed(tokens) -> tuple[list[int], list[float]]:
    """(the tokens of an iterator of token ids, the milliseconds each took)."""
    ids = []

    def kept():
        for token in tokens:
            ids.append(token)
            yield token
    return ids, in_turn({"run": kept()})["run"]


def run_one(runner: str, prompt_ids: list[int], n: int) -> tuple[list[int], list[float], int]:
    """One peer's run in this process: (token ids, per-token ms, prompt tokens), after a short warm-up."""
    threads = torch.get_num_threads()
    if runner == PEER:
        llm = load_llama_cpp(default_gguf_path(), threads, context=512)
        timed(llama_greedy(llm, prompt_ids, 4))
        ids, token_ms = timed(llama_greedy(llm, prompt_ids, n))
        return ids, token_ms, len(prompt_ids)
    base = load_model()
    lm = base if runner == "fp32" else quantize(base, runner)
    calibration = hardware.calibration_for(base.device)
    run = lambda k: Generation(lm, GenConfig(PROMPT, max_new_tokens=k, ignore_eos=True),  # noqa: E731
                               calibration=calibration, telemetry=False)
    timed(run(4))
    gen = run(n)
    ids, token_ms = timed(t.token_id for t in gen)
    return ids, token_ms, len(gen.prompt_ids)


def in_process(runner: str, prompt_ids: list[int], n: int) -> tuple | str:
    """run_one in a process of its own: its result, or how the process ended where it gave none."""
    command = [sys.executable, __file__, "--one", runner, "--tokens", str(n),
               "--prompt-ids", ",".join(map(str, prompt_ids))]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"no result within {RUN_TIMEOUT_S:.0f} s"
    if done.returncode:
        how = (f"killed by {signal.Signals(-done.returncode).name}" if done.returncode < 0
               else f"exit {done.returncode}")
        last = done.stderr.strip().splitlines()[-1][-200:] if done.stderr.strip() else "no message"
        return f"crashed ({how}): {last}"
    ids, token_ms, prompt_len = json.loads(done.stdout.strip().splitlines()[-1])
    return ids, token_ms, prompt_len


def rounds_alternating(runners: dict, rounds: int) -> list[dict]:
    """Every runner's whole run ({name: a call giving its result or how it ended}) once a round, the order
    rotating from round to round."""
    names = list(runners)
    return [{k: runners[k]() for k in names[r % len(names):] + names[:r % len(names)]} for r in range(rounds)]


def agreement(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy generations share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def served_request(client, model: str, n: int) -> tuple[list[int], list[float], int]:
    """(token ids, per-token ms, prompt tokens) of one greedy streamed request of exactly n tokens: the
    first entry is the time to the first token, and a chunk of several tokens shares its gap among them."""
    body = request_body(model=model, prompt=PROMPT, raw=False, max_new_tokens=n, temperature=0.0, top_p=1.0,
                        seed=None, token_ids=True)
    body["extra_body"]["ignore_eos"] = True
    result, ids, token_ms = StreamResult(), [], []
    last = time.perf_counter_ns()
    for chunk in read_stream(open_stream(client, body), result):
        count = len(chunk.token_ids or [None])
        gap_ms = (chunk.t_ns - last) / 1e6
        token_ms += [gap_ms] if not token_ms else [gap_ms / count] * count
        ids += chunk.token_ids or []
        last = chunk.t_ns
    return ids, token_ms, result.usage_prompt


@contextlib.contextmanager
def served_runner(n: int, threads: int):
    """A call giving one greedy streamed request's result from a vLLM server (or how it failed) while the block
    runs, the server started before it and stopped after it; None (with a line saying why) where vLLM is not
    installed or does not start."""
    try:
        vllm_python()  # says how to install it where it is not
        server = VLLMServer(dtype=VLLM_DTYPE, threads=threads)
        server.start()
    except VLLMError as exc:
        print(f"vLLM is not a peer in this run: {exc}")
        yield None
        return
    try:
        client = make_client(server.url)

        def one() -> tuple | str:
            try:
                return served_request(client, server.model_name, n)
            except (openai.APIError, httpx2.HTTPError) as exc:  # costs its row of the round, not the table
                return f"failed: {explain(exc, server.url)}"
        one()  # warm up
        print(f"{SERVED} started; idle, it takes {idle_cpu_share(server.process.pid):.2f} cores while the others run")
        yield one
    finally:
        server.stop()


def decode_rate(run: tuple) -> float:
    """Tokens/s of a run's median decode token (the first token came with the prefill)."""
    return 1e3 / statistics.median(run[1][1:])


def report(rounds: list[dict], levels: list[str], threads: int, n: int) -> None:
    """One row per runner over the rounds it finished (a runner whose run gave no result says how it ended), then
    each runner against llama.cpp: the ratio of its decode and prefill speeds over the rounds, with the interval."""
    keys = [*levels, *(k for k in (PEER, SERVED) if k in rounds[0])]
    ran = {k: [r[k] for r in rounds if not isinstance(r[k], str)] for k in keys}
    prefill = {k: [p / ms[0] * 1e3 for _, ms, p in ran[k]] for k in keys}
    decode = {k: [decode_rate(run) for run in ran[k]] for k in keys}
    peer = ran[PEER]
    prompt_len = next(p for k in keys for _, _, p in ran[k]) if any(ran.values()) else None
    served = (f"; {SERVED} served in its turn, {threads} threads, its first token's time including the HTTP round "
              "trip") if SERVED in rounds[0] else ""
    print(f"{len(rounds)} rounds, each runner's whole run in turn (each Tokenpath level and llama.cpp in its own "
          f"process), {threads} threads on every side, {prompt_len} prompt tokens, {n} new tokens, greedy{served}")
    print(f"{'runner':<16} {'decode tok/s':>12} {'prefill tok/s':>13} {'tokens as llama.cpp':>19}  (medians)")
    for k in keys:
        if ran[k]:
            same = f"{agreement(ran[k][-1][0], peer[-1][0]):>14}/{n:<4}" if peer else f"{'-':>19}"
            print(f"{k:<16} {statistics.median(decode[k]):>12.1f} {statistics.median(prefill[k]):>13.1f} {same}")
        for i, r in enumerate(rounds):
            if isinstance(r[k], str):
                print(f"{k:<16} no result in round {i + 1}: {r[k]}")
    if not peer:
        print(f"no ratios: {PEER} finished no round")
        return
    print(f"\nagainst {PEER} over the rounds (95% interval; \"{NO_DIFFERENCE}\" where it includes 1):")
    for k in keys:
        if k != PEER and ran[k]:
            print(f"{k:<16} decode {ratio(decode[PEER], decode[k])}; prefill {ratio(prefill[PEER], prefill[k])}")
    finished = [k for k in levels if ran[k]]
    if finished:
        best = max(finished, key=lambda k: statistics.median(decode[k]))
        print(f"fastest Tokenpath level at decode: {best}, {ratio(decode[PEER], decode[best])} against {PEER}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--levels", help="comma-separated; default: every level this device runs")
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM's CPU build out even where it is installed")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a runner's own process: its run as JSON on stdout
    parser.add_argument("--prompt-ids", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tokens < 2 or args.rounds < 1:
        print("--tokens must be at least 2 and --rounds at least 1.", file=sys.stderr)
        return 2
    if args.one:
        print(json.dumps(run_one(args.one, [int(t) for t in args.prompt_ids.split(",")], args.tokens)))
        return 0
    if importlib.util.find_spec("llama_cpp") is None:
        print(f"llama.cpp, the peer every runner is set against, is not installed here: `make peers` builds "
              f"{LLAMA_CPP_PIN} into .venv.", file=sys.stderr)
        return 2
    base = load_model()
    levels = args.levels.split(",") if args.levels else available_levels(base.device)
    unknown = sorted(set(levels) - set(available_levels(base.device)))
    if unknown:
        print(f"Unknown or unavailable level(s) here: {', '.join(unknown)}.", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    prompt_ids = chat_ids(base, PROMPT, raw=False)
    del base  # the runs load their own models
    print(f"llama.cpp on {default_gguf_path().name} (the GGUF Tokenpath's weights are converted from)")
    runners = {k: (lambda k=k: in_process(k, prompt_ids, args.tokens)) for k in [*levels, PEER]}
    with contextlib.ExitStack() as stack:
        served = None if args.no_vllm else stack.enter_context(served_runner(args.tokens, threads))
        if served:
            runners[SERVED] = served
        rounds = rounds_alternating(runners, args.rounds)
    report(rounds, levels, threads, args.tokens)
    return 0


if __name__ == "__main__":
    if "--one" in sys.argv:
        sys.exit(main())
    with recorded("peers"):
        code = main()
        if code:  # leaves the block by the exception: nothing is written for a refused run
            sys.exit(code)
