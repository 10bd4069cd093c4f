"""The generation process the Live page runs its generations in (engine.run.worker), with the real model."""
import json

import pytest

from engine.paths import CACHE_ENV
from engine.run.generate import Generation, GenConfig
from engine.spec import RunSpec
from engine.store.db import Store
from engine.run.worker import GenerationWorker, WorkerFailed, WorkerRefused
from test_served import stream_server  # noqa: F401 (a fixture: a small real streaming server)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def worker():
    return GenerationWorker()


def request(db, model="default", level="fp32", sparsity=0.0, **config) -> dict:
    cfg = GenConfig(prompt=config.pop("prompt", "Name a colour."), **config)
    spec = RunSpec(gen=cfg, model=model, device="cpu", weights=level, sparsity=sparsity)
    return {"db": str(db), "spec": spec.to_dict()}


def until_ready(run) -> dict:
    return next(payload for kind, payload in run if kind == "ready")


def test_the_worker_streams_the_tokens_an_in_process_run_gives(worker, default_lm, tmp_path):
    kinds, rows = [], []
    for kind, payload in worker.generate(request(tmp_path / "w.duckdb", max_new_tokens=12), every_s=0.05):
        kinds.append(kind)
        if kind == "ready":  # with the first step's token, which a page shows at once
            assert payload["special_ids"] and payload["run_id"] == 1 and len(payload["tokens"]) == 1
            rows.extend(payload["tokens"])
        elif kind == "tokens":
            rows.extend(payload)
        else:
            done = payload
    # a fresh worker loads the model first: the page shows its spinner for that only
    assert kinds[:2] == ["preparing", "ready"] and kinds[-1] == "done" and "tokens" in kinds
    local = Generation(default_lm, GenConfig(prompt="Name a colour.", max_new_tokens=12), telemetry=False).run()
    streamed = [r["token_id"] for r in rows]  # in batches: the ones after the last batch come with "done"
    assert streamed and streamed == local["token_ids"][:len(streamed)]
    assert [r["token_id"] for r in done["tokens"]] == local["token_ids"]
    assert done["result"]["text"] == local["text"]
    assert Store(tmp_path / "w.duckdb").run(done["run_id"])["status"] == "ok"


def test_no_batch_comes_before_every_s_has_passed_since_the_first_token(worker, tmp_path):
    kinds = [kind for kind, _ in worker.generate(request(tmp_path / "w.duckdb", max_new_tokens=12), every_s=1e9)]
    assert kinds[-2:] == ["ready", "done"] and "tokens" not in kinds


def test_closing_the_stream_stops_the_run_and_keeps_it_as_cancelled(worker, tmp_path):
    run = worker.generate(request(tmp_path / "w.duckdb", max_new_tokens=400, ignore_eos=True), every_s=0.05)
    ready = until_ready(run)
    next(run)
    run.close()
    row = Store(tmp_path / "w.duckdb").run(ready["run_id"])
    assert row["status"] == "cancelled" and 0 < row["n_new_tokens"] < 400


def test_a_run_stopped_while_the_model_loads_still_reports_its_number(tmp_path):
    ids = []
    run = GenerationWorker().generate(request(tmp_path / "w.duckdb", max_new_tokens=400, ignore_eos=True),
                                      every_s=0.05, on_run_id=ids.append)
    assert next(run) == ("preparing", None)  # a fresh worker loads the model
    run.close()
    assert len(ids) == 1 and Store(tmp_path / "w.duckdb").run(ids[0])["status"] == "cancelled"


def test_input_the_engine_turns_down_is_one_sentence_and_the_worker_goes_on(worker, tmp_path):
    with pytest.raises(WorkerRefused, match="No model folder"):
        list(worker.generate(request(tmp_path / "w.duckdb", model=str(tmp_path / "missing")), every_s=0.05))
    with pytest.raises(WorkerRefused, match="Sparsity must be between"):
        list(worker.generate(request(tmp_path / "w.duckdb", sparsity=1.5), every_s=0.05))
    assert list(worker.generate(request(tmp_path / "w.duckdb", max_new_tokens=2), every_s=0.05))[-1][0] == "done"


def test_a_dead_worker_is_one_sentence_and_the_next_run_starts_a_new_one(tmp_path):
    worker = GenerationWorker()
    run = worker.generate(request(tmp_path / "w.duckdb", max_new_tokens=400, ignore_eos=True), every_s=0.05)
    ready = until_ready(run)
    worker._process.kill()
    with pytest.raises(WorkerFailed, match="ended unexpectedly"):
        list(run)
    assert list(worker.generate(request(tmp_path / "w.duckdb", max_new_tokens=2), every_s=0.05))[-1][0] == "done"
    assert Store(tmp_path / "w.duckdb").run(ready["run_id"])["status"] == "interrupted"


