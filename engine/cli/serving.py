"""Command-line side of served models: `generate --endpoint URL`, `load` (a load sweep) and
`serve-vllm` (vLLM's CPU build on 127.0.0.1), as parser builders and command functions."""
from __future__ import annotations

import json
import shlex
import signal
import sys
import time

from engine.errors import USER_ERROR


def add_generate_options(g) -> None:
    g.add_argument("--endpoint", help="an OpenAI-compatible server (vLLM, SGLang, llama.cpp, TGI), e.g. "
                                      "http://127.0.0.1:8000: the run goes there instead of the local model")
    g.add_argument("--served-model", help="with --endpoint: the server's model name (default: the first it lists)")
    g.add_argument("--api-key-env", help="with --endpoint: the environment variable that holds the API key")
    g.add_argument("--gpu", help="with --endpoint: the server's GPU, to split its work into memory and compute "
                                 "with the planner (an estimate)")
    g.add_argument("--timeout", type=float, help="with --endpoint: seconds the stream may go without a token "
                                                 "(default 120; keep-alive comments do not count)")
    g.add_argument("--deadline", type=float, help="with --endpoint: seconds the whole run may take (default: the "
                                                  "timeout plus one second per token of --max-new-tokens)")


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))


def served_fields(args) -> dict:
    """The RunSpec fields of `generate --endpoint`: backend, server, key, GPU, timeout and deadline."""
    from engine.run.spec import STALL_TIMEOUT_S

    fields = {"timeout_s": STALL_TIMEOUT_S if args.timeout is None else args.timeout, "deadline_s": args.deadline,
              "served_model": args.served_model, "api_key_env": args.api_key_env, "gpu": args.gpu}
    if args.endpoint is not None:
        fields.update(backend="served", endpoint=args.endpoint)
    return fields


def print_summary(run, result: dict) -> None:
    """The lines after a served run's text: its figures and its buckets."""
    chunks = f" in {result['n_chunks']} chunks" if result["n_chunks"] != result["n_new_tokens"] else ""
    print(f"\n\nrun {result['run_id']} on {run.root} ({run.served_model}): {result['n_new_tokens']} tokens{chunks}, "
          f"TTFT {result['ttft_ms'] or 0:.1f} ms, TPOT {result['tpot_ms'] or 0:.1f} ms, E2E {result['e2e_ms'] or 0:.1f} ms "
          f"(tokens from {result['token_source']}, stopped by {result['stop_reason']})", file=sys.stderr)
    d = result["distances_ms"]
    parts = [f"{k} {v:.1f}" for k, v in d.items() if v is not None]
    if d.get("memory") is None:
        parts.append(f"server work {result['server_work_ms']:.1f} (not split: no --gpu)")
    print("buckets (ms): " + ", ".join(parts), file=sys.stderr)


