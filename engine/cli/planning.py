"""`python -m engine plan`: the deployment planner on the command line.

One configuration in, its five buckets, speeds, prefill and memory fit out; with --offline, --rate or --capacity
the continuous-batching simulation at a load, an SLO's goodput and capacity, GPUs, $ and J per token (text or JSON)."""
from __future__ import annotations

import argparse
import json

from engine.measure import slo as slos
from engine.plan import capacity as cap
from engine.plan import disaggregate as dis
from engine.plan import kvcalc
from engine.plan import planner as plan
from engine.plan import simulate as sim
from engine.plan.planner import PlanError

JSON_KEYS = ("decode_ms_per_token", "tokens_per_s_per_user", "tokens_per_s_total", "prefill_ms", "distances_ms",
             "memory_per_gpu_bytes", "fits")


def setup_from_args(args) -> plan.Setup:
    gpu = plan.get_gpu(args.gpu[0])
    gpus = args.gpus[0] if args.gpus else max(args.tp or 1, 1) * args.pp
    return plan.Setup(model=plan.resolve_model(args.model), gpu=gpu, gpus=gpus, tp=args.tp, pp=args.pp,
                      interconnect=args.interconnect or default_interconnect(gpu), weights=args.weights,
                      bits_per_weight=args.bits_per_weight, kv_dtype=args.kv_dtype, batch=args.batch,
                      prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                      speculative_acceptance=args.speculative_acceptance,
                      speculative_draft_length=args.speculative_draft_length,
                      speculative_draft_cost=args.speculative_draft_cost, ep=args.ep)


def default_interconnect(gpu: dict) -> str:
    """The GPU's own link where it has one, else PCIe."""
    if gpu["gpu_link"]["gbps_per_direction"] is None:
        return "pcie"
    return "infinity-fabric" if gpu["id"].startswith("mi") else "nvlink"


def listed(kind):
    """An argparse type for a comma-separated list of `kind`."""
    def parse(text: str) -> list:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise PlanError(f"Give at least one value in {text!r}.")
        try:
            return [kind(t) for t in items]
        except ValueError:
            raise PlanError(f"Cannot read {text!r} as a comma-separated list of {kind.__name__} values.") from None
    parse.__name__ = f"list of {kind.__name__}"
    return parse


def workload_from_args(args) -> tuple[sim.Workload, sim.Scheduler]:
    plan.shapes.whole("requests", args.requests)
    spread = plan.shapes.fraction("length_spread", args.length_spread, 0.0, 0.99)
    if args.rate is not None:
        sim.check_rate(args.rate)
    workload = sim.Workload(requests=args.requests, rate=args.rate if args.rate is not None else float("inf"),
                            burstiness=args.burstiness, prompt_tokens=args.prompt_tokens,
                            new_tokens=args.new_tokens, length_spread=spread, seed=args.seed)
    scheduler = sim.Scheduler(max_num_seqs=plan.shapes.whole("max_num_seqs", args.max_num_seqs),
                              max_batched_tokens=plan.shapes.whole("max_batched_tokens", args.max_batched_tokens),
                              chunked_prefill=not args.no_chunked_prefill)
    return workload, scheduler


def slo_from_args(args) -> dict:
    if not args.slo:
        raise PlanError(f"Give the latency targets with --slo, e.g. --slo {slos.EXAMPLE}.")
    return slos.parse_slo(args.slo)


def cmd_plan(args) -> int:
    if args.disaggregate:
        return cmd_disaggregate(args)
    if args.offline or args.rate is not None or args.capacity:
        return cmd_load(args)
    if len(args.gpu) > 1 or len(args.gpus or []) > 1:
        raise PlanError("Several GPU types or counts are compared only with --capacity.")
    setup = setup_from_args(args)
    result = plan.plan(setup, require_fit=True)
    if args.json:
        print(json.dumps({**{k: result[k] for k in JSON_KEYS}, **{k: v for k, v in result.items() if k not in JSON_KEYS}},
                         indent=2, default=str))
        return 0
    print(f"{result['model']} on {result['gpus']} x {setup.gpu['name']} (tp {result['tp']}, pp {result['pp']}, "
          f"{result['interconnect']}), weights {result['bits_per_weight']:g} bits, batch {result['batch']}: estimates")
    print(f"  decode: {result['decode_ms_per_token']:.3f} ms per token = {result['tokens_per_s_per_user']:.1f} tokens/s "
          f"per user, {result['tokens_per_s_total']:.1f} tokens/s in all")
    print(f"  prefill of {result['prompt_tokens']} tokens: {result['prefill_ms']:.2f} ms")
    for bucket, formula in plan.formulas(setup).items():
        figure = f"{result['distances_ms'][bucket]:9.4f} ms" if bucket in result["distances_ms"] else " " * 12
        print(f"  {bucket:>8} {figure}  = {formula}")
    print(f"  memory per GPU: {kvcalc.human(result['memory_per_gpu_bytes'])} of "
          f"{kvcalc.human(result['memory']['capacity_bytes'])}; largest batch that fits: {result['largest_batch']}")
    return 0


