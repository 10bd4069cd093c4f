"""`python -m engine report`: one self-contained HTML report of stored runs, a story, a sweep or a load sweep."""
from __future__ import annotations

import sys
from engine.errors import USER_ERROR


def cmd_report(args) -> int:
    """python -m engine report: write the report file; bad input is one sentence and exit code 2."""
    from engine.report import story  # loaded only for this command, as the rest: they pull in pandas and the planner
    from engine.report import sweeps as sweep_report
    from engine.report.html import runs_report

    if args.story:
        return _write(args, story.story_report, "the latest story runs")
    if args.sweep:
        return _write(args, lambda store: sweep_report.sweep_report(store, args.sweep), f"sweep {args.sweep}")
    if args.load_sweep is not None:
        return _write(args, lambda store: sweep_report.load_sweep_report(store, args.load_sweep),
                      f"load sweep #{args.load_sweep}")
    try:
        ids = [int(part) for part in args.runs.split(",") if part.strip()]
    except ValueError:
        print(f"error: --runs takes run ids separated by commas (such as 3,4,5), not '{args.runs}'.", file=sys.stderr)
        return USER_ERROR
    return _write(args, lambda store: runs_report(store, ids, title=args.title),
                  f"runs {', '.join(f'#{i}' for i in ids)}")


def _write(args, build, what: str) -> int:
    """Build the report from the store and write it; bad input is one sentence and exit code 2."""
    from engine.report.html import ReportError
    from engine.report.output import OutputError, write_output
    from engine.store.db import StoreError, existing_store

    try:
        store = existing_store(args.db)
        page = build(store)
        write_output(args.out, page, store.path)
    except (ReportError, StoreError, OutputError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USER_ERROR
    print(f"wrote {args.out} ({len(page) / 1e6:.1f} MB): {what}")
    return 0


def add_parser(sub) -> None:
    r = sub.add_parser("report", help="one self-contained HTML report of stored runs")
    which = r.add_mutually_exclusive_group(required=True)
    which.add_argument("--runs", help="run ids separated by commas; the first is the baseline")
    which.add_argument("--story", action="store_true", help="the latest runs of the Story page, chapter by chapter")
    which.add_argument("--sweep", help="a sweep of the Sweeps page, by the id shown under its results")
    which.add_argument("--load-sweep", type=int, help="a load sweep against a server, by its number")
    r.add_argument("--out", required=True, help="the HTML file to write")
    r.add_argument("--title", help="the report's title (default: the run ids)")
    r.add_argument("--db", help="DuckDB file (default data/runs.duckdb or $TOKENPATH_DB)")
    r.set_defaults(func=cmd_report)
