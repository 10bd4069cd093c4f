"""Latency targets (SLOs) and goodput, shared by measured load sweeps and the planner's simulation.

Definitions follow `vllm bench serve --goodput`: a request is good when it meets every target (<=)."""
from __future__ import annotations

import math

import numpy as np

from engine.errors import UserError

# ttft: send to first token; tpot: (e2e - ttft) / (output tokens - 1), 0 for one token; itl: the request's
# largest gap between tokens (tpot already holds the mean gap); e2e: send to last token. All in ms.
METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
EXAMPLE = "ttft_ms=500,tpot_ms=50"
KEPT_UP = 0.8  # a rate level whose requests leave at under this share of the arrival rate is overloaded


class SLOError(UserError):
    """An SLO string or figure that cannot be used; the message is one sentence."""


def parse_slo(text: str) -> dict[str, float]:
    """'ttft_ms=500,tpot_ms=50' -> {'ttft_ms': 500.0, 'tpot_ms': 50.0}; every target a positive number of ms."""
    if not isinstance(text, str) or not text.strip():
        raise SLOError(f"Give an SLO as metric=milliseconds pairs, e.g. {EXAMPLE}.")
    slo: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        name = name.strip().lower()
        if not sep or not name:
            raise SLOError(f"Cannot read {part.strip()!r} in the SLO: write metric=milliseconds, e.g. {EXAMPLE}.")
        if name not in METRICS:
            raise SLOError(f"Unknown SLO metric {name!r}: use {', '.join(METRICS)}.")
        if name in slo:
            raise SLOError(f"The SLO names {name} twice: give each metric once.")
        try:
            target = float(value)
        except ValueError:
            raise SLOError(f"The SLO target for {name} must be a number of milliseconds, not {value.strip()!r}.") from None
        if not math.isfinite(target) or target <= 0:
            raise SLOError(f"The SLO target for {name} must be a positive number of milliseconds, not {value.strip()}.")
        slo[name] = target
    return slo


def format_slo(slo: dict[str, float]) -> str:
    return ",".join(f"{k}={v:g}" for k, v in slo.items())


def request_metrics(token_times_s: list[float], send_s: float = 0.0) -> dict:
    """The four metrics (ms) of one request from its send time and the arrival time of each output token."""
    if not token_times_s:
        return {"ttft_ms": None, "tpot_ms": None, "itl_ms": None, "e2e_ms": None, "output_tokens": 0}
    times = np.asarray(token_times_s, dtype=float)
    ttft, e2e, n = (times[0] - send_s) * 1e3, (times[-1] - send_s) * 1e3, len(times)
    return {"ttft_ms": ttft, "tpot_ms": (e2e - ttft) / (n - 1) if n > 1 else 0.0,
            "itl_ms": float(np.diff(times).max()) * 1e3 if n > 1 else 0.0, "e2e_ms": e2e, "output_tokens": n}


def is_good(request: dict, slo: dict[str, float]) -> bool:
    """Whether a finished request met every target; a failed request (ok False or a metric missing) never is."""
    if request.get("ok") is False:
        return False
    return all(request.get(name) is not None and request[name] <= target for name, target in slo.items())


def attainment(requests: list[dict], slo: dict[str, float]) -> float:
    """Share of requests that were good (failed ones count against it); 0 when there are none."""
    return sum(is_good(r, slo) for r in requests) / len(requests) if requests else 0.0


def goodput(requests: list[dict], slo: dict[str, float], duration_s: float) -> dict:
    """Good requests per second and their output tokens per second over the level's duration."""
    if not duration_s > 0:
        raise SLOError("Goodput needs a positive duration.")
    good = [r for r in requests if is_good(r, slo)]
    return {"goodput_requests_per_s": len(good) / duration_s,
            "goodput_tokens_per_s": sum(r.get("output_tokens", 0) for r in good) / duration_s,
            "attainment": attainment(requests, slo)}


def percentile(requests: list[dict], name: str, q: float) -> float | None:
    """The q-th percentile of a metric over the requests that have it (failed ones count as infinitely late)."""
    values = [math.inf if r.get("ok") is False or r.get(name) is None else r[name] for r in requests]
    if not values:
        return None
    # interpolating towards an infinite value gives nan; take the order statistic above instead
    return float(np.percentile(values, q, method="higher" if math.inf in values else "linear"))


def worst_metric(requests: list[dict], slo: dict[str, float], q: float) -> tuple[str, float]:
    """(the metric furthest over or nearest its target at the q-th percentile, that percentile / target)."""
    ratios = {name: percentile(requests, name, q) / target for name, target in slo.items()}
    name = max(ratios, key=ratios.get)
    return name, ratios[name]


def meets(requests: list[dict], slo: dict[str, float], q: float | None = None,
          target_attainment: float | None = None) -> bool:
    """Whether a level holds the SLO: each metric's q-th percentile within its target, and/or the attainment."""
    ok = True
    if q is not None:
        ok = worst_metric(requests, slo, q)[1] <= 1.0
    if target_attainment is not None:
        ok = ok and attainment(requests, slo) >= target_attainment
    return ok


def kept_up(ends_s: list[float], rate: float | None) -> tuple[float | None, bool | None]:
    """(departures per second, whether they kept up with `rate` arrivals per second) of a level whose requests ended
    at ends_s: a server that keeps up lets requests leave as fast as they arrive; one that does not, at its own pace.
    None for either where fewer than three ended or no rate was set."""
    ends = sorted(ends_s)
    departures = (len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) >= 3 and ends[-1] > ends[0] else None
    return departures, departures >= KEPT_UP * rate if departures and rate else None


def overlapped(spans_ms: list[tuple[float, float]]) -> bool | None:
    """Whether any request was sent while another was in flight, from each request's (sent, ended) times; None where
    none ended. A level whose requests each ran alone measured the server unloaded: no lower rate does better."""
    if not spans_ms:
        return None
    last_end = -math.inf
    for start, end in sorted(spans_ms):
        if start < last_end:
            return True
        last_end = max(last_end, end)
    return False
