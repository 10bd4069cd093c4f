"""A sweep from the command line: its full specification stored before its first run, its runs interleaved
and tagged, the command it shows making the same stored specification again; bad input refused in one
sentence with exit 2 and nothing stored."""
import json
import shlex
from dataclasses import replace

import pytest

from engine.cli.main import build_parser
from engine.cli.sweeping import spec_from_args
from engine.store.db import Store
from engine.sweep import MAX_REPEAT, Arm, SweepError, SweepSpec, arm_of, start, stored, stored_ids
from commands import run_engine


def cli(*args):
    proc = run_engine(*args, timeout=900)
    return proc.returncode, proc.stdout, proc.stderr


def parsed(command: str) -> SweepSpec:
    """The specification a shown command describes, read by the command line's own parser."""
    words = shlex.split(command)
    assert words[:4] == ["python", "-m", "engine", "sweep"]
    return spec_from_args(build_parser().parse_args(words[3:]))


def test_the_grid_is_every_combination_with_sparsity_on_fp32_only_and_the_runs_interleaved():
    spec = SweepSpec("summary", ["fp32", "int8-dyn"], ["on", "off"], ["dense", "skip-50"], repeat=2)
    assert [a.label for a in spec.grid()] == ["fp32, KV on", "fp32, KV on, skip-50", "fp32, KV off",
                                              "fp32, KV off, skip-50", "int8-dyn, KV on", "int8-dyn, KV off"]
    runs = spec.runs("20261203-080000")
    assert [arm for arm, _ in runs] == spec.grid() * 2  # A B C ... A B C, not A A B B
    assert {r.tag for _, r in runs} == {"sweep:20261203-080000"}
    assert all(arm_of({"config": {"run_spec": r.to_dict()}}) == arm for arm, r in runs)  # a stored run's setting


def test_several_users_only_where_the_settings_batch():
    spec = SweepSpec("summary", ["fp32"], ["on", "off"], ["dense", "skip-50"], ["none", "draft"], [1, 4])
    batched = [a for a in spec.grid() if a.users > 1]
    assert [a.label for a in batched] == ["fp32, KV on, 4 users"]
    assert len(spec.grid()) == 8 + 1
    assert spec.run_spec(batched[0], "x").users == 4


@pytest.mark.parametrize("spec", [
    SweepSpec("summary"), SweepSpec("code edit", ["fp32", "int8-dyn"], ["off", "on"], ["dense", "mask-50"],
                                    ["none", "lookahead"], [1, 8], new_tokens=5, repeat=MAX_REPEAT, model="/tmp/a b"),
])
def test_the_command_describes_the_specification_exactly(spec):
    assert parsed(spec.command()) == spec
    assert SweepSpec.from_json(spec.to_json()) == spec


@pytest.mark.parametrize("change, words", [
    (dict(weights=["fp33"]), "Unknown weight level 'fp33'"), (dict(kv=["maybe"]), "Unknown KV cache setting"),
    (dict(sparsity=["mask-90"]), "Unknown sparsity 'mask-90'"), (dict(speculative=["psychic"]), "psychic"),
    (dict(workload="novel"), "Unknown workload 'novel'"), (dict(repeat=0), "1 to 10 times, not 0"),
    (dict(repeat=10**9), "not 1000000000"), (dict(new_tokens=3), "4 to 512 new tokens"),
    (dict(weights=[]), "The grid is empty"), (dict(users=[0]), "1 to 256 users, not 0"),
    (dict(users=[1, 257]), "not 257"), (dict(kv=["off"], users=[8]), "The grid is empty"), (dict(weights=["int8-dyn"], sparsity=["mask-50"]), "The grid is empty"),
])
def test_bad_input_is_one_sentence_and_nothing_is_stored(store, change, words):
    with pytest.raises(SweepError, match=words) as caught:
        start(store, replace(SweepSpec("summary"), **change))
    assert "\n" not in str(caught.value) and str(caught.value).endswith(".")
    assert stored_ids(store) == []


@pytest.mark.parametrize("args", [["--weights", "fp33"], ["--repeat", "0"], ["--repeat", "100000"],
                                  ["--weights", "int8-dyn", "--sparsity", "mask-50"], ["--weights", ","],
                                  ["--users", "eight"], ["--users", "0"], ["--users", "8", "--kv", "off"]])
def test_bad_input_on_the_command_line_exits_2_without_a_database(tmp_path, args):
    db = tmp_path / "runs.duckdb"
    code, out, err = cli("sweep", "--workload", "summary", *args, "--db", db)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not db.exists()


def test_a_tiny_sweep_and_its_shown_command_store_the_same_specification(tiny_folder, tmp_path):
    db = tmp_path / "runs.duckdb"
    code, out, err = cli("sweep", "--workload", "summary", "--weights", "fp32,int8-dyn", "--new-tokens", 4,
                         "--repeat", 2, "--model", tiny_folder, "--device", "cpu", "--json", "--db", db)
    assert code == 0, err
    made = json.loads(out)
    store = Store(db)
    first = stored(store, made["sweep_id"])
    assert first == SweepSpec("summary", ["fp32", "int8-dyn"], new_tokens=4, repeat=2, model=str(tiny_folder),
                              device="cpu")
    assert made["command"] == first.command() and parsed(made["command"]) == first
    runs = store.query("SELECT run_id, weights, tag, n_new_tokens FROM runs ORDER BY run_id")
    assert [q.split()[0] for q in runs["weights"]] == ["fp32", "int8-dyn", "fp32", "int8-dyn"]  # interleaved
    assert set(runs["tag"]) == {f"sweep:{made['sweep_id']}"} and set(runs["n_new_tokens"]) == {4}
    rows = made["settings"]
    assert [(r["label"], r["repeats"], r["run_ids"]) for r in rows] == [
        ("fp32, KV on", 2, [1, 3]), ("int8-dyn, KV on", 2, [2, 4])]
    assert all("95% interval" in r["decode vs baseline"] and "2 vs 2 repeats" in r["decode vs baseline"] for r in rows)
    assert any("bound by" in line for line in made["advice"])

    words = shlex.split(made["command"])  # the command as shown, run again into the same database
    code, out, err = cli(*words[3:], "--db", db)
    assert code == 0, err
    again = [i for i in stored_ids(store) if i != made["sweep_id"]]
    assert len(again) == 1 and stored(store, again[0]) == first
    assert "made again by: " + first.command() in out
    assert len(store.query("SELECT run_id FROM runs WHERE tag = ?", [f"sweep:{again[0]}"])) == 4


def test_two_sweeps_started_in_the_same_second_get_their_own_ids(store):
    ids = [start(store, SweepSpec("summary")) for _ in range(3)]
    assert len(set(ids)) == 3 and stored_ids(store)[0] in ids
    assert Arm("fp32", "on", "dense", "none").label == "fp32, KV on"
