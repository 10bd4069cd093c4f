"""Every weight precision level against fp32 on the default model, alternating levels in one run:
decode tokens/s (the levels' generations advanced token by token in turn; bench/common.py), weight bytes per token, fraction of the memory roofline reached, and quality
(perplexity, top-1 agreement, KL) teacher-forced on data/eval.txt.

    .venv/bin/python bench/quant.py [--tokens 64] [--rounds 4] [--levels fp32,bf16,...]
"""
import argparse
import statistics

from engine.measure import hardware
from engine.run import quality
from engine.measure.accounting import model_shape
from engine.model.loader import load_model
from engine.switches.quant import available_levels, level_info, quantize
from common import lockstep_rates, ratio, recorded


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--levels", help="comma-separated; default: every level this device runs")
    args = parser.parse_args()
    base = load_model()
    levels = args.levels.split(",") if args.levels else available_levels(base.device)
    variants = {lv: base if lv == "fp32" else quantize(base, lv) for lv in levels}
    calibration = hardware.calibrate(base.device)
    lockstep_rates(variants, calibration, 4, 1)  # warm up
    rates, steps = lockstep_rates(variants, calibration, args.tokens, args.rounds)
    memory_ms = {lv: statistics.mean(st["memory_ms"] for st in steps[lv]) for lv in levels}
    print(f"{base.name} on {base.device}, greedy, {args.tokens} new tokens, {args.rounds} rounds, levels in lockstep; "
          f"calibrated read bandwidth {calibration['memory_gbps']:.1f} GB/s")
    print(f"{'level':<10} {'weights MB/token':>16} {'decode tok/s':>12} {'roofline':>9} "
          f"{'memory ms/tok':>13} {'perplexity':>10} {'top-1':>7} {'KL nats':>8}  kernel; decode speed against fp32")
    for lv in levels:
        lm = variants[lv]
        weight_bytes = model_shape(lm.model).weight_bytes
        rate = statistics.median(rates[lv])
        roofline = calibration["memory_gbps"] * 1e9 / weight_bytes
        q = quality.evaluate(base, lm)
        info = level_info(lv, base.device)
        print(f"{lm.weights:<10} {weight_bytes / 1e6:>16.1f} {rate:>12.2f} "
              f"{rate / roofline:>8.0%} {memory_ms[lv]:>13.2f} {q['perplexity']:>10.3f} "
              f"{q['top1_agreement']:>6.1%} {q['kl_mean']:>8.5f}  {info.kernel}"
              f"{'' if info.accelerated else ' (emulated)'}; {ratio(rates['fp32'], rates[lv]) if 'fp32' in rates else '-'}")


if __name__ == "__main__":
    with recorded("quant"):
        main()
