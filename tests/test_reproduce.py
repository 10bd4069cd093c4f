"""The command that reproduces a run: a run made through the worker (as the pages make them) and its
reproduction by `generate --from-run` give the same tokens and the same settings; the command the Runs
page shows is that same command; bad ids and repeat counts are refused in one sentence."""
import json
import shlex

import pytest

from engine.run.generate import Generation
from engine.run.reproduce import ReproduceError, arguments, command, run_command, stored_spec
from engine.spec import GenConfig, RunSpec
from engine.run.worker import GenerationWorker
from engine.switches.quant import variant
from engine.store.db import Store
from test_served import stream_server  # noqa: F401 (a fixture)
from commands import run_engine

SETTINGS = ["model", "device", "dtype", "kv_cache", "temperature", "weights", "sparsity", "sparsity_mode",
            "speculative"]


def cli(*args):
    proc = run_engine(*args)
    return proc.returncode, proc.stdout, proc.stderr


def test_a_worker_run_and_its_reproduction_from_the_command_line_give_the_same_tokens(tiny_folder, tmp_path):
    page_db, other_db = tmp_path / "page.duckdb", tmp_path / "other.duckdb"
    spec = RunSpec(gen=GenConfig("Name three colours.", max_new_tokens=9, kv_cache=False, stop=["zz"],
                                 ignore_eos=True, kv_dtype="bf16"),
                   model=str(tiny_folder), device="cpu", weights="int8-dyn")
    events = list(GenerationWorker().generate({"db": str(page_db), "spec": spec.to_dict()}, every_s=0.05))
    assert events[-1][0] == "done"
    original = Store(page_db).run(1)
    assert original["status"] == "ok" and stored_spec(Store(page_db), 1) == spec

    for db in (page_db, other_db):  # into the same database and into another
        code, _, stderr = cli("generate", "--from-run", 1, "--from-db", page_db, "--db", db, "--json")
        assert code == 0, stderr
        store = Store(db)
        again = store.runs(1).iloc[0].to_dict()
        assert list(again["token_ids"]) == list(original["token_ids"]) and again["output"] == original["output"]
        assert {k: again[k] for k in SETTINGS} == {k: original[k] for k in SETTINGS}
        assert stored_spec(store, again["run_id"]) == spec


def test_the_command_shown_is_the_one_that_runs(tiny_folder, tmp_path, tiny_lm, calibration):
    spec = RunSpec(gen=GenConfig("It's \"quoted\"; $HOME stays text.", max_new_tokens=4, temperature=0.7, seed=11,
                                 top_k=5), model=str(tiny_folder), sparsity=0.5, sparsity_mode="skip")
    text = command(spec, db=tmp_path / "x.duckdb")
    words = shlex.split(text)
    assert words[:4] == ["python", "-m", "engine", "generate"] and words[4:-2] == arguments(spec)
    assert words[words.index("--prompt") + 1] == spec.gen.prompt
    assert "--sparsity-mode" in words and "--weights" not in words  # defaults are left out
    db = tmp_path / "x.duckdb"
    code, stdout, stderr = cli(*words[3:-2], "--db", db, "--json")
    assert code == 0, stderr
    assert stored_spec(Store(db), json.loads(stdout)["run_id"]) == spec


def test_a_batch_reproduced_from_the_command_line_decodes_the_same_tokens_with_the_same_settings(tiny_folder,
                                                                                                 tmp_path):
    first, other, others = tmp_path / "a.duckdb", tmp_path / "b.duckdb", tmp_path / "others.txt"
    others.write_text("Tell a short story.\n\nList four birds.\n", encoding="utf-8")
    code, stdout, stderr = cli("generate", "--prompt", "Count the stars", "--users", 3, "--prompts", others,
                               "--kv-budget-mb", 0.75, "--max-new-tokens", 6, "--ignore-eos", "--model", tiny_folder,
                               "--db", first, "--json")
    assert code == 0, stderr
    made = json.loads(stdout)["run_ids"]
    originals = [Store(first).run(i) for i in made]
    words = shlex.split(run_command(originals[1]))  # the second user's run shows its whole batch's command
    assert words[words.index("--users") + 1] == "3" and words[words.index("--prompts") + 1] == str(others)
    assert float(words[words.index("--kv-budget-mb") + 1]) == 0.75

    code, stdout, stderr = cli("generate", "--from-run", made[1], "--from-db", first, "--db", other, "--json")
    assert code == 0, stderr
    again = json.loads(stdout)
    assert again["users"] == 3
    for old, new in zip(originals, (Store(other).run(i) for i in again["run_ids"])):
        assert list(new["token_ids"]) == list(old["token_ids"]) and new["prompt"] == old["prompt"]
        assert {k: new[k] for k in SETTINGS} == {k: old[k] for k in SETTINGS}
        assert json.loads(new["config"]) == json.loads(old["config"])  # users, prompts, cap and KV budget
    assert [r["prompt"] for r in originals] == ["Count the stars", "Tell a short story.", "List four birds."]

    others.write_text("Another prompt.\n", encoding="utf-8")  # the file no longer holds the batch's prompts
    code, _, stderr = cli("generate", "--from-run", made[0], "--from-db", first, "--db", other)
    assert code == 2 and "no longer holds" in stderr and len(stderr.strip().splitlines()) == 1
    assert len(Store(other).runs(10)) == 3  # nothing more was recorded