def cmd_load(args) -> int:
    from engine.serve import load
    from engine.serve.client import ServedError
    from engine.store.db import Store, StoreError

    if args.from_sweep is not None:
        return load_again(args)
    if not args.endpoint:
        print("error: give the server with --endpoint URL, or make a stored sweep again with --from-sweep ID.",
              file=sys.stderr)
        return USER_ERROR
    try:
        cfg = load.SweepConfig(endpoint=args.endpoint, concurrency=load.parse_concurrency(args.concurrency),
                               requests=args.requests, max_new_tokens=args.max_new_tokens,
                               prompts=load.load_prompts(args.prompts), served_model=args.served_model,
                               api_key_env=args.api_key_env, temperature=args.temperature, timeout_s=args.timeout)
        sweep = load.Sweep(cfg, Store(args.db), progress_path=args.progress,
                           on_progress=None if args.json else _print_progress)
    except (ServedError, StoreError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USER_ERROR
    # Stop (the page's button, or Ctrl-C) cuts the requests in flight and keeps what finished
    signal.signal(signal.SIGTERM, lambda *_: sweep.stop())
    signal.signal(signal.SIGINT, lambda *_: sweep.stop())
    summary = sweep.run()
    if args.json:
        _print_json(summary)
    else:
        print(file=sys.stderr)
        print(level_table(summary["levels"]))
        print(f"sweep {summary['sweep_id']} {summary['status']}", file=sys.stderr)
    return 0 if summary["status"] in ("ok", "stopped") else 1


def load_again(args) -> int:
    """load --from-sweep ID: the stored sweep's parameters as `load`'s options, run against --db."""
    from engine.run.reproduce import ReproduceError, sweep_arguments
    from engine.store.db import Store, StoreError

    try:
        store = Store(args.from_db or args.db)
        found = store.query("SELECT config FROM load_sweeps WHERE sweep_id = ?", [args.from_sweep])
        if found.empty:
            raise ReproduceError(f"Load sweep {args.from_sweep} is not in {store.path}; the Serving page lists them.")
        options = {flag for action in args.parser._actions for flag in action.option_strings}
        argv = sweep_arguments(json.loads(found["config"].iloc[0]), options)
    except (ReproduceError, StoreError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USER_ERROR
    print("running: python -m engine load " + shlex.join(argv), file=sys.stderr)
    passed = [flag for flag, on in (("--json", args.json),) if on] + (["--db", args.db] if args.db else [])
    again = args.parser.parse_args(argv + passed)
    return again.func(again)


def _print_progress(state: dict) -> None:
    eta = f", about {state['eta_s']:.0f} s left" if state.get("eta_s") is not None else ""
    print(f"\r{state['done']}/{state['total']} requests{eta}   ", end="", file=sys.stderr, flush=True)


def level_table(levels: list[dict]) -> str:
    """One line per concurrency level: the p50/p90/p99 figures and throughput."""
    lines = [f"{'conc':>4} {'ok':>4} {'TTFT p50/p90/p99 ms':>22} {'ITL p50/p90/p99 ms':>20} {'TPOT p50 ms':>11} "
             f"{'E2E p50 ms':>10} {'req/s':>6} {'out tok/s':>9}"]
    fmt = lambda s: "/".join(f"{s[f'p{q}']:.0f}" if s[f"p{q}"] is not None else "-" for q in (50, 90, 99))  # noqa: E731
    for lv in levels:
        lines.append(f"{lv['concurrency']:>4} {lv['completed']:>4} {fmt(lv['ttft_ms']):>22} {fmt(lv['itl_ms']):>20} "
                     f"{lv['tpot_ms']['p50'] or 0:>11.1f} {lv['e2e_ms']['p50'] or 0:>10.0f} "
                     f"{lv['requests_per_s'] or 0:>6.2f} {lv['output_tokens_per_s'] or 0:>9.1f}")
    return "\n".join(lines)


def cmd_serve_vllm(args) -> int:
    from engine.serve.client import api_key
    from engine.serve.vllm import VLLMServer

    key = api_key(args.api_key_env) if args.api_key_env else None
    server = VLLMServer(port=args.port, dtype=args.dtype, threads=args.threads, api_key=key)
    print(f"starting vLLM on 127.0.0.1:{server.port} (log {server.log_path}); the first start compiles for "
          "several minutes", file=sys.stderr)
    url = server.start()
    print(url, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while server.process is not None and server.process.poll() is None:
            time.sleep(1.0)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        server.stop()
    return 0


def add_parsers(sub) -> None:
    """The `load` and `serve-vllm` commands."""
    lp = sub.add_parser("load", help="a load sweep against an OpenAI-compatible server")
    lp.add_argument("--endpoint", help="the server, e.g. http://127.0.0.1:8000 (required unless --from-sweep)")
    lp.add_argument("--from-sweep", type=int, help="make this stored load sweep again, with its parameters")
    lp.add_argument("--from-db", help="with --from-sweep: the database that holds it (default: --db)")
    lp.add_argument("--concurrency", default="1,2,4,8", help="levels, comma-separated")
    lp.add_argument("--requests", type=int, default=16, help="requests per level")
    lp.add_argument("--max-new-tokens", type=int, default=64)
    lp.add_argument("--prompts", help="a prompts file (JSON list, or paragraphs of text) or a shipped workload name")
    lp.add_argument("--served-model", help="the server's model name (default: the first it lists)")
    lp.add_argument("--api-key-env", help="the environment variable that holds the API key")
    lp.add_argument("--temperature", type=float, default=0.0)
    lp.add_argument("--timeout", type=float, default=120.0, help="seconds a stream may stall")
    lp.add_argument("--progress", help="a JSON file the sweep keeps its progress in")
    lp.add_argument("--db", help="DuckDB file (default data/runs.duckdb or $TOKENPATH_DB)")
    lp.add_argument("--json", action="store_true", help="print one JSON object")
    lp.set_defaults(func=cmd_load, parser=lp)

    sp = sub.add_parser("serve-vllm", help="start vLLM's CPU build with the default model on 127.0.0.1")
    sp.add_argument("--port", type=int, help="default: a free port")
    sp.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    sp.add_argument("--threads", type=int, default=1, help="OpenMP threads for the model")
    sp.add_argument("--api-key-env", help="require the API key held in this environment variable")
    sp.set_defaults(func=cmd_serve_vllm)
