"""Capacity planning on the simulation: one level at a request rate, the offline maximum, the highest rate that
holds an SLO (bracketed by the offline rate, then bisected), GPUs for a target rate, cost and energy per token.

Data-parallel instances share the arrivals evenly, so a level of K instances is one instance at rate / K."""
from __future__ import annotations

import json
import math
from dataclasses import replace
from itertools import product

import numpy as np

from engine.measure import slo as slos
from engine.plan import planner
from engine.plan import simulate as sim
from engine.plan.planner import PlanError, Setup

BISECTIONS = 7  # rate steps of the search: the capacity is found within (offline rate / floor) ^ (1 / 2^7)
FLOOR = 50  # the lowest rate tried: the offline rate / FLOOR, where queueing is negligible
WAVES = 4  # a level's arrivals last this many request lifetimes (at low load), the saturation run this many full batches
MAX_REQUESTS = 3000


def prices() -> dict:
    return json.loads((planner.DATA / "gpu_prices.json").read_text())


def price_per_gpu_hour(gpu: dict, override: float | None = None) -> float:
    """The price of one GPU-hour: the override, else data/gpu_prices.json's offer for this GPU."""
    if override is not None:
        if isinstance(override, bool) or not isinstance(override, (int, float)) or not override > 0 \
                or math.isinf(override):
            raise PlanError(f"The price per GPU-hour must be a positive number of dollars, not {override}.")
        return float(override)
    offer = prices()["prices"].get(gpu["id"])
    if not offer:
        raise PlanError(f"No price per GPU-hour is known for the {gpu['name']}: give one with --price-per-gpu-hour.")
    return offer["usd_per_gpu_hour"]


def power_w(gpu: dict, utilisation: float) -> float:
    """Estimated board power at this utilisation: an idle share of the data sheet's power plus the rest in use."""
    data = prices()
    board = data["power"].get(gpu["id"])
    if not board:
        raise PlanError(f"No board power is known for the {gpu['name']}, so energy per token cannot be estimated.")
    idle = data["idle_share"]
    return board["board_power_w"] * (idle + (1 - idle) * utilisation)


def run_level(setup: Setup, workload: sim.Workload, scheduler: sim.Scheduler, instances: int = 1) -> dict:
    """One simulated level for `instances` replicas: one replica at the rate / instances."""
    planner.shapes.whole("instances", instances)
    rate = sim.check_rate(workload.rate)
    return sim.simulate(setup, replace(workload, rate=rate / instances), scheduler)


def offline(setup: Setup, workload: sim.Workload, scheduler: sim.Scheduler, instances: int = 1) -> dict:
    """Every request waiting at the start: the maximum throughput and where a token's time goes there."""
    s = run_level(setup, replace(workload, rate=math.inf), scheduler)["summary"]
    return {"output_tokens_per_s": s["output_tokens_per_s"] * instances,
            "requests_per_s": s["requests_per_s"] * instances, "batch": s["mean_batch"],
            "distances_ms_per_token": s["distances_ms_per_token"], "preemptions": s["preemptions"],
            "ttft_ms_p50": s["ttft_ms_p50"], "tpot_ms_p50": s["tpot_ms_p50"], "instances": instances,
            "gpus": setup.gpus * instances, "estimate": True}


def at_rate(setup: Setup, workload: sim.Workload, scheduler: sim.Scheduler, slo: dict, q: float = 99,
            instances: int = 1) -> dict:
    """Latency percentiles, goodput and attainment at one request rate."""
    level = run_level(setup, workload, scheduler, instances)
    s, scored = level["summary"], sim.score(level, slo)
    tag = f"p{q:g}"
    return {"rate_requests_per_s": workload.rate, "slo": slos.format_slo(slo), "percentile": q,
            "ttft_ms_p50": s["ttft_ms_p50"], f"ttft_ms_{tag}": slos.percentile(level["requests"], "ttft_ms", q),
            "tpot_ms_p50": s["tpot_ms_p50"], f"tpot_ms_{tag}": slos.percentile(level["requests"], "tpot_ms", q),
            "e2e_ms_p50": s["e2e_ms_p50"], f"e2e_ms_{tag}": slos.percentile(level["requests"], "e2e_ms", q),
            "goodput_requests_per_s": scored["goodput_requests_per_s"] * instances,
            "goodput_tokens_per_s": scored["goodput_tokens_per_s"] * instances, "attainment": scored["attainment"],
            "output_tokens_per_s": s["output_tokens_per_s"] * instances, "batch": s["mean_batch"],
            "preemptions": s["preemptions"], "distances_ms_per_token": s["distances_ms_per_token"],
            "instances": instances, "gpus": setup.gpus * instances, "estimate": True}


