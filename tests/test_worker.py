"""The generation process the Live page runs its generations in (engine.run.worker), with the real model."""
import pytest

from engine.run.generate import Generation, GenConfig
from engine.run.spec import RunSpec
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
        if kind == "ready":
            assert payload["special_ids"] and payload["run_id"] == 1
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
