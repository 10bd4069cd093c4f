"""python -m engine COMMAND: everything the pages show, from a terminal."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys

from engine.cli import serving as served_cli
from engine.cli.interrupts import (cancel_on_sigterm, caused_by_interrupt, ignore_interrupts, interrupt_once,
                                   interrupted, redeliver_dropped_interrupt)
from engine.switches import names

from engine.errors import USER_ERROR


# Commands that load no model: they run without the model stack (torch, transformers) imported up front.
WITHOUT_MODEL = {"runs", "kvcalc", "plan", "report", "trace", "serve-vllm"}


def loads_a_model(args) -> bool:
    """Whether the command may load a model: every one but those above, and load and capacity against a server."""
    if args.command in ("load", "capacity"):
        return args.local
    return args.command not in WITHOUT_MODEL


def _quiet_libraries() -> None:
    from transformers.utils import logging

    logging.disable_progress_bar()


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))


SPECULATIVE_FLAGS = {"speculative_k": "--speculative-k", "adaptive": "--adaptive", "draft_model": "--draft-model",
                     "max_ngram": "--max-ngram", "window": "--window", "guesses": "--guesses"}


def spec_from_args(args):
    """The RunSpec the command line describes; speculative flags without --speculative are refused."""
    from engine.spec import GenConfig, GenerationError, RunSpec

    given = [flag for dest, flag in SPECULATIVE_FLAGS.items()
             if getattr(args, dest, None) is not None and getattr(args, dest) is not False]
    if args.speculative == "none" and given:
        raise GenerationError(f"{', '.join(given)} only appl{'ies' if len(given) == 1 else 'y'} to speculative decoding: add --speculative METHOD, or leave {'it' if len(given) == 1 else 'them'} out.")
    defaults = GenConfig("")
    speculative_settings = {dest: getattr(defaults, dest) if getattr(args, dest) is None else getattr(args, dest)
                            for dest in SPECULATIVE_FLAGS}
    gen = GenConfig(prompt=args.prompt, max_new_tokens=args.max_new_tokens, kv_cache=not args.no_kv_cache,
                    temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                    raw=args.raw, stop=args.stop or [], ignore_eos=args.ignore_eos, speculative=args.speculative,
                    kv_dtype=args.kv_dtype, **speculative_settings)
    return RunSpec(gen=gen, model=args.model, device=args.device, weights=args.weights, group_size=args.group_size,
                   sparsity=args.sparsity, sparsity_mode=args.sparsity_mode,
                   users=args.users, **served_cli.served_fields(args))


def what_became_of(run) -> str:
    """Where an ended run stands in the store, in words: written with its status, waiting in its journal,
    or never started."""
    recorder = run.recorder
    if recorder is None or recorder.run_id is None:
        return "no run was recorded"
    if recorder.written:
        n = run.result["n_new_tokens"] if run.result else len(run.tokens)
        return f"run {recorder.run_id} recorded as {run.status} with {n} token{'s' if n != 1 else ''}"
    return (f"run {recorder.run_id} is kept in its journal and goes into the database the next time Tokenpath "
            "opens it")


def cmd_generate(args) -> int:
    """One run, or --repeat N of them one after another; --from-run takes every setting from a stored run."""
    from engine.spec import GenerationError

    if args.from_run is not None:
        return generate_again(args)
    if args.prompt is None:
        raise GenerationError("Give the prompt with --prompt TEXT, or make a stored run again with --from-run ID.")
    if args.json and args.repeat > 1:
        args.collected = []  # one JSON array of every run's object, those that finished where one fails
    code = 0
    for i in range(args.repeat):
        if args.repeat > 1:
            print(f"repeat {i + 1} of {args.repeat}", file=sys.stderr)
        code = generate_once(args)
        if code:
            break
    if getattr(args, "collected", None) is not None:
        _print_json(args.collected)
    return code


# what generate --from-run takes beside the run: where to read it and write the new runs, how many, what to print
FROM_RUN_OPTIONS = {"from_run", "from_db", "db", "repeat", "json", "tokens", "func"}


def generate_again(args) -> int:
    """generate --from-run ID: the stored run's own command, parsed and run against --db."""
    from engine.run.reproduce import from_run_arguments
    from engine.spec import GenerationError
    from engine.store.db import Store, existing_store

    alone = vars(build_parser().parse_args(["generate", "--from-run", str(args.from_run)]))
    given = [f"--{k.replace('_', '-')}" for k, v in vars(args).items() if k not in FROM_RUN_OPTIONS and v != alone.get(k)]
    if given:
        raise GenerationError(f"--from-run takes every setting from the stored run: leave out {', '.join(given)}.")
    source = existing_store(args.from_db) if args.from_db else Store(args.db)
    argv = ["generate", *from_run_arguments(source, args.from_run), "--repeat", str(args.repeat)]
    argv += [flag for flag, on in (("--json", args.json), ("--tokens", args.tokens)) if on]
    again = build_parser().parse_args(argv + (["--db", args.db] if args.db else []))
    print("running: python -m engine " + shlex.join(argv), file=sys.stderr)
    return again.func(again)


