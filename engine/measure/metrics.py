"""Run metrics under the names the field uses (TTFT, TPOT, ITL percentiles, tokens/s)."""
from __future__ import annotations

import numpy as np


def percentile(values, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def itl_percentiles(itl: list[float]) -> dict:
    """The inter-token latencies' p50, p90 and p99 (ms), None without any: one numpy call for the three, as a run
    ends in the middle of other runs' steps."""
    figures = np.percentile(itl, (50, 90, 99)).tolist() if itl else [None] * 3
    return dict(zip(("itl_p50_ms", "itl_p90_ms", "itl_p99_ms"), figures))


def run_metrics(token_times_ms: list[float], n_prompt_tokens: int) -> dict:
    """token_times_ms: when each new token was ready, measured from the request start."""
    n = len(token_times_ms)
    total = token_times_ms[-1] if n else None
    ttft = token_times_ms[0] if n else None
    itl = [b - a for a, b in zip(token_times_ms, token_times_ms[1:])]
    tpot = (total - ttft) / (n - 1) if n > 1 else None
    return {
        "n_prompt_tokens": n_prompt_tokens,
        "n_new_tokens": n,
        "ttft_ms": ttft,
        "tpot_ms": tpot,
        "total_ms": total,
        "tokens_per_s": n / total * 1e3 if n and total > 0 else None,
        "decode_tokens_per_s": 1e3 / tpot if tpot else None,
        "itl_ms": itl,
        **itl_percentiles(itl),
    }
