"""Capacity on this machine, predicted then measured. For the local engine (fp32, continuous batching) the
planner's queueing simulation first predicts, on this machine's calibration (the planner's local step, as every
run's prediction uses it), the TTFT and TPOT p50/p90, goodput and attainment at each request rate and the
capacity at the SLO (the prompts as the engine prefills them, in their chat template, and the engine's own
step: each prefill chunk a forward of its own beside one batched decode), and plays the capacity search on the
simulation; then the load tools measure the same rates (Poisson arrivals, requests sent straight into the engine) and
search the capacity (bracket from the predicted capacity, then bisect). Each simulated level sends the arrivals the
measured level of the same number sends (the sweep's seed), so the two differ by the engine alone, not by the luck of
16 draws. Each figure is printed planned beside measured with the planned one's error. Nothing of the measurement goes
into the prediction.

With --vllm (or --only vllm), vLLM's CPU build (started once) is predicted and measured the same way. Its step is
not calibrated here, so a short probe (engine/serve/probe.py: single requests at two prompt lengths, the decode step
at batch 1 and at --probe-batch, nothing of the rate sweep) is fitted as physics (engine/plan/probe.py: weights at
this machine's calibrated read bandwidth, products and attention each at a FLOP rate of its own, a fixed cost and
host work per sequence per step, the delay before the engine's queue) into a planner device; the same simulation,
with vLLM's fused step and its scheduler's limits, predicts; the same sweep and capacity search measure.
Writes bench/results/capacity.md (not with --predict-only, which prints the predictions alone: vLLM's still needs
its probe).

    .venv/bin/python bench/capacity.py [--rates 0.5,1,2,4] [--requests 16] [--input-tokens 64] [--output-tokens 32]
        [--slo ttft_ms=1000,tpot_ms=100] [--attainment 0.9] [--duration 16] [--steps 2] [--max-batch 8]
        [--calibrate] [--vllm | --only vllm|local] [--dtype float32] [--threads 2] [--probe-batch 8]
        [--probe-long 512] [--predict-only]
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path


from common import error_pct, idle_cpu_share, local_target, recorded  # first: the engine sets OpenMP's wait policy before torch loads
import torch
from engine.cli.serving import level_table
from engine.measure import hardware
from engine.measure import slo as slos
from engine.measure.slo import format_slo, parse_slo
from engine.plan import capacity as cap
from engine.plan import planner
from engine.plan import simulate as sim
from engine.plan.probe import ProbeError
from engine.run.batch import PREFILL_CHUNK
from engine.run.load_target import planned_setup
from engine.serve import capacity
from engine.serve import probe
from engine.serve.arrivals import parse_rates
from engine.serve.load import Sweep, SweepConfig, level_requests
from engine.serve.vllm import MAX_BATCHED_TOKENS, MAX_NUM_SEQS, VLLMServer
from engine.store.db import Store

FIGURES = (("TTFT p50 ms", "ttft_ms", "p50"), ("TTFT p90 ms", "ttft_ms", "p90"),
           ("TPOT p50 ms", "tpot_ms", "p50"), ("TPOT p90 ms", "tpot_ms", "p90"))


def config(args, endpoint, **levels) -> SweepConfig:
    return SweepConfig(endpoint, requests=args.requests, input_tokens=args.input_tokens,
                       output_tokens=args.output_tokens, slo=parse_slo(args.slo), seed=1, poll_s=0.5, **levels)


def workload(args, prompt_tokens: int, rate: float = float("inf"), level: int = 0,
             requests: int | None = None) -> sim.Workload:
    """The traffic of level `level` of a sweep with the benchmark's seed (at a finite rate, the arrivals it sends)."""
    return sim.Workload(requests=requests or args.requests, rate=rate, prompt_tokens=prompt_tokens,
                        new_tokens=args.output_tokens, seed=1, level=level)


