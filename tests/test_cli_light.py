"""The command line parses before it imports the model stack: help, refused arguments and the commands that
load no model import none of torch, transformers, scipy; the names it offers are the registries' own."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.cli.main import build_parser
from engine.switches import names, quant, sparsity, speculative

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "scipy")
SHOW_HEAVY = ("import json, runpy, sys\nsys.argv = ['engine', *sys.argv[1:]]\ntry:\n    runpy.run_module('engine', "
              "run_name='__main__')\nexcept SystemExit as end:\n    code = end.code\n"
              f"print('heavy:', json.dumps([[m for m in {HEAVY!r} if m in sys.modules], code]), file=sys.stderr)")


def heavy_imports(tmp_path, *argv) -> list:
    """The heavy modules `python -m engine ARGV` imported, and its exit code, from one real process ({tmp} in an
    argument is the test's own folder)."""
    argv = [arg.format(tmp=tmp_path) for arg in argv]
    done = subprocess.run([sys.executable, "-c", SHOW_HEAVY, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TOKENPATH_DB": str(tmp_path / "runs.duckdb")})
    *_, last = done.stderr.strip().splitlines()
    assert last.startswith("heavy: "), done.stderr
    return json.loads(last.removeprefix("heavy: "))


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["plan", "--help"], ["sweep", "--help"],
                                  ["generate", "--prompt", "x", "--weights", "int3"], ["runs", "--limit", "0"],
                                  ["generate", "--prompt", "x", "--speculative", "nope"], ["no-such-command"],
                                  ["generate", "--prompt", "x", "--temperature", "nan"],
                                  ["generate", "--prompt", "x", "--speculative", "jacobi", "--temperature", "1"],
                                  ["generate", "--prompt", "x", "--speculative", "draft", "--speculative-k", "17"],
                                  ["generate", "--prompt", "x", "--model", "{tmp}"],  # a folder with no config.json
                                  ["generate", "--prompt", "x", "--model", "./no-such-folder"],
                                  ["sweep", "--workload", "summary", "--repeat", "0"],
                                  ["sweep", "--workload", "summary", "--users", "8", "--kv", "off"]],
                         ids=" ".join)
def test_help_and_refused_arguments_import_no_model_stack(tmp_path, argv):
    found, code = heavy_imports(tmp_path, *argv)
    assert found == [] and code == (0 if "--help" in argv else 2)


@pytest.mark.parametrize("argv", [["runs"], ["kvcalc", "--preset", "llama-3.1-8b"], ["plan", "--model", "llama-3.1-8b"],
                                  ["trace", "--run", "1", "--out", "{tmp}/t.json"]], ids=" ".join)
def test_commands_that_load_no_model_import_none_of_its_stack(tmp_path, argv):
    found, _ = heavy_imports(tmp_path, *argv)
    assert not {"torch", "transformers"} & set(found)


def test_the_names_shipped_are_the_registries():
    assert list(quant.LEVELS) == list(names.LEVELS)
    assert {name: m.help for name, m in speculative.METHODS.items()} == names.METHOD_HELP
    assert [name for name, m in speculative.METHODS.items() if m.samples] == list(names.SAMPLING_METHODS)
    assert quant.INT4_GROUPS == names.INT4_GROUPS and sparsity.ALL_MODES == names.ALL_MODES


def test_the_parser_offers_the_registries_choices():
    generate = build_parser()._subparsers._group_actions[0].choices["generate"]
    options = {action.dest: action for action in generate._actions if action.option_strings}
    assert options["weights"].choices == list(quant.LEVELS)
    assert options["speculative"].choices == list(speculative.METHODS)
    assert options["sparsity_mode"].choices == sparsity.ALL_MODES


def test_an_interrupt_python_had_to_drop_is_delivered_again(monkeypatch):
    """A KeyboardInterrupt raised inside a weakref callback (as a Ctrl-C landing in the import machinery's) cannot
    propagate; the command's hook raises it again at the next line instead of letting the command run on."""
    import weakref

    from engine.cli.interrupts import redeliver_dropped_interrupt

    def interrupted(_):
        raise KeyboardInterrupt

    class Held:
        pass

    monkeypatch.setattr(sys, "unraisablehook", redeliver_dropped_interrupt)
    held = Held()
    ref = weakref.ref(held, interrupted)
    with pytest.raises(KeyboardInterrupt):
        del held  # the callback's KeyboardInterrupt is unraisable here
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.01)
    assert ref() is None


def test_a_ctrl_c_held_back_by_a_whole_write_goes_to_the_handler_it_put_aside():
    """Two Ctrl-C during a write that must happen whole: after it, the command's handler sees the first, as it
    would have without the write, so that a handler that ignores the ones after it (a command's) still does."""
    import signal

    from engine.store.db import signals_deferred

    seen = []

    def once(signum, frame):
        seen.append(signum)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    def arrives():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # Python runs a handler between two instructions of the main thread

    previous = signal.signal(signal.SIGINT, once)
    try:
        with pytest.raises(KeyboardInterrupt):
            with signals_deferred():
                arrives()
                arrives()
        assert seen == [signal.SIGINT] and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        with signals_deferred():  # ignored before the write, ignored after it
            arrives()
        arrives()
        assert seen == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)
