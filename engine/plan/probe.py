"""A served engine's step fitted from a short probe: the planner device and efficiency under which the planner's own
five-bucket forward reproduces what a few requests measured, so that the capacity simulation can run that engine.

The probe (engine/serve/probe.py) gives the time to the first token of single requests at two prompt lengths, the
decode step at two batch sizes and, where the server reports its own times, the delay before its queue. Each is one
forward the planner can count: its bytes (weights, and the cache it reads) at the machine's calibrated read
bandwidth (memory), its products' FLOPs and its attention's FLOPs, each at a rate of its own (compute: a CPU's
attention kernels reach far less of its peak than its products), a fixed cost per step and host work per sequence
(time: scheduling, sampling, sending each token). Four figures, four unknowns, solved exactly:

    step at batch b, context C  = fixed + b x host + product FLOPs / R_products + attention FLOPs / R_attention
                                  + bytes / bandwidth
    TTFT at n new prompt tokens = admission + the same for a forward of n tokens (its prefill)

Where host work comes out negative, a decode step's products ran faster per FLOP than a prefill's: host work is 0
and the decode's products get a rate of their own. Where the attention's rate comes out negative (a longer prompt
cheaper per FLOP), attention runs at the products' rate and the admission delay is what the prefills leave. Where
the step at batch 1 is shorter than the weights' read at the calibrated bandwidth, the server read faster: its
bandwidth is the one the step gives, the fixed cost 0. A probe cannot tell the weights' read from the fixed cost
(both paid once a step), so the calibrated bandwidth splits them; the prediction does not depend on the split.

Nothing of a rate sweep goes in."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from engine.measure.distances import BUCKETS
from engine.plan import planner
from engine.plan.planner import PlanError, Setup

FORMATS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
ROUNDS = 20  # re-solves where the bandwidth bound is hit (the cache's read moves with the bandwidth)


class ProbeError(PlanError):
    """A probe the fit cannot read as physics; the message is one sentence for the user."""


@dataclass(frozen=True)
class Prefill:
    """Single requests at one prompt length: the prompt tokens the server counted (its usage, chat template
    included), those its prefix cache found, and the median time to the first token (ms)."""
    prompt_tokens: float
    cached_tokens: float
    ttft_ms: float

    @property
    def new_tokens(self) -> float:
        return self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True)
class Decode:
    """The decode step (ms) with `batch` sequences decoding together, `context` tokens in each one's cache (mean)."""
    batch: int
    context: float
    step_ms: float


@dataclass(frozen=True)
class Figures:
    """What a probe measured: prefills at two or more prompt lengths, decode steps at two or more batch sizes, and
    the time from sending a request to its entry into the engine's queue where the server's own times tell it."""
    prefills: tuple[Prefill, ...]
    decodes: tuple[Decode, ...]
    admission_ms: float | None = None


@dataclass(frozen=True)
class Fit:
    """The fitted engine: a planner setup (device and efficiency) and the admission delay before its queue."""
    setup: Setup
    admission_ms: float
    figures: Figures
    notes: tuple[str, ...] = ()

    def summary(self) -> dict:
        """The fitted physics in the units one reads them in, with the bandwidth the split was given."""
        eff, gpu, fmt = self.setup.efficiency, self.setup.gpu, planner.compute_format(self.setup)
        peak = gpu["peak_tflops"][fmt]
        one = decode_step(self.setup, 1, self.figures.decodes[0].context)
        return {"bandwidth_gbps": gpu["bandwidth_gbps"],
                "weights_ms": one["_weight_bytes"] / gpu["bandwidth_gbps"] / 1e6,
                "prefill_gflops": peak * eff.prefill_compute * 1e3, "decode_gflops": peak * eff.compute * 1e3,
                "attention_gflops": gpu["attention_tflops"] * 1e3,
                "step_fixed_ms": eff.step_fixed_us / 1e3, "per_sequence_ms": eff.host_us_per_sequence / 1e3,
                "admission_ms": self.admission_ms}

    def describe(self) -> str:
        s = self.summary()
        text = (f"weights read at {s['bandwidth_gbps']:.1f} GB/s ({s['weights_ms']:.1f} ms a step, memory); products "
                f"at {s['prefill_gflops']:.0f} GFLOP/s in a prefill and {s['decode_gflops']:.0f} GFLOP/s in a decode "
                f"step, attention at {s['attention_gflops']:.1f} GFLOP/s (compute); {s['step_fixed_ms']:.1f} ms fixed "
                "per step and "
                f"{s['per_sequence_ms']:.2f} ms host work per sequence per step (time); {s['admission_ms']:.1f} ms "
                "from sending a request to the engine's queue (time)")
        return text + "".join(f"; {note}" for note in self.notes)