def cmd_load(args) -> int:
    """--offline, --rate or --capacity: the planner under load."""
    if sum(bool(x) for x in (args.offline, args.rate is not None, args.capacity)) > 1:
        raise PlanError("Choose one of --offline, --rate and --capacity.")
    plan.shapes.whole("instances", args.instances)
    workload, scheduler = workload_from_args(args)
    setup = setup_from_args(args)
    if len(args.gpu) > 1 or len(args.gpus or []) > 1:
        if not args.capacity:
            raise PlanError("Several GPU types or counts are compared only with --capacity.")
        counts = [plan.shapes.whole("gpus", n) for n in (args.gpus or [1])]
        result = cap.compare(setup, args.gpu, counts, workload, scheduler, slo_from_args(args), *criteria(args),
                             args.instances, args.target_rate, args.price_per_gpu_hour,
                             interconnect=(lambda g: args.interconnect or default_interconnect(g)))
        return show(args, result, render_comparison)
    plan.plan(setup, require_fit=True)
    if args.offline:
        return show(args, cap.offline(setup, workload, scheduler, args.instances), render_offline)
    if args.rate is not None:
        q = args.percentile if args.percentile is not None else 99
        return show(args, cap.at_rate(setup, workload, scheduler, slo_from_args(args), q, args.instances),
                    render_rate)
    result = cap.capacity(setup, workload, scheduler, slo_from_args(args), *criteria(args), args.instances,
                          args.target_rate, args.price_per_gpu_hour)
    return show(args, result, render_capacity)


def cmd_disaggregate(args) -> int:
    """--disaggregate P:D at --rate R: prefill and decode pools against the same GPUs co-located."""
    if args.offline or args.capacity:
        raise PlanError("--disaggregate compares the pools at one --rate, not with --offline or --capacity.")
    if args.rate is None:
        raise PlanError("Give the request rate to compare the pools at with --rate.")
    if len(args.gpu) > 1 or len(args.gpus or []) > 1:
        raise PlanError("--disaggregate takes one GPU type and one instance size (--gpus or --tp x --pp).")
    prefill, decode = dis.parse_pools(args.disaggregate)
    workload, scheduler = workload_from_args(args)
    setup = setup_from_args(args)
    plan.plan(setup, require_fit=True)
    link = args.link or args.interconnect or default_interconnect(setup.gpu)
    return show(args, dis.disaggregate(setup, workload, scheduler, prefill, decode, link), render_disaggregated)


def criteria(args) -> tuple:
    """(percentile, attainment): the 99th percentile of every metric unless an attainment alone is asked for."""
    if args.percentile is None and args.attainment is not None:
        return None, args.attainment
    return (args.percentile if args.percentile is not None else 99.0), args.attainment


def show(args, result: dict, render) -> int:
    print(json.dumps(result, indent=2, default=str) if args.json else render(result))
    return 0


def buckets_line(buckets: dict) -> str:
    return ", ".join(f"{b} {v:.3f}" for b, v in buckets.items()) + " ms per output token"


def render_offline(r: dict) -> str:
    return (f"Offline (every request waiting at the start), estimates: {r['output_tokens_per_s']:,.0f} output tokens/s, "
            f"{r['requests_per_s']:.2f} requests/s on {r['gpus']} GPUs; the scheduler settled at a batch of "
            f"{r['batch']:.0f}\n  a token's time there: {buckets_line(r['distances_ms_per_token'])}")


