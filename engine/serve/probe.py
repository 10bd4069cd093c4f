"""A short profiling probe of an OpenAI-compatible server through the load tools, for engine/plan/probe.py's fit:

    single requests at the workload's prompt length, one at a time: the time to the first token (a prefill) and
        the time per output token after it (the decode step at batch 1)
    single requests at a long prompt: the time to the first token (a second prefill)
    `batch` identical-length requests at once, each to its full output (ignore_eos): the decode step at that batch,
        timed over the window where all of them are decoding (after the last one's first token, before the first
        one's last), so prefills and the ragged ends stay out and tokens a busy server sends in one chunk still count

A prefill's time is the server's own (its queue and prefill histograms, where it has them: its forward by its own
clock) plus the delay before its queue measured at the workload's prompt length, else the least of its repeats'
(other work on the machine only delays a request); a decode step's at batch 1 is the least of its repeats' too.
Prompt lengths are the server's own counts (its usage: the chat template included), less the tokens its prefix cache
found (its /metrics, where it has them). The prompts come from a seed of their own (a new one each time unless
given), apart from any sweep's, so the server's prefix cache carries nothing from an earlier probe into this one,
nor from this one into a measurement."""
from __future__ import annotations

import secrets
import statistics
from dataclasses import dataclass, replace

from engine.plan import simulate as sim
from engine.plan.planner import Setup
from engine.plan.probe import Decode, Figures, Fit, Prefill, ProbeError, fit
from engine.serve import records, vllm
from engine.serve.load import Sweep, SweepConfig
from engine.store.db import Store


@dataclass(frozen=True)
class ProbeConfig:
    endpoint: str
    input_tokens: int = 64  # the workload's prompt length as a sweep asks for it (tokens, or words without a tokenizer)
    long_tokens: int = 512
    output_tokens: int = 32
    batch: int = 8
    repeats: int = 2  # single requests at each prompt length
    seed: int | None = None  # the probe's prompts; None: new ones each time, so no probe finds an earlier one's cached
    served_model: str | None = None
    api_key_env: str | None = None

    def check(self) -> None:
        if not 2 <= self.batch <= 256:
            raise ProbeError(f"The probe's batch must be a whole number from 2 to 256, not {self.batch}.")
        if not self.long_tokens > self.input_tokens:
            raise ProbeError(f"The probe's long prompt ({self.long_tokens} tokens) must be longer than the workload's "
                             f"({self.input_tokens}).")
        if self.output_tokens < 4:
            raise ProbeError(f"The probe needs at least 4 output tokens per request to time a decode step, not "
                             f"{self.output_tokens}.")
        if self.repeats < 1:
            raise ProbeError(f"The probe needs at least 1 request per prompt length, not {self.repeats}.")


def run_part(cfg: ProbeConfig, store: Store, *, concurrency: int, requests: int, input_tokens: int,
             output_tokens: int, seed: int, warmup: int = 0) -> tuple[dict, list[dict]]:
    """One level of the load tools at a fixed number in flight: its summary and its requests (sent_ms, chunk_ms,
    chunk_tokens, n_prompt_tokens as stored), every one of them finished."""
    sweep_cfg = SweepConfig(cfg.endpoint, concurrency=[concurrency], requests=requests, input_tokens=input_tokens,
                            output_tokens=output_tokens, served_model=cfg.served_model, api_key_env=cfg.api_key_env,
                            seed=seed, warmup=warmup, poll_s=0.5)
    summary = Sweep(sweep_cfg, store).run()
    level = summary["levels"][0] if summary["levels"] else None
    rows = records.sweep_requests(store, summary["sweep_id"]).to_dict("records")
    failed = [r for r in rows if r["status"] != "ok"]
    if summary["status"] != "ok" or level is None or failed or len(rows) != requests:
        why = summary["error"] or (failed[0]["error"] if failed else "not every request finished")
        raise ProbeError(f"The probe's {requests} request(s) of {input_tokens} tokens, {concurrency} at once, did not "
                         f"all finish ({why}).")
    if any(r["n_prompt_tokens"] is None for r in rows):
        raise ProbeError("The server reported no prompt token counts (usage), which the probe needs to know what it "
                         "prefilled.")
    return level, rows


def cached_per_request(level: dict, requests: int) -> float:
    """Prompt tokens the server's prefix cache found per request over a level (0 without its counters)."""
    return (level.get("prefix_cache_hits") or 0.0) / requests


def admission(level: dict, rows: list[dict]) -> float | None:
    """The time from sending a request to its entry into the engine's queue, one at a time: the client's mean TTFT
    less the server's own mean time in its queue and prefill (vLLM's histograms); None without them."""
    server = level.get("server") or {}
    counted = server.get("prefill_count")
    if not counted or server.get("queue_count") != counted or counted != len(rows):
        return None
    return statistics.mean(r["ttft_ms"] for r in rows) - (server["prefill_ms"] + server["queue_ms"]) / counted


