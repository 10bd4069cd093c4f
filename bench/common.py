"""What the benchmarks share: the prompt and decode rates that resist a shared machine's spikes."""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.generate import Generation, GenConfig  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def lockstep_rates(variants: dict, calibration, n: int, rounds: int) -> tuple[dict, dict]:
    """Decode tokens/s of every variant, its greedy generations advanced one token each in turn
    (each round starting from the next variant), so that a burst of load on a shared machine slows
    them all alike; alternating whole runs leaves each run to its own stretch of luck. A token's
    time is the time spent inside its generation (the step, its selection and bookkeeping); the
    rate comes from the median over decode tokens. Returns the rates per round and the decode
    steps of the last round, per variant."""
    keys = list(variants)
    rates = {k: [] for k in keys}
    steps = {}
    for i in range(rounds):
        order = keys[i % len(keys):] + keys[: i % len(keys)]
        gens = {k: Generation(variants[k], GenConfig(PROMPT, max_new_tokens=n, ignore_eos=True),
                              calibration=calibration, telemetry=False) for k in order}
        running = {k: iter(g) for k, g in gens.items()}
        token_ms = {k: [] for k in order}
        while running:
            for k in list(running):
                start = time.perf_counter()
                if next(running[k], None) is None:
                    del running[k]
                else:
                    token_ms[k].append((time.perf_counter() - start) * 1e3)
        for k, g in gens.items():
            rates[k].append(1e3 / statistics.median(token_ms[k][1:]))  # the first token came with the prefill
            steps[k] = [s for s in g.steps if s["kind"] == "decode"]
    return rates, steps