def holds(level: dict, slo: dict, q: float | None, attainment: float | None) -> bool:
    return slos.meets(level["requests"], slo, q, attainment)


def limiting(level: dict, slo: dict, q: float | None) -> tuple[str, str]:
    """(the metric that fails first, the largest bucket of a token at that load: queueing counts as time)."""
    if q is not None:
        metric = slos.worst_metric(level["requests"], slo, q)[0]
    else:
        misses = {m: sum(r[m] > target for r in level["requests"]) for m, target in slo.items()}
        metric = max(misses, key=misses.get)
    buckets = level["summary"]["distances_ms_per_token"]
    return metric, max(buckets, key=buckets.get)


def highest_rate(setup: Setup, workload: sim.Workload, scheduler: sim.Scheduler, slo: dict, q: float | None = 99,
                 attainment: float | None = None) -> tuple[float, dict, float, str, str]:
    """The search alone, for one replica: (the highest rate that holds, its simulated level, the saturated rate,
    the metric that fails first, the largest bucket of a token there)."""
    if q is not None and not 0 < q <= 100:
        raise PlanError(f"The percentile must be above 0 and at most 100, not {q:g}.")
    if attainment is not None and not 0 < attainment <= 1:
        raise PlanError(f"The attainment must be a share above 0 and at most 1, not {attainment:g}.")
    # enough requests to keep the batch full for several rounds, so the drain at the end is a small share
    saturated = sim.simulate(setup, replace(workload, rate=math.inf,
                                            requests=max(workload.requests, WAVES * scheduler.max_num_seqs)), scheduler)
    top = saturated["summary"]["requests_per_s"]
    lo_rate, hi_rate = top / FLOOR, top
    low = sim.simulate(setup, replace(workload, rate=lo_rate), scheduler)
    if not holds(low, slo, q, attainment):
        metric, bucket = limiting(low, slo, q)
        raise Unreachable(setup, metric, bucket, low, slo, q)
    settle_s = low["summary"]["e2e_ms_p50"] / 1e3

    def level(rate):
        """A level whose arrivals last several request lifetimes, so a queue that grows shows it."""
        n = min(max(workload.requests, math.ceil(rate * WAVES * settle_s)), MAX_REQUESTS)
        return sim.simulate(setup, replace(workload, rate=rate, requests=n), scheduler)

    best, first_miss = low, None
    high = level(hi_rate)
    if holds(high, slo, q, attainment):
        best, lo_rate = high, hi_rate
    else:
        first_miss = high
        for _ in range(BISECTIONS):
            mid = math.sqrt(lo_rate * hi_rate)
            trial = level(mid)
            if holds(trial, slo, q, attainment):
                lo_rate, best = mid, trial
            else:
                hi_rate, first_miss = mid, trial
    # holding the SLO up to the saturated rate: throughput, not latency, ends capacity
    if first_miss:
        metric, bucket = limiting(first_miss, slo, q)
    else:
        steps = saturated["summary"]["step_distances_ms_per_token"]
        metric, bucket = "throughput", max(steps, key=steps.get)
    return lo_rate, best, top, metric, bucket


