"""Batching: aggregate decode tokens/s of B identical requests decoded together against one alone, at fp32 and
at the fastest level, and one sequence through the batch engine against the plain decode loop, in lockstep.

Each round measures every (level, batch) once, the order rotating from round to round, so a burst of load on
a shared machine does not favour one of them. A batch's decode rate is B tokens over the median step once every
sequence is past its prefill; per user it is one token over that step. On a machine shared with other work a
step's wall time is mostly waiting for a core, so each step's CPU time (the process's, both threads) is printed
beside it: tokens per CPU second compare the work a token costs at each batch. The single-sequence check advances the
plain loop (engine.run.generate) and a one-user batch engine one token each in turn (bench/common.py's in_turn)
and compares their median decode tokens. Writes bench/results/batching.md.

    .venv/bin/python bench/batching.py [--tokens 48] [--rounds 3] [--batches 1,2,4,8] [--levels fp32,int4-dyn]
"""
import argparse
import statistics
import time

from common import PROMPT, in_turn, ratio, recorded  # first: the engine sets OpenMP's wait policy before torch loads
from engine.measure import hardware
from engine.model.loader import load_model
from engine.run.batch import BatchEngine
from engine.run.generate import GenConfig, Generation
from engine.switches.quant import quantize


def request(n: int) -> GenConfig:
    return GenConfig(PROMPT, max_new_tokens=n, ignore_eos=True)


def decode_step_ms(lm, users: int, n: int, calibration) -> tuple[list[float], list[float]]:
    """The wall time and the process's CPU time (all its threads) of each step of `users` identical requests
    once all of them decode (no prefill in it), in ms."""
    engine = BatchEngine(lm, max_batch=users, calibration=calibration)
    seqs = [engine.submit(request(n)) for _ in range(users)]
    wall, cpu = [], []
    while True:
        all_decoding = all(s.phase == "decode" for s in seqs)
        start, start_cpu = time.perf_counter(), time.process_time()
        if not engine.step():
            return wall, cpu
        if all_decoding:
            wall.append((time.perf_counter() - start) * 1e3)
            cpu.append((time.process_time() - start_cpu) * 1e3)


def engine_tokens(lm, n: int, calibration):
    """A one-user batch engine as an iterator: one item per step, as a Generation yields one per token."""
    engine = BatchEngine(lm, max_batch=1, calibration=calibration)
    engine.submit(request(n))
    while engine.step():
        yield True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--levels", default="fp32,int4-dyn")
    args = parser.parse_args()
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


if __name__ == "__main__":
    with recorded("batching"):
        main()