def test_the_worker_runs_a_served_spec_as_it_runs_a_local_one(worker, stream_server, tmp_path):
    url, _ = stream_server("ok", delay=0.05)
    spec = RunSpec(gen=GenConfig("Say something.", max_new_tokens=6), backend="served", endpoint=url)
    kinds, done = [], None
    for kind, payload in worker.generate({"db": str(tmp_path / "w.duckdb"), "spec": spec.to_dict()}, every_s=0.05):
        kinds.append(kind)
        done = payload
    assert "ready" in kinds and kinds[-1] == "done"
    assert done["result"]["n_new_tokens"] == len(done["tokens"]) == 6
    assert Store(tmp_path / "w.duckdb").run(done["run_id"])["backend"] == "served"
    # the page's served run refuses top-k with the command line's sentence, instead of dropping it
    refused = RunSpec(gen=GenConfig("Hi", top_k=5), backend="served", endpoint=url)
    with pytest.raises(WorkerRefused, match="^A served run cannot honour top-k sampling"):
        list(worker.generate({"db": str(tmp_path / "w.duckdb"), "spec": refused.to_dict()}, every_s=0.05))


def test_a_spec_with_users_runs_as_one_batch_each_sequence_decoding_what_it_decodes_alone(worker, default_lm,
                                                                                         tmp_path):
    from engine.model.cpu_kernels import optional_kernel
    from engine.run.batch import batch_prompts

    if optional_kernel() is None:
        pytest.skip("the C++ extension cannot be built here")
    db = tmp_path / "w.duckdb"
    gen = GenConfig(prompt="Name a colour.", max_new_tokens=10, ignore_eos=True)
    rows, done = [], None
    for kind, payload in worker.generate({"db": str(db), "spec": RunSpec(gen=gen, device="cpu", users=3).to_dict()},
                                         every_s=0.05):
        if kind == "tokens":
            rows.extend(payload)
        elif kind == "ready":  # every run of the batch, which a Stop must speak of
            ready = payload
        elif kind == "done":
            done = payload
    assert done["users"] == 3 and len(done["run_ids"]) == 3 and done["run_id"] == done["run_ids"][0]
    assert ready["run_ids"] == done["run_ids"] and ready["run_id"] == done["run_id"]
    assert done["tokens_per_s_total"] > 0 and done["tokens_per_s_per_user"] > 0
    assert rows and {r["run_id"] for r in rows} <= set(done["run_ids"])  # every streamed row names its run
    store = Store(db)
    for user, (run_id, prompt) in enumerate(zip(done["run_ids"], batch_prompts(gen.prompt, 3))):
        lone = Generation(default_lm, GenConfig(prompt=prompt, max_new_tokens=10, ignore_eos=True),
                          telemetry=False).run()
        assert [r["token_id"] for r in done["tokens"] if r["user"] == user and r["run_id"] == run_id] == \
            lone["token_ids"], prompt
        assert store.run(run_id)["status"] == "ok" and store.run(run_id)["prompt"] == prompt
    # a lone run's summary has the same figures; its decode tokens carry the weights alone, not a third of them
    alone = list(worker.generate({"db": str(db), "spec": RunSpec(gen=gen, device="cpu").to_dict()}, every_s=1.0))[-1][1]
    assert alone["users"] == 1 and alone["run_ids"] == [alone["run_id"]]
    assert done["bytes_per_token"] < alone["bytes_per_token"] / 2
    assert done["result"]["bytes_per_token_own"] < alone["bytes_per_token"] / 2  # the planner's footing: yours alone


def test_a_batch_the_engine_cannot_run_is_refused_in_one_sentence_and_nothing_is_recorded(worker, tmp_path):
    db = tmp_path / "w.duckdb"
    for gen, users, says in [(GenConfig("Hi", speculative="prompt-lookup"), 2, "^Speculative decoding .* does not batch"),
                             (GenConfig("Hi"), 0, "^users must be a whole number between 1 and 256"),
                             (GenConfig("Hi"), 257, "^users must be a whole number between 1 and 256")]:
        with pytest.raises(WorkerRefused, match=says):
            list(worker.generate({"db": str(db), "spec": RunSpec(gen=gen, users=users).to_dict()}, every_s=0.05))
    sparse = RunSpec(gen=GenConfig("Hi"), users=2, sparsity=0.5)
    with pytest.raises(WorkerRefused, match="^Activation sparsity .* does not batch"):
        list(worker.generate({"db": str(db), "spec": sparse.to_dict()}, every_s=0.05))
    assert Store(db).runs(10).empty


def test_closing_a_batch_stream_stops_every_sequence_and_keeps_each_as_cancelled(worker, tmp_path):
    spec = RunSpec(gen=GenConfig("Name a colour.", max_new_tokens=400, ignore_eos=True), device="cpu", users=3)
    run = worker.generate({"db": str(tmp_path / "w.duckdb"), "spec": spec.to_dict()}, every_s=0.05)
    until_ready(run)
    rows = next(payload for kind, payload in run if kind == "tokens")
    run.close()
    runs = Store(tmp_path / "w.duckdb").runs(10)
    assert len(runs) == 3 and set(runs["status"]) == {"cancelled"} and (runs["n_new_tokens"] < 400).all()
    assert {r["run_id"] for r in rows} <= set(runs["run_id"])