def device(name: str, bandwidth_gbps: float, tflops: float, memory_bytes: float,
           attention_tflops: float | None = None) -> dict:
    """A served engine's machine as a planner GPU: its read bandwidth, one FLOP rate for the products in every format
    (the fit scales it by the efficiency factors), its attention's achieved rate (the products' where None), its
    memory, and no links."""
    return {"id": "probed", "name": name, "memory_mib": memory_bytes / 2**20, "bandwidth_gbps": bandwidth_gbps,
            "peak_tflops": {fmt: tflops for fmt in ("fp32", "bf16", "fp16")},
            "attention_tflops": attention_tflops or tflops,
            "gpu_link": {"name": "none", "gbps_per_direction": None},
            "host_link": {"name": "none", "gbps_per_direction": None}}


def efficiency(step_fixed_ms: float = 0.0, per_sequence_ms: float = 0.0, decode: float = 1.0,
               prefill: float = 1.0) -> planner.Efficiency:
    """The planner's factors for a fitted CPU engine: the figures are achieved ones already (bandwidth 1), the cores
    that read also multiply and do the host work (no overlap: each adds), no launches or links of their own."""
    return planner.Efficiency(bandwidth=1.0, kv_bandwidth=1.0, compute=decode, prefill_compute=prefill, link=1.0,
                              collective_fixed_us=0.0, step_fixed_us=step_fixed_ms * 1e3, launch_us=0.0,
                              kernels_per_layer=0, matvec_us=0.0, one_call_layer_us=None, host_sync_us=0.0,
                              host_us_per_sequence=per_sequence_ms * 1e3, overlap=False, dequant_ops={})


def forward_ms(setup: Setup, new_tokens: list[int], contexts: list[int]) -> dict:
    """The planner's buckets (ms) of one forward, and their sum under 'total'."""
    work = planner.batch_work(setup.model.spec, new_tokens, contexts)
    buckets = planner.forward_buckets(setup, work)
    return {**buckets, "total": sum(buckets[b] for b in BUCKETS)}


def decode_step(setup: Setup, batch: int, context: float) -> dict:
    return forward_ms(setup, [1] * batch, [round(context)] * batch)


def prefill_forward(setup: Setup, p: Prefill) -> dict:
    return forward_ms(setup, [round(p.new_tokens)], [round(p.cached_tokens)])


