"""What the benchmarks share: the prompt and a decode rate that resists a shared machine's spikes."""
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.generate import Generation, GenConfig  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def decode_run(lm, calibration, n: int) -> tuple[float, list[dict]]:
    """Decode tokens/s from the median decode step of one greedy run of n tokens, and those steps."""
    gen = Generation(lm, GenConfig(PROMPT, max_new_tokens=n, ignore_eos=True), calibration=calibration)
    gen.run()
    steps = [s for s in gen.steps if s["kind"] == "decode"]
    return 1e3 / statistics.median(s["wall_ms"] for s in steps), steps
