"""`python -m engine trace`: stored runs and load sweeps as one Chrome trace-event / Perfetto JSON file."""
from __future__ import annotations

import argparse


def cmd_trace(args) -> int:
    """Write the trace file; bad input (an unknown id, nothing chosen, an unwritable path) is one sentence."""
    from engine.report.output import write_output
    from engine.report.trace import trace_json
    from engine.store.db import existing_store

    store = existing_store(args.db)
    text = trace_json(store, args.run or [], args.load_sweep or [])
    write_output(args.out, text, store.path)
    what = [f"run #{i}" for i in args.run or []] + [f"load sweep #{i}" for i in args.load_sweep or []]
    print(f"wrote {args.out} ({len(text) / 1e6:.1f} MB): {', '.join(what)}; open it in ui.perfetto.dev or chrome://tracing")
    return 0


def positive_id(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"an id is a whole number from 1, not '{text[:40]}'")
    return value


def add_parser(sub) -> None:
    t = sub.add_parser("trace", help="runs and load sweeps as a trace for ui.perfetto.dev or chrome://tracing")
    t.add_argument("--run", type=positive_id, action="append", help="a run id (repeatable)")
    t.add_argument("--load-sweep", type=positive_id, action="append", help="a load sweep's number (repeatable)")
    t.add_argument("--out", required=True, help="the JSON file to write")
    t.add_argument("--db", help="DuckDB file (default data/runs.duckdb or $TOKENPATH_DB)")
    t.set_defaults(func=cmd_trace)