def check(figures: Figures) -> tuple[Prefill, Prefill, Decode, Decode]:
    """The two prefills furthest apart and the decodes at the smallest and largest batch; one sentence where
    the probe has too few or impossible figures."""
    for p in figures.prefills:
        if not (math.isfinite(p.ttft_ms) and p.ttft_ms > 0 and p.new_tokens >= 1 and p.cached_tokens >= 0):
            raise ProbeError(f"A prefill point ({p.prompt_tokens:g} prompt tokens, {p.cached_tokens:g} cached, TTFT "
                             f"{p.ttft_ms:g} ms) is not a positive time for at least one new token: probe again.")
    for d in figures.decodes:
        if not (math.isfinite(d.step_ms) and d.step_ms > 0 and d.batch >= 1 and d.context >= 0):
            raise ProbeError(f"A decode point (batch {d.batch}, step {d.step_ms:g} ms) is not a positive step time "
                             "at a batch of at least 1: probe again.")
    prefills = sorted(figures.prefills, key=lambda p: p.new_tokens)
    decodes = sorted(figures.decodes, key=lambda d: d.batch)
    if len(prefills) < 2 or prefills[-1].new_tokens - prefills[0].new_tokens < 1:
        raise ProbeError("The probe needs the first-token time at two different prompt lengths to fit the prefill's "
                         "FLOP rate: give it a longer second prompt.")
    if len(decodes) < 2 or decodes[-1].batch == decodes[0].batch:
        raise ProbeError("The probe needs the decode step at two different batch sizes to fit the cost of each "
                         "sequence: give it a batch above 1.")
    short, long = prefills[0], prefills[-1]
    if long.ttft_ms <= short.ttft_ms:
        raise ProbeError(f"The {long.new_tokens:g}-token prompt's first token came no later than the "
                         f"{short.new_tokens:g}-token one's ({long.ttft_ms:.1f} against {short.ttft_ms:.1f} ms), so "
                         "the prefill's cost per token is not positive: probe again on a quieter machine or with "
                         "prompts further apart.")
    one, many = decodes[0], decodes[-1]
    if many.step_ms <= one.step_ms:
        raise ProbeError(f"The decode step at batch {many.batch} was no longer than at batch {one.batch} "
                         f"({many.step_ms:.2f} against {one.step_ms:.2f} ms), so a sequence's cost is not positive: "
                         "probe again on a quieter machine or at a larger batch.")
    return short, long, one, many


