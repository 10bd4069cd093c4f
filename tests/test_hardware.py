"""Device facts, calibration and telemetry on this machine (no GPU here: a normal state)."""
import json
import subprocess
import sys
from pathlib import Path

import torch

from engine import hardware
from engine.generate import Generation, GenConfig

REPO = Path(__file__).resolve().parent.parent


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


def test_calibrate_command_json_is_quick(tmp_path):
    out = subprocess.run([sys.executable, "-m", "engine", "calibrate", "--json", "--db", str(tmp_path / "c.duckdb")],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["calibration"]["seconds"] < 15
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
