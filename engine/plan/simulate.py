"""Continuous batching as a discrete-event simulation: requests arrive, a vLLM-like scheduler batches them while
KV memory lasts, and every step lasts what the planner's five-bucket forward of that batch costs.

Each iteration: the running sequences first (a decode token each, or their next prefill chunk), preempting the
newest running sequence by recomputation when the KV blocks run out; then waiting requests while the token budget,
the sequence limit and the blocks allow. A request's first token comes at the end of the step that completes its
prefill. An engine whose forwards are not fused (the local engine, `separate_prefills`) runs each prefill chunk as a
forward of its own (but a prompt's last token alone, which rides the decode) and then one batched decode, one after
another in the step. A token's time at this load is split into the buckets of the steps its request was in, and the
time distance takes the rest (waiting in the queue, steps it sat out)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from engine.measure import arrivals

from engine.measure import slo as slos
from engine.measure.distances import BUCKETS
from engine.plan import kvcalc
from engine.plan import planner
from engine.plan.planner import PlanError, Setup

BLOCK_TOKENS = 16  # vLLM's default KV block size
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Workload:
    """Arrivals and lengths: `rate` requests/s (inf: all at time 0, the offline scenario), gamma gaps of shape
    `burstiness` (1 = Poisson), mean prompt and output tokens spread uniformly by +/- `length_spread`. `prefilled`:
    each request arrives with its prompt's KV cache and its first token (from a prefill pool), so it only decodes.
    `level`: the number of a load sweep's level with the same seed; at a finite rate the simulation then replays the
    arrival offsets and lengths that level of the sweep sends (engine.measure.arrivals.level_rng)."""
    requests: int = 200
    rate: float = math.inf
    burstiness: float = 1.0
    prompt_tokens: int = 128
    new_tokens: int = 256
    length_spread: float = 0.0
    seed: int = 0
    prefilled: bool = False
    level: int = 0


@dataclass(frozen=True)
class Scheduler:
    """The engine's limits: sequences per step, tokens per step, chunked prefill, the share of GPU memory it takes,
    and how it claims KV blocks: as a sequence grows, preempting when they run out (vLLM), or `reserve_full`, its whole
    prompt and output at admission so nothing is ever evicted (TensorRT-LLM's default GUARANTEED_NO_EVICT).
    `separate_prefills`: a step runs each sequence's prefill chunk as a forward of its own, then one forward of every
    decoding sequence, which a prompt's last token joins where its chunks computed the rest (engine/run/batch.py);
    the token budget counts the other prefill tokens only. `admission_ms`: the time
    from a request's sending to its entry into the queue (an API server's parsing and tokenizing, the request's trip),
    apart from every step: it counts in the request's TTFT and, as waiting, in its time distance."""
    max_num_seqs: int = 256
    max_batched_tokens: int = 8192
    chunked_prefill: bool = True
    memory_utilization: float = 0.9
    reserve_full: bool = False
    separate_prefills: bool = False
    admission_ms: float = 0.0


def check_rate(rate: float, name: str = "rate") -> float:
    """A request rate: positive and a number (inf allowed: every request at once)."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or math.isnan(rate) or rate <= 0:
        raise PlanError(f"The {name} must be a positive number of requests per second, not {rate}.")
    return float(rate)


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0,
                  rng: np.random.Generator | None = None) -> np.ndarray:
    """Send times (s) as `vllm bench serve` makes them: gamma gaps with shape b and scale 1 / (rate x b), summed and
    scaled so the last request goes at n / rate; all zero at an infinite rate. Drawn from rng, else from the
    generator of level 0 of a sweep with this seed."""
    rate = check_rate(rate)
    if not burstiness > 0 or math.isnan(burstiness):
        raise PlanError(f"The burstiness must be a positive number (1 is Poisson), not {burstiness}.")
    if math.isinf(rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / rate)
    else:
        return np.asarray(arrivals.schedule(n, rate, burstiness, rng or arrivals.level_rng(seed, 0)))
    times = np.cumsum(gaps)
    return times * (n / rate / times[-1])


def traffic(workload: Workload) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(send times, prompt lengths, output lengths), drawn in a load sweep's order from its level's generator: at a
    finite rate of gamma gaps, what that level of a sweep with the same seed sends."""
    n, rng = workload.requests, arrivals.level_rng(workload.seed, workload.level)
    sent = arrival_times(n, workload.rate, workload.burstiness, rng=rng)
    outputs = np.asarray(arrivals.lengths(n, workload.new_tokens, workload.length_spread, rng))
    return sent, np.asarray(arrivals.lengths(n, workload.prompt_tokens, workload.length_spread, rng)), outputs


def kv_blocks(setup: Setup, scheduler: Scheduler) -> int:
    """KV blocks that fit beside the weights on one GPU of the model's group (every sequence's cache is split over
    tensor-parallel GPUs and pipeline stages alike); a sliding window is not credited (conservative)."""
    memory = planner.memory_per_gpu(replace(setup, batch=1))
    free = memory["capacity_bytes"] * scheduler.memory_utilization - memory["weights_bytes"] - planner.RESERVE_BYTES
    per_block = kvcalc.kv_bytes(kvcalc.with_window(setup.model.spec, None), BLOCK_TOKENS, setup.kv_dtype, 1,
                                planner.tp_degree(setup)) / setup.pp
    return int(free // per_block) if free > 0 else 0


def blocks_to_claim(r, n: int, scheduler: Scheduler) -> int:
    """KV blocks request r must add to compute n more tokens: up to its whole length if the engine reserves it."""
    tokens = r.prompt + r.output if scheduler.reserve_full else r.computed + n
    return max(-(-tokens // BLOCK_TOKENS) - r.blocks, 0)


class _Request:
    __slots__ = ("i", "arrival", "prompt", "output", "computed", "emitted", "blocks", "first", "last", "max_gap",
                 "finish", "started", "buckets", "busy_ms", "seg_start", "last_step", "preemptions")

    def __init__(self, i: int, arrival: float, prompt: int, output: int):
        self.i, self.arrival, self.prompt, self.output = i, arrival, prompt, output
        self.computed = self.emitted = self.blocks = self.preemptions = 0
        self.first = self.last = self.finish = self.started = None
        self.max_gap = 0.0
        self.buckets = np.zeros(len(BUCKETS))
        self.seg_start = self.last_step = -2

    def pending(self) -> int:
        """Tokens to compute before the next one comes out: the prompt and every emitted token not yet in the cache
        (all of them again after a preemption, which recomputes)."""
        return self.prompt + self.emitted - self.computed


def simulate(setup: Setup, workload: Workload, scheduler: Scheduler = Scheduler(), max_steps: int = 2_000_000) -> dict:
    """Run the workload through the scheduler on this setup; per-request metrics and the level's summary."""
    planner.check_setup(setup)
    sent, prompts, outputs = traffic(workload)
    total_blocks = kv_blocks(setup, scheduler)
    widest = int(prompts.max() + outputs.max())
    if total_blocks * BLOCK_TOKENS < widest:
        raise PlanError(f"{setup.model.name} leaves room for {total_blocks * BLOCK_TOKENS:,} KV tokens per GPU on "
                        f"{setup.gpus} x {setup.gpu['name']}, fewer than one request's {widest:,}: add GPUs or use "
                        "fewer bits per weight.")
    requests = [_Request(i, float(a), int(p), int(o)) for i, (a, p, o) in enumerate(zip(sent, prompts, outputs))]
    if workload.prefilled:
        if outputs.min() < 2:
            raise PlanError("A request that arrives with its first token needs at least 2 output tokens to decode.")
        for r in requests:
            r.computed, r.emitted, r.first = r.prompt, 1, r.arrival
            r.last = r.arrival
    waiting: list[_Request] = []
    running: list[_Request] = []
    pending = iter(requests)
    upcoming = next(pending, None)
    free_blocks, now, step = total_blocks, 0.0, 0
    delay = scheduler.admission_ms / 1e3
    cumulative = [np.zeros(len(BUCKETS))]  # bucket sums after each step
    busy = batch_time = 0.0
    preemptions = finished = 0

    def close_segment(r: _Request) -> None:
        if r.seg_start >= 0:
            r.buckets += cumulative[r.last_step + 1] - cumulative[r.seg_start]
        r.seg_start = -2

    def preempt(r: _Request) -> None:
        nonlocal free_blocks, preemptions
        running.remove(r)
        close_segment(r)
        free_blocks += r.blocks
        r.blocks, r.computed = -1, 0  # -1: out of the running set for the rest of this iteration
        r.preemptions += 1
        preemptions += 1
        waiting.insert(0, r)

    while finished < len(requests):
        if step >= max_steps:
            raise PlanError("The simulation ran past its step limit: give fewer requests or a lower rate.")
        while upcoming is not None and upcoming.arrival + delay <= now:
            waiting.append(upcoming)
            upcoming = next(pending, None)
        if not running and not waiting:
            now = upcoming.arrival + delay
            continue
        batch = schedule(running, waiting, scheduler, preempt, blocks_free=lambda: free_blocks)
        for r in waiting:
            r.blocks = max(r.blocks, 0)
        for r, n in batch:
            grown = blocks_to_claim(r, n, scheduler)
            free_blocks -= grown
            r.blocks += grown
        if not batch:
            if upcoming is None:
                raise PlanError("A request cannot be scheduled: its prompt exceeds the token budget per step.")
            now = max(now, upcoming.arrival + delay)
            continue
        buckets = step_buckets(setup, batch, scheduler)
        duration = buckets.sum() / 1e3
        cumulative.append(cumulative[-1] + buckets)
        now += duration
        busy += duration
        batch_time += duration * len(batch)
        for r, n in batch:
            if r.started is None:
                r.started = now - duration
            if r.last_step != step - 1:
                close_segment(r)
                r.seg_start = step
            r.last_step = step
            r.computed += n
            if r.pending() == 0:
                if r.emitted == 0:
                    r.first = now
                else:
                    r.max_gap = max(r.max_gap, now - r.last)
                r.last = now
                r.emitted += 1
                if r.emitted >= r.output:
                    close_segment(r)
                    r.finish = now
                    running.remove(r)
                    free_blocks += r.blocks
                    r.blocks = 0
                    finished += 1
        step += 1
    return summarise(requests, workload, busy, batch_time, step, preemptions, total_blocks)


def is_decode(r, n: int) -> bool:
    """Whether (request, new tokens) is one row of a decode: a request with its cache up to its last token (a
    decode token, or the last of a prompt whose chunks computed the rest, which the local engine runs as a decode
    row)."""
    return n == 1 and r.computed > 0 and r.pending() == 1


def step_buckets(setup: Setup, batch: list[tuple], scheduler: Scheduler) -> np.ndarray:
    """The five buckets (ms) of one iteration: one forward of the whole batch, or with `separate_prefills` a
    forward of each prefill chunk and one of the decodes, one after another."""
    spec = setup.model.spec
    if scheduler.separate_prefills:
        decodes = [(r, n) for r, n in batch if is_decode(r, n)]
        forwards = [[item] for item in batch if not is_decode(*item)] + ([decodes] if decodes else [])
    else:
        forwards = [batch]
    total = np.zeros(len(BUCKETS))
    for items in forwards:
        work = planner.batch_work(spec, [n for _, n in items], [r.computed for r, _ in items])
        buckets = planner.forward_buckets(setup, work)
        total += [buckets[b] for b in BUCKETS]
    return total


def schedule(running: list, waiting: list, scheduler: Scheduler, preempt, blocks_free) -> list[tuple]:
    """One iteration's batch as (request, new tokens) pairs; admits and preempts in place. With chunked prefill
    (vLLM's V1 engine) running sequences go first and prefill chunks fill the token budget; without it a step is
    either the prefills of newly admitted requests or one decode token for every running sequence."""
    budget, batch, claimed = scheduler.max_batched_tokens, [], 0

    def blocks_for(r, n):
        return blocks_to_claim(r, n, scheduler)

    def admit() -> None:
        nonlocal budget, claimed
        while waiting and len(running) < scheduler.max_num_seqs and budget > 0:
            r = waiting[0]
            n = min(r.pending(), budget) if scheduler.chunked_prefill else r.pending()
            if n > budget or blocks_for(r, n) > blocks_free() - claimed:
                break
            waiting.pop(0)
            running.append(r)
            batch.append((r, n))
            budget -= n
            claimed += blocks_for(r, n)

    if not scheduler.chunked_prefill:
        admit()
        if batch:
            return batch
    preempted = False
    for r in list(running):
        free = scheduler.separate_prefills and is_decode(r, 1)  # a decode token the prefill budget does not count
        if r.blocks < 0 or (budget <= 0 and not free):  # preempted earlier in this iteration
            continue
        pending = r.prompt + r.emitted - r.computed
        n = pending if pending <= budget or free else budget
        if not scheduler.chunked_prefill and n < pending:
            continue
        while blocks_for(r, n) > blocks_free() - claimed:
            victim = running[-1]
            preempt(victim)
            preempted = True
            if victim is r:
                break
        if r.blocks >= 0:
            claimed += blocks_for(r, n)
            batch.append((r, n))
            budget -= 0 if free else n
    if scheduler.chunked_prefill and not preempted:
        admit()
    return batch


def request_rows(requests: list[_Request]) -> list[dict]:
    """Each request's metrics (ms, from its arrival) and its buckets (ms, the whole request)."""
    rows = []
    for r in requests:
        e2e = (r.finish - r.arrival) * 1e3
        ttft = (r.first - r.arrival) * 1e3
        stepped = dict(zip(BUCKETS, r.buckets))
        stepped["time"] += e2e - float(r.buckets.sum())  # queued, preempted or sitting steps out
        rows.append({"arrival_s": r.arrival, "prompt_tokens": r.prompt, "output_tokens": r.output, "ttft_ms": ttft,
                     "tpot_ms": (e2e - ttft) / (r.output - 1) if r.output > 1 else 0.0,
                     "itl_ms": r.max_gap * 1e3, "e2e_ms": e2e, "queued_ms": (r.started - r.arrival) * 1e3,
                     "in_steps_ms": float(r.buckets.sum()), "preemptions": r.preemptions, "buckets_ms": stepped})
    return rows


def summarise(requests, workload: Workload, busy: float, batch_time: float, steps: int, preemptions: int,
              blocks: int) -> dict:
    rows = request_rows(requests)
    start = min(r.arrival for r in requests)
    duration = max(r.finish for r in requests) - start
    out_tokens = sum(r["output_tokens"] for r in rows)
    per_token = {b: float(np.mean([r["buckets_ms"][b] / r["output_tokens"] for r in rows])) for b in BUCKETS}
    in_steps = {b: float(np.mean([q.buckets[i] / q.output for q in requests])) for i, b in enumerate(BUCKETS)}
    summary = {"requests": len(rows), "duration_s": duration, "requests_per_s": len(rows) / duration,
               "steady_requests_per_s": steady_rate([r.finish for r in requests]),
               "output_tokens_per_s": out_tokens / duration, "steps": steps, "preemptions": preemptions,
               "mean_batch": batch_time / busy if busy else 0.0, "busy_fraction": busy / duration if duration else 0.0,
               "kv_blocks": blocks, "kv_tokens": blocks * BLOCK_TOKENS,
               "mean_in_system": sum(r["e2e_ms"] for r in rows) / 1e3 / duration,
               "distances_ms_per_token": per_token, "step_distances_ms_per_token": in_steps,
               "e2e_ms_per_token": sum(per_token.values())}
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        values = [r[name] for r in rows]
        summary[f"{name}_mean"] = float(np.mean(values))
        for q in PERCENTILES:
            summary[f"{name}_p{q}"] = float(np.percentile(values, q))
    return {"summary": summary, "requests": rows}


def steady_rate(finishes: list[float], trim: float = 0.2) -> float:
    """Completions per second between the first and last `trim` share of them: the rate a level sustains
    without its start (the batch filling) and its end (the batch draining)."""
    times = sorted(finishes)
    lo, hi = int(len(times) * trim), int(len(times) * (1 - trim)) - 1
    if hi <= lo or times[hi] == times[lo]:
        return len(times) / (times[-1] - min(times)) if times[-1] > min(times) else math.inf
    return (hi - lo) / (times[hi] - times[lo])


def steady_state(setup: Setup, prompt: int, new: int, scheduler: Scheduler = Scheduler(),
                 concurrency: int | None = None) -> dict:
    """The closed form of a full engine: a batch held at the largest size the sequence limit, the KV blocks (at the
    mean context prompt + new / 2, or the whole prompt + new where the engine reserves it), the token budget and the `concurrency` allow; each step carries a decode token
    per sequence and, spread over the steps, the prompts of the sequences that replace finished ones."""
    planner.check_setup(setup)
    mean_context = prompt + new // 2
    by_memory = kv_blocks(setup, scheduler) * BLOCK_TOKENS // (prompt + new if scheduler.reserve_full else mean_context)
    by_budget = int(scheduler.max_batched_tokens // (1 + prompt / new))
    limits = {"sequence limit": scheduler.max_num_seqs, "KV memory": by_memory, "token budget": by_budget}
    if concurrency is not None:
        limits["concurrency"] = concurrency
    batch = max(min(limits.values()), 1)
    spec = setup.model.spec
    work = planner.Work(rows=round(batch * (1 + prompt / new)),
                        kv_token_layers=batch * kvcalc.stored_token_layers(spec, mean_context),
                        key_positions=batch * mean_context + round(batch / new * prompt * (prompt + 1) / 2),
                        sequences=batch, widest=min(prompt, scheduler.max_batched_tokens))
    buckets = planner.forward_buckets(setup, work)
    step_ms = sum(buckets[b] for b in BUCKETS)
    return {"batch": batch, "limited_by": min(limits, key=limits.get), "step_ms": step_ms,
            "output_tokens_per_s": batch * 1e3 / step_ms, "requests_per_s": batch * 1e3 / step_ms / new,
            "step_distances_ms": {b: buckets[b] for b in BUCKETS}}


def static_batch(setup: Setup, batch: int, prompt: int, new: int) -> dict:
    """A fixed batch run start to finish (static batching): one prefill of every prompt, then `new` - 1 decode
    steps at the mean context."""
    s = replace(setup, batch=batch, prompt_tokens=prompt, new_tokens=new)
    planner.check_setup(s)
    prefill = planner.step_buckets(s, prompt, 0)
    decode = planner.step_buckets(s, 1, prompt + new // 2)
    e2e_ms = sum(prefill[b] for b in BUCKETS) + (new - 1) * sum(decode[b] for b in BUCKETS)
    return {"e2e_ms": e2e_ms, "output_tokens_per_s": batch * new * 1e3 / e2e_ms}


def score(result: dict, slo: dict[str, float]) -> dict:
    """Goodput and attainment of a simulated level at an SLO."""
    s = result["summary"]
    return slos.goodput(result["requests"], slo, s["duration_s"])