def first_token(level: dict, rows: list[dict], delay: float | None) -> float:
    """A prefill's time to the first token: the server's own mean time in its queue and prefill plus the delay before
    its queue at the workload's prompt length, where it reports them (its forward timed by its own clock, apart from
    the client's machine); else the least of the client's."""
    if delay is None or admission(level, rows) is None:
        return min(r["ttft_ms"] for r in rows)
    server = level["server"]
    return (server["prefill_ms"] + server["queue_ms"]) / server["prefill_count"] + delay


def together(rows: list[dict]) -> tuple[float, float]:
    """(the decode step in ms, the tokens emitted per request before the window's middle) over the window where
    every request of a batch sent at once was decoding."""
    times = [[r["sent_ms"] + t for t in r["chunk_ms"]] for r in rows]
    start, end = max(t[0] for t in times), min(t[-1] for t in times)
    counts = [sum(n for t, n in zip(ts, r["chunk_tokens"]) if start < t <= end) for ts, r in zip(times, rows)]
    if end <= start or min(counts) < 1:
        raise ProbeError(f"The probe's {len(rows)} requests at once never all decoded together (the last first token "
                         "came after the first request ended): give them more output tokens.")
    middle = (start + end) / 2
    before = [sum(n for t, n in zip(ts, r["chunk_tokens"]) if t <= middle) for ts, r in zip(times, rows)]
    return (end - start) / statistics.mean(counts), statistics.mean(before)


def measure(cfg: ProbeConfig, store: Store) -> dict:
    """The probe's figures for the fit, with what the server counted of the workload's prompts."""
    cfg.check()
    seed = cfg.seed if cfg.seed is not None else secrets.randbelow(2**31 - 3) + 2  # never a sweep's 0 or 1
    level, rows = run_part(cfg, store, concurrency=1, requests=cfg.repeats, input_tokens=cfg.input_tokens,
                           output_tokens=cfg.output_tokens, seed=seed, warmup=1)
    prompt = statistics.mean(r["n_prompt_tokens"] for r in rows)
    cached = cached_per_request(level, len(rows))
    delay = admission(level, rows)
    short = Prefill(prompt, cached, first_token(level, rows, delay))
    one = Decode(1, prompt + cfg.output_tokens / 2, min(r["tpot_ms"] for r in rows))
    level, rows = run_part(cfg, store, concurrency=1, requests=cfg.repeats, input_tokens=cfg.long_tokens,
                           output_tokens=2, seed=seed + 1)
    long = Prefill(statistics.mean(r["n_prompt_tokens"] for r in rows), cached_per_request(level, len(rows)),
                   first_token(level, rows, delay))
    level, rows = run_part(cfg, store, concurrency=cfg.batch, requests=cfg.batch, input_tokens=cfg.input_tokens,
                           output_tokens=cfg.output_tokens, seed=seed + 2)
    step, emitted = together(rows)
    many = Decode(cfg.batch, statistics.mean(r["n_prompt_tokens"] for r in rows) + emitted, step)
    return {"figures": Figures(prefills=(short, long), decodes=(one, many), admission_ms=delay),
            "prompt_tokens": prompt, "cached_tokens": cached}


def describe(found: dict) -> str:
    """The probe's figures, one line each."""
    f = found["figures"]
    delay = (f"{f.admission_ms:.1f} ms from sending to the engine's queue (the client's TTFT less the server's own "
             "queue and prefill time, at the first prompt length; the prefills' times are the server's own plus that)"
             if f.admission_ms is not None else "no server times: no admission delay known")
    lines = [delay] + [f"prefill: {p.prompt_tokens:.0f} prompt tokens ({p.cached_tokens:.0f} found in the prefix "
                       f"cache), TTFT {p.ttft_ms:.1f} ms" for p in f.prefills]
    lines += [f"decode: batch {d.batch}, {d.context:.0f} tokens in each cache, step {d.step_ms:.2f} ms"
              for d in f.decodes]
    return "\n".join(lines)


def planned_setup(found: dict, bandwidth_gbps: float, new_tokens: int, *, model="default", dtype: str = "float32",
                  max_num_seqs: int = vllm.MAX_NUM_SEQS, max_batched_tokens: int = vllm.MAX_BATCHED_TOKENS,
                  kv_space_bytes: float = vllm.KV_CACHE_GIB * 2**30) -> tuple[Setup, sim.Scheduler, Fit]:
    """A probed server as the planner sees it (engine.run.load_target.planned_setup's twin for the local engine):
    the fitted device, the workload's prompts as the server prefills them (its count, less what its prefix cache
    found), and its scheduler: one fused forward a step (prefill chunks and decodes together, vLLM's V1 engine), its
    sequence and token limits, chunked prefill, its KV room, and the admission delay before its queue."""
    fitted = fit(found["figures"], model, dtype, bandwidth_gbps=bandwidth_gbps, kv_space_bytes=kv_space_bytes)
    setup = replace(fitted.setup, prompt_tokens=max(round(found["prompt_tokens"] - found["cached_tokens"]), 1),
                    new_tokens=new_tokens)
    scheduler = sim.Scheduler(max_num_seqs=max_num_seqs, max_batched_tokens=max_batched_tokens, chunked_prefill=True,
                              memory_utilization=1.0, admission_ms=fitted.admission_ms)
    return setup, scheduler, fitted
