"""Corners that used to run on, or end in a traceback: a model whose weights do not load, a corrupt weights
file for the calculators, tensor parallel beyond one node's GPU link, a database cut short, a read-only
database folder, and a reader that closes the pipe."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import save_file

from engine.cli.main import main
from engine.plan import planner
from engine.store.db import Store
from commands import run_engine

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "data" / "models" / "SmolLM2-135M-Instruct"


def engine(*args, db, timeout=600):
    return run_engine(*args, timeout=timeout, env={**os.environ, "TOKENPATH_DB": str(db)})


def one_sentence(done, *words):
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert all(word in lines[0] for word in words), lines[0]
    return lines[0]


def model_folder(path: Path, config, state: dict) -> Path:
    path.mkdir()
    config.save_pretrained(path)
    save_file({k: v.detach().clone().contiguous() for k, v in state.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODEL / file, path / file)
    return path


def tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)


def test_weights_whose_names_do_not_match_the_config_are_refused_naming_them(tmp_path):
    from transformers import LlamaForCausalLM

    config = tiny_llama_config()
    state = {f"transformer.{k}": v for k, v in LlamaForCausalLM(config).state_dict().items()}
    path = model_folder(tmp_path / "renamed", config, state)
    done = engine("generate", "--prompt", "hi", "--max-new-tokens", "2", "--model", str(path), db=tmp_path / "r.duckdb")
    # transformers prints its own load report first; the refusal is the last line
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "do not match its config" in last and "model.embed_tokens.weight" in last
    assert Store(tmp_path / "r.duckdb").runs().empty


def test_a_bert_config_with_bert_weights_is_refused(tmp_path):
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=49152, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, is_decoder=True)
    path = model_folder(tmp_path / "bert", config, BertModel(config).state_dict())
    done = engine("generate", "--prompt", "hi", "--max-new-tokens", "2", "--model", str(path), db=tmp_path / "r.duckdb")
    # transformers prints its own load report first; the refusal is the last line
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "do not match its config" in last and "random weights" in last, last
    assert Store(tmp_path / "r.duckdb").runs().empty


def test_a_matching_folder_still_loads(tmp_path):
    from transformers import LlamaForCausalLM

    config = tiny_llama_config()
    path = model_folder(tmp_path / "good", config, LlamaForCausalLM(config).state_dict())
    done = engine("generate", "--prompt", "hi", "--max-new-tokens", "2", "--raw", "--model", str(path), "--json",
                  db=tmp_path / "r.duckdb")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["n_new_tokens"] == 2


@pytest.mark.parametrize("command", [["kvcalc"], ["plan", "--gpu", "h100-80gb-sxm"]])
def test_a_corrupt_safetensors_file_is_one_sentence_for_the_calculators(tmp_path, capsys, command):
    path = tmp_path / "model"
    path.mkdir()
    shutil.copy(MODEL / "config.json", path / "config.json")
    (path / "model.safetensors").write_bytes((MODEL / "model.safetensors").read_bytes()[:1000])
    assert main([*command, "--model", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "not a readable safetensors file" in err[0], err


def test_tensor_parallel_over_more_gpus_than_one_node_links_is_refused(capsys):
    args = ["plan", "--model", "llama-2-70b", "--gpu", "h100-80gb-sxm", "--gpus", "16", "--tp", "16"]
    for interconnect in ("nvlink", "nvswitch"):
        assert main([*args, "--interconnect", interconnect]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "at most 8 GPUs" in err and "\n" not in err, err
    assert main([*args[:-2], "--tp", "8", "--pp", "2", "--interconnect", "nvlink", "--json"]) == 0


def test_every_gpu_to_gpu_link_states_how_many_gpus_it_joins():
    for gpu in planner.load_gpu_data()["gpus"]:
        if gpu["gpu_link"].get("gbps_per_direction"):
            assert gpu["gpu_link"].get("max_gpus", 0) >= 2, gpu["id"]


def test_a_link_without_a_stated_limit_is_assumed_to_join_one_node():
    gpu = dict(planner.get_gpu("h100-80gb-sxm"))
    gpu["gpu_link"] = {k: v for k, v in gpu["gpu_link"].items() if k != "max_gpus"}
    setup = planner.Setup(model=planner.resolve_model("llama-2-70b"), gpu=gpu, gpus=16, tp=16)
    with pytest.raises(planner.PlanError, match="assumed"):
        planner.check_setup(setup)


def test_generate_on_a_database_cut_short_is_refused_before_the_model_loads(tmp_path):
    db = tmp_path / "runs.duckdb"
    store = Store(db)
    for _ in range(3):
        store.start_run(model="m", device="cpu", dtype="fp32", config={}, hardware={}, prompt="p" * 1000)
    data = db.read_bytes()
    db.write_bytes(data[:len(data) // 2])
    # a hub id that no cache holds (loading it would fail): refused for the database first means nothing was loaded
    done = engine("generate", "--prompt", "hi", "--model", "no-such-org/no-such-model", "--db", str(db), db=db)
    one_sentence(done, "damaged or cut short")


def test_runs_reads_a_database_in_a_read_only_folder(tmp_path):
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("needs unshare and mount for a read-only folder")
    folder = tmp_path / "ro"
    folder.mkdir()
    db = folder / "runs.duckdb"
    Store(db).start_run(model="m", device="cpu", dtype="fp32", config={}, hardware={}, prompt="read me")
    # a mount namespace of its own, where the folder is mounted read-only (root ignores file modes)
    script = (f"mount --bind {folder} {folder} && mount -o remount,bind,ro {folder} || exit 99; "
              f"touch {folder}/probe 2>/dev/null && exit 98; exec {sys.executable} -m engine runs --json --db {db}")
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    if done.returncode in (98, 99):
        pytest.skip("this machine cannot mount a folder read-only")
    assert done.returncode == 0, done.stderr
    assert [run["prompt"] for run in json.loads(done.stdout)] == ["read me"]


def test_a_reader_closing_the_pipe_gets_no_traceback(tmp_path):
    db = tmp_path / "runs.duckdb"
    store = Store(db)
    for i in range(60):  # more JSON than a pipe holds, so the writer meets the closed end
        store.start_run(model="m", device="cpu", dtype="fp32", config={}, hardware={}, prompt=f"{i} " + "x" * 2000)
    reader = subprocess.Popen([sys.executable, "-m", "engine", "runs", "--json", "--limit", "100", "--db", str(db)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert len(reader.stdout.read(10)) == 10
    reader.stdout.close()
    err = reader.stderr.read().decode()
    assert reader.wait(timeout=300) in (0, 1) and "Traceback" not in err and "Exception ignored" not in err, err