def predict(args, setup, scheduler) -> tuple[list[dict], dict, dict]:
    """The simulated level at each rate (at_rate, p90; each the arrivals the sweep's level at that rate sends),
    the planner's capacity at the SLO, and the capacity search that starts there played on the simulation, for the
    engine as planned_setup plans it."""
    prompt_tokens = setup.prompt_tokens
    slo = parse_slo(args.slo)
    levels = [cap.at_rate(setup, workload(args, prompt_tokens, r, level=i), scheduler, slo, q=90)
              for i, r in enumerate(parse_rates(args.rates))]
    try:
        rate, best, top, metric, bucket = cap.highest_rate(setup, workload(args, prompt_tokens), scheduler, slo, q=None,
                                                           attainment=args.attainment)
    except cap.Unreachable as exc:
        planned_cap = {"capacity_requests_per_s": None, "text": f"none: {str(exc).rstrip('.')}"}
    else:
        batch = best["summary"]["mean_batch"]
        planned_cap = {"capacity_requests_per_s": rate, "text": f"{rate:.3g} req/s ({metric} fails first, {bucket} "
                       f"the largest bucket there; mean batch {batch:.1f}; saturated at {top:.3g} req/s)"}
    return levels, planned_cap, planned_search(args, setup, scheduler, start_rate(args, planned_cap))


def start_rate(args, planned_cap: dict) -> float:
    """Where the capacity search starts: the predicted capacity, or the lowest rate where none was predicted."""
    return planned_cap["capacity_requests_per_s"] or parse_rates(args.rates)[0]


def planned_search(args, setup, scheduler, start: float) -> dict:
    """The measured capacity search played on the simulation before it runs: the same start, doublings or halvings
    and bisections, each level the arrivals the measured search's level of that number sends (its duration's worth,
    at least --requests), held as a measured level is (the attainment, and requests leaving as fast as they come)."""
    slo, rates = parse_slo(args.slo), []

    def run_level(rate: float) -> dict:
        n = level_requests(args.requests, rate, args.duration)
        rows = sim.simulate(setup, workload(args, setup.prompt_tokens, rate, len(rates), n), scheduler)["requests"]
        rates.append(rate)
        kept = slos.kept_up([r["arrival_s"] + r["e2e_ms"] / 1e3 for r in rows], rate)[1]
        return {"status": "ok", "error": None, "rate": rate, "attainment": slos.attainment(rows, slo), "kept_up": kept}

    good, bad, _ = capacity.find_edge(run_level, lambda level: capacity.holds(level, args.attainment), start,
                                      args.steps)
    found = good["rate"] if good else None
    tried = ", ".join(f"{r:.3g}" for r in rates)
    return {"capacity_requests_per_s": found,
            "text": f"{f'{found:.3g} req/s' if found else 'none held'} (levels at {tried} req/s)"}


def calibration_line(calibration: dict) -> str:
    """The calibration figures the local step is built from, so a prediction far off can be traced to them."""
    memory = ", ".join(f"{k} {v:.1f}" for k, v in (calibration.get("memory_methods_gbps") or {}).items())
    return (f"calibration {calibration.get('device_key')} measured {calibration.get('measured_at')}: decode read "
            f"{planner.decode_bandwidth_gbps(calibration):.1f} GB/s ({memory}), dispatch {calibration['dispatch_us']:.1f} "
            f"us, one matrix-vector call {calibration.get('matvec_call_us', 0):.0f} us")


def prediction_text(args, planned: list[dict], planned_cap: dict, search: dict, basis: str, seconds: float) -> str:
    """The predicted capacity, the predicted outcome of the capacity search and the predicted levels, before
    anything is measured."""
    return (f"\n\nPredicted capacity (the planner's simulation on {basis}, {seconds:.1f} s): {planned_cap['text']}"
            f"\n\nPredicted outcome of the capacity search from there ({args.duration:g} s of arrivals a level, "
            f"{args.steps} bisections): {search['text']}"
            f"\n\nPredicted at each rate ({args.requests} Poisson arrivals, p90):\n\n```\n"
            f"{side_by_side(planned, [{} for _ in planned])}\n```")


def measure(args, store: Store, endpoint: str | None, target, planned_cap: dict) -> tuple[dict, dict | None]:
    """The rate sweep and the capacity search from the predicted capacity (the lowest rate where none was
    predicted), both through the load tools, sent to `target` (the local engine) or, where it is None, to the
    server at `endpoint`. No search where even the lowest rate measured failed: halving from there would wait for
    arrivals minutes apart."""
    start = start_rate(args, planned_cap)
    sweep = Sweep(config(args, endpoint, rates=parse_rates(args.rates)), store, target=target).run()
    if not capacity.holds(sweep["levels"][0], args.attainment):
        return sweep, None
    cfg = config(args, endpoint, rates=[start], duration_s=args.duration)
    found = capacity.search(Sweep(cfg, store, target=target), attainment=args.attainment, start_rate=start,
                            steps=args.steps)
    return sweep, found


