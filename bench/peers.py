"""Tokenpath at each weight level against llama.cpp (llama-cpp-python) on the same GGUF the default
model is converted from: same prompt tokens, thread count and token count, greedy, advanced in lockstep.

Every round runs all of them one token each in turn (bench/common.py's in_turn), so a burst of load on
a shared machine slows them alike. Prefill tokens/s is the prompt's length over the first token's time
(the prompt's forward and the first pick), decode tokens/s the inverse of the median later token; both
are measured the same way on both sides. Tokenpath's loop is the instrumented one (timing and
attribution on, the telemetry sampler off). Where vLLM's CPU build is installed (`make vllm`), it is
a second peer: after the lockstep rounds, with the others idle (a server cannot be advanced one token
at a time, and its threads would take the cores from the others), the same prompt, token count and
thread count go to a vLLM server as the same number of streamed requests, one after another, timed
the same way from the client (the first token's time includes the request's round trip). Writes
bench/results/peers.md.

    .venv/bin/python bench/peers.py [--tokens 64] [--rounds 3] [--levels fp32,int8-dyn,...]

llama-cpp-python is this benchmark's own dependency (`make peers` installs it into .venv).
"""
import argparse
import importlib.util
import statistics
import sys
import time

from common import PROMPT, in_turn, recorded  # first: the engine sets OpenMP's wait policy before torch loads
from engine.measure import hardware

import httpx2
import numpy as np
import openai
import torch
from engine.run.generate import Generation, GenConfig
from engine.model.loader import default_gguf_path, load_model
from engine.switches.quant import available_levels, quantize
from engine.serve.client import StreamResult, explain, make_client, open_stream, read_stream, request_body
from engine.serve.vllm import VLLMError, VLLMServer, vllm_python

LLAMA_CPP_PIN = "llama-cpp-python==0.3.36"
PEER = "llama.cpp Q4_1"
VLLM_DTYPE = "bfloat16"  # the dtype vLLM's CPU build is fastest at here
SERVED = "vLLM bf16"


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


def one_round(variants: dict, llm, n: int, calibration: dict, first: int) -> dict:
    """{name: (token ids, per-token ms)} of one lockstep round, starting from the `first`-th runner."""
    cfg = lambda: GenConfig(PROMPT, max_new_tokens=n, ignore_eos=True)  # noqa: E731
    gens = {lv: Generation(lm, cfg(), calibration=calibration, telemetry=False) for lv, lm in variants.items()}
    prompt_ids = next(iter(gens.values())).prompt_ids
    tokens = {PEER: []}

    def peer():
        for token in llama_greedy(llm, prompt_ids, n):
            tokens[PEER].append(token)
            yield token

    runners = {**{lv: iter(g) for lv, g in gens.items()}, PEER: peer()}
    keys = list(runners)
    order = keys[first % len(keys):] + keys[: first % len(keys)]
    token_ms = in_turn({k: runners[k] for k in order})
    tokens.update({lv: g.token_ids for lv, g in gens.items()})
    return {k: (tokens[k], token_ms[k], len(prompt_ids)) for k in keys}


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


def served_rounds(n: int, rounds: int, threads: int) -> list | None:
    """vLLM's rounds, each like one_round's entries, or None (with a line saying why) where it is not
    installed or does not start."""
    if not vllm_python().exists():
        print("vLLM is not a peer in this run: its CPU build is not installed (`make vllm`).")
        return None
    server = VLLMServer(dtype=VLLM_DTYPE, threads=threads)
    try:
        server.start()
    except VLLMError as exc:
        print(f"vLLM is not a peer in this run: {exc}")
        return None
    try:
        client = make_client(server.url)
        served_request(client, server.model_name, 4)  # warm up
        return [served_request(client, server.model_name, n) for _ in range(rounds)]
    except (openai.APIError, httpx2.HTTPError) as exc:  # the others' rounds are kept and reported
        print(f"vLLM is not a peer in this run: {explain(exc, server.url)}")
        return None
    finally:
        server.stop()


def report(rounds: list[dict], levels: list[str], threads: int, n: int) -> None:
    prefill = {k: [p / ms[0] * 1e3 for _, ms, p in (r[k] for r in rounds)] for k in rounds[0]}
    decode = {k: [1e3 / statistics.median(ms[1:]) for _, ms, _ in (r[k] for r in rounds)] for k in rounds[0]}
    peer_decode, peer_prefill = statistics.median(decode[PEER]), statistics.median(prefill[PEER])
    prompt_len = rounds[0][PEER][2]
    served = (f"; {SERVED} served alone after them, {threads} threads, {rounds[0][SERVED][2]} prompt tokens, its "
              "first token's time including the HTTP round trip") if SERVED in rounds[0] else ""
    print(f"{len(rounds)} rounds in lockstep, {threads} threads on both sides, {prompt_len} prompt tokens, "
          f"{n} new tokens, greedy{served}")
    print(f"{'runner':<16} {'decode tok/s':>12} {'vs llama.cpp':>12} {'prefill tok/s':>13} {'vs llama.cpp':>12} "
          f"{'tokens as llama.cpp':>19}  per-round decode ratio")
    for k in [*levels, PEER, *([SERVED] if SERVED in rounds[0] else [])]:
        d, p = statistics.median(decode[k]), statistics.median(prefill[k])
        same = agreement(rounds[-1][k][0], rounds[-1][PEER][0])
        per_round = ", ".join(f"{a / b:.2f}" for a, b in zip(decode[k], decode[PEER]))
        print(f"{k:<16} {d:>12.1f} {d / peer_decode:>11.2f}x {p:>13.1f} {p / peer_prefill:>11.2f}x "
              f"{same:>14}/{n:<4}  {per_round}")
    best = max(levels, key=lambda k: statistics.median(decode[k]))
    print(f"best Tokenpath level: {best}, {statistics.median(decode[best]) / peer_decode:.2f}x llama.cpp's decode")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--levels", help="comma-separated; default: every level this device runs")
    args = parser.parse_args()
    if args.tokens < 2 or args.rounds < 1:
        print("--tokens must be at least 2 and --rounds at least 1.", file=sys.stderr)
        return 2
    base = load_model()
    levels = args.levels.split(",") if args.levels else available_levels(base.device)
    unknown = sorted(set(levels) - set(available_levels(base.device)))
    if unknown:
        print(f"Unknown or unavailable level(s) here: {', '.join(unknown)}.", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    gguf = default_gguf_path()
    llm = load_llama_cpp(gguf, threads, context=512)
    variants = {lv: base if lv == "fp32" else quantize(base, lv) for lv in levels}
    calibration = hardware.calibration_for(base.device)
    print(f"{base.name} on {base.device}; llama.cpp on {gguf.name} (the GGUF Tokenpath's weights are converted from)")
    one_round(variants, llm, 4, calibration, 0)  # warm up every path
    rounds = [one_round(variants, llm, args.tokens, calibration, i) for i in range(args.rounds)]
    served = served_rounds(args.tokens, args.rounds, threads)
    for lockstep_round, served_round in zip(rounds, served or []):
        lockstep_round[SERVED] = served_round
    report(rounds, levels, threads, args.tokens)
    return 0


if __name__ == "__main__":
    if importlib.util.find_spec("llama_cpp") is None:
        print(f"llama-cpp-python is not installed in this environment: `make peers` installs {LLAMA_CPP_PIN}.",
              file=sys.stderr)
        sys.exit(2)
    with recorded("peers"):
        code = main()
        if code:  # leaves the block by the exception: nothing is written for a refused run
            sys.exit(code)