def capacity(setup: Setup, workload: sim.Workload, scheduler: sim.Scheduler, slo: dict, q: float | None = 99,
             attainment: float | None = None, instances: int = 1, target_rate: float | None = None,
             price: float | None = None) -> dict:
    """The highest request rate at which the SLO holds, with GPUs for the target, $ and J per output token."""
    if target_rate is not None:
        sim.check_rate(target_rate, "target rate")
    lo_rate, best, top, metric, bucket = highest_rate(setup, workload, scheduler, slo, q, attainment)
    s = best["summary"]
    replica_gpus = setup.gpus
    per_hour = price_per_gpu_hour(setup.gpu, price) * replica_gpus
    tokens_per_s = lo_rate * np.mean([r["output_tokens"] for r in best["requests"]])  # in a steady state
    input_per_s = lo_rate * np.mean([r["prompt_tokens"] for r in best["requests"]])
    result = {"model": setup.model.name, "gpu": setup.gpu["id"], "gpus_per_instance": replica_gpus,
              "tp": planner.tp_degree(setup), "pp": setup.pp, "instances": instances, "gpus": replica_gpus * instances,
              "weights": setup.weights, "kv_dtype": setup.kv_dtype, "slo": slos.format_slo(slo), "percentile": q,
              "attainment_target": attainment,
              "capacity_requests_per_s": lo_rate * instances, "output_tokens_per_s": tokens_per_s * instances,
              "saturation_requests_per_s": top * instances,
              "limiting_metric": metric, "limiting_bucket": bucket, "attainment": slos.attainment(best["requests"], slo),
              "ttft_ms_p50": s["ttft_ms_p50"], "tpot_ms_p50": s["tpot_ms_p50"], "batch": s["mean_batch"],
              "distances_ms_per_token": s["distances_ms_per_token"],
              "usd_per_gpu_hour": per_hour / replica_gpus,
              # each charges the whole GPU-hour to one kind of token, as per-token price lists do not split it
              "usd_per_million_output_tokens": per_hour / (tokens_per_s * 3600) * 1e6,
              "usd_per_million_input_tokens": per_hour / (input_per_s * 3600) * 1e6,
              "usd_per_million_tokens": per_hour / ((tokens_per_s + input_per_s) * 3600) * 1e6,
              "joules_per_output_token": replica_gpus * power_w(setup.gpu, s["busy_fraction"]) / tokens_per_s,
              "estimate": True}
    if target_rate is not None:
        replicas = math.ceil(target_rate / lo_rate - 1e-9)
        result.update({"target_rate_requests_per_s": target_rate, "replicas_for_target": replicas,
                       "gpus_for_target": replicas * replica_gpus, "usd_per_hour_for_target": replicas * per_hour})
    return result


class Unreachable(PlanError):
    """The SLO fails even at almost no load; the message names the metric and the bucket that stop it."""

    def __init__(self, setup: Setup, metric: str, bucket: str, level: dict, slo: dict, q: float | None):
        self.metric, self.bucket = metric, bucket
        figure = slos.percentile(level["requests"], metric, q or 50)
        super().__init__(f"{setup.model.name} on {setup.gpus} x {setup.gpu['name']} misses {metric} = {slo[metric]:g} "
                         f"even at almost no load ({'p%g' % (q or 50)} {figure:.1f} ms), and the {bucket} distance is "
                         "most of a token's time there.")


def compare(base: Setup, gpu_ids: list[str], gpu_counts: list[int], workload: sim.Workload,
            scheduler: sim.Scheduler, slo: dict, q: float | None = 99, attainment: float | None = None,
            instances: int = 1, target_rate: float | None = None, price: float | None = None,
            interconnect=None) -> dict:
    """Capacity of every GPU type x count (tensor parallel over the count): the cheapest for the target first
    (per million output tokens without a target); the ones that cannot run it, with why."""
    rows, skipped, unreachable = [], [], []
    for gpu_id, n in product(gpu_ids, gpu_counts):
        gpu = planner.get_gpu(gpu_id)
        setup = replace(base, gpu=gpu, gpus=n, tp=None, pp=1,
                        interconnect=interconnect(gpu) if callable(interconnect) else base.interconnect)
        try:
            if not planner.plan(setup)["fits"]:
                skipped.append({"gpu": gpu_id, "gpus": n, "why": "the weights and one request's KV cache do not fit"})
                continue
            rows.append(capacity(setup, workload, scheduler, slo, q, attainment, instances, target_rate, price))
        except Unreachable as e:
            unreachable.append(e)
            skipped.append({"gpu": gpu_id, "gpus": n, "why": str(e)})
        except PlanError as e:
            if "price" in str(e) or "power" in str(e):
                raise
            skipped.append({"gpu": gpu_id, "gpus": n, "why": str(e)})
    if not rows:
        if unreachable:
            buckets = sorted({e.bucket for e in unreachable})
            raise PlanError(f"No configuration meets the SLO even at almost no load: {unreachable[0].metric} is the "
                            f"metric that fails and the {' and '.join(buckets)} distance stops it.")
        raise PlanError("No configuration can run this model: " + skipped[0]["why"] if skipped else
                        "Give at least one GPU type and count.")
    key = "usd_per_hour_for_target" if target_rate is not None else "usd_per_million_output_tokens"
    rows.sort(key=lambda r: r[key])
    return {"configurations": rows, "skipped": skipped, "sorted_by": key, "estimate": True}
