"""Latency by distance: split a step's measured wall time into five buckets that sum to it.

The formulas (FORMULAS, which the Home page shows as they are):

    physical = upload + download/sync                        (crossing a link)
    memory   = min(bytes moved / calibrated bandwidth, forward)
    compute  = min(max(FLOPs / calibrated peak - memory estimate, 0), forward - memory)
    time     = forward - memory - compute + draft + select + host   (serial waiting)
    decision = waste x (memory + compute + forward part of time), taken from those three,
               plus the share of the draft phase spent on rejected guesses

where waste is the fraction of the forward's roofline spent on work whose result is thrown away,
1 - roofline(useful work) / roofline(work done), and roofline(w) = max(bytes/bandwidth,
FLOPs/peak). Every switch reports its waste the same way: by naming the useful work of a step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the attribution itself needs no torch
    from engine.measure.accounting import ForwardWork

BUCKETS = ("physical", "memory", "compute", "time", "decision")
PHASES = ("draft", "upload", "forward", "sync", "select", "host")
FORMULAS = __doc__.split("as they are):\n\n", 1)[1]


@dataclass(frozen=True)
class Roofline:
    memory_gbps: float
    peak_gflops: float

    def memory_ms(self, work: ForwardWork) -> float:
        return work.bytes_moved / (self.memory_gbps * 1e9) * 1e3

    def compute_ms(self, work: ForwardWork) -> float:
        return work.flops / (self.peak_gflops * 1e9) * 1e3

    def time_ms(self, work: ForwardWork) -> float:
        return max(self.memory_ms(work), self.compute_ms(work))


def waste_fraction(roofline: Roofline, work: ForwardWork, useful: ForwardWork | None) -> float:
    if useful is None:
        return 0.0
    done = roofline.time_ms(work)
    if done <= 0:
        return 0.0
    return min(max(1.0 - roofline.time_ms(useful) / done, 0.0), 1.0)


def attribute(phases_ms: dict, work: ForwardWork, roofline: Roofline, waste: float = 0.0,
              draft_waste: float = 0.0) -> dict:
    """The five buckets of one step (ms) plus the estimates they came from. draft_waste is the share
    of the draft phase spent on guesses the target rejected."""
    forward = phases_ms["forward"]
    memory_est = roofline.memory_ms(work)
    compute_est = roofline.compute_ms(work)
    memory = min(memory_est, forward)
    compute = min(max(compute_est - memory_est, 0.0), forward - memory)
    waiting_in_forward = forward - memory - compute
    keep = 1.0 - waste
    buckets = {
        "physical": phases_ms["upload"] + phases_ms["sync"],
        "memory": memory * keep,
        "compute": compute * keep,
        "time": waiting_in_forward * keep + phases_ms["draft"] * (1 - draft_waste) + phases_ms["select"]
        + phases_ms["host"],
        "decision": forward * waste + phases_ms["draft"] * draft_waste,
    }
    return {
        "buckets": buckets,
        "memory_est_ms": memory_est,
        "compute_est_ms": compute_est,
        "roofline_ms": max(memory_est, compute_est),
        "waste_fraction": waste,
    }


def split_over_tokens(buckets: dict, n_tokens: int) -> dict:
    return {b: buckets[b] / n_tokens for b in BUCKETS}


def sum_buckets(rows) -> dict:
    totals = dict.fromkeys(BUCKETS, 0.0)
    for row in rows:
        for b in BUCKETS:
            totals[b] += row[b]
    return totals


def cache_read_gbps(calibration: dict, working_set: float) -> float | None:
    """The rate bytes read again and again (each decode step reads the same weights as the one before) are read
    at where they stay in the last-level cache, from the calibration's reads of such weights: its rate at the share
    of the cache it read, at most that many bytes; between that and the whole cache, the line between the two rates
    it measured (more of the bytes are evicted by the other work the cache serves); None beyond, or where that line
    falls to the memory peak (the bytes come from memory), or without those reads."""
    cache = calibration.get("cache_read")
    if not cache or working_set > cache.get("whole", cache)["bytes"]:
        return None
    if working_set <= cache["bytes"]:
        return cache["gbps"]
    whole = cache["whole"]
    rate = cache["gbps"] + (whole["gbps"] - cache["gbps"]) * (working_set - cache["bytes"]) / (whole["bytes"]
                                                                                            - cache["bytes"])
    return rate if rate > calibration["memory_gbps"] else None
