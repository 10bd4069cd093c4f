"""Our instrumented loop against transformers' model.generate, greedy, same prompt and token count,
alternating in one run. Our loop runs three ways per round: instrumented with the telemetry
sampler off, instrumented (timing, attribution, telemetry), and instrumented plus recorded to
DuckDB (a run row, every step and token); and once more on transformers' own forward instead of the
lean one (engine/model/lean.py), to show what the lean forward saves. Prints
tokens/s of each, the ratios, the fraction of the calibrated memory peak reached (weight bytes per
token / the best read bandwidth calibration saw, at the start and again beside each round, since the
machine's bandwidth moves from minute to minute; and step by step: each round ends with a decode
that runs one pass of the small-rows kernel, the fp32 decode's own and the peak's usual method, over
cold weights after every step, and sets each step's bytes per second (its weights and its KV cache's)
beside that pass's), and the fixed cost of a decode step: the lean forward's step on a tiny model as
deep as the default one, whose weights take a fraction of a ms.

    .venv/bin/python bench/decode.py [--tokens 64] [--rounds 5]
"""
import argparse
import statistics
import tempfile
import time
from pathlib import Path

from common import ratio, recorded  # first: the engine sets OpenMP's wait policy before torch loads
from engine.measure import hardware

import torch

from engine.measure.accounting import model_shape
from engine.run.generate import Generation, GenConfig
from engine.run.text import prompt_ids
from engine.model.loader import load_model, tiny_model
from engine.store.db import Store

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def time_ours(lm, store, calibration, n, telemetry=True):
    gen = Generation(lm, GenConfig(PROMPT, max_new_tokens=n, ignore_eos=True), store=store, calibration=calibration,
                     telemetry=telemetry)
    start = time.perf_counter()
    gen.run()
    return n / (time.perf_counter() - start), gen.result


def time_hf(lm, n):
    ids = torch.tensor([prompt_ids(lm, PROMPT, raw=False)], device=lm.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False)
    assert out.shape[1] - ids.shape[1] == n
    return n / (time.perf_counter() - start)


def paired_steps(lm, calibration, n: int, peak_pass) -> list[tuple[float, float]]:
    """(the step's GB/s, the small-rows kernel's GB/s in a pass right after it) for each decode step of an
    instrumented run. The step's bytes are what the run's own peak check counts: its weights and the
    bytes its KV cache moved. The step is timed from the loop's resumption to its token, so the pass
    between tokens is not in it."""
    gen = Generation(lm, GenConfig(PROMPT, max_new_tokens=n, ignore_eos=True), calibration=calibration)
    tokens = iter(gen)
    next(tokens)  # the prefill's token
    pairs = []
    while True:
        start = time.perf_counter()
        if next(tokens, None) is None:
            return pairs
        step_s = time.perf_counter() - start
        read, pass_s = peak_pass()
        step = gen.steps[-1]
        moved = step["weight_bytes"] + step["kv_read_bytes"] + step["kv_write_bytes"]
        pairs.append((moved / step_s / 1e9, read / pass_s / 1e9))


def fixed_cost(lm, calibration, n: int) -> dict:
    """The instrumented decode step of a tiny model with lm's depth: what a step costs apart from its
    weights (its forward and its whole step, medians in ms, and the tiny model's weight bytes)."""
    tiny = tiny_model(layers=lm.config.num_hidden_layers)
    gen = Generation(tiny, GenConfig(PROMPT, max_new_tokens=n, ignore_eos=True), calibration=calibration,
                     telemetry=False)
    gen.run()
    steps = [s for s in gen.steps if s["kind"] == "decode"]
    return {"forward_ms": statistics.median(s["forward_ms"] for s in steps),
            "step_ms": statistics.median(s["wall_ms"] for s in steps), "weight_bytes": steps[0]["weight_bytes"]}