def test_a_request_of_a_load_sweep_points_to_its_sweep(store, tiny_lm, calibration):
    run_id = Generation(tiny_lm, GenConfig("Hello.", max_new_tokens=2), store=store, calibration=calibration,
                        tag="load:4:1:2").run()["run_id"]
    shown = run_command(store.run(run_id))
    assert shown == (f"Run {run_id} is request 2 of level 1 of load sweep 4: `python -m engine load --from-sweep 4` "
                     "makes the sweep again.")
    code, _, stderr = cli("generate", "--from-run", run_id, "--db", store.path)
    assert code == 2 and "load --from-sweep 4" in stderr and len(stderr.strip().splitlines()) == 1


def test_a_run_stored_without_its_specification_is_read_back_from_its_settings(store, tiny_lm, calibration):
    cfg = GenConfig("Hello.", max_new_tokens=3, top_p=0.9, temperature=0.5, seed=3)
    run_id = Generation(tiny_lm, cfg, store=store, calibration=calibration).run()["run_id"]
    spec = stored_spec(store, run_id)
    assert spec.gen == cfg and spec.model == tiny_lm.name and spec.weights == "fp32"
    grouped = stored_spec(store, Generation(variant(tiny_lm, "int4-wo", 64), cfg, store=store,
                                            calibration=calibration).run()["run_id"])
    assert (grouped.weights, grouped.group_size) == ("int4-wo", 64)


def test_repeat_runs_the_same_settings_n_times(tiny_folder, tmp_path):
    db = tmp_path / "r.duckdb"
    code, _, stderr = cli("generate", "--prompt", "Hi.", "--model", tiny_folder, "--max-new-tokens", 3,
                          "--repeat", 3, "--db", db)
    assert code == 0, stderr
    runs = Store(db).runs()
    assert len(runs) == 3 and len({tuple(t) for t in runs["token_ids"]}) == 1


def test_unknown_runs_and_bad_repeat_counts_are_one_sentence(tmp_path, store):
    with pytest.raises(ReproduceError, match="Run 5 is not in"):
        stored_spec(store, 5)
    for args in (["--from-run", 5, "--db", store.path], ["--prompt", "x", "--repeat", 0],
                 ["--prompt", "x", "--repeat", 100_000], ["--from-run", "one"], ["--db", store.path],
                 ["--from-run", 1, "--prompt", "x", "--db", store.path],
                 ["--from-run", 1, "--weights", "int4-wo", "--db", store.path],
                 ["--from-run", 1, "--max-new-tokens", "2", "--db", store.path],
                 ["--from-run", 1, "--from-db", store.path.with_name("absent.duckdb")]):
        code, _, stderr = cli("generate", *args)
        assert code == 2 and stderr.startswith("error: ") and len(stderr.strip().splitlines()) == 1, (args, stderr)
    assert not store.path.with_name("absent.duckdb").exists()  # a database only read is never made


def test_the_arguments_give_back_every_setting_to_the_last_digit_and_a_prompt_that_starts_with_a_dash():
    from engine.cli.main import build_parser, spec_from_args

    spec = RunSpec(gen=GenConfig("-hello", max_new_tokens=4, temperature=0.1234567, top_p=0.9999999, seed=7,
                                 stop=["-x", "end"]))
    again = spec_from_args(build_parser().parse_args(["generate", *arguments(spec)]))
    assert again.gen == spec.gen


def test_a_load_sweep_is_made_again_from_its_stored_parameters(stream_server, tmp_path):  # noqa: F811
    from engine.serve.load import Sweep, SweepConfig, load_prompts

    url, _ = stream_server("ok", delay=0.01)
    first, other = tmp_path / "a.duckdb", tmp_path / "b.duckdb"
    cfg = SweepConfig(url, [1, 2], 2, 5, load_prompts("summary"), temperature=0.5, timeout_s=30.0)
    sweep_id = Sweep(cfg, Store(first)).run()["sweep_id"]
    code, _, stderr = cli("load", "--from-sweep", sweep_id, "--from-db", first, "--db", other, "--json")
    assert code == 0, stderr
    stored = {db: json.loads(Store(db).query("SELECT config FROM load_sweeps")["config"].iloc[-1]) for db in (first, other)}
    for config in stored.values():
        config.pop("rtt_ms")  # measured by each sweep
    assert stored[first] == stored[other]
    assert len(Store(other).query("SELECT * FROM requests")) == 4
    code, _, stderr = cli("load", "--from-sweep", 9, "--db", other)
    assert code == 2 and "Load sweep 9 is not in" in stderr


def test_the_earlier_flag_names_make_the_same_run_and_stay_out_of_the_help(capsys):
    """Commands stored before --weights and --speculative said --quant, --spec and --spec-k: they still run."""
    from engine.cli.main import build_parser, main, spec_from_args

    parser = build_parser()
    earlier = ["generate", "--prompt", "x", "--quant", "int8-wo", "--spec", "prompt-lookup", "--spec-k", "3"]
    today = ["generate", "--prompt", "x", "--weights", "int8-wo", "--speculative", "prompt-lookup", "--speculative-k",
             "3"]
    spec = spec_from_args(parser.parse_args(today))
    assert spec == spec_from_args(parser.parse_args(earlier))
    assert (spec.weights, spec.gen.speculative, spec.gen.speculative_k) == ("int8-wo", "prompt-lookup", 3)
    assert spec_from_args(parser.parse_args(["generate", "--prompt", "x"])).weights == "fp32"
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    shown = capsys.readouterr().out
    assert "--weights" in shown and "--speculative-k" in shown
    assert not {"--quant", "--spec", "--spec-k"} & set(shown.replace(",", " ").replace("[", " ").split())
