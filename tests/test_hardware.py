"""Device facts, calibration and telemetry on this machine (no GPU here: a normal state)."""
import json
import math
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

import pytest
import torch

from engine.paths import CACHE_ENV
from engine.measure import hardware
from engine.run.generate import Generation, GenConfig
from engine.store.db import Store
from commands import run_engine


def test_no_gpu_is_reported_not_raised():
    facts = hardware.gpu_facts()
    if not torch.cuda.is_available():
        assert facts["available"] is False and facts["reason"] and facts["gpus"] == []


def test_cpu_facts_are_real():
    facts = hardware.cpu_facts()
    assert facts["logical_cores"] >= 1 and facts["ram_bytes"] > 2**30 and facts["torch_threads"] >= 1


def test_pcie_bandwidth_from_generation_and_width():
    assert hardware.pcie_bandwidth_gbps(4, 16) == 1.969 * 16
    assert hardware.pcie_bandwidth_gbps(None, 16) is None


def test_calibration_is_stored_and_reused(store, calibration):
    device = torch.device("cpu")
    first = hardware.calibration_for(device, store)
    assert first["memory_gbps"] > 0 and first["matmul_gflops"]["float32"] > 0 and first["dispatch_us"] > 0
    again = hardware.calibration_for(device, store)
    assert again["memory_gbps"] == first["memory_gbps"] and "created_at" in again