def render_rate(r: dict) -> str:
    q = f"p{r['percentile']:g}"
    return (f"At {r['rate_requests_per_s']:g} requests/s, estimates: TTFT p50 {r['ttft_ms_p50']:.1f} ms, {q} "
            f"{r['ttft_ms_' + q]:.1f} ms; TPOT p50 {r['tpot_ms_p50']:.2f} ms, {q} {r['tpot_ms_' + q]:.2f} ms\n"
            f"  goodput at {r['slo']}: {r['goodput_requests_per_s']:.2f} requests/s, attainment {r['attainment']:.1%}; "
            f"{r['output_tokens_per_s']:,.0f} output tokens/s\n"
            f"  a token's time at this load: {buckets_line(r['distances_ms_per_token'])}")


def render_capacity(r: dict) -> str:
    lines = [f"{r['model']} on {r['gpus']} x {r['gpu']} ({r['instances']} instance(s) of {r['gpus_per_instance']}), "
             f"SLO {r['slo']}, estimates:",
             f"  capacity {r['capacity_requests_per_s']:.2f} requests/s, {r['output_tokens_per_s']:,.0f} output tokens/s; "
             + (f"{r['limiting_metric']} fails first" if r["limiting_metric"] != "throughput" else
              "the SLO holds up to the engine's saturation") +
             f", and the {r['limiting_bucket']} distance is most of a token's time there",
             f"  ${r['usd_per_million_output_tokens']:.3f} per million output tokens or "
             f"${r['usd_per_million_input_tokens']:.3f} per million input tokens (the whole GPU-hour charged to "
             f"each), ${r['usd_per_million_tokens']:.3f} per million of either, at ${r['usd_per_gpu_hour']:.2f} per GPU-hour",
             f"  {r['joules_per_output_token']:.3f} J per output token (board power, utilisation model)",
             f"  a token's time at capacity: {buckets_line(r['distances_ms_per_token'])}"]
    if "gpus_for_target" in r:
        lines.append(f"  for {r['target_rate_requests_per_s']:g} requests/s: {r['replicas_for_target']} replicas, "
                     f"{r['gpus_for_target']} GPUs, ${r['usd_per_hour_for_target']:.2f} per hour")
    return "\n".join(lines)


def render_disaggregated(r: dict) -> str:
    co, dg = r["colocated"], r["disaggregated"]
    return "\n".join([
        f"{r['model']} on {r['gpu']} at {r['rate_requests_per_s']:g} requests/s, instances of {r['gpus_per_instance']} "
        "GPU(s), estimates:",
        f"  co-located, {co['gpus']} GPUs as {co['instances']} instances: TTFT p50 {co['ttft_ms_p50']:.1f} ms, p99 "
        f"{co['ttft_ms_p99']:.1f} ms; TPOT p50 {co['tpot_ms_p50']:.2f} ms, p99 {co['tpot_ms_p99']:.2f} ms",
        f"  disaggregated, {r['prefill_gpus']} prefill + {r['decode_gpus']} decode GPUs: TTFT p50 "
        f"{dg['ttft_ms_p50']:.1f} ms, p99 {dg['ttft_ms_p99']:.1f} ms; TPOT p50 {dg['tpot_ms_p50']:.2f} ms, p99 "
        f"{dg['tpot_ms_p99']:.2f} ms",
        f"  each request's KV cache ({kvcalc.human(r['kv_bytes_per_request'])}) crosses {r['link']} at "
        f"{r['link_gbps']:g} GB/s per GPU in {r['kv_transfer_ms']:.3f} ms, which TTFT pays (physical distance)"])


def render_comparison(result: dict) -> str:
    lines = [f"Configurations by {result['sorted_by'].replace('_', ' ')}, cheapest first (estimates):",
             "  gpu                GPUs  capacity req/s  output tok/s  $/Mtok   J/token  limit"
             + ("  GPUs for target" if result["sorted_by"] == "usd_per_hour_for_target" else "")]
    for r in result["configurations"]:
        lines.append(f"  {r['gpu']:<18} {r['gpus']:>4}  {r['capacity_requests_per_s']:>14.2f}  "
                     f"{r['output_tokens_per_s']:>12,.0f}  {r['usd_per_million_output_tokens']:>6.3f}  "
                     f"{r['joules_per_output_token']:>8.3f}  {r['limiting_metric']} ({r['limiting_bucket']})"
                     + (f"  {r['gpus_for_target']}" if "gpus_for_target" in r else ""))
    for s in result["skipped"]:
        lines.append(f"  skipped {s['gpu']} x {s['gpus']}: {s['why']}")
    return "\n".join(lines)


