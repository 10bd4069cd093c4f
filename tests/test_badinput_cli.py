"""Bad command-line input through real processes: one sentence on stderr, exit 2, no traceback,
no run recorded; Ctrl-C while a model loads: one line, exit 130."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.store.db import Store
from commands import run_engine, run_python

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "data" / "models" / "SmolLM2-135M-Instruct"


def engine(*args, db, timeout=300):
    return run_engine(*args, timeout=timeout, env={**os.environ, "TOKENPATH_DB": str(db)})


def folder(tmp_path, name, config='{"model_type": "llama"}', weights=None, tokenizer=True):
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(config)
    if tokenizer:
        for file in ("tokenizer.json", "tokenizer_config.json"):
            (path / file).write_bytes((MODEL / file).read_bytes())
    if weights is not None:
        (path / "model.safetensors").write_bytes(weights)
    return path


BAD_FOLDERS = {
    "config.json that is not JSON": (dict(config="not json {"), "is not a readable JSON object"),
    "config.json that is a list": (dict(config="[1, 2]"), "is not a readable JSON object"),
    "no weights": (dict(config=(MODEL / "config.json").read_text()), "no weights"),
    "a corrupt model.safetensors": (dict(config=(MODEL / "config.json").read_text(),
                                         weights=(MODEL / "model.safetensors").read_bytes()[:1000]),
                                    "could not be loaded"),
}


@pytest.mark.parametrize("case", list(BAD_FOLDERS))
def test_a_broken_model_folder_is_one_sentence(tmp_path, case):
    kwargs, expected = BAD_FOLDERS[case]
    path = folder(tmp_path, "model", **kwargs)
    db = tmp_path / "runs.duckdb"
    done = engine("generate", "--prompt", "hi", "--max-new-tokens", "2", "--model", str(path), db=db)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], done.stderr
    assert Store(db).runs().empty


ARGUMENT_ERRORS = [
    ["runs", "--limit", "-1"],
    ["runs", "--limit", "0"],
    ["runs", "--limit", str(2 ** 64)],
    ["runs", "--limit", "ten"],
    ["generate"],
    ["generate", "--prompt", "hi", "--max-new-tokens", "many"],
    ["generate", "--prompt", "hi", "--weights", "int3"],
    ["no-such-command"],
    [],
]


@pytest.mark.parametrize("args", ARGUMENT_ERRORS, ids=lambda a: " ".join(a) or "nothing")
def test_argument_errors_are_one_sentence_without_the_usage_block(tmp_path, args):
    done = engine(*args, db=tmp_path / "runs.duckdb", timeout=120)
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert "usage:" not in done.stderr and "Traceback" not in done.stderr


def test_runs_with_a_sane_limit_still_works(tmp_path):
    done = engine("runs", "--limit", "5", db=tmp_path / "runs.duckdb", timeout=120)
    assert done.returncode == 0 and "no runs recorded yet" in done.stdout


@pytest.mark.parametrize("after_s", [0.5, 1.5, 3.0, 5.0])
def test_ctrl_c_in_a_run_s_first_seconds_is_one_line_and_exit_130(tmp_path, after_s, long_tiny_folder):
    db = tmp_path / "runs.duckdb"
    process = subprocess.Popen([sys.executable, "-m", "engine", "generate", "--prompt", "hi", "--model",
                                str(long_tiny_folder), "--max-new-tokens", "4000"],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "TOKENPATH_DB": str(db)})
    # inside the imports, the model load or the run, whose 4000 tokens take seconds more
    time.sleep(after_s)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 130, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    # before the run began, nothing to record; once it began (a fast machine gets there within seconds), it is
    # recorded as cancelled with the tokens it had
    assert len(lines) == 1 and lines[0].startswith(("cancelled", "interrupted: run ")), err


# A Ctrl-C that lands inside a library comes out of it as the library's own error: a lazy import as the model
# loads wraps it (here as a dataclass field's __set_name__ does, met in transformers' configuration), and DuckDB
# ends the statement it was running with "Query interrupted", the KeyboardInterrupt gone.
INTERRUPTED_INSIDE = {
    "wrapped": """
