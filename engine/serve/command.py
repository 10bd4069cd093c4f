"""The command that makes a stored load sweep again: `python -m engine load ...` with the parameters its
config keeps (engine.run.reproduce.sweep_arguments), copyable as it is; `load --from-sweep ID` runs the same."""
from __future__ import annotations

import json
import shlex

from engine.run.reproduce import ReproduceError, sweep_arguments

# the options of `python -m engine load` that a stored sweep's config can set (tests/test_load_command.py holds
# this to the command line's parser, which lives above this wing)
LOAD_OPTIONS = frozenset({
    "--api-key-env", "--burstiness", "--concurrency", "--deadline", "--duration", "--endpoint", "--input-tokens",
    "--kv-budget-mb", "--length-spread", "--local", "--max-batch", "--max-concurrency", "--max-new-tokens", "--model",
    "--output-tokens", "--prompts", "--rate", "--requests", "--seed", "--served-model", "--shared-prefix-tokens",
    "--slo", "--temperature", "--timeout", "--warmup"})


def sweep_command(store, sweep_id: int, db: str | None = None) -> str:
    """The shell command that makes load sweep `sweep_id` of `store` again (into `db` where given)."""
    found = store.query("SELECT config, kind FROM load_sweeps WHERE sweep_id = ?", [int(sweep_id)])
    if found.empty:
        raise ReproduceError(f"Load sweep {sweep_id} is not in {store.path}; the Serving page lists them.")
    if found["kind"].iloc[0] == "capacity":
        raise ReproduceError(f"Sweep {sweep_id} is a capacity search, whose rates follow from its own results: run "
                             "`python -m engine capacity` again with its target to search again.")
    argv = sweep_arguments(json.loads(found["config"].iloc[0]), set(LOAD_OPTIONS))
    return shlex.join(["python", "-m", "engine", "load", *argv, *(["--db", str(db)] if db else [])])