def generate_once(args) -> int:
    """A run of the local engine, or of a server with --endpoint: the same spec, the same loop, the same record."""
    from engine.errors import UserError
    from engine.run.open import open_run
    from engine.store.record import RecordDeferred
    from engine.spec import GenerationError
    from engine.address import ServedRunError
    from engine.store.db import Store

    interrupt_once()
    spec = spec_from_args(args)
    spec.check()  # bad input is refused before the database is opened
    if spec.users > 1:
        return generate_batch(args, spec)
    if args.prompts is not None or args.kv_budget_mb is not None:
        raise GenerationError("--prompts and --kv-budget-mb apply to a batch: add --users N (2 or more), or leave "
                              "them out.")
    run = open_run(spec, Store(args.db))
    try:
        for event in run:
            if not args.json:
                print(event.piece, end="", flush=True)
        _print_result(args, run, run.result)
        ignore_interrupts()  # every word about the run is said: a Ctrl-C now would only cut the exit short
    except KeyboardInterrupt:
        print(f"\ninterrupted: {what_became_of(run)}", file=sys.stderr, flush=True)
        return 130
    except (RecordDeferred, ServedRunError) as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    except UserError as exc:  # refused as the run began (a database held too long); nothing was run
        print(f"\nerror: {exc}", file=sys.stderr)
        return USER_ERROR
    except Exception as exc:
        if caused_by_interrupt(exc):
            print(f"\ninterrupted: {what_became_of(run)}", file=sys.stderr, flush=True)
            return 130
        print(f"\nerror: the run failed ({type(exc).__name__}: {exc}); {what_became_of(run)}", file=sys.stderr)
        return 1
    return 0


def _print_run_json(args, run, result: dict) -> None:
    """The run's result as JSON, with how it shared the machine (users, tokens/s in total and per user, as a
    batch's has them) and, with --tokens, its token and step rows."""
    from engine.run.local import load_figures

    shared = load_figures(run)
    result = {**result, **{k: shared[k] for k in ("users", "tokens_per_s_total", "tokens_per_s_per_user")}}
    if args.tokens:
        result = {**result, "tokens": run.tokens, "steps": run.steps}
    if getattr(args, "collected", None) is not None:
        args.collected.append(result)
    else:
        _print_json(result)


