"""When requests arrive and how long they are, drawn as `vllm bench serve` draws them: shared by load sweeps
against a server and the planner's simulation of one, so a measured level and a simulated one see the same traffic."""
from __future__ import annotations

import numpy as np


def schedule(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Arrival offsets (s) of n requests: gamma gaps of shape b and mean 1/rate (b = 1: Poisson),
    summed and scaled so the last arrives at n / rate, as vllm bench serve does."""
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    times = np.cumsum(gaps)
    return (times * (n / rate) / times[-1]).tolist()


def lengths(n: int, mean: int, spread: float, rng: np.random.Generator) -> list[int]:
    """n lengths uniform in [mean (1 - spread), mean (1 + spread)], at least 1 (spread 0: all mean)."""
    low, high = max(1, round(mean * (1 - spread))), max(1, round(mean * (1 + spread)))
    return rng.integers(low, high + 1, size=n).tolist()


def level_rng(seed: int, level: int) -> np.random.Generator:
    """The generator of a sweep's level: one stream per seed and level number, so a level's traffic is the same
    however many levels ran before it, and a simulation of level k replays what the sweep sends at level k."""
    return np.random.default_rng([seed, level])
