"""The command that makes a stored run again: its RunSpec read back from the store, written as the
exact `python -m engine generate ...` arguments that describe it.

Local runs store their RunSpec whole (the config's "run_spec"); a sequence of a batch stores its batch's
(the config's "batch": the spec with its users, every user's prompt, the prompts file and the KV budget), so
its command makes the whole batch again; served runs and runs stored before that are read back from the
settings their config holds. A request of a load sweep is made again with its sweep (`load --from-sweep`)."""
from __future__ import annotations

import json
import shlex

from engine.errors import UserError

from engine.serve.command import ReproduceError
from engine.spec import GenConfig, RunSpec, gen_settings

# RunSpec and GenConfig fields that `generate` takes as flags; each is written only where it differs
# from its default (a boolean as its bare flag). Flags of speculative settings only apply with --speculative.
SPEC_FLAGS = {"model": "--model", "device": "--device", "weights": "--weights", "group_size": "--group-size",
              "sparsity": "--sparsity", "sparsity_mode": "--sparsity-mode", "endpoint": "--endpoint",
              "served_model": "--served-model", "api_key_env": "--api-key-env", "gpu": "--gpu", "users": "--users"}
GEN_FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p",
             "top_k": "--top-k", "seed": "--seed", "raw": "--raw", "stop": "--stop", "ignore_eos": "--ignore-eos",
             "speculative": "--speculative", "kv_dtype": "--kv-dtype"}
SPECULATIVE_FLAGS = {"speculative_k": "--speculative-k", "adaptive": "--adaptive", "draft_model": "--draft-model",
                     "max_ngram": "--max-ngram", "window": "--window", "guesses": "--guesses"}
SERVED_KEYS = ("endpoint", "served_model", "api_key_env", "gpu")  # a served run's config keys that are RunSpec fields


def stored_spec(store, run_id: int) -> RunSpec:
    """The specification a stored run was made with."""
    run = store.run(int(run_id))
    if run is None:
        raise ReproduceError(f"Run {run_id} is not in {store.path}; `python -m engine runs` lists the runs there.")
    return spec_of(run)


def config_of(run: dict) -> dict:
    return run["config"] if isinstance(run["config"], dict) else json.loads(run["config"] or "{}")


def spec_of(run: dict) -> RunSpec:
    """The specification of a run row (its config as stored text or already parsed); a sequence of a batch's
    is its batch's (the first user's prompt, users as many as the batch held)."""
    config = config_of(run)
    if "batch" in config:
        return RunSpec.from_dict(config["batch"]["run_spec"])
    if "run_spec" in config:
        return RunSpec.from_dict(config["run_spec"])
    gen = GenConfig(**{k: v for k, v in gen_settings(config).items() if k != "prompt"}, prompt=run["prompt"])
    if run.get("backend") == "served":
        return RunSpec(gen=gen, backend="served", **{k: config.get(k) for k in SERVED_KEYS})
    # a grouped level is stored as "int4-wo g32"; runs recorded before the key was "weights" say "quant"
    level, *group = (config.get("weights") or config.get("quant") or "fp32").split()
    return RunSpec(gen=gen, model=config.get("model", run["model"]), weights=level,
                   group_size=int(group[0].removeprefix("g")) if group else 32,
                   sparsity=float(config.get("sparsity") or 0.0), sparsity_mode=config.get("sparsity_mode") or "mask")


def _flags(obj, table: dict, defaults) -> list[str]:
    out = []
    for name, flag in table.items():
        value, default = getattr(obj, name), getattr(defaults, name)
        if value == default or value is None:
            continue
        if isinstance(value, bool):
            out.append(flag)  # every boolean flag turns on what defaults to off
        elif isinstance(value, list):
            for item in value:
                out += option(flag, str(item))
        else:
            out += option(flag, repr(value) if isinstance(value, float) else str(value))  # repr: every digit kept
    return out


def option(flag: str, value: str) -> list[str]:
    """The flag and its value as the command line takes them: joined by '=' where the value starts with '-',
    which would otherwise read as an option (a prompt such as '-hello')."""
    return [f"{flag}={value}"] if value.startswith("-") else [flag, value]