def _print_result(args, run, result: dict) -> None:
    if args.json:
        _print_run_json(args, run, result)
    elif args.endpoint is not None:
        served_cli.print_summary(run, result)
    else:
        d = result["distances_ms"]
        print(f"\n\nrun {result['run_id']}: {result['n_new_tokens']} tokens, TTFT {result['ttft_ms']:.1f} ms, "
              f"TPOT {result['tpot_ms'] or 0:.1f} ms, {result['tokens_per_s']:.1f} tok/s end to end "
              f"(stopped by {result['stop_reason']})", file=sys.stderr)
        print("distances (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in d.items()), file=sys.stderr)
        if "speculative" in result:
            sp = result["speculative"]
            print(f"speculative: {sp['accepted']} of {sp['drafted']} drafted tokens accepted, "
                  f"{sp['tokens_per_target_forward']:.2f} tokens per target forward", file=sys.stderr)


def generate_batch(args, spec) -> int:
    """--users N: the prompt and N - 1 others decoded together in one continuously batched engine (open_run),
    each sequence a recorded run. Every request is checked before the first is recorded."""
    from engine.run.batch import budget_bytes
    from engine.run.open import open_run
    from engine.store.db import Store

    budget = budget_bytes(args.kv_budget_mb)
    run = open_run(spec, Store(args.db), prompts_file=args.prompts, kv_budget_bytes=budget)
    try:
        run.run()
    except KeyboardInterrupt:
        print(f"\ncancelled: {batch_outcome(run)}", file=sys.stderr)
        return 130
    except Exception as exc:
        if caused_by_interrupt(exc):
            print(f"\ncancelled: {batch_outcome(run)}", file=sys.stderr)
            return 130
        print(f"\nerror: the batch failed ({exc}); {batch_outcome(run)}", file=sys.stderr)
        return 1
    result = {k: v for k, v in run.result.items() if k != "own"}
    if args.json:
        _print_run_json(args, run, result)
    else:
        _print_batch(result)
    ignore_interrupts()  # every word about the runs is said: a Ctrl-C now would only cut the exit short
    return 0


def batch_outcome(run) -> str:
    """What became of a batch's runs, in words: their ids by the status each was recorded with, or kept in their
    journals where the database has not taken them yet."""
    by_status: dict[str, list[str]] = {}
    for seq in run.sequences:
        if seq.run_id is not None:
            written = seq.recorder is None or seq.recorder.written
            by_status.setdefault(f"recorded as {seq.status}" if written else "kept in their journals", []).append(
                str(seq.run_id))
    if not by_status:
        return "no run was recorded"
    return "; ".join(f"run{'s' if len(ids) > 1 else ''} {', '.join(ids)} {where}"
                     for where, ids in by_status.items()) + (
        " (they go into the database the next time Tokenpath opens it)" if "kept in their journals" in by_status
        else "")


def _print_batch(result: dict) -> None:
    for one in result["runs"]:
        print(f"--- run {one['run_id']} ({one['n_new_tokens']} tokens, TTFT {one['ttft_ms']:.1f} ms)\n{one['text']}")
    figure = lambda value, scale=1.0: f"{value / scale:.1f}" if value else "n/a"  # noqa: E731
    print(f"\n{result['users']} users: {figure(result['tokens_per_s_total'])} tok/s in total, "
          f"{figure(result['tokens_per_s_per_user'])} tok/s per user, {figure(result['bytes_per_token'], 1e6)} MB "
          "moved per decode token", file=sys.stderr)
    planned = result["planned"]
    print(f"no planner prediction: {planned['error']}" if "error" in planned else
          f"planned at batch {planned['batch']}: {figure(planned['tokens_per_s_per_user'])} decode tok/s per user "
          f"(measured {figure(result['decode_tokens_per_s_per_user'])}), {figure(planned['bytes_per_token'], 1e6)} MB "
          f"per decode token of your sequence (measured {figure(result['bytes_per_token_own'], 1e6)})", file=sys.stderr)


def cmd_quality(args) -> int:
    from engine.measure import hardware
    from engine.run import quality
    from engine.store.db import Store

    from engine.run.prepare import base_model, prepare
    from engine.spec import GenConfig, RunSpec
    from engine.paths import EVAL_TEXT

    text = args.text or EVAL_TEXT
    quality.read_text(text)  # a text that cannot be scored is refused before a model loads
    store = Store(args.db)
    spec = RunSpec(gen=GenConfig("quality"), model=args.model, device=args.device, weights=args.weights,
                   group_size=args.group_size, sparsity=args.sparsity, sparsity_mode=args.sparsity_mode)
    spec.check()
    base, candidate = base_model(spec), prepare(spec, store)
    calibration = hardware.calibration_for(base.device, store)
    name = candidate.weights + (f" sparsity {args.sparsity:g} {args.sparsity_mode}" if args.sparsity else "")
    result = quality.measure(base, candidate, name, calibration, store=store,
                             settings={"weights": args.weights, "group_size": args.group_size, "sparsity": args.sparsity,
                                       "sparsity_mode": args.sparsity_mode}, text=text)
    if args.json:
        _print_json(result)
        return 0
    divergence = result["first_divergence"]
    print(f"{base.name} at {name} on {base.device}, {result['n_tokens']} tokens of {args.text or 'data/eval.txt'}, "
          f"teacher-forced against fp32:")
    print(f"  perplexity {result['perplexity']:.3f}, mean KL {result['kl_mean']:.5f} nats, "
          f"top-1 agreement {result['top1_agreement']:.1%}")
    print("  greedy text identical to fp32 for 48 tokens" if divergence is None
          else f"  greedy text departs from fp32 at token {divergence}")
    return 0


def cmd_runs(args) -> int:
    from engine.store.db import Store

    frame = Store(args.db, read_only=True).runs(args.limit)
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
    from engine.measure import hardware
    from engine.model.loader import pick_device
    from engine.store.db import Store

    device = pick_device(args.device)
    store = Store(args.db)
    results = hardware.calibration_for(device, store, fresh=True)
    facts = hardware.hardware_summary(device)
    if args.json:
        _print_json({"calibration": results, "hardware": facts})
        return 0
    print(f"device {results['device_key']} (calibrated in {results['seconds']:.1f} s)")
    if results.get("suspect"):
        print(f"  flagged, and not used while agreeing calibrations exist: {results['suspect']}")
    print(f"  memory read peak: {results['memory_gbps']:.1f} GB/s (best method: {results['memory_method']})")
    for method, gbps in results["memory_methods_gbps"].items():
        print(f"    {method:<33} {gbps:.1f} GB/s")
    for dtype, gflops in results["matmul_gflops"].items():
        print(f"  matmul peak {dtype:>9}:             {gflops:.0f} GFLOP/s ({results['matmul_shape'][dtype]})")
    print(f"  dispatch overhead per op:            {results['dispatch_us']:.1f} us")
    print(f"  per matrix-vector product (4 MB):    {results['matvec_call_us']:.1f} us beyond its bytes")
    for what, figure in hardware.cache_read_rows(results):
        print(f"  {what}: {figure}")
    if "host_link" in results:
        link = results["host_link"]
        print(f"  host to device {link['h2d_gbps']:.1f} GB/s, device to host {link['d2h_gbps']:.1f} GB/s, "
              f"latency {link['h2d_latency_us']:.0f}/{link['d2h_latency_us']:.0f} us")
    return 0


def cmd_hardware(args) -> int:
    from engine.measure import hardware
    from engine.model.loader import pick_device

    _print_json(hardware.hardware_summary(pick_device(args.device)))
    return 0


def kv_spec_from_args(args):
    from engine.plan import kvcalc

    if args.preset:
        presets = kvcalc.load_presets()
        from engine.plan.planner import preset_ids

        wanted = preset_ids().get(args.preset.lower(), args.preset).lower()
        matches = [name for name in presets if wanted in name.lower()]
        exact = [name for name in matches if name.lower() == wanted]
        if len(exact or matches) != 1:
            raise kvcalc.KVCalcError(f"Preset '{args.preset}' matches {len(matches)} presets; choose one of: "
                                     + "; ".join(presets) + ".")
        s = presets[(exact or matches)[0]]
    elif args.config:
        s = kvcalc.spec_from_config(kvcalc.read_config_file(args.config), name=args.config)
    elif args.model:
        s = kvcalc.spec_from_model_folder(args.model)
    elif None not in (args.layers, args.kv_heads, args.head_dim):
        s = kvcalc.spec(layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim,
                        attention_heads=args.heads)
    else:
        raise kvcalc.KVCalcError("Give --preset NAME, --config PATH, --model default|FOLDER, or all of --layers, "
                                 "--kv-heads and --head-dim.")
    if args.window is not None or args.sliding_layers is not None:
        s = kvcalc.with_window(s, args.window, args.sliding_layers)
    if args.params is not None:
        s = kvcalc.replace(s, params=args.params)
    return s


def cmd_kvcalc(args) -> int:
    from engine.plan import kvcalc

    if args.list_presets:
        for name, s in kvcalc.load_presets().items():
            print(f"{name}: {s.kind}, {s.layers} layers, {s.kv_heads} kv heads x {s.head_dim}")
        return 0
    s = kv_spec_from_args(args)
    result = kvcalc.calculate(s, context=args.context, dtype=args.dtype, batch=args.batch, tp=args.tp,
                              group=args.group, weight_dtype=args.weight_dtype)
    if args.json:
        _print_json(result)
        return 0
    print(f"{s.name}: {s.kind}, KV in {args.dtype} ({result['bits_per_value']:g} bits per value)")
    print(f"  per token: {result['values_per_token']:,} values = {kvcalc.human(result['bytes_per_token'])}")
    print(f"  at {args.context} tokens x batch {args.batch}{f' per GPU of {args.tp}' if args.tp > 1 else ''}: "
          f"{kvcalc.human(result['total_bytes'])}")
    print(f"  = {kvcalc.formula(s, args.dtype, args.context, args.batch, args.tp, args.group)}")
    if result["weights_bytes"]:
        print(f"  weights ({args.weight_dtype}{', per GPU' if args.tp > 1 else ''}): {kvcalc.human(result['weights_bytes'])}")
    else:
        print("  weights: unknown (give --params); the fits below count the KV cache alone")
    for g in result["gpus"]:
        fit = "fits" if g["fits"] else "does not fit"
        cap = " (the model's limit)" if g["longest_context"] == g["context_search_limit"] else ""
        print(f"  {g['gpu']:<30} {fit:>12}; reading the cache once takes {g['kv_read_ms_per_step']:.3f} ms; "
              f"longest context {g['longest_context']:,}{cap}")
    return 0


def cmd_prepare(args) -> int:
    from engine.model import cpu_kernels
    from engine.model.loader import default_model_dir

    print(f"default model ready at {default_model_dir()}")
    print(f"C++ kernels {cpu_kernels.prepare()} ({cpu_kernels.build_directory()})")
    return 0


def loaded_registry(module: str, registry: str) -> dict | None:
    """A switch registry where its module is loaded already (with any entry registered since); None where it
    is not, and the names shipped (engine.switches.names) stand for it: building the parser imports no torch."""
    loaded = sys.modules.get(module)
    return getattr(loaded, registry) if loaded else None


def weight_levels() -> list[str]:
    return list(loaded_registry("engine.switches.quant", "LEVELS") or names.LEVELS)


def speculative_help() -> dict[str, str]:
    """Each speculative method's help, by name."""
    methods = loaded_registry("engine.switches.speculative", "METHODS")
    return {name: m.help for name, m in methods.items()} if methods else dict(names.METHOD_HELP)


def add_weight_args(p) -> None:
    levels = weight_levels()
    p.add_argument("--weights", default="fp32", choices=levels, help="weight precision level")
    p.add_argument("--quant", dest="weights", choices=levels, default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)  # the earlier name, which stored commands and scripts still use
    p.add_argument("--group-size", type=int, default=32,
                   help=f"int4 group size ({', '.join(map(str, names.INT4_GROUPS))})")
    limited(p, "--sparsity", "sparsity", "target activation sparsity")
    p.add_argument("--sparsity-mode", default="mask", choices=names.ALL_MODES,
                   help="mask: zero small inputs, dense matmul; skip: do not read their weights")


class Parser(argparse.ArgumentParser):
    """argparse with its errors in one sentence (no usage block); --help still prints the usage."""

    def error(self, message: str):
        print(f"error: {message}; see '{self.prog} --help'.", file=sys.stderr)
        sys.exit(USER_ERROR)


MAX_LIMIT = 1_000_000


def run_limit(text: str) -> int:
    """--limit: a whole number of runs from 1 to MAX_LIMIT."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 1 <= value <= MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"give a whole number of runs from 1 to {MAX_LIMIT:,}, not '{text[:40]}'")
    return value


MAX_REPEAT = 100


def repeat_count(text: str) -> int:
    """--repeat: a whole number of runs from 1 to MAX_REPEAT."""
    value = int(text) if text.strip().isdigit() else 0
    if not 1 <= value <= MAX_REPEAT:
        raise argparse.ArgumentTypeError(f"--repeat takes a whole number from 1 to {MAX_REPEAT}, not '{text[:40]}'")
    return value


def run_id(text: str) -> int:
    value = int(text) if text.strip().isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a run id is a whole number from 1, not '{text[:40]}'")
    return value


def limited(parser, flag: str, name: str, help: str = "") -> None:
    """An option whose default comes from GenConfig and whose range, stated in its help, from
    engine.spec.LIMITS, the table GenConfig.check enforces."""
    from engine.spec import DEFAULTS, LIMITS

    limit = LIMITS[name]
    shown = (lambda v: str(int(v))) if limit.whole else (lambda v: f"{v:g}")
    parser.add_argument(flag, type=int if limit.whole else float, default=DEFAULTS[name],
                        help=f"{help + '; ' if help else ''}{shown(limit.low)} to {shown(limit.high)}")


def common(p, device=True) -> None:
    p.add_argument("--db", help="DuckDB file (default data/runs.duckdb or $TOKENPATH_DB)")
    if device:
        p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def add_generate_parser(sub) -> None:
    """generate: its choices of weight level, KV precision and speculative method come from the registries."""
    from engine.dtypes import KV_CHOICES

    methods = speculative_help()
    g = sub.add_parser("generate", help="generate text token by token and record the run")
    g.add_argument("--prompt", help="the text to continue (required unless --from-run)")
    g.add_argument("--from-run", type=run_id, help="make this stored run again, with every setting it had")
    g.add_argument("--from-db", help="with --from-run: the database that holds it (default: --db)")
    g.add_argument("--repeat", type=repeat_count, default=1,
                   help=f"run it this many times, one after another (1 to {MAX_REPEAT}); with --json, one "
                        "JSON array of their objects")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-text token")
    g.add_argument("--model", default="default", help="'default', a Hugging Face id or a local folder")
    add_weight_args(g)
    limited(g, "--max-new-tokens", "max_new_tokens")
    g.add_argument("--no-kv-cache", action="store_true", help="recompute the whole sequence every step")
    g.add_argument("--kv-dtype", default="auto", choices=KV_CHOICES,
                   help="KV-cache precision; auto keeps the weights' compute dtype")
    limited(g, "--temperature", "temperature", "0 means greedy")
    limited(g, "--top-p", "top_p")
    limited(g, "--top-k", "top_k", "0 means off")
    limited(g, "--seed", "seed", "the random generator's seed when sampling")
    g.add_argument("--raw", action="store_true", help="no chat template: continue the prompt as plain text")
    g.add_argument("--stop", action="append", help="stop when this string appears (repeatable)")
    g.add_argument("--tokens", action="store_true", help="with --json: per-token and per-step rows")
    g.add_argument("--speculative", default="none", choices=list(methods),
                   help="speculative decoding: " + "; ".join(f"{name}: {help}" for name, help in methods.items()))
    g.add_argument("--spec", dest="speculative", choices=list(methods), default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)  # the earlier name, which stored commands and scripts still use
    g.add_argument("--speculative-k", type=int, help="tokens drafted per step (default 4)")
    g.add_argument("--spec-k", dest="speculative_k", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    g.add_argument("--adaptive", action="store_true", help="grow K on full acceptance, shrink it on rejection")
    g.add_argument("--draft-model", help="for --speculative draft: self-int8, self-exit:K, or a model id or folder")
    g.add_argument("--max-ngram", type=int,
                   help="prompt-lookup: the longest n-gram matched; lookahead: the n-gram size N (default 3)")
    g.add_argument("--window", type=int, help="for --speculative lookahead: W, columns of the lookahead branch (default 4)")
    g.add_argument("--guesses", type=int, help="for --speculative lookahead: G, n-grams verified per step (default 4)")
    limited(g, "--users", "users", "decode this many sequences together in one batch: the prompt and others from "
                                   "the workloads or --prompts")
    g.add_argument("--prompts", help="with --users: a text file of the other users' prompts, one per line")
    g.add_argument("--kv-budget-mb", type=float,
                   help="with --users: KV-cache memory the batch may reserve; arrivals beyond it wait")
    served_cli.add_generate_options(g)
    common(g)
    g.set_defaults(func=cmd_generate)


def add_kvcalc_parser(sub) -> None:
    from engine.dtypes import BITS, FP4_BITS

    k = sub.add_parser("kvcalc", help="KV-cache and memory calculator")
    k.add_argument("--preset", help="a shipped model preset (substring of its name); --list-presets lists them")
    k.add_argument("--config", help="a model's config.json")
    k.add_argument("--model", help="'default' or a local model folder: its config.json and real parameter count")
    k.add_argument("--layers", type=int)
    k.add_argument("--kv-heads", type=int)
    k.add_argument("--heads", type=int, help="attention heads (default: --kv-heads)")
    k.add_argument("--head-dim", type=int)
    k.add_argument("--window", type=int, help="sliding-window length")
    k.add_argument("--sliding-layers", type=int, help="layers that use the window (default: all)")
    k.add_argument("--dtype", default="fp16", choices=[*BITS, *FP4_BITS], help="KV-cache precision (FP4 formats with their block scales)")
    k.add_argument("--group", type=int, default=64, help="values per 16-bit scale for int8/int4 KV")
    k.add_argument("--context", type=int, default=2048)
    k.add_argument("--batch", type=int, default=1)
    k.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (per-GPU share)")
    k.add_argument("--params", type=float, help="parameter count, for the weights memory")
    k.add_argument("--weight-dtype", default="bf16", choices=list(BITS))
    k.add_argument("--list-presets", action="store_true")
    k.add_argument("--json", action="store_true")
    k.set_defaults(func=cmd_kvcalc)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m engine", description="Tokenpath engine")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    q = sub.add_parser("quality", help="perplexity, KL and top-1 agreement against fp32 on data/eval.txt")
    q.add_argument("--model", default="default", help="'default', a Hugging Face id or a local folder")
    q.add_argument("--text", help="the UTF-8 text to score (default: the shipped data/eval.txt; "
                   "reports compare only figures scored on it)")
    add_weight_args(q)
    common(q)
    q.set_defaults(func=cmd_quality)

    r = sub.add_parser("runs", help="recorded runs, newest first")
    r.add_argument("--limit", type=run_limit, default=20, help=f"how many runs, 1 to {MAX_LIMIT:,}")
    common(r, device=False)
    r.set_defaults(func=cmd_runs)

    c = sub.add_parser("calibrate", help="measure memory bandwidth, matmul peak and dispatch cost")
    common(c)
    c.set_defaults(func=cmd_calibrate)

    h = sub.add_parser("hardware", help="device facts (CPU, NVML GPUs)")
    h.add_argument("--device", default="auto")
    h.set_defaults(func=cmd_hardware)

    add_kvcalc_parser(sub)
    from engine.cli.planning import add_plan_parser

    add_plan_parser(sub)
    p = sub.add_parser("prepare", help="convert the embedded default model and build the C++ kernels, once")
    p.set_defaults(func=cmd_prepare)
    served_cli.add_parsers(sub)
    from engine.cli.reporting import add_parser as add_report_parser

    add_report_parser(sub)
    from engine.cli.tracing import add_parser as add_trace_parser

    add_trace_parser(sub)
    from engine.cli.sweeping import add_parser as add_sweep_parser

    add_sweep_parser(sub)
    from engine.cli.doctor import add_parser as add_doctor_parser

    add_doctor_parser(sub)
    return parser


def _cancelled(*_):
    """Ctrl-C before a run started (importing, parsing, loading): nothing to record. The process
    ends at once: an import cut half-way leaves modules that a normal shutdown trips over."""
    print("\ncancelled: interrupted before the command finished", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(130)


def main(argv=None) -> int:
    hook, sys.unraisablehook = sys.unraisablehook, redeliver_dropped_interrupt
    try:
        return _command(argv)
    finally:
        sys.unraisablehook = hook


def early_check(args) -> None:
    """The checks of a generation's or a sweep's settings that need nothing heavy imported."""
    if args.command == "generate" and args.from_run is None and args.prompt is not None:
        spec_from_args(args).check()
    elif args.command == "sweep":
        from engine.cli.sweeping import spec_from_args as sweep_spec

        sweep_spec(args).check_settings()


def _command(argv) -> int:
    interrupted.clear()  # a command run in a process that ran one before starts with no interrupt noted
    previous = signal.signal(signal.SIGINT, _cancelled)
    signal.signal(signal.SIGTERM, _cancelled)  # until a command can record a cancellation, as Ctrl-C
    try:
        args = build_parser().parse_args(argv)
        from engine.errors import UserError

        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        try:  # a spec that cannot run is refused before the heavy imports (the command checks it again)
            early_check(args)
        except UserError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return USER_ERROR
        if loads_a_model(args):
            from engine.run import generate  # noqa: F401 (the heavy imports happen here, under the handler)

            _quiet_libraries()
    finally:
        signal.signal(signal.SIGINT, previous)
    cancel_on_sigterm()
    try:
        code = args.func(args)
        sys.stdout.flush()  # a reader gone already shows here, inside the handling below, not at exit
        return code
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USER_ERROR
    except KeyboardInterrupt:  # a command's own run records its cancellation; this one had none running
        _cancelled()
    except BrokenPipeError:  # the reader went away (`| head`): nothing left to say, and nowhere to say it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that the exit's flush finds no pipe
        return 1
    except Exception as exc:
        if caused_by_interrupt(exc):
            _cancelled()
        raise