class Field:
    def __set_name__(self, owner, name):
        raise KeyboardInterrupt

def open_run(*args, **kwargs):
    try:
        class Config:
            load_in_8bit = Field()
    except RuntimeError as exc:
        raise ImportError("a lazy import failed") from exc
""",
    "replaced": """
import os, signal, time

def open_run(*args, **kwargs):
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(60)
    except KeyboardInterrupt:
        error = RuntimeError("Query interrupted")
    raise error  # raised outside the handler: nothing links it to the interrupt
""",
}
RUN_GENERATE = """
import sys
import engine.run.open
from engine.cli.main import main

engine.run.open.open_run = open_run
sys.exit(main(["generate", "--prompt", "hi", "--db", sys.argv[1]]))
"""


@pytest.mark.parametrize("how", INTERRUPTED_INSIDE)
def test_ctrl_c_turned_into_a_library_s_error_is_still_one_line_and_exit_130(tmp_path, how):
    db = tmp_path / "runs.duckdb"
    done = run_python("-c", INTERRUPTED_INSIDE[how] + RUN_GENERATE, str(db), timeout=300)
    assert done.returncode == 130, done.stderr
    assert done.stderr.strip() == "cancelled: interrupted before the command finished"
    assert not db.exists() or Store(db).query("SELECT count(*) AS n FROM runs")["n"][0] == 0


GENERATE_VALUES = [
    (["--temperature", "nan"], "temperature"),
    (["--temperature", "inf"], "temperature"),
    (["--top-p", "nan"], "top_p"),
    (["--seed", str(2 ** 64)], "seed"),
    (["--seed", "-1"], "seed"),
    (["--speculative-k", "0"], "--speculative-k only applies to speculative decoding"),
    (["--speculative", "prompt-lookup", "--speculative-k", "0"], "draft length"),
    (["--window", "3", "--adaptive"], "only apply to speculative decoding"),
    (["--sparsity", "nan"], "Sparsity"),
    (["--max-new-tokens", "0"], "max_new_tokens"),
]


@pytest.mark.parametrize("args, expected", GENERATE_VALUES, ids=lambda a: " ".join(a) if isinstance(a, list) else "")
def test_generate_values_out_of_range_are_one_sentence_and_record_nothing(tmp_path, args, expected):
    db = tmp_path / "runs.duckdb"
    done = engine("generate", "--prompt", "hi", *args, db=db, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], done.stderr
    assert not db.exists() or Store(db).runs().empty


def test_a_prompt_that_is_not_utf8_is_one_sentence(tmp_path):
    db = tmp_path / "runs.duckdb"
    done = subprocess.run([sys.executable, "-m", "engine", "generate", "--prompt", b"caf\xe9 \xff"], cwd=ROOT,
                          capture_output=True, timeout=120, env={**os.environ, "TOKENPATH_DB": str(db)})
    err = done.stderr.decode("utf-8", "replace")
    assert done.returncode == 2 and "UTF-8" in err and "Traceback" not in err, err
    assert not db.exists() or Store(db).runs().empty


@pytest.mark.parametrize("content, expected", [(None, "cannot be read as the evaluation text"),
                                               (b"caf\xe9 \xff", "cannot be read as UTF-8 text"),
                                               (b"  \n\n ", "holds no text to score")])
def test_a_quality_text_that_cannot_be_scored_is_one_sentence_before_anything_is_written(tmp_path, content, expected):
    db, text = tmp_path / "runs.duckdb", tmp_path / "own.txt"
    if content is not None:
        text.write_bytes(content)
    done = engine("quality", "--text", str(text), db=db, timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and expected in lines[0], done.stderr
    assert not db.exists()
