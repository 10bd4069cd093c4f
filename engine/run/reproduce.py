"""The command that makes a stored run again: its RunSpec read back from the store, written as the
exact `python -m engine generate ...` arguments that describe it.

Local runs store their RunSpec whole (the config's "run_spec"); served runs and runs stored before that
are read back from the settings their config holds."""
from __future__ import annotations

import json
import shlex

from engine.serve.command import ReproduceError
from engine.spec import GenConfig, RunSpec, gen_settings

# RunSpec and GenConfig fields that `generate` takes as flags; each is written only where it differs
# from its default (a boolean as its bare flag). Flags of speculative settings only apply with --speculative.
SPEC_FLAGS = {"model": "--model", "device": "--device", "weights": "--weights", "group_size": "--group-size",
              "sparsity": "--sparsity", "sparsity_mode": "--sparsity-mode", "endpoint": "--endpoint",
              "served_model": "--served-model", "api_key_env": "--api-key-env", "gpu": "--gpu"}
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


def spec_of(run: dict) -> RunSpec:
    """The specification of a run row (its config as stored text or already parsed)."""
    config = run["config"] if isinstance(run["config"], dict) else json.loads(run["config"] or "{}")
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
                out += [flag, str(item)]
        else:
            out += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    return out


def arguments(spec: RunSpec) -> list[str]:
    """`generate`'s arguments for this specification (without --db)."""
    gen, plain = spec.gen, GenConfig(spec.gen.prompt)
    args = ["--prompt", gen.prompt] + _flags(spec, SPEC_FLAGS, RunSpec(gen=plain))
    if not gen.kv_cache:
        args.append("--no-kv-cache")
    args += _flags(gen, GEN_FLAGS, plain)
    if gen.speculative != "none":
        args += _flags(gen, SPECULATIVE_FLAGS, plain)
    if spec.sparsity == 0 and "--sparsity-mode" in args:  # the mode only matters with some sparsity
        i = args.index("--sparsity-mode")
        del args[i:i + 2]
    return args


def command(spec: RunSpec, db: str | None = None) -> str:
    """The shell command that runs this specification again, copyable as it is."""
    return shlex.join(["python", "-m", "engine", "generate", *arguments(spec), *(["--db", str(db)] if db else [])])