def arguments(spec: RunSpec) -> list[str]:
    """`generate`'s arguments for this specification (without --db)."""
    gen, plain = spec.gen, GenConfig(spec.gen.prompt)
    args = option("--prompt", gen.prompt) + _flags(spec, SPEC_FLAGS, RunSpec(gen=plain))
    if not gen.kv_cache:
        args.append("--no-kv-cache")
    args += _flags(gen, GEN_FLAGS, plain)
    if gen.speculative != "none":
        args += _flags(gen, SPECULATIVE_FLAGS, plain)
    if spec.sparsity == 0 and "--sparsity-mode" in args:  # the mode only matters with some sparsity
        i = args.index("--sparsity-mode")
        del args[i:i + 2]
    return args


def command(spec: RunSpec, db: str | None = None, extra: list[str] = ()) -> str:
    """The shell command that runs this specification again (with extra arguments), copyable as it is."""
    return shlex.join(["python", "-m", "engine", "generate", *arguments(spec), *extra,
                       *(["--db", str(db)] if db else [])])


def load_request(run: dict) -> str | None:
    """For a request of a load sweep (its run tagged load:<sweep>:<level>:<index>), the sentence that says how
    to make it again; None for any other run."""
    parts = (run.get("tag") or "").split(":")
    if len(parts) != 4 or parts[0] != "load":
        return None
    sweep, level, index = parts[1:]
    return (f"Run {run['run_id']} is request {index} of level {level} of load sweep {sweep}: "
            f"`python -m engine load --from-sweep {sweep}` makes the sweep again.")


def batch_arguments(run: dict) -> list[str]:
    """The arguments beyond its spec's that make a sequence's batch again: the prompts file and the KV budget."""
    batch = config_of(run).get("batch") or {}
    args = option("--prompts", batch["prompts_file"]) if batch.get("prompts_file") else []
    if batch.get("kv_budget_bytes"):  # MiB written exactly, so --kv-budget-mb gives back the same bytes
        args += ["--kv-budget-mb", repr(batch["kv_budget_bytes"] / 2**20)]
    return args


def check_batch_prompts(run: dict) -> None:
    """ReproduceError unless the batch's command gives every user the prompt it had (the workloads or the
    prompts file may have changed since)."""
    batch = config_of(run).get("batch")
    if not batch:
        return
    from engine.run.batch import batch_prompts  # torch's import, only when a batch is made again

    spec = RunSpec.from_dict(batch["run_spec"])
    try:
        now = batch_prompts(spec.gen.prompt, spec.users, batch.get("prompts_file"))
    except UserError as exc:
        raise ReproduceError(f"Run {run['run_id']}'s batch cannot be made again: {exc}") from None
    if now != batch["prompts"]:
        source = f"the prompts file {batch['prompts_file']}" if batch.get("prompts_file") else "the shipped workloads"
        raise ReproduceError(f"Run {run['run_id']}'s batch gave its other users prompts that {source} no longer "
                             "holds, so its command would decode another batch.")


def run_command(run: dict, db: str | None = None) -> str:
    """What makes a stored run again: its command (a batch's sequence: the whole batch's), or for a request of
    a load sweep the sentence naming its sweep's."""
    sentence = load_request(run)
    if sentence:
        return sentence
    return command(spec_of(run), db, batch_arguments(run))


def from_run_arguments(store, run_id: int) -> list[str]:
    """`generate`'s arguments that make stored run `run_id` again (a batch's sequence: its whole batch);
    ReproduceError with one sentence for a run that is not there, a request of a load sweep, or a batch
    whose other prompts are no longer where they came from."""
    run = store.run(int(run_id))
    if run is None:
        stored_spec(store, run_id)  # raises the sentence naming the database
    sentence = load_request(run)
    if sentence:
        raise ReproduceError(sentence)
    check_batch_prompts(run)
    return [*arguments(spec_of(run)), *batch_arguments(run)]