def add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="deployment planner: a model on GPUs you do not have, five buckets per token")
    p.add_argument("--model", required=True, help="a preset id (see kvcalc --list-presets), a config.json or a folder")
    p.add_argument("--gpu", required=True, type=listed(str),
                   help="a GPU id of data/gpus.json, e.g. a100-80gb-sxm (several, comma-separated, with --capacity)")
    p.add_argument("--gpus", type=listed(int), help="GPU count (default: tp x pp; several with --capacity)")
    p.add_argument("--tp", type=int, help="tensor-parallel degree (default: all GPUs / pp)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree: a mixture of experts' routed experts "
                                                     "spread over this many of the GPUs (all-to-all on the links)")
    p.add_argument("--interconnect", help="nvlink, nvswitch, pcie, infinity-fabric, infiniband or ethernet "
                                          "(default: the GPU's own link)")
    p.add_argument("--weights", default="bf16", help="fp32 bf16 fp16 fp8 int8 int4 nvfp4 mxfp4")
    p.add_argument("--bits-per-weight", type=float, help="instead of --weights, e.g. 4.85 for Q4_K_M")
    p.add_argument("--kv-dtype", default="bf16", help="KV-cache precision (fp32 bf16 fp16 fp8 int8 int4 nvfp4 mxfp4)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--speculative-acceptance", type=float,
                   help="speculative decoding: per-token acceptance rate, 0 to 1")
    p.add_argument("--speculative-draft-length", type=int, default=4,
                   help="speculative decoding: tokens drafted per step")
    p.add_argument("--speculative-draft-cost", type=float, default=0.05,
                   help="speculative decoding: one draft token's cost as a fraction of a target step")
    for name, kind in (("acceptance", float), ("draft-length", int), ("draft-cost", float)):
        p.add_argument(f"--spec-{name}", dest=f"speculative_{name.replace('-', '_')}", type=kind,
                       default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # the earlier names, which scripts still use
    load = p.add_argument_group("under load (the continuous-batching simulation)")
    load.add_argument("--offline", action="store_true", help="every request waiting at the start: maximum throughput")
    load.add_argument("--rate", type=float, help="requests per second arriving (gamma gaps, see --burstiness)")
    load.add_argument("--capacity", action="store_true", help="the highest rate that holds --slo")
    load.add_argument("--slo", help=f"latency targets in ms, e.g. {slos.EXAMPLE} (also itl_ms, e2e_ms)")
    load.add_argument("--percentile", type=float, help="the percentile every metric must meet (default 99)")
    load.add_argument("--attainment", type=float, help="the share of requests that must meet every target")
    load.add_argument("--target-rate", type=float, help="requests per second to serve: replicas and GPUs for it")
    load.add_argument("--instances", type=int, default=1, help="data-parallel replicas (GPUs = tp x pp x instances)")
    load.add_argument("--requests", type=int, default=200, help="requests simulated per level")
    load.add_argument("--length-spread", type=float, default=0.0,
                      help="prompt and output lengths uniform within the mean x (1 +/- spread)")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 is Poisson")
    load.add_argument("--seed", type=int, default=0, help="seed of the arrivals and lengths")
    load.add_argument("--max-num-seqs", type=int, default=256, help="sequences per step, as vLLM's option")
    load.add_argument("--max-batched-tokens", type=int, default=8192, help="tokens per step, as vLLM's option")
    load.add_argument("--no-chunked-prefill", action="store_true", help="whole prefills in steps of their own")
    load.add_argument("--price-per-gpu-hour", type=float, help="dollars, instead of data/gpu_prices.json")
    load.add_argument("--disaggregate", metavar="PREFILL_GPUS:DECODE_GPUS",
                      help="with --rate: separate prefill and decode pools against the same GPUs co-located")
    load.add_argument("--link", help="with --disaggregate: the interconnect the KV cache crosses between the pools "
                                     "(nvlink within a node, infiniband or ethernet between nodes; default the "
                                     "GPU's own link)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_plan)