def ending(worker, request: dict) -> dict:
    return next(payload for kind, payload in worker.generate(request, every_s=60.0) if kind == "done")


def test_a_fresh_database_warms_from_the_machine_cache_and_calibrates_only_where_none_is(tiny_folder, tmp_path,
                                                                                       monkeypatch):
    """The dashboard's warm start: the model, then the calibration a cache of this machine holds; a
    calibration is measured only where the cache has none for this device, and cached only when the machine
    was quiet while it was measured."""
    from datetime import datetime, timezone

    import torch

    from engine.measure import hardware
    from engine.paths import DATA

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(hardware.FIXED_CALIBRATION_ENV)  # the worker's process measures as a user's does
    worker = GenerationWorker()  # started now, with this environment
    warm = {"warm": True, "spec": RunSpec(gen=GenConfig("warm"), model=str(tiny_folder), device="cpu").to_dict()}
    key = hardware.device_key(torch.device("cpu"))

    loaded = ending(worker, {**warm, "db": str(tmp_path / "first.duckdb")})
    assert loaded["calibration"] is None and loaded["device"] == "cpu"  # nothing cached: the warm start measures nothing
    assert hardware.recent_calibrations(Store(tmp_path / "first.duckdb"), key) == []
    measured = ending(worker, {"db": str(tmp_path / "first.duckdb"), "device": "cpu", "calibrate": True,
                               "missing_only": True})["calibration"]
    assert measured["memory_gbps"] > 0 and "reused_from" not in measured
    # the cache holds it only if the check at the time found no other work on the machine
    cached = [c["measured_at"] for c in hardware.cached_calibrations(torch.device("cpu"))]
    assert cached == ([measured["measured_at"]] if hardware.measured_quiet(measured) else [])

    # a calibration of this machine measured while it was quiet, as the cache keeps one
    quiet = {**json.loads((DATA / "test_calibration.json").read_text()), "device_key": key, "other_work_share": 0.0,
             "measured_at": datetime.now(timezone.utc).replace(tzinfo=None).isoformat(timespec="seconds")}
    hardware.remember_calibration(torch.device("cpu"), quiet)
    # the cache's pick: this one, or the one measured above where the machine was quiet then too
    expected = hardware.reused_calibration(torch.device("cpu"))
    assert expected["measured_at"] in (quiet["measured_at"], measured["measured_at"])
    loaded = ending(worker, {**warm, "db": str(tmp_path / "second.duckdb")})
    reused = loaded["calibration"]
    assert reused["memory_gbps"] == expected["memory_gbps"] and reused["measured_at"] == expected["measured_at"]
    assert reused["reused_from"] == str(tmp_path / "cache" / "calibrations.json")
    stored = hardware.recent_calibrations(Store(tmp_path / "second.duckdb"), key)
    assert [c["memory_gbps"] for c in stored] == [expected["memory_gbps"]] and stored[0]["reused_from"]
    # the run after it is attributed with the reused calibration, and measures none of its own
    run = {"db": str(tmp_path / "second.duckdb"),
           "spec": RunSpec(gen=GenConfig("Hi", raw=True, max_new_tokens=3), model=str(tiny_folder),
                           device="cpu").to_dict()}
    done = ending(worker, run)
    metrics = Store(tmp_path / "second.duckdb").run(done["run_id"])["metrics"]
    assert '"reused_from"' in metrics and len(hardware.recent_calibrations(Store(tmp_path / "second.duckdb"), key)) == 1

    # a cache of another device is not used (by a new process, which has measured nothing itself)
    cache = json.loads((tmp_path / "cache" / "calibrations.json").read_text())
    (tmp_path / "cache" / "calibrations.json").write_text(json.dumps(
        {name.replace(key, "cpu:Another CPU:64threads"): entries for name, entries in cache.items()}))
    assert ending(GenerationWorker(), {**warm, "db": str(tmp_path / "third.duckdb")})["calibration"] is None


def test_a_database_file_removed_between_runs_is_made_again_for_the_next_run(worker, tmp_path):
    """The worker keeps each database's Store between runs, and opens it again where the file went."""
    db = tmp_path / "w.duckdb"
    ending(worker, request(db, max_new_tokens=2))
    for path in (db, db.with_name(db.name + ".wal")):
        path.unlink(missing_ok=True)
    second = ending(worker, request(db, max_new_tokens=2))
    runs = Store(db).runs(10)
    assert list(runs["run_id"]) == [second["run_id"]] and list(runs["status"]) == ["ok"]
