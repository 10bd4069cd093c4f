"""Prefill/decode disaggregation as a what-if: the same GPUs split into a prefill pool and a decode pool, each
request's KV cache sent from one to the other over a link one chooses, against the same GPUs co-located.

Both pools are instances of the setup (tp x pp GPUs each), as are the co-located replicas. A prefill instance runs
prompts only (a request leaves it with its first token); its KV cache then crosses the link, every GPU of the
instance sending its own shard at once over its own link:

    transfer = hop latency + KV bytes of the prompt per GPU / (link GB/s x link efficiency)

and a decode instance admits it with its cache in place and decodes the rest. TTFT is the prefill pool's TTFT plus
the transfer (the first token reaches the user from the decode side); TPOT is the decode pool's, now in steps that
carry no prompt. The decode pool's arrivals are taken as the same kind of stream as the prefill pool's, at the rate
shared over its instances (a stable queue's departures keep its arrivals' rate)."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from engine.plan import kvcalc
from engine.plan import planner
from engine.plan import simulate as sim
from engine.plan.planner import PlanError, Setup

PERCENTILES = (50, 99)


def parse_pools(text: str) -> tuple[int, int]:
    """'PREFILL_GPUS:DECODE_GPUS' as two positive whole numbers."""
    parts = str(text).split(":")
    try:
        prefill, decode = (int(p) for p in parts)
    except ValueError:
        raise PlanError(f"Give the pools as PREFILL_GPUS:DECODE_GPUS, e.g. 2:6, not {text!r}.") from None
    if prefill < 1 or decode < 1:
        raise PlanError(f"Each pool needs at least one GPU, not {text!r}.")
    return prefill, decode


def pool_instances(setup: Setup, gpus: int, pool: str) -> int:
    if gpus % setup.gpus:
        raise PlanError(f"The {pool} pool's {gpus} GPUs do not split into instances of {setup.gpus} (tp x pp): give a "
                        "multiple of it.")
    return gpus // setup.gpus


def check_link(setup: Setup, link: str, gpus: int) -> dict:
    """The link between the pools: an interconnect of data/gpus.json that reaches all `gpus` GPUs."""
    links = planner.interconnects()
    if link not in links:
        raise PlanError(f"Unknown link {planner.shapes._show(link)}: use one of {', '.join(links)}.")
    most = setup.gpu["gpu_link"].get("max_gpus") or planner.NODE_GPUS
    if links[link]["link"] == "gpu" and gpus > most:
        raise PlanError(f"The {setup.gpu['name']}'s {setup.gpu['gpu_link']['name']} joins at most {most} GPUs, one "
                        f"node, so pools of {gpus} GPUs in all exchange their caches over infiniband or ethernet.")
    planner.link_gbps(replace(setup, interconnect=link))  # refuses a GPU link the GPU does not have
    return links[link]


def kv_transfer_ms(setup: Setup, prompt_tokens: int, link: str) -> dict:
    """Sending one request's prompt cache from a prefill instance to a decode instance: the bytes each GPU sends
    (its tensor-parallel heads of its pipeline stage's layers), the link's bandwidth and the time."""
    hop = planner.interconnects()[link]["hop_latency_us"]
    per_gpu = kvcalc.kv_bytes(setup.model.spec, prompt_tokens, setup.kv_dtype, 1, planner.tp_degree(setup)) / setup.pp
    gbps = planner.link_gbps(replace(setup, interconnect=link)) * setup.efficiency.link
    return {"bytes_per_gpu": per_gpu, "bytes": per_gpu * setup.gpus, "link_gbps": gbps,
            "ms": (hop + per_gpu / (gbps * 1e3)) / 1e3}


def latency(ttft: list[float], tpot: list[float]) -> dict:
    out = {}
    for name, values in (("ttft_ms", ttft), ("tpot_ms", tpot)):
        for q in PERCENTILES:
            out[f"{name}_p{q}"] = float(np.percentile(values, q))
    return out


def disaggregate(setup: Setup, workload: sim.Workload, scheduler: sim.Scheduler, prefill_gpus: int,
                 decode_gpus: int, link: str) -> dict:
    """TTFT and TPOT at the workload's rate with the GPUs split into pools, and the same GPUs co-located."""
    planner.check_setup(setup)
    rate = sim.check_rate(workload.rate)
    if math.isinf(rate):
        raise PlanError("Disaggregation is compared at a request rate: give one with --rate.")
    prefill_n = pool_instances(setup, planner.shapes.whole("prefill_gpus", prefill_gpus), "prefill")
    decode_n = pool_instances(setup, planner.shapes.whole("decode_gpus", decode_gpus), "decode")
    check_link(setup, link, prefill_gpus + decode_gpus)
    colocated = sim.simulate(setup, replace(workload, rate=rate / (prefill_n + decode_n)), scheduler)
    prefill = sim.simulate(setup, replace(workload, rate=rate / prefill_n, new_tokens=1), scheduler)
    decode = sim.simulate(setup, replace(workload, rate=rate / decode_n, prefilled=True), scheduler)
    transfers = [kv_transfer_ms(setup, r["prompt_tokens"], link)["ms"] for r in prefill["requests"]]
    mean = kv_transfer_ms(setup, workload.prompt_tokens, link)
    rows = colocated["requests"]
    return {"model": setup.model.name, "gpu": setup.gpu["id"], "gpus_per_instance": setup.gpus,
            "rate_requests_per_s": rate, "link": link, "prefill_gpus": prefill_gpus, "decode_gpus": decode_gpus,
            "kv_bytes_per_request": mean["bytes"], "kv_transfer_ms": mean["ms"], "link_gbps": mean["link_gbps"],
            "colocated": {"instances": prefill_n + decode_n, "gpus": prefill_gpus + decode_gpus,
                          **latency([r["ttft_ms"] for r in rows], [r["tpot_ms"] for r in rows]),
                          "output_tokens_per_s": colocated["summary"]["output_tokens_per_s"] * (prefill_n + decode_n)},
            "disaggregated": {"prefill_instances": prefill_n, "decode_instances": decode_n,
                              **latency([r["ttft_ms"] + t for r, t in zip(prefill["requests"], transfers)],
                                        [r["tpot_ms"] for r in decode["requests"]]),
                              "prefill_ttft_ms_p50": prefill["summary"]["ttft_ms_p50"],
                              "decode_batch": decode["summary"]["mean_batch"],
                              "output_tokens_per_s": decode["summary"]["output_tokens_per_s"] * decode_n},
            "estimate": True}