def test_calibrate_command_prints_the_stored_calibration_as_json(tmp_path):
    out = run_engine("calibrate", "--json", "--db", tmp_path / "c.duckdb", timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["calibration"]["memory_gbps"] > 0 and result["calibration"]["seconds"] > 0
    assert result["hardware"]["gpu"]["available"] in (True, False)


def test_telemetry_is_sampled_and_stored_with_the_run(tiny_lm, calibration, store):
    gen = Generation(tiny_lm, GenConfig("Tell me", raw=True, max_new_tokens=400, ignore_eos=True), store=store,
                     calibration=calibration)
    gen.run()
    rows = store.telemetry(gen.run_id)
    if gen.result["total_ms"] > 300:
        assert len(rows) >= 2
        assert (rows["rss_bytes"] > 0).all()
        assert rows["t_ms"].is_monotonic_increasing


def scaled(calibration, factor):
    """The real calibration with its bandwidth and peaks scaled, as a busier or quieter machine reads."""
    return {**calibration, "memory_gbps": calibration["memory_gbps"] * factor,
            "matmul_gflops": {k: v * factor for k, v in calibration["matmul_gflops"].items()}}


def test_a_calibration_far_below_the_recent_ones_is_flagged_stored_and_not_used(store, calibration):
    key = calibration["device_key"]
    for factor in (1.0, 1.05, 0.97):
        store.save_calibration(key, scaled(calibration, factor))
    loaded = scaled(calibration, 0.35)
    flag = hardware.disagreement(loaded, hardware.recent_calibrations(store, key))
    assert flag and "35%" in flag and "median of the 3 previous" in flag
    store.save_calibration(key, {**loaded, "suspect": flag})
    recent = hardware.recent_calibrations(store, key)
    assert recent[0]["suspect"] == flag  # the flag is stored with it
    used = hardware.calibration_for(torch.device("cpu"), store)
    assert used["memory_gbps"] == scaled(calibration, 0.97)["memory_gbps"] and "suspect" not in used
    assert hardware.disagreement(scaled(calibration, 0.9), recent) is None  # ordinary wander is not flagged


def test_a_low_first_calibration_gives_way_to_a_later_higher_one(store, calibration):
    key = calibration["device_key"]
    store.save_calibration(key, scaled(calibration, 0.4))
    store.save_calibration(key, scaled(calibration, 1.0))
    assert hardware.disagreement(scaled(calibration, 1.0), hardware.recent_calibrations(store, key)[1:]) is None
    assert hardware.calibration_for(torch.device("cpu"), store)["memory_gbps"] == calibration["memory_gbps"]


def test_a_flagged_calibration_alone_is_used_and_says_so(store, calibration):
    store.save_calibration(calibration["device_key"], {**scaled(calibration, 0.3), "suspect": "Its memory ..."})
    used = hardware.calibration_for(torch.device("cpu"), store)
    assert used["suspect"] == "Its memory ..."


def test_a_run_names_the_calibration_it_was_attributed_with(tiny_lm, store, calibration):
    store.save_calibration(calibration["device_key"], calibration)
    gen = Generation(tiny_lm, GenConfig("Hi", raw=True, max_new_tokens=3, ignore_eos=True), store=store)
    gen.run()
    found = hardware.find_calibration(store, json.loads(store.run(gen.run_id)["metrics"])["calibration"])
    assert found is not None and found["memory_gbps"] == calibration["memory_gbps"] and "created_at" in found


def test_telemetry_counts_from_its_start_and_never_reports_an_unmeasured_cpu_share():
    import time

    sampler = hardware.TelemetrySampler(torch.device("cpu"))
    first = sampler.sample()
    assert first["cpu_percent"] is None  # no interval yet to measure a share over (never a fake 0%)
    assert 0 <= first["t_ms"] < 60_000  # since the sampler started, not since boot
    other = hardware.TelemetrySampler(torch.device("cpu"))
    time.sleep(0.3)
    other.sample()  # another sampler's reading does not shorten this one's interval
    later = sampler.sample()
    assert later["cpu_percent"] is not None and 0 <= later["cpu_percent"] <= 100
    assert later["t_ms"] >= 300


def test_a_sampler_stopped_before_its_thread_started_raises_nothing():
    # a Ctrl-C or SIGTERM inside __enter__'s start() leaves the run's cleanup to stop a thread that never said it ran
    sampler = hardware.TelemetrySampler(torch.device("cpu"))
    sampler.__exit__(KeyboardInterrupt, KeyboardInterrupt(), None)
    assert sampler.samples == []
    with hardware.TelemetrySampler(torch.device("cpu"), interval_s=0.01) as running:
        time.sleep(0.1)
    assert not running._thread.is_alive()


def test_the_memory_and_matmul_peaks_are_the_best_of_their_methods(calibration):
    methods = calibration["memory_methods_gbps"]
    assert {"gemv", "stream_sum", "copy"} <= set(methods)
    assert all(calibration["memory_gbps"] >= v > 0 for v in methods.values())
    assert methods[calibration["memory_method"]] == calibration["memory_gbps"]
    for dtype, shapes in calibration["matmul_shapes_gflops"].items():
        assert all(calibration["matmul_gflops"][dtype] >= v > 0 for v in shapes.values())
        assert shapes[calibration["matmul_shape"][dtype]] == calibration["matmul_gflops"][dtype]


def test_a_pass_of_the_peak_s_kernel_reads_every_cold_weight_once():
    from engine.model.cpu_kernels import has_small_rows_kernel

    one_pass = hardware.small_rows_pass(torch.device("cpu"))
    if not has_small_rows_kernel():
        assert one_pass is None
        return
    for _ in range(2):
        read, seconds = one_pass()
        assert read == hardware._weights_budget_bytes(torch.device("cpu")) and seconds > 0


def test_the_peak_check_flags_only_what_beats_the_peak_beyond_noise():
    peak = {"memory_gbps": 10.0, "memory_method": "copy"}
    within = hardware.peak_check(10.4e9, 1.0, peak)
    assert within["beyond_peak"] is None and abs(within["peak_fraction"] - 1.04) < 1e-9
    beyond = hardware.peak_check(12e9, 1.0, peak)
    assert beyond["gbps"] == 12.0 and "120% of the calibrated peak of 10.0 GB/s (copy)" in beyond["beyond_peak"]


def test_a_forward_whose_bytes_fit_the_cache_is_checked_against_the_cache_s_rate():
    """Each decode step reads the same weights: where a forward's bytes fit the share of the last-level cache the
    calibration read again and again, they come from there, faster than memory's peak."""
    calibration = {"memory_gbps": 30.0, "memory_method": "gemv", "matmul_gflops": {"float32": 100.0},
                   "cache_read": {"bytes": 150e6, "gbps": 60.0, "matvec_call_us": 3.0, "cache_bytes": 300e6}}
    assert hardware.read_peak(calibration, 100e6)[0] == 60.0
    assert hardware.read_peak(calibration, 200e6) == (30.0, "gemv")
    assert hardware.read_peak({k: v for k, v in calibration.items() if k != "cache_read"}, 100e6)[0] == 30.0
    fits = hardware.peak_check(50e9, 1.0, calibration, working_set=100e6)
    assert fits["beyond_peak"] is None and fits["peak_fraction"] == pytest.approx(50 / 60)
    beyond = hardware.peak_check(50e9, 1.0, calibration, working_set=200e6)
    assert "167% of the calibrated peak of 30.0 GB/s (gemv)" in beyond["beyond_peak"]
    assert hardware.roofline(calibration, torch.float32, 100e6).memory_gbps == 60.0
    # an integer level multiplies at the best rate its own kernels were timed at, not at the float matmul peak
    timed = {**calibration, "prefill_gflops": {"float32": {"16": 80.0}, "int4-dyn": {"16": 500.0, "128": 700.0}}}
    assert hardware.roofline(timed, torch.float32, 100e6, "int4-dyn").peak_gflops == 700.0
    assert hardware.roofline(timed, torch.float32, 100e6, "int8-dyn").peak_gflops == 100.0
    assert hardware.roofline(timed, torch.float32, 100e6).peak_gflops == 100.0


def test_the_cache_s_read_rate_is_measured_on_weights_that_fit_it():
    cache = hardware.last_level_cache_bytes()
    measured = hardware.measure_cache_read(torch.device("cpu"))
    if cache is None or measured is None:
        pytest.skip("this machine reports no CPU cache, or the kernels are not built")
    assert 0 < measured["bytes"] <= cache * hardware.CACHE_SHARE and measured["cache_bytes"] == cache
    assert measured["gbps"] > 0 and measured["matvec_call_us"] >= 0
    assert measured["bytes"] < measured["whole"]["bytes"] <= cache and measured["whole"]["gbps"] > 0
    rows = hardware.cache_read_rows({"cache_read": measured})
    assert len(rows) == 2 and all(figure.endswith(" GB/s") for _, figure in rows)


def test_bytes_between_half_the_cache_and_all_of_it_are_read_at_the_rate_between_its_two_reads():
    """Past the share of the cache the calibration read, more of a step's bytes are evicted by the other work the
    cache serves: the rate falls along the line to the one measured over the whole cache, and is memory's beyond it
    or where that line falls below memory's peak."""
    whole = {"bytes": 300e6, "gbps": 40.0}
    calibration = {"memory_gbps": 30.0, "memory_method": "gemv",
                   "cache_read": {"bytes": 150e6, "gbps": 60.0, "matvec_call_us": 3.0, "cache_bytes": 300e6,
                                  "whole": whole}}
    assert hardware.read_peak(calibration, 150e6)[0] == 60.0
    assert hardware.read_peak(calibration, 200e6)[0] == pytest.approx(60.0 - 20.0 / 3)
    assert hardware.read_peak(calibration, 300e6)[0] == pytest.approx(40.0)
    assert hardware.read_peak(calibration, 301e6) == (30.0, "gemv")
    below = {**calibration, "cache_read": {**calibration["cache_read"], "whole": {**whole, "gbps": 20.0}}}
    assert hardware.read_peak(below, 250e6)[0] == pytest.approx(60.0 - 40.0 * 2 / 3)
    assert hardware.read_peak(below, 290e6) == (30.0, "gemv")


def test_the_integer_levels_products_are_timed_through_their_own_layers():
    levels = hardware.integer_levels_here(torch.device("cpu"))
    if not levels:
        pytest.skip("the project's kernels are not built here")
    for level in levels:
        figures = hardware.measure_prefill_products(torch.device("cpu"), [(64, 96), (96, 64)], rows=(4, 32),
                                                    level=level)
        assert set(figures) == {"4", "32"} and all(v > 0 for v in figures.values())


def test_a_run_faster_than_the_given_peak_is_flagged_in_its_stored_metrics(tiny_lm, store, calibration):
    def run(peak_gbps):
        cfg = GenConfig("Hi", raw=True, max_new_tokens=4, ignore_eos=True)
        rates = {"memory_gbps": peak_gbps, "cache_read": {**calibration["cache_read"], "gbps": peak_gbps}}
        gen = Generation(tiny_lm, cfg, store=store, calibration={**calibration, **rates})
        gen.run()
        return json.loads(store.run(gen.run_id)["metrics"])["peak_check"]

    low = run(1e-9)  # any real decode moves more than a byte per second
    assert low["beyond_peak"] and low["gbps"] > 0 and low["peak_fraction"] > 1
    high = run(1e9)
    assert high["beyond_peak"] is None and 0 < high["peak_fraction"] < 1


@pytest.fixture
def machine_cache(tmp_path, monkeypatch):
    """An empty calibration cache of the machine's own, and no fixed calibration: the process then
    attributes runs as a user's dashboard does."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(hardware.FIXED_CALIBRATION_ENV, raising=False)
    monkeypatch.setattr(hardware, "_session_calibrations", {})
    return tmp_path / "cache"


def measured(calibration, days_ago=0.0, other_work_share=0.02):
    """A calibration as the cache keeps one: when it was measured, and the share of the cores other work took
    meanwhile (its check whether the machine was quiet)."""
    when = datetime.now(timezone.utc).replace(tzinfo=None) - timedelta(days=days_ago)
    return {**calibration, "measured_at": when.isoformat(timespec="seconds"), "other_work_share": other_work_share}


def test_a_fresh_database_reuses_a_recent_calibration_of_this_machine_and_the_verdict_says_so(machine_cache, store,
                                                                                               calibration):
    device = torch.device("cpu")
    hardware.remember_calibration(device, measured(calibration, days_ago=2))
    used = hardware.calibration_for(device, store, measure=False)
    assert used["memory_gbps"] == calibration["memory_gbps"]
    assert used["reused_from"] == str(machine_cache / "calibrations.json")
    stored = hardware.recent_calibrations(store, hardware.device_key(device))
    assert len(stored) == 1 and stored[0]["reused_from"] == used["reused_from"]  # the database keeps its origin
    verdict = hardware.calibration_verdict(store, hardware.device_key(device))
    assert verdict.trustworthy and "(2 days ago) on this machine for another database, reused from its " \
        "calibration cache" in verdict.why
    assert hardware.calibration_for(device, store)["memory_gbps"] == calibration["memory_gbps"]  # nothing measured


def test_a_cached_calibration_of_another_machine_a_stale_one_or_a_flagged_one_is_not_reused(machine_cache, store,
                                                                                          calibration):
    device = torch.device("cpu")
    other = {"cpu:Another CPU:64threads|128 logical cores|torch 2.0|v3": [measured(calibration)],
             hardware.machine_key(device).replace("torch ", "torch 0."): [measured(calibration)]}
    machine_cache.mkdir()
    (machine_cache / "calibrations.json").write_text(json.dumps(other))
    assert hardware.calibration_for(device, store, measure=False) is None
    hardware.remember_calibration(device, measured(calibration, days_ago=31))
    assert hardware.calibration_for(device, store, measure=False) is None
    hardware.remember_calibration(device, {**measured(calibration), "suspect": "Its memory bandwidth ..."})
    assert hardware.calibration_for(device, store, measure=False) is None
    hardware.remember_calibration(device, measured(calibration, other_work_share=0.4))  # its check: busy
    assert hardware.calibration_for(device, store, measure=False) is None
    unchecked = measured(calibration)
    del unchecked["other_work_share"]  # cached before calibrations checked the machine
    hardware.remember_calibration(device, unchecked)
    assert hardware.calibration_for(device, store, measure=False) is None
    assert hardware.recent_calibrations(store, hardware.device_key(device)) == []  # nothing stored either


def test_a_calibration_measured_beside_other_work_is_stored_but_never_enters_the_machine_cache(machine_cache, store,
                                                                                                tmp_path):
    device = torch.device("cpu")
    # spinning processes that take twice the quiet share of the cores' time (one on a machine of up to five cores)
    count = math.ceil(2 * hardware.QUIET_OTHER_WORK * (os.cpu_count() or 1))
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(1.0)  # they have started spinning
        results = hardware.calibration_for(device, store, fresh=True)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert results["other_work_share"] > hardware.QUIET_OTHER_WORK and not hardware.measured_quiet(results)
    stored = hardware.recent_calibrations(store, hardware.device_key(device))
    assert [(c["measured_at"], c["other_work_share"]) for c in stored] == \
        [(results["measured_at"], results["other_work_share"])]  # its own database keeps it, with its check
    assert not (machine_cache / "calibrations.json").exists()  # the machine's cache does not
    hardware._session_calibrations.clear()  # as another process finds the machine: nothing to reuse
    assert hardware.calibration_for(device, Store(tmp_path / "another.duckdb"), measure=False) is None


def test_a_calibration_older_than_its_age_limit_is_not_trusted(store, calibration):
    store.save_calibration(calibration["device_key"], measured(calibration, days_ago=45))
    verdict = hardware.calibration_verdict(store, calibration["device_key"])
    assert not verdict.trustworthy and "is 45 days old" in verdict.headline and verdict.action


def test_the_prefill_products_timed_are_the_default_model_s_layers():
    """One layer's products as the engine runs them, over every layer, and the output head make up every
    parameter a token reads but the norms'."""
    from engine.plan import planner

    shapes = hardware.default_layer_shapes()
    model = planner.resolve_model("default")
    products = model.spec.layers * sum(n_in * n_out for n_in, n_out in shapes) + model.vocab * model.hidden
    assert products == pytest.approx(model.read_params(), rel=1e-3)


def test_prefill_products_are_timed_at_each_count_of_rows_through_the_engine_s_linear_module():
    figures = hardware.measure_prefill_products(torch.device("cpu"), [(64, 96), (96, 64)], rows=(4, 32))
    assert set(figures) == {"4", "32"} and all(v > 0 for v in figures.values())


def test_a_stored_calibration_of_an_older_version_is_measured_again(store, calibration):
    """A calibration before the cache's read rate and the integer levels' rates would plan those levels as float
    ones read from memory: it is not read, so the next run measures; a calibration without prefill rates (a
    machine without the default model's folder) plans prefills at the matmul peak."""
    from engine.plan import planner

    key = hardware.device_key(torch.device("cpu"))
    store.save_calibration(key, {**calibration, "version": 4})
    assert hardware.recent_calibrations(store, key) == []
    without = {k: v for k, v in calibration.items() if k != "prefill_gflops"}
    assert planner.local_device(without)["prefill_tflops"] == {}
    assert planner.local_device(calibration)["prefill_tflops"]["fp32"][128] == \
        calibration["prefill_gflops"]["float32"]["128"] / 1e3


def test_the_verdict_reads_the_store_over_one_connection(store, calibration):
    """Pages show the verdict on every rerun, and each connection opens the database file anew."""
    opened = []

    class CountingStore(Store):
        def connect(self):
            opened.append(1)
            return super().connect()

    key = hardware.device_key(torch.device("cpu"))
    store.save_calibration(key, calibration)
    counting = CountingStore(store.path)
    opened.clear()
    verdict = hardware.calibration_verdict(counting, key)
    assert verdict.trustworthy and verdict.calibration["memory_gbps"] == calibration["memory_gbps"]
    assert len(opened) == 1



# a prefill's pattern: tensors of several MB made and freed layer after layer, forward after forward
FORWARDS = """
import os, resource, sys, torch
if sys.argv[1] == "engine":
    import engine
    print(engine.FREED_MEMORY)
def forward():
    x = torch.ones(2944, 576)
    for _ in range(4):
        h = x * 2.0
        up = torch.ones(2944, 3072)
        x = x + (up[:, :1536] * h.sum())[:, :576]
        del h, up
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
forward()
before = faults()
for _ in range(3):
    forward()
print(faults() - before)
"""


def forward_faults(process: str, **env) -> tuple[str, int]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", FORWARDS, process], env={**base, **env}, capture_output=True,
                         text=True, check=True, timeout=300).stdout.splitlines()
    return out[0] if len(out) > 1 else "", int(out[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the allocation policy is glibc's")
def test_an_engine_process_reuses_freed_memory_instead_of_faulting_it_in_again():
    policy, kept = forward_faults("engine")
    _, plain = forward_faults("torch")
    assert policy.startswith("kept for reuse") and kept * 3 < plain, (kept, plain)
    policy, _ = forward_faults("engine", MALLOC_MMAP_THRESHOLD_="131072")  # the user's choice is kept
    assert policy == "glibc's malloc as set in the environment"
