"""Activation sparsity on the default model: dense against mask and skip at several sparsities,
their generations advanced token by token in turn (bench/common.py). Prints decode tokens/s
(median decode token), weight bytes actually read
per token, the ratio to dense, and quality (perplexity, top-1 agreement, KL against dense, on
data/eval.txt; mask and skip compute the same function, so quality is measured once per sparsity).

    .venv/bin/python bench/sparsity.py [--tokens 48] [--rounds 3] [--levels 0,0.25,0.5,0.7]
"""
import argparse
import statistics

from engine.measure import hardware
from engine.run import quality
from engine.switches import sparsity
from engine.model.loader import load_model
from common import lockstep_rates, ratio, recorded


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--levels", default="0,0.25,0.5,0.7")
    args = parser.parse_args()
    base = load_model()
    calibration = hardware.calibrate(base.device)
    levels = [float(v) for v in args.levels.split(",")]
    variants = {("dense", 0.0): base}
    for s in levels:
        for mode in sparsity.MODES:
            variants[(mode, s)] = sparsity.sparsify(base, s, mode, sparsity.calibrate_thresholds(base, s))
    lockstep_rates(variants, calibration, 4, 1)  # warm up
    rates, steps = lockstep_rates(variants, calibration, args.tokens, args.rounds)
    bytes_read = {key: statistics.mean(st["weight_bytes"] for st in steps[key]) for key in variants}
    print(f"{base.name} on {base.device}, fp32 greedy, {args.tokens} new tokens, {args.rounds} rounds, variants in lockstep")
    print(f"{'mode':<6} {'sparsity':>8} {'weights MB/token':>16} {'decode tok/s':>12} "
          f"{'perplexity':>10} {'top-1':>7} {'KL nats':>8}  decode speed against dense")
    scores = {s: quality.evaluate(base, variants[("mask", s)]) for s in levels}
    scores[0.0] = scores.get(0.0) or quality.evaluate(base, base)
    for (mode, s), lm in variants.items():
        rate = statistics.median(rates[(mode, s)])
        q = scores[s]
        print(f"{mode:<6} {s:>8.0%} {bytes_read[(mode, s)] / 1e6:>16.1f} {rate:>12.2f} "
              f"{q['perplexity']:>10.3f} {q['top1_agreement']:>6.1%} {q['kl_mean']:>8.5f}  "
              f"{ratio(rates[('dense', 0.0)], rates[(mode, s)])}")


if __name__ == "__main__":
    with recorded("sparsity"):
        main()
