"""`python -m engine plan`: the deployment planner on the command line.

One configuration in, its five buckets, speeds, prefill and memory fit out (text, or one JSON object)."""
from __future__ import annotations

import json

from engine.plan import kvcalc
from engine.plan import planner as plan

JSON_KEYS = ("decode_ms_per_token", "tokens_per_s_per_user", "tokens_per_s_total", "prefill_ms", "distances_ms",
             "memory_per_gpu_bytes", "fits")


def setup_from_args(args) -> plan.Setup:
    gpu = plan.get_gpu(args.gpu)
    gpus = args.gpus if args.gpus is not None else max(args.tp or 1, 1) * args.pp
    return plan.Setup(model=plan.resolve_model(args.model), gpu=gpu, gpus=gpus, tp=args.tp, pp=args.pp,
                      interconnect=args.interconnect or default_interconnect(gpu), weights=args.weights,
                      bits_per_weight=args.bits_per_weight, kv_dtype=args.kv_dtype, batch=args.batch,
                      prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                      spec_acceptance=args.spec_acceptance, spec_draft_length=args.spec_draft_length,
                      spec_draft_cost=args.spec_draft_cost)


def default_interconnect(gpu: dict) -> str:
    """The GPU's own link where it has one, else PCIe."""
    if gpu["gpu_link"]["gbps_per_direction"] is None:
        return "pcie"
    return "infinity-fabric" if gpu["id"].startswith("mi") else "nvlink"


def cmd_plan(args) -> int:
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


def add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="deployment planner: a model on GPUs you do not have, five buckets per token")
    p.add_argument("--model", required=True, help="a preset id (see kvcalc --list-presets), a config.json or a folder")
    p.add_argument("--gpu", required=True, help="a GPU id of data/gpus.json, e.g. a100-80gb-sxm")
    p.add_argument("--gpus", type=int, help="GPU count (default: tp x pp)")
    p.add_argument("--tp", type=int, help="tensor-parallel degree (default: all GPUs / pp)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    p.add_argument("--interconnect", help="nvlink, nvswitch, pcie, infinity-fabric, infiniband or ethernet "
                                          "(default: the GPU's own link)")
    p.add_argument("--weights", default="bf16", help="fp32 bf16 fp16 fp8 int8 int4")
    p.add_argument("--bits-per-weight", type=float, help="instead of --weights, e.g. 4.85 for Q4_K_M")
    p.add_argument("--kv-dtype", default="bf16", help="KV-cache precision (fp32 bf16 fp16 fp8 int8 int4)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--spec-acceptance", type=float, help="speculative decoding: per-token acceptance rate, 0 to 1")
    p.add_argument("--spec-draft-length", type=int, default=4, help="speculative decoding: tokens drafted per step")
    p.add_argument("--spec-draft-cost", type=float, default=0.05,
                   help="speculative decoding: one draft token's cost as a fraction of a target step")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_plan)
