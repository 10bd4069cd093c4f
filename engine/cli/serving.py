"""Command-line side of served models: `generate --endpoint URL`, `load` (a load sweep), `capacity`
(a search over request rates) and `serve-vllm` (vLLM's CPU build on 127.0.0.1), as parser builders and command functions."""
from __future__ import annotations

import json
import shlex
import signal
import sys
import threading
import time

from engine.errors import USER_ERROR

INTERRUPTED = threading.Event()  # set by Ctrl-C during a load or capacity sweep


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
    from engine.spec import STALL_TIMEOUT_S

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
    net = result.get("network")
    if net:
        print(f"network (ms): connect {net['connect_ms']:.2f} (name lookup {net['dns_ms']:.2f} of it), TLS "
              f"{net['tls_ms']:.2f}, request sent {net['send_ms']:.2f}, first byte {net['first_byte_ms']:.2f} "
              f"({net['connection']} connection)", file=sys.stderr)
    cache = result.get("prefix_cache")
    if cache and cache["prefix_cache_hit_rate"] is not None:
        print(f"prefix cache: {cache['prefix_cache_hits']:.0f} of {cache['prefix_cache_queries']:.0f} prompt tokens "
              f"found ({cache['prefix_cache_hit_rate']:.0%})", file=sys.stderr)


def _sweep_config(args, **levels):
    """The sweep's settings from the command line; every fault is a ServedError or an SLOError."""
    from engine.measure.slo import parse_slo
    from engine.serve import arrivals, load

    trace = arrivals.read_trace(args.trace) if args.trace else None
    return load.SweepConfig(
        endpoint=args.endpoint, requests=args.requests, max_new_tokens=args.max_new_tokens,
        prompts=[] if args.input_tokens or trace else load.load_prompts(args.prompts), served_model=args.served_model,
        api_key_env=args.api_key_env, temperature=args.temperature, timeout_s=args.timeout,
        burstiness=args.burstiness, max_concurrency=args.max_concurrency, seed=args.seed,
        input_tokens=args.input_tokens, output_tokens=args.output_tokens, length_spread=args.length_spread,
        trace=trace, trace_name=args.trace, duration_s=args.duration, warmup=args.warmup,
        slo=parse_slo(args.slo) if args.slo else {}, deadline_s=args.deadline,
        shared_prefix_tokens=args.shared_prefix_tokens, **levels)


def _start(args, make_levels, on_progress):
    """The sweep, checked and ready (nothing stored yet), or the exit code of a refusal."""
    from engine.errors import UserError
    from engine.serve import load
    from engine.serve.client import ServedError
    from engine.store.db import Store, StoreError

    if getattr(args, "from_sweep", None) is not None:
        return load_again(args)
    if args.endpoint and args.local:
        print("error: --endpoint sends the requests to a server and --local to this machine's engine: give one, "
              "not both.", file=sys.stderr)
        return USER_ERROR
    if not args.endpoint and not args.local:
        print("error: give the server with --endpoint URL, run the local engine with --local, or make a stored "
              "sweep again with --from-sweep ID.", file=sys.stderr)
        return USER_ERROR
    if args.endpoint and args.weights is not None:
        print("error: --weights sets the local engine's weight level, and a server runs the weights it loaded: leave "
              "it out, or use --local.", file=sys.stderr)
        return USER_ERROR
    if args.endpoint and args.kv_dtype is not None:
        print("error: --kv-dtype sets the local engine's KV-cache precision, and a server keeps the cache it chose "
              "(vLLM's --kv-cache-dtype): leave it out, or use --local.", file=sys.stderr)
        return USER_ERROR
    if args.endpoint and args.prefix_cache_mb is not None:
        print("error: --prefix-cache-mb sets the local engine's prefix cache, and a server keeps its own (vLLM's "
              "--enable-prefix-caching): leave it out, or use --local.", file=sys.stderr)
        return USER_ERROR
    target = None
    try:
        cfg = _sweep_config(args, **make_levels())
        if args.local:
            target = _local_target(args, cfg)
        sweep = load.Sweep(cfg, target.store if target else Store(args.db), progress_path=args.progress,
                           on_progress=on_progress, target=target)
        if target is not None:
            target.check(sweep.requests())
    except (ServedError, StoreError, UserError) as exc:
        if target is not None:
            target.close()
        print(f"error: {exc}", file=sys.stderr)
        return USER_ERROR
    # Stop (the page's button: SIGTERM) cuts the requests in flight and keeps what finished; Ctrl-C does the same, and
    # the command then ends as an interrupted one does (exit 130)
    INTERRUPTED.clear()
    signal.signal(signal.SIGTERM, lambda *_: sweep.stop())
    signal.signal(signal.SIGINT, lambda *_: (INTERRUPTED.set(), sweep.stop()))
    return sweep


