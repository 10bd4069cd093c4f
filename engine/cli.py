"""python -m engine COMMAND: everything the pages show, from a terminal."""
from __future__ import annotations

import argparse
import json
import os
import sys

USER_ERROR = 2


def _quiet_libraries() -> None:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers.utils import logging

    logging.disable_progress_bar()


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))


def cmd_generate(args) -> int:
    from .generate import Generation, GenConfig
    from .models import load_model
    from .store import Store

    cfg = GenConfig(prompt=args.prompt, max_new_tokens=args.max_new_tokens, kv_cache=not args.no_kv_cache,
                    temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                    raw=args.raw, stop=args.stop or [])
    cfg.check()
    store = Store(args.db)
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    gen = Generation(lm, cfg, store=store)
    try:
        for event in gen:
            if not args.json:
                print(event.piece, end="", flush=True)
    except KeyboardInterrupt:
        print(f"\ncancelled: run {gen.run_id} recorded as cancelled", file=sys.stderr)
        return 130
    except Exception as exc:
        print(f"\nerror: the run failed and was recorded as run {gen.run_id} with status error: {exc}", file=sys.stderr)
        return 1
    result = gen.result
    if args.json:
        if args.tokens:
            result["tokens"] = gen.tokens
            result["steps"] = gen.steps
        _print_json(result)
    else:
        d = result["distances_ms"]
        print(f"\n\nrun {result['run_id']}: {result['n_new_tokens']} tokens, TTFT {result['ttft_ms']:.1f} ms, "
              f"TPOT {result['tpot_ms'] or 0:.1f} ms, {result['tokens_per_s']:.1f} tok/s end to end "
              f"(stopped by {result['stop_reason']})", file=sys.stderr)
        print("distances (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in d.items()), file=sys.stderr)
    return 0


def cmd_runs(args) -> int:
    from .store import Store

    frame = Store(args.db).runs(args.limit)
    if args.json:
        _print_json(json.loads(frame.to_json(orient="records", date_format="iso")))
        return 0
    if frame.empty:
        print("no runs recorded yet")
        return 0
    cols = ["run_id", "started_at", "status", "model", "device", "kv_cache", "n_new_tokens", "ttft_ms",
            "tpot_ms", "tokens_per_s", "prompt"]
    view = frame[cols].copy()
    view["prompt"] = view["prompt"].str.slice(0, 40)
    print(view.to_string(index=False, float_format=lambda v: f"{v:.1f}"))
    return 0


def cmd_calibrate(args) -> int:
    from . import hardware
    from .models import pick_device
    from .store import Store

    device = pick_device(args.device)
    store = Store(args.db)
    results = hardware.calibration_for(device, store, fresh=True)
    facts = hardware.hardware_summary(device)
    if args.json:
        _print_json({"calibration": results, "hardware": facts})
        return 0
    print(f"device {results['device_key']} (calibrated in {results['seconds']:.1f} s)")
    print(f"  memory read, GEMV over cold weights: {results['memory_gbps']:.1f} GB/s")
    print(f"  memory read, streaming sum:          {results['stream_read_gbps']:.1f} GB/s")
    for dtype, gflops in results["matmul_gflops"].items():
        print(f"  matmul peak {dtype:>9}:             {gflops:.0f} GFLOP/s")
    print(f"  dispatch overhead per op:            {results['dispatch_us']:.1f} us")
    if "host_link" in results:
        link = results["host_link"]
        print(f"  host to device {link['h2d_gbps']:.1f} GB/s, device to host {link['d2h_gbps']:.1f} GB/s, "
              f"latency {link['h2d_latency_us']:.0f}/{link['d2h_latency_us']:.0f} us")
    return 0


def cmd_hardware(args) -> int:
    from . import hardware
    from .models import pick_device

    _print_json(hardware.hardware_summary(pick_device(args.device)) | {"gpu": hardware.gpu_facts()})
    return 0


def cmd_prepare(args) -> int:
    from .models import default_model_dir

    print(f"default model ready at {default_model_dir()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine", description="Tokenpath engine")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p, device=True):
        p.add_argument("--db", help="DuckDB file (default data/runs.duckdb or $TOKENPATH_DB)")
        if device:
            p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
        p.add_argument("--json", action="store_true", help="print one JSON object")

    g = sub.add_parser("generate", help="generate text token by token and record the run")
    g.add_argument("--prompt", required=True)
    g.add_argument("--model", default="default", help="'default', a Hugging Face id or a local folder")
    g.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--no-kv-cache", action="store_true", help="recompute the whole sequence every step")
    g.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--raw", action="store_true", help="no chat template: continue the prompt as plain text")
    g.add_argument("--stop", action="append", help="stop when this string appears (repeatable)")
    g.add_argument("--tokens", action="store_true", help="with --json: per-token and per-step rows")
    common(g)
    g.set_defaults(func=cmd_generate)

    r = sub.add_parser("runs", help="recorded runs, newest first")
    r.add_argument("--limit", type=int, default=20)
    common(r, device=False)
    r.set_defaults(func=cmd_runs)

    c = sub.add_parser("calibrate", help="measure memory bandwidth, matmul peak and dispatch cost")
    common(c)
    c.set_defaults(func=cmd_calibrate)

    h = sub.add_parser("hardware", help="device facts (CPU, NVML GPUs)")
    h.add_argument("--device", default="auto")
    h.set_defaults(func=cmd_hardware)

    p = sub.add_parser("prepare", help="convert the embedded default model once")
    p.set_defaults(func=cmd_prepare)
    return parser


def main(argv=None) -> int:
    from .generate import GenerationError
    from .models import ModelError
    from .store import StoreError

    args = build_parser().parse_args(argv)
    _quiet_libraries()
    try:
        return args.func(args)
    except (GenerationError, ModelError, StoreError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USER_ERROR