def search_text(args, found: dict | None) -> str:
    """The capacity search's levels and answer, or why there was no search."""
    if found is None:
        return (f"No capacity search: the lowest rate measured ({parse_rates(args.rates)[0]:g} req/s) did not hold "
                "the SLO, so the capacity lies below it.")
    return (f"Capacity search, {args.duration:g} s of arrivals per level:\n\n```\n{level_table(found['levels'])}\n```"
            f"\n\n{capacity.describe(found)}")


def side_by_side(planned: list[dict], measured: list[dict]) -> str:
    """One line per rate and figure: planned, measured ('-' before the measurement), the planned one's error."""
    lines = [f"{'rate':>6} {'figure':<14} {'planned':>9} {'measured':>9} {'error':>7}"]
    for p, m in zip(planned, measured):
        rows = [(name, p[f"{key}_{q}"], m.get(key, {}).get(q)) for name, key, q in FIGURES]
        rows += [("goodput req/s", p["goodput_requests_per_s"], m.get("goodput_requests_per_s")),
                 ("attainment", p["attainment"], m.get("attainment"))]
        for name, plan_value, measured_value in rows:
            shown = f"{measured_value:>9.2f}" if measured_value is not None else f"{'-':>9}"
            lines.append(f"{p['rate_requests_per_s']:>6g} {name:<14} {plan_value:>9.2f} {shown} "
                         f"{error_pct(plan_value, measured_value):>7}")
    return "\n".join(lines)


def local_part(args, store: Store) -> None:
    target = local_target(config(args, None, rates=parse_rates(args.rates)), store, args.max_batch)
    try:
        lm = target.engine.engine.lm
        calibration = hardware.calibration_for(lm.device, store, fresh=args.calibrate)
        t0 = time.monotonic()
        setup, scheduler = planned_setup(calibration, args.input_tokens, args.output_tokens, args.max_batch,
                                         tokenizer=lm.tokenizer)
        planned, planned_cap, planned_found = predict(args, setup, scheduler)
        print(f"## The local engine, fp32, at most {args.max_batch} sequences a step\n\n{calibration_line(calibration)}"
              f"\n\n{args.input_tokens} prompt tokens are {setup.prompt_tokens} in the chat template the engine "
              f"prefills; each step runs every prefill chunk ({PREFILL_CHUNK} prompt tokens in all at most) as a "
              "forward of its own, then one batched decode."
              f"{prediction_text(args, planned, planned_cap, planned_found, 'that calibration', time.monotonic() - t0)}")
        if args.predict_only:
            return
        t0 = time.monotonic()
        sweep, found = measure(args, store, None, target, planned_cap)
    finally:
        target.close()
    compare(args, planned, planned_cap, planned_found, sweep, found, time.monotonic() - t0)


def compare(args, planned: list[dict], planned_cap: dict, planned_found: dict, sweep: dict, found: dict | None,
            seconds: float) -> None:
    """The measured sweep and search, then planned beside measured with the errors, and the capacity search's
    outcome predicted beside measured."""
    print(f"\nMeasured ({seconds:.0f} s): Poisson arrivals, {args.requests} requests per rate\n\n```\n"
          f"{level_table(sweep['levels'])}\n```\n\n{search_text(args, found)}\n")
    measured_cap = found["capacity_requests_per_s"] if found else None
    print(f"Planned beside measured (error = (planned - measured) / measured):\n\n```\n"
          f"{side_by_side(planned, sweep['levels'])}\n```\n\ncapacity: planned {planned_cap['text']}; the search "
          f"predicted {planned_found['text']}; measured {f'{measured_cap:.3g} req/s' if measured_cap else 'none found'}"
          f"; error of the predicted search {error_pct(planned_found['capacity_requests_per_s'], measured_cap)}, of the "
          f"planner's capacity {error_pct(planned_cap['capacity_requests_per_s'], measured_cap)}")