def _local_target(args, cfg):
    """load/capacity --local: the model loaded per --model at --weights and a LocalTarget with --max-batch and
    --kv-budget-mb, after every setting is checked (nothing is loaded or stored for bad input)."""
    from engine.run.batch import budget_bytes, check_cap
    from engine.run.load_target import LocalTarget
    from engine.store.db import Store
    from engine.switches.quant import level

    check_cap(args.max_batch)
    budget = budget_bytes(args.kv_budget_mb)
    prefixes = budget_bytes(args.prefix_cache_mb, "--prefix-cache-mb")
    weights = args.weights or "fp32"
    level(weights)
    cfg.check()
    return LocalTarget.load(cfg, Store(args.db), model=args.model, weights=weights, max_batch=args.max_batch,
                            kv_budget_bytes=budget, prefix_cache_bytes=prefixes, kv_dtype=args.kv_dtype or "auto")


def _swept(sweep, run) -> dict:
    """run(sweep)'s summary; the sweep's target is closed after it (a local engine's thread stops)."""
    try:
        return run(sweep)
    finally:
        sweep.target.close()


def cmd_load(args) -> int:
    from engine.serve import arrivals, load
    from engine.serve.client import ServedError

    def levels() -> dict:
        if args.rate is not None:
            if args.concurrency is not None:
                raise ServedError("Give --rate or --concurrency, not both.")
            return {"rates": arrivals.parse_rates(args.rate)}
        if args.trace:
            return {"concurrency": load.parse_concurrency(args.concurrency)} if args.concurrency is not None else {}
        return {"concurrency": load.parse_concurrency("1,2,4,8" if args.concurrency is None else args.concurrency)}

    sweep = _start(args, levels, None if args.json else _print_progress)
    if isinstance(sweep, int):
        return sweep
    summary = _swept(sweep, load.Sweep.run)
    if args.json:
        _print_json(summary)
    else:
        print(file=sys.stderr)
        print(level_table(summary["levels"]))
    return _ending(summary, args.json)


def _ending(summary: dict, quiet: bool) -> int:
    """The sweep's last line, true to what happened: how many requests failed, which level broke and why.
    Non-zero when a level broke or no request succeeded; 130 when Ctrl-C stopped it."""
    ok, failed = summary["requests_ok"], summary["requests_failed"]
    sent = f"{ok + failed} requests, {failed} failed" if failed else f"{ok} requests"
    if failed and not ok:
        sent = f"none of its {failed} requests succeeded"
    code = 1 if summary["status"] == "error" or (failed and not ok) else 0
    if INTERRUPTED.is_set():
        code = 130
    if summary["status"] == "error":
        kept = sum(lv["status"] == "ok" for lv in summary["levels"])
        line = f"sweep {summary['sweep_id']} ended early: {summary['error']} ({kept} level(s) before it stored; {sent})"
    else:
        ending = "finished" if summary["status"] == "ok" else summary["status"]  # "ok" beside "none succeeded" misleads
        line = f"sweep {summary['sweep_id']} {ending}: {sent}"
    if not quiet or code:
        print(line, file=sys.stderr)
    return code


