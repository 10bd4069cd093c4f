"""`python -m engine sweep`: a grid of settings on one workload, each setting repeated with the settings
interleaved, compared over the repeats: the same stored sweep the Sweeps page makes."""
from __future__ import annotations

import argparse
import json
import sys

from engine.sweep import MAX_REPEAT, MAX_TOKENS, MIN_TOKENS, SweepSpec, start


def listed(text: str) -> list[str]:
    """A comma-separated list, blanks left out."""
    return [part.strip() for part in text.split(",") if part.strip()]


def user_counts(text: str) -> list[int]:
    """--users: whole numbers separated by commas."""
    counts = listed(text)
    if not all(c.isdigit() for c in counts):
        raise argparse.ArgumentTypeError(f"--users takes whole numbers separated by commas (such as 1,8), not "
                                         f"'{text[:40]}'")
    return [int(c) for c in counts]


def spec_from_args(args) -> SweepSpec:
    return SweepSpec(args.workload, listed(args.weights), listed(args.kv), listed(args.sparsity),
                     listed(args.speculative), args.users, new_tokens=args.new_tokens, repeat=args.repeat,
                     model=args.model, device=args.device)


def cmd_sweep(args) -> int:
    """Check the grid (bad input: one sentence, exit 2, nothing stored), store it, run it, print the comparison."""
    spec = spec_from_args(args)
    spec.check()  # before the database is opened and before the model stack loads
    from engine.report.advisor import advise
    from engine.report.sweeps import sweep_results
    from engine.run.open import open_run
    from engine.store.db import Store

    store = Store(args.db)
    sweep_id = start(store, spec)
    order = spec.runs(sweep_id)
    print(f"sweep {sweep_id}: {len(spec.grid())} settings x {spec.repeat} repeats, interleaved", file=sys.stderr)
    for i, (arm, run_spec) in enumerate(order, start=1):
        print(f"{i} of {len(order)}: {arm.label}", file=sys.stderr, flush=True)
        try:
            for _ in open_run(run_spec, store):
                pass
        except KeyboardInterrupt:
            print(f"\ninterrupted: the {i - 1} finished runs of sweep {sweep_id} are stored", file=sys.stderr)
            return 130
    results = sweep_results(store, sweep_id)
    advice = advise(results, results[0]) if results else []
    if args.json:
        print(json.dumps({"sweep_id": sweep_id, "spec": json.loads(spec.to_json()), "command": spec.command(),
                          "settings": results, "advice": advice}, indent=2, default=str))
        return 0
    for row in results:
        print(f"{row['label']:<32} {row['repeats']} repeats, decode {row['decode_tokens_per_s'] or 0:7.2f} tok/s (every user's); "
              f"against the baseline {row['decode vs baseline']}")
    for line in advice:
        print(f"- {line}")
    print(f"sweep {sweep_id}; made again by: {spec.command()}")
    return 0


def add_parser(sub) -> None:
    s = sub.add_parser("sweep", help="a grid of settings on one workload, repeated and interleaved, compared")
    s.add_argument("--workload", required=True, help="a shipped workload (data/workloads.json), by name")
    s.add_argument("--weights", default="fp32", help="weight levels, comma-separated; the first is the baseline")
    s.add_argument("--kv", default="on", help="KV cache: on, off or on,off")
    s.add_argument("--sparsity", default="dense", help="dense, mask-50, skip-50 (comma-separated; fp32 only)")
    s.add_argument("--speculative", default="none", help="speculative methods, comma-separated (none: plain)")
    s.add_argument("--users", type=user_counts, default=[1],
                   help="sequences decoded together in one batch, comma-separated (1,2,4,8); more than one needs the "
                        "KV cache on, dense and no speculative method")
    s.add_argument("--new-tokens", type=int, default=32, help=f"new tokens per run, {MIN_TOKENS} to {MAX_TOKENS}")
    s.add_argument("--repeat", type=int, default=3, help=f"runs of each setting, interleaved, 1 to {MAX_REPEAT}")
    s.add_argument("--model", default="default", help="'default', a Hugging Face id or a local folder")
    s.add_argument("--device", default="auto")
    s.add_argument("--json", action="store_true", help="the stored sweep, its comparison and advice as JSON")
    s.add_argument("--db", help="DuckDB file (default data/runs.duckdb or $TOKENPATH_DB)")
    s.set_defaults(func=cmd_sweep)
