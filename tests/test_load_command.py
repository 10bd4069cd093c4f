"""The command that makes a stored load sweep again (engine.serve.command): rate levels come back as --rate,
and a sweep it cannot make again (a capacity search, a replayed trace) says why in one sentence."""
import argparse
import shlex

import pytest

from engine.serve.command import ReproduceError
from engine.serve import records as served_store
from engine.cli.main import build_parser
from engine.serve.command import LOAD_OPTIONS, sweep_command

CONFIG = {"endpoint": None, "concurrency": [], "rates": [2.0, 4.5], "requests": 3, "max_new_tokens": 5,
          "slo": {"ttft_ms": 500.0}, "seed": 0, "local": True, "model": "default", "weights": "int4-dyn", "max_batch": 4,
          "kv_budget_mb": None, "trace_name": None, "rtt_ms": None}


def stored(store, config: dict, kind: str) -> int:
    return served_store.start_sweep(store, endpoint="local", server_model="m", config=config, kind=kind)


def test_a_rate_sweep_comes_back_with_its_rates_and_every_stored_option(store):
    argv = shlex.split(sweep_command(store, stored(store, CONFIG, "rate"), db="other.duckdb"))
    assert argv[:4] == ["python", "-m", "engine", "load"] and argv[-2:] == ["--db", "other.duckdb"]
    assert "--local" in argv
    at = {flag: argv[argv.index(flag) + 1] for flag in ("--rate", "--requests", "--slo", "--max-batch", "--model",
                                                        "--weights")}
    assert at == {"--rate": "2.0,4.5", "--requests": "3", "--slo": "ttft_ms=500", "--max-batch": "4",
                  "--model": "default", "--weights": "int4-dyn"}
    assert set(a for a in argv if a.startswith("--")) <= LOAD_OPTIONS | {"--db"}
    assert "--concurrency" not in argv and "--kv-budget-mb" not in argv  # empty and unset: the defaults


@pytest.mark.parametrize("config, kind, words", [
    (CONFIG, "capacity", "is a capacity search"),
    ({**CONFIG, "trace_name": "data/traces/x.jsonl"}, "rate", "replayed a trace file"),
])
def test_a_sweep_that_cannot_be_made_again_says_why(store, config, kind, words):
    with pytest.raises(ReproduceError, match=words):
        sweep_command(store, stored(store, config, kind))
    with pytest.raises(ReproduceError, match="is not in"):
        sweep_command(store, 999)


def test_the_options_a_sweep_can_store_are_the_load_command_s_own():
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parsed = {flag for action in commands.choices["load"]._actions for flag in action.option_strings}
    not_stored = {"-h", "--help", "--db", "--from-db", "--from-sweep", "--json", "--progress", "--trace"}
    assert LOAD_OPTIONS == parsed - not_stored


def test_load_from_sweep_refuses_a_capacity_search_in_one_sentence_exit_2_and_runs_nothing(store, capsys):
    from engine.cli.main import main

    sweep_id = stored(store, CONFIG, "capacity")
    code = main(["load", "--from-sweep", str(sweep_id), "--db", str(store.path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "is a capacity search" in err and "python -m engine capacity" in err
    assert len(served_store.sweeps(store)) == 1  # nothing run, nothing stored