def cmd_capacity(args) -> int:
    from engine.serve import arrivals, capacity
    from engine.serve.client import ServedError

    def levels() -> dict:
        if not 0 < args.attainment <= 1:
            raise ServedError(f"--attainment must be a share above 0 and at most 1, such as 0.9, not {args.attainment:g}.")
        if not (args.think_time >= 0 and args.think_time < float("inf")):
            raise ServedError(f"--think-time must be 0 or a positive number of seconds, not {args.think_time:g}.")
        if not 0 <= args.steps <= 10:
            raise ServedError(f"--steps must be between 0 and 10, not {args.steps}.")
        return {"rates": arrivals.parse_rates(str(args.start_rate))}

    sweep = _start(args, levels, None if args.json else _print_progress)
    if isinstance(sweep, int):
        return sweep
    summary = _swept(sweep, lambda s: capacity.search(s, attainment=args.attainment, start_rate=s.cfg.rates[0],
                                                     steps=args.steps, think_time_s=args.think_time))
    if args.json:
        _print_json(summary)
    else:
        print(file=sys.stderr)
        print(level_table(summary["levels"]))
        print(capacity.describe(summary))
    return _ending(summary, args.json)


def load_again(args) -> int:
    """load --from-sweep ID: the stored sweep's parameters as `load`'s options, run against --db."""
    from engine.serve.command import ReproduceError, stored_sweep_config, sweep_arguments
    from engine.store.db import Store, StoreError

    try:
        store = Store(args.from_db or args.db)
        options = {flag for action in args.parser._actions for flag in action.option_strings}
        argv = sweep_arguments(stored_sweep_config(store, args.from_sweep), options)
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
    """One line per level: the p50/p90/p99 figures, throughput, with an SLO goodput and attainment, and the
    share of prompt tokens the server found in its prefix cache where it counts them."""
    lines = [f"{'level':>12} {'ok':>4} {'fail':>4} {'TTFT p50/p90/p99 ms':>22} {'ITL p50/p90/p99 ms':>20} "
             f"{'TPOT p50 ms':>11} {'E2E p50 ms':>10} {'req/s':>6} {'out tok/s':>9} {'good/s':>6} {'attain':>6} "
             f"{'cached':>6}"]
    fmt = lambda s: "/".join(f"{s[f'p{q}']:.0f}" if s[f"p{q}"] is not None else "-" for q in (50, 90, 99))  # noqa: E731
    for lv in levels:
        label = lv.get("label") or f"{lv['concurrency']} at once"
        good = f"{lv['goodput_requests_per_s']:>6.2f} {lv['attainment']:>6.0%}" if "attainment" in lv else f"{'-':>6} {'-':>6}"
        hit = lv.get("prefix_cache_hit_rate")
        cached = f"{hit:>6.0%}" if hit is not None else f"{'-':>6}"
        lines.append(f"{label:>12} {lv['completed']:>4} {lv['failed']:>4} {fmt(lv['ttft_ms']):>22} "
                     f"{fmt(lv['itl_ms']):>20} {lv['tpot_ms']['p50'] or 0:>11.1f} {lv['e2e_ms']['p50'] or 0:>10.0f} "
                     f"{lv['requests_per_s'] or 0:>6.2f} {lv['output_tokens_per_s'] or 0:>9.1f} {good} {cached}")
        if lv.get("status", "ok") != "ok":
            lines.append(f"{'':>12} broke: {lv['error']}")
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


