"""Every speculative method against plain greedy on each shipped workload, the methods' generations
advanced token by token in turn (bench/common.py): speedup in end-to-end tokens/s (new tokens over
the time spent generating them, prefill included), acceptance, tokens per target forward, and the speedup the formula
expects from the measured acceptance and cost ratio; per workload, the slowest adaptive setting.

    .venv/bin/python bench/speculative.py [--tokens 64] [--rounds 2]
"""
import argparse
import statistics

from engine.measure import hardware
from engine.run.generate import GenConfig
from engine.paths import workloads
from engine.model.loader import load_model
from common import lockstep, ratio, recorded

METHODS = {
    "greedy": dict(),
    "prompt-lookup K=4": dict(speculative="prompt-lookup", speculative_k=4),
    "prompt-lookup K=8": dict(speculative="prompt-lookup", speculative_k=8),
    "prompt-lookup adaptive": dict(speculative="prompt-lookup", speculative_k=4, adaptive=True),
    "draft self-int8 K=3": dict(speculative="draft", draft_model="self-int8", speculative_k=3),
    "draft self-int8 adaptive": dict(speculative="draft", draft_model="self-int8", speculative_k=3, adaptive=True),
    "draft self-exit:20 adaptive": dict(speculative="draft", draft_model="self-exit:20", speculative_k=2, adaptive=True),
    "lookahead W=4 N=3 G=4": dict(speculative="lookahead", window=4, max_ngram=3, guesses=4),
    "lookahead adaptive": dict(speculative="lookahead", window=4, max_ngram=3, guesses=4, adaptive=True),
    "jacobi K=4": dict(speculative="jacobi", speculative_k=4),
    "jacobi adaptive": dict(speculative="jacobi", speculative_k=4, adaptive=True),
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    lm = load_model()
    calibration = hardware.calibrate(lm.device)
    lockstep({name: (lm, GenConfig("Hello", max_new_tokens=4, **settings)) for name, settings in METHODS.items()},
             calibration)  # build drafters and warm up
    print(f"{lm.name} on {lm.device}, fp32, up to {args.tokens} new tokens, {args.rounds} rounds, methods in lockstep")
    print(f"{'workload':<17} {'method':<28} {'tok/s':>6} {'accept':>7} {'tok/fwd':>7} {'expected':>8}  "
          "speed against greedy")
    for workload, item in workloads().items():
        rates = {name: [] for name in METHODS}
        last = {}
        names = list(METHODS)
        for i in range(args.rounds):
            order = names[i % len(names):] + names[: i % len(names)]
            done = lockstep({name: (lm, GenConfig(item["prompt"], max_new_tokens=args.tokens, **METHODS[name]))
                             for name in order}, calibration)
            for name, (gen, token_ms) in done.items():
                rates[name].append(len(gen.token_ids) / (sum(token_ms) / 1e3))
                last[name] = gen.result
        best = max((n for n in METHODS if n != "greedy"), key=lambda n: statistics.median(rates[n]))
        for name in METHODS:
            rate = statistics.median(rates[name])
            sp = last[name].get("speculative") or {}
            fmt = lambda v, f: format(v, f) if v is not None else "-"  # noqa: E731
            mark = "  <- best" if name == best else ""
            print(f"{workload:<17} {name:<28} {rate:>6.2f} {fmt(sp.get('acceptance_rate'), '>7.0%')} "
                  f"{fmt(sp.get('tokens_per_target_forward'), '>7.2f')} {fmt(sp.get('expected_speedup'), '>7.2f')}"
                  f"{'x' if sp.get('expected_speedup') else ' '}  {ratio(rates['greedy'], rates[name])}{mark}")
        adaptive = [n for n in METHODS if METHODS[n].get("adaptive")]
        worst = min(adaptive, key=lambda n: statistics.median(rates[n]))
        print(f"{workload:<17} slowest adaptive setting: {worst} at {ratio(rates['greedy'], rates[worst])}")


if __name__ == "__main__":
    with recorded("speculative"):
        main()