def print_pairs(rounds: list[list[tuple[float, float]]]) -> None:
    steps = [step / peak for pairs in rounds for step, peak in pairs]
    quartiles = statistics.quantiles(steps, n=4)
    per_round = [statistics.median(step / peak for step, peak in pairs) for pairs in rounds]
    best = [statistics.harmonic_mean([step for step, _ in pairs]) / max(peak for _, peak in pairs) for pairs in rounds]
    print("step by step, each decode step's bytes per second (weights and KV cache) against a pass of the "
          f"small-rows kernel over cold weights right after it ({len(steps)} steps): median {quartiles[1]:.0%}, "
          f"quartiles {quartiles[0]:.0%}-{quartiles[2]:.0%} (per round: " + ", ".join(f"{f:.0%}" for f in per_round)
          + "); the round's mean step against its best pass: " + ", ".join(f"{f:.0%}" for f in best))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.tokens < 3 or args.rounds < 1:
        parser.error("--tokens must be at least 3 (two decode steps to compare) and --rounds at least 1")
    lm = load_model()
    hf_lm = load_model(lean_forward=False)  # transformers' own forward, for generate and our loop on it
    calibration = hardware.calibrate(lm.device)
    store = Store(Path(tempfile.mkdtemp()) / "bench.duckdb")
    time_ours(lm, store, calibration, 8), time_hf(hf_lm, 8)  # warm up both paths
    runners = {
        "no-telemetry": lambda: time_ours(lm, None, calibration, args.tokens, telemetry=False),
        "ours": lambda: time_ours(lm, None, calibration, args.tokens),
        "recorded": lambda: time_ours(lm, store, calibration, args.tokens),
        "hf": lambda: (time_hf(hf_lm, args.tokens), None),
        "ours-hf-forward": lambda: time_ours(hf_lm, None, calibration, args.tokens),
    }
    peak_pass = hardware.small_rows_pass(lm.device)
    rates = {name: [] for name in runners}
    decode, peaks, pairs = [], [], []
    order = list(runners)
    for i in range(args.rounds):
        for name in order[i % len(order):] + order[: i % len(order)]:  # rotate who goes first
            rate, result = runners[name]()
            rates[name].append(rate)
            if name == "ours":
                decode.append(result["decode_tokens_per_s"])
                peaks.append(hardware.best_method(hardware.measure_read_bandwidth(lm.device)))  # the same minute
        if peak_pass is not None:  # last in each round: the passes' wake falls on whoever goes first next
            pairs.append(paired_steps(lm, calibration, args.tokens, peak_pass))
    fixed = fixed_cost(lm, calibration, args.tokens)
    med = {k: statistics.median(v) for k, v in rates.items()}
    shape = model_shape(lm.model)
    roofline_tps = calibration["memory_gbps"] * 1e9 / shape.weight_bytes
    print(f"model {lm.name} on {lm.device}, fp32 greedy, {args.tokens} new tokens, {args.rounds} rounds alternating")
    print(f"ours, instrumented, telemetry sampler off:       median {med['no-telemetry']:.2f} tok/s end to end")
    print(f"ours, instrumented (timing, buckets, telemetry): median {med['ours']:.2f} tok/s end to end")
    print(f"ours, instrumented and recorded to DuckDB:        median {med['recorded']:.2f} tok/s end to end")
    print(f"ours, instrumented, on transformers' forward:     median {med['ours-hf-forward']:.2f} tok/s end to end")
    print(f"transformers model.generate:                      median {med['hf']:.2f} tok/s end to end")
    print(f"lean forward against transformers' forward, both in our loop: {ratio(rates['ours-hf-forward'], rates['ours'])}")
    print(f"telemetry on against off: {ratio(rates['no-telemetry'], rates['ours'])}")
    for name in ("ours", "recorded"):
        per_round = ", ".join(f"{a / b:.3f}" for a, b in zip(rates[name], rates["hf"]))
        print(f"{name} against generate: {ratio(rates['hf'], rates[name])} (per round: {per_round})")
    print(f"memory peak: {shape.weight_bytes / 1e6:.0f} MB of weights per token at {calibration['memory_gbps']:.1f} "
          f"GB/s (best method: {calibration['memory_method']}; "
          + ", ".join(f"{k} {v:.1f}" for k, v in calibration["memory_methods_gbps"].items())
          + f") -> {roofline_tps:.1f} tok/s; our decode steps reached {statistics.median(decode) / roofline_tps:.0%} of it")
    fractions = [tps * shape.weight_bytes / (gbps * 1e9) for tps, (_, gbps) in zip(decode, peaks)]
    print("the peak again beside each round's decode (best method, GB/s): "
          + ", ".join(f"{method} {gbps:.1f}" for method, gbps in peaks)
          + f"; our decode steps reached {statistics.median(fractions):.0%} of it (per round: "
          + ", ".join(f"{f:.0%}" for f in fractions) + ")")
    if pairs:
        print_pairs(pairs)
    step_ms = 1e3 / statistics.median(decode)
    print(f"fixed cost of a decode step (tiny model, {lm.config.num_hidden_layers} layers, "
          f"{fixed['weight_bytes'] / 1e6:.1f} MB of weights): forward {fixed['forward_ms']:.2f} ms, whole step "
          f"{fixed['step_ms']:.2f} ms; {fixed['step_ms'] / step_ms:.0%} of the default model's {step_ms:.2f} ms step")


if __name__ == "__main__":
    with recorded("decode"):
        main()
