"""What the benchmarks share: the prompt and decode rates that resist a shared machine's spikes."""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.generate import Generation, GenConfig  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def lockstep(runs: dict, calibration) -> dict:
    """Run every (model, GenConfig) of `runs` with the generations advanced one token each in turn,
    so that a burst of load on a shared machine slows them all alike (alternating whole runs leaves
    each to its own stretch of luck). Returns, per key, the finished Generation and the time spent
    inside it for each token (its step, selection and bookkeeping; the first includes the prefill)."""
    gens = {k: Generation(lm, cfg, calibration=calibration, telemetry=False) for k, (lm, cfg) in runs.items()}
    running = {k: iter(g) for k, g in gens.items()}
    token_ms = {k: [] for k in gens}
    while running:
        for k in list(running):
            start = time.perf_counter()
            if next(running[k], None) is None:
                del running[k]
            else:
                token_ms[k].append((time.perf_counter() - start) * 1e3)
    return {k: (gens[k], token_ms[k]) for k in gens}


def lockstep_rates(variants: dict, calibration, n: int, rounds: int) -> tuple[dict, dict]:
    """Decode tokens/s of every variant's greedy generation of n tokens, from the median decode
    token, over rounds of lockstep() (each round starting from the next variant). Returns the rates
    per round and the decode steps of the last round, per variant."""
    keys = list(variants)
    rates = {k: [] for k in keys}
    steps = {}
    for i in range(rounds):
        order = keys[i % len(keys):] + keys[: i % len(keys)]
        done = lockstep({k: (variants[k], GenConfig(PROMPT, max_new_tokens=n, ignore_eos=True)) for k in order},
                        calibration)
        for k, (gen, token_ms) in done.items():
            rates[k].append(1e3 / statistics.median(token_ms[1:]))  # the first token came with the prefill
            steps[k] = [s for s in gen.steps if s["kind"] == "decode"]
    return rates, steps
