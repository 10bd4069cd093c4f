"""The command that makes a stored load sweep again: `python -m engine load ...` with the parameters its
config keeps (engine.run.reproduce.sweep_arguments), copyable as it is; `load --from-sweep ID` runs the same."""
from __future__ import annotations

import argparse
import json
import shlex
from functools import cache

from engine.run.reproduce import ReproduceError, sweep_arguments


@cache
def load_options() -> frozenset[str]:
    """Every option string `python -m engine load` takes."""
    from engine.cli.main import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return frozenset(flag for action in commands.choices["load"]._actions for flag in action.option_strings)


def sweep_command(store, sweep_id: int, db: str | None = None) -> str:
    """The shell command that makes load sweep `sweep_id` of `store` again (into `db` where given)."""
    found = store.query("SELECT config, kind FROM load_sweeps WHERE sweep_id = ?", [int(sweep_id)])
    if found.empty:
        raise ReproduceError(f"Load sweep {sweep_id} is not in {store.path}; the Serving page lists them.")
    if found["kind"].iloc[0] == "capacity":
        raise ReproduceError(f"Sweep {sweep_id} is a capacity search, whose rates follow from its own results: run "
                             "`python -m engine capacity` again with its target to search again.")
    argv = sweep_arguments(json.loads(found["config"].iloc[0]), set(load_options()))
    return shlex.join(["python", "-m", "engine", "load", *argv, *(["--db", str(db)] if db else [])])
