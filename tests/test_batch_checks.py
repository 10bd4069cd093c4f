"""A batch's prediction and its peak check on real stored batched runs: the planner plans a batched run at its
batch (a decode token's bytes fall with the batch), and the check against the calibrated peak counts what a
batched forward really moves, the weights once for every sequence beside each sequence's own cache."""
import json

import pytest

from engine.measure import hardware
from engine.plan import planner
from engine.run.batch import BatchEngine
from engine.run.generate import Generation
from engine.spec import GenConfig

BATCH = 8
PROMPTS = ["Count the stars", "Name a river", "Say hello", "Pick a colour", "List two cats", "Add one and two",
           "Spell blue", "Find a word"]  # short and raw: all eight prefill in the first step and decode together


def request(prompt: str) -> GenConfig:
    return GenConfig(prompt=prompt, max_new_tokens=8, raw=True, ignore_eos=True)


def run_batch(lm, store, calibration) -> list[dict]:
    """Eight sequences in one batch, recorded; their stored run rows."""
    engine = BatchEngine(lm, store, max_batch=BATCH, calibration=calibration)
    seqs = [engine.submit(request(p)) for p in PROMPTS]
    engine.run()
    return [store.run(s.run_id) for s in seqs]


def run_alone(lm, store, calibration) -> dict:
    return store.run(Generation(lm, request(PROMPTS[0]), store=store, calibration=calibration,
                                telemetry=False).run()["run_id"])


def metrics(run: dict) -> dict:
    return json.loads(run["metrics"])


def test_the_local_plan_of_a_batch_of_eight_moves_fewer_bytes_per_token_than_one(calibration):
    one, eight = (planner.local_plan("default", calibration, batch=b) for b in (1, BATCH))
    assert eight["batch"] == BATCH and one["batch"] == 1
    assert eight["bytes_per_token"] < one["bytes_per_token"] / 4  # the weights' trip shared by eight tokens
    assert eight["distances_ms"]["memory"] / BATCH < one["distances_ms"]["memory"]
    assert eight["tokens_per_s_total"] > one["tokens_per_s_total"]


def test_a_stored_batched_run_is_planned_at_its_batch(default_lm, store, calibration):
    batched = run_batch(default_lm, store, calibration)
    lone = run_alone(default_lm, store, calibration)
    assert {metrics(r)["batch_mean"] for r in batched} == {BATCH}
    planned, alone = planner.plan_for_run(batched[0], calibration), planner.plan_for_run(lone, calibration)
    assert planned["batch"] == BATCH and alone["batch"] == 1
    assert planned["bytes_per_token"] < alone["bytes_per_token"] / 4
    assert planned["distances_ms"]["memory"] / BATCH < alone["distances_ms"]["memory"]
    # the prediction's bytes per token are the accounting's: a decode token's share of the weights, its own cache
    steps = store.steps(batched[0]["run_id"])
    decode = steps[steps["kind"] == "decode"]
    measured = (decode["weight_bytes"] + decode["kv_read_bytes"] + decode["kv_write_bytes"]).mean()
    assert planned["bytes_per_token"] == pytest.approx(measured, rel=0.1)


def test_the_peak_check_of_a_batched_run_counts_each_forward_whole(default_lm, store, calibration):
    batched = run_batch(default_lm, store, calibration)
    decode = [(lambda s: s[s["kind"] == "decode"].set_index("step"))(store.steps(r["run_id"])) for r in batched]
    assert all(set(d["batch"]) == {BATCH} for d in decode)
    # the eight decode in lockstep: step i of every run is one forward, which moved the weights once (each row
    # holds an eighth of them) and every sequence's own cache
    whole = sum(d["weight_bytes"] + d["kv_read_bytes"] + d["kv_write_bytes"] for d in decode)
    roofline = sum(d["roofline_ms"] for d in decode)
    for run, own in zip(batched, decode):
        forward_ms = own["forward_ms"].sum()
        assert metrics(run)["peak_check"]["gbps"] == pytest.approx(whole.sum() / (forward_ms / 1e3) / 1e9, rel=1e-6)
        assert metrics(run)["roofline_ratio_decode"] == pytest.approx(roofline.sum() / forward_ms, rel=1e-3)
    # a calibrated peak below what the batch moves, but above a sequence's share of it (an eighth), is caught;
    # a sixth of the first batch's rate leaves room for the second batch to run several times slower on a busy machine
    rate = min(metrics(r)["peak_check"]["gbps"] for r in batched)
    low = {**calibration, "memory_gbps": rate / 6, "version": hardware.CALIBRATION_VERSION}
    low.pop("suspect", None)
    store.save_calibration(low["device_key"], low)
    caught = run_batch(default_lm, store, low)
    assert all(metrics(r)["peak_check"]["beyond_peak"] for r in caught)
    verdict = hardware.calibration_verdict(store, low["device_key"])
    assert not verdict.trustworthy and "moved more bytes per second than its peak" in verdict.headline