def fit(figures: Figures, model, weights: str = "bf16", kv_dtype: str | None = None, bandwidth_gbps: float = 20.0,
        kv_space_bytes: float = 2 * 2**30, name: str = "probed server") -> Fit:
    """The planner setup whose forward reproduces the probe (see the module's formulas): `model` a planner Model or
    what planner.resolve_model takes, `weights` the served precision (a planner level or a torch dtype name),
    `bandwidth_gbps` the machine's calibrated read bandwidth, `kv_space_bytes` the room the server keeps for its
    KV cache (the device's memory is the weights, the planner's reserve and that room)."""
    short, long, one, many = check(figures)
    model = planner.resolve_model(model)
    weights = FORMATS.get(weights, weights)
    kv_dtype = FORMATS.get(kv_dtype, kv_dtype) if kv_dtype else weights
    if not (isinstance(bandwidth_gbps, (int, float)) and math.isfinite(bandwidth_gbps) and bandwidth_gbps > 0):
        raise ProbeError(f"The read bandwidth must be a positive number of GB/s, not {bandwidth_gbps}.")
    memory = kv_space_bytes + model.params * planner.LEVEL_BITS[weights] / 8 + planner.RESERVE_BYTES
    base = Setup(model=model, gpu=device(name, bandwidth_gbps, 1.0, memory), weights=weights, kv_dtype=kv_dtype,
                 efficiency=efficiency())
    planner.check_setup(base)
    admission = figures.admission_ms if figures.admission_ms is not None else 0.0
    notes, bandwidth = [], float(bandwidth_gbps)
    if figures.admission_ms is None:
        notes.append("the server reports no times of its own, so no delay before its queue is known: taken as 0")
    for _ in range(ROUNDS):
        unit = replace(base, gpu=device(name, bandwidth, 1.0, memory))
        rows = [forward_ms(unit, [1] * d.batch, [round(d.context)] * d.batch) for d in (one, many)]
        rows += [forward_ms(unit, [round(p.new_tokens)], [round(p.cached_tokens)]) for p in (short, long)]
        times = [one.step_ms, many.step_ms, short.ttft_ms - admission, long.ttft_ms - admission]
        left = [t - r["memory"] for t, r in zip(times, rows)]
        products = [r["_flops"] - r["_attention_flops"] for r in rows]
        attention = [r["_attention_flops"] for r in rows]
        sequences = [one.batch, many.batch, 1, 1]
        fixed, host, per_product, per_attention = solve([[1, n, p, a] for n, p, a in zip(sequences, products,
                                                                                           attention)], left)
        per_decode = per_product
        if per_attention < 0:  # a longer prompt cheaper per FLOP: attention at the products' rate, admission left over
            work = [p + a for p, a in zip(products, attention)]  # the long prefill's row: its excess over the short's
            fixed, host, per_product = solve([[1, sequences[0], work[0]], [1, sequences[1], work[1]],
                                              [0, 0, work[3] - work[2]]], [left[0], left[1], left[3] - left[2]])
            per_attention = per_decode = per_product
            admission = short.ttft_ms - rows[2]["memory"] - fixed - host - per_product * (products[2] + attention[2])
            notes.append("a longer prompt cost no more per FLOP: attention runs at the products' rate")
        if host < 0:  # a decode step's products ran faster per FLOP than a prefill's
            fixed, per_decode, per_product, per_attention = solve(
                [[1, p if i < 2 else 0, 0 if i < 2 else p, a] for i, (p, a) in enumerate(zip(products, attention))],
                left)
            host = 0.0
            notes.append("a decode step's products ran faster per FLOP than a prefill's, with no host work per "
                         "sequence left")
        if min(per_product, per_decode, per_attention) <= 0:
            raise ProbeError("The probe's figures give a FLOP rate that is not positive (the steps and first tokens "
                             "do not grow with the work they do): probe again on a quieter machine.")
        if fixed >= -1e-9:
            break
        weights_ms = rows[0]["_weight_bytes"] / (bandwidth * 1e6)
        if weights_ms + fixed <= 0:
            raise ProbeError(f"The decode step at batch {one.batch} ({one.step_ms:.2f} ms) is shorter than the "
                             "products and host work the rest of the probe gives it, leaving no time to read the "
                             "weights: probe again on a quieter machine.")
        bandwidth *= weights_ms / (weights_ms + fixed)
    else:
        raise ProbeError("The fit of the weights' read bandwidth did not settle: probe again on a quieter machine.")
    if bandwidth > bandwidth_gbps * (1 + 1e-9):
        notes.append(f"the step at batch {one.batch} is shorter than the weights' read at the calibrated "
                     f"{bandwidth_gbps:.1f} GB/s: the server read them at {bandwidth:.1f} GB/s, no fixed cost left")
    # rates in TFLOP/s (ms per FLOP -> FLOP per ms / 1e9); the faster of the products' two is the peak, so the
    # efficiency factors stay at most 1
    prefill_rate, decode_rate = 1 / per_product / 1e9, 1 / per_decode / 1e9
    peak = max(prefill_rate, decode_rate)
    setup = replace(base, gpu=device(name, bandwidth, peak, memory, 1 / per_attention / 1e9),
                    efficiency=efficiency(max(fixed, 0.0), host, decode_rate / peak, prefill_rate / peak))
    if admission < 0:
        notes.append(f"a prefill took {-admission:.1f} ms less than the rest of the probe gives it: no admission delay")
    return Fit(setup=setup, admission_ms=max(admission, 0.0), figures=figures, notes=tuple(notes))


def solve(rows: list[list[float]], values: list[float]) -> list[float]:
    """The unknowns of a square linear system (columns: fixed, sequences, then FLOP counts); one sentence where the
    figures do not determine them."""
    a = np.array(rows, dtype=float)
    a[:, 2:] *= 1e-9  # FLOPs in GFLOP, so the columns are of a size
    try:
        x = np.linalg.solve(a, np.array(values, dtype=float))
    except np.linalg.LinAlgError:
        raise ProbeError("The probe's figures do not determine the step's parts (two of its points do the same "
                         "work): give it prompts further apart and a larger batch.") from None
    x[2:] *= 1e-9
    return [float(v) for v in x]