def vllm_part(args, store: Store) -> None:
    calibration = hardware.calibration_for(torch.device("cpu"), store, fresh=args.calibrate)  # before vLLM's threads
    bandwidth = planner.decode_bandwidth_gbps(calibration)
    server = VLLMServer(dtype=args.dtype, threads=args.threads)
    print(f"\n## vLLM's CPU build, {args.dtype}, {args.threads} OpenMP thread(s), at most {MAX_NUM_SEQS} sequences "
          f"and {MAX_BATCHED_TOKENS} tokens a step\n\n{calibration_line(calibration)}")
    t0 = time.monotonic()
    try:
        url = server.start()
        started = time.monotonic() - t0
        idle = idle_cpu_share(server.process.pid)
        t0 = time.monotonic()
        cfg = probe.ProbeConfig(url, input_tokens=args.input_tokens, long_tokens=args.probe_long,
                                output_tokens=args.output_tokens, batch=args.probe_batch)
        found = probe.measure(cfg, store)
        print(f"\nstarted in {started:.0f} s (idle, it took {idle:.2f} cores)\n\nProbe ({time.monotonic() - t0:.0f} s;"
              f" single requests at {args.input_tokens} and {args.probe_long} prompt words, {args.output_tokens} "
              f"output tokens; {args.probe_batch} at once):\n\n```\n{probe.describe(found)}\n```")
        try:
            setup, scheduler, fitted = probe.planned_setup(found, bandwidth, args.output_tokens, dtype=args.dtype)
        except ProbeError as exc:  # a noisy probe costs vLLM's part, not the local one measured before it
            print(f"\nvLLM is not planned or measured: {exc}")
            return
        t0 = time.monotonic()
        planned, planned_cap, planned_found = predict(args, setup, scheduler)
        print(f"\nFitted: {fitted.describe()}."
              f"\n\n{args.input_tokens} prompt words are {found['prompt_tokens']:.0f} tokens as vLLM counts them (its "
              f"chat template included), {setup.prompt_tokens} of them prefilled; each step is one forward of every "
              "prefill chunk and decode together."
              f"{prediction_text(args, planned, planned_cap, planned_found, 'that fit', time.monotonic() - t0)}")
        if args.predict_only:
            return
        t0 = time.monotonic()
        sweep, found_cap = measure(args, store, url, None, planned_cap)
    finally:
        server.stop()
    compare(args, planned, planned_cap, planned_found, sweep, found_cap, time.monotonic() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="0.5,1,2,4")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--input-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--slo", default="ttft_ms=1000,tpot_ms=100")
    p.add_argument("--attainment", type=float, default=0.9)
    p.add_argument("--duration", type=float, default=16.0, help="seconds of arrivals per capacity level")
    p.add_argument("--steps", type=int, default=2, help="bisections of the measured capacity search")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine's calibration now instead of reusing a recent one (on a quiet machine)")
    p.add_argument("--vllm", action="store_true", help="also predict and measure vLLM's CPU build (needs .venv-vllm)")
    p.add_argument("--only", choices=["local", "vllm"], help="one engine alone (vllm implies --vllm)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="vLLM's dtype; float32 by default: on a CPU without AVX-512 BF16 its bf16 products fall back "
                        "to a path many times slower")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--probe-batch", type=int, default=8,
                   help="vLLM's probe: requests at once for the second decode step")
    p.add_argument("--probe-long", type=int, default=512, help="vLLM's probe: the long prompt's words")
    p.add_argument("--predict-only", action="store_true",
                   help="print the predictions alone (vLLM's after its probe), measure no sweep, write no result file")
    args = p.parse_args()
    store = Store(Path(tempfile.mkdtemp(prefix="tokenpath-bench-")) / "capacity.duckdb")
    print(f"Synthetic prompts of {args.input_tokens} tokens ({args.input_tokens} words to a server whose tokenizer is "
          f"not here), {args.output_tokens} output tokens (ignore_eos); SLO {format_slo(parse_slo(args.slo))} for "
          f"{args.attainment:.0%} of requests\n")
    if args.only != "vllm":
        local_part(args, store)
    if args.only == "vllm" or (args.vllm and args.only != "local"):
        vllm_part(args, store)


if __name__ == "__main__":
    if "--predict-only" in sys.argv:
        main()
    else:
        with recorded("capacity"):
            main()
