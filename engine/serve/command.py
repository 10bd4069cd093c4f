"""The command that makes a stored load sweep again: `python -m engine load ...` with the parameters its
config keeps (sweep_arguments), copyable as it is; `load --from-sweep ID` runs the same."""
from __future__ import annotations

import json
import shlex

from engine.errors import UserError

# the options of `python -m engine load` that a stored sweep's config can set (tests/test_load_command.py holds
# this to the command line's parser, which lives above this wing)
LOAD_OPTIONS = frozenset({
    "--api-key-env", "--burstiness", "--concurrency", "--deadline", "--duration", "--endpoint", "--input-tokens",
    "--kv-budget-mb", "--kv-dtype", "--length-spread", "--local", "--max-batch", "--max-concurrency",
    "--max-new-tokens", "--model", "--output-tokens", "--prefix-cache-mb", "--prompts", "--rate", "--requests",
    "--seed", "--served-model", "--shared-prefix-tokens", "--slo", "--temperature", "--timeout", "--warmup",
    "--weights"})
SWEEP_RENAMED = {"rates": "--rate"}  # a load sweep's config keys whose option is not their own name


class ReproduceError(UserError):
    """A run or a load sweep whose command cannot be made."""


def stored_sweep_config(store, sweep_id: int) -> dict:
    """The stored config of load sweep `sweep_id`, which `load` can make again; a capacity search is refused,
    since its rates follow from its own results."""
    found = store.query("SELECT config, kind FROM load_sweeps WHERE sweep_id = ?", [int(sweep_id)])
    if found.empty:
        raise ReproduceError(f"Load sweep {sweep_id} is not in {store.path}; the Serving page lists them.")
    if found["kind"].iloc[0] == "capacity":
        raise ReproduceError(f"Sweep {sweep_id} is a capacity search, whose rates follow from its own results: run "
                             "`python -m engine capacity` again with its target to search again.")
    return json.loads(found["config"].iloc[0])


def sweep_command(store, sweep_id: int, db: str | None = None) -> str:
    """The shell command that makes load sweep `sweep_id` of `store` again (into `db` where given)."""
    argv = sweep_arguments(stored_sweep_config(store, sweep_id), set(LOAD_OPTIONS))
    return shlex.join(["python", "-m", "engine", "load", *argv, *(["--db", str(db)] if db else [])])


def sweep_arguments(config: dict, options: set[str]) -> list[str]:
    """`load`'s arguments for a stored load sweep's config: each stored parameter whose name is one of the
    command's options (`timeout_s` is --timeout), lists joined by commas, booleans as bare flags."""
    from engine.paths import workloads

    if config.get("trace_name"):
        raise ReproduceError("This sweep replayed a trace file, which the store does not keep: run `load` again with "
                             "that file as --trace.")
    args = []
    for key, value in config.items():
        flag = SWEEP_RENAMED.get(key) or next((f for f in ("--" + key.replace("_", "-"),
                                                           "--" + key.removesuffix("_s").replace("_", "-"))
                                               if f in options), None)
        if flag is None or value is None or value is False or value in ([], {}):
            continue  # left out: the option's default (no SLO, synthetic prompts or a trace)
        if key == "slo":
            value = ",".join(f"{metric}={target:g}" for metric, target in value.items())
        if key == "prompts":
            shipped = list(workloads())
            if value == shipped:
                continue  # every shipped workload: the default
            if len(value) != 1 or value[0] not in shipped:
                raise ReproduceError("This sweep's prompts came from a file, which the store does not keep: run "
                                     "`load` again with that file as --prompts.")
            value = value[0]
        args += [flag] if value is True else [flag, ",".join(map(str, value)) if isinstance(value, list) else
                                              f"{value:g}" if isinstance(value, float) else str(value)]
    return args