def _sweep_options(p, duration: float | None = None, slo_required: bool = False) -> None:
    """The options load and capacity share: the server or the local engine, the requests' lengths, arrivals,
    SLO, store."""
    from engine.dtypes import KV_CHOICES
    from engine.spec import MAX_BATCH

    p.add_argument("--endpoint", help="the server, e.g. http://127.0.0.1:8000 (or --local)")
    p.add_argument("--local", action="store_true", help="send the requests straight into this machine's "
                                                        "continuous-batching engine, each one a recorded run")
    p.add_argument("--model", default="default", help="with --local: 'default', a Hugging Face id or a local folder")
    p.add_argument("--weights", help="with --local: the weight level the whole batch runs at (default fp32; "
                                     "int8-dyn, int4-dyn, ...: `generate --help` lists them)")
    p.add_argument("--max-batch", type=int, default=8,
                   help=f"with --local: sequences decoded together (1-{MAX_BATCH})")
    p.add_argument("--kv-dtype", choices=KV_CHOICES, help="with --local: the precision every sequence's KV cache is "
                   "kept in (default auto: the weights' compute precision); bf16 or fp16 halve its bytes")
    p.add_argument("--kv-budget-mb", type=float, help="with --local: KV-cache memory the batch may reserve; "
                                                      "arrivals beyond it wait")
    p.add_argument("--prefix-cache-mb", type=float, help="with --local: keep prefilled prompts' KV cache, up to this "
                   "many MiB, so that a later request opening with a kept prompt's tokens prefills only the rest "
                   "(vLLM's prefix caching); off when not given")
    p.add_argument("--slo", required=slo_required, help="targets in ms, e.g. ttft_ms=500,tpot_ms=50 (also itl_ms, "
                                                        "e2e_ms): goodput and attainment per level")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma-shaped gaps between arrivals: 1 Poisson, "
                                                                  "below 1 burstier, above 1 more even")
    p.add_argument("--max-concurrency", type=int, help="with rates: at most this many in flight; the rest wait in the client")
    p.add_argument("--seed", type=int, default=0, help="the same seed gives the same arrivals and lengths")
    p.add_argument("--duration", type=float, default=duration, help="with rates: seconds of arrivals per level "
                                                                      "(rate x duration requests, at least --requests)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--input-tokens", type=int, help="synthetic prompts of this many tokens instead of --prompts")
    p.add_argument("--output-tokens", type=int, help="output tokens per request (ignore_eos where the server has it; "
                                                     "the real length is recorded)")
    p.add_argument("--length-spread", type=float, default=0.0, help="lengths uniform within +- this fraction")
    p.add_argument("--shared-prefix-tokens", type=int, help="every prompt starts with the same preamble of this "
                                                            "many tokens (a long system prompt), so a server's "
                                                            "prefix cache can skip its prefill")
    p.add_argument("--prompts", help="a prompts file (JSON list, or paragraphs of text) or a shipped workload name")
    p.add_argument("--trace", help="a JSONL trace (t_s, prompt or input_tokens, output_tokens), replayed at its own "
                                   "timing or scaled to each --rate")
    p.add_argument("--warmup", type=int, default=0, help="requests sent before the first level, left out of the figures")
    p.add_argument("--deadline", type=float, help="seconds a request may take in all; later ones are cut and recorded")
    p.add_argument("--served-model", help="the server's model name (default: the first it lists)")
    p.add_argument("--api-key-env", help="the environment variable that holds the API key")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a stream may stall")
    p.add_argument("--progress", help="a JSON file the sweep keeps its progress in")
    p.add_argument("--db", help="DuckDB file (default data/runs.duckdb or $TOKENPATH_DB)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def add_parsers(sub) -> None:
    """The `load` and `serve-vllm` commands."""
    lp = sub.add_parser("load", help="a load sweep against an OpenAI-compatible server or the local engine")
    lp.add_argument("--concurrency", help="levels of requests kept in flight, comma-separated (default 1,2,4,8)")
    lp.add_argument("--rate", help="levels of open-loop arrivals in requests/s, comma-separated, e.g. 0.5,1,2,4")
    lp.add_argument("--requests", type=int, default=16, help="requests per level")
    lp.add_argument("--from-sweep", type=int, help="make this stored load sweep again, with its parameters")
    lp.add_argument("--from-db", help="with --from-sweep: the database that holds it (default: --db)")
    _sweep_options(lp)
    lp.set_defaults(func=cmd_load, parser=lp)

    cp = sub.add_parser("capacity", help="the highest request rate a server (or the local engine) holds at a latency target")
    cp.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet every target")
    cp.add_argument("--think-time", type=float, default=0.0, help="seconds a user waits between answer and next request")
    cp.add_argument("--start-rate", type=float, default=1.0, help="the first rate tried, requests/s")
    cp.add_argument("--steps", type=int, default=3, help="bisections after the bracket")
    cp.add_argument("--requests", type=int, default=16, help="the fewest requests a level sends")
    _sweep_options(cp, duration=30.0, slo_required=True)
    cp.set_defaults(func=cmd_capacity)

    sp = sub.add_parser("serve-vllm", help="start vLLM's CPU build with the default model on 127.0.0.1")
    sp.add_argument("--port", type=int, help="default: a free port")
    sp.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    sp.add_argument("--threads", type=int, default=1, help="OpenMP threads for the model")
    sp.add_argument("--api-key-env", help="require the API key held in this environment variable")
    sp.set_defaults(func=cmd_serve_vllm)
