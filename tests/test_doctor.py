"""python -m engine doctor on the CPU: every switch runs with the default model and gives a rate, the
store reads back each run, and a device this machine lacks is one sentence with exit code 2."""
import json

import pytest
import torch

from engine.cli.doctor import telemetry_checks
from engine.measure.energy import counters_for
from engine.switches.quant import LEVELS, available_levels
from commands import run_engine


def doctor(*args):
    return run_engine("doctor", *args, timeout=1700)


def test_the_doctor_runs_every_switch_on_the_cpu_and_reads_each_run_back():
    out = doctor("--device", "cpu", "--tokens", "4", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    here = available_levels(torch.device("cpu"))
    switches = [f"weights {name}" for name in here] + ["KV cache off", "sparsity 0.5 mask", "sparsity 0.5 skip",
                                                        "speculative prompt-lookup"]
    for name in switches:
        assert checks[name]["status"] == "ok" and checks[name]["tokens_per_s"] > 0, checks[name]
    for name in set(LEVELS) - set(here):
        assert checks[f"weights {name}"]["status"] == "not here" and checks[f"weights {name}"]["detail"]
    assert checks["sparsity 0.5 2:4"]["status"] == "not here"  # 2:4 runs on CUDA only
    assert checks["store"]["status"] == "ok" and f"{len(switches)} of {len(switches)} runs" in checks["store"]["detail"]
    assert checks["C++ kernels"]["status"] == "ok" and checks["telemetry: psutil"]["status"] == "ok"
    assert checks["calibration"]["status"] == "ok" and "fixed" in checks["calibration"]["detail"]
    assert checks["energy"]["status"] in ("ok", "not here") and checks["energy"]["detail"]


def test_the_doctor_says_whether_a_runs_energy_can_be_measured_here():
    """The counters a CPU run reads: their joules and watts where this machine exposes them, else the reason."""
    energy = {c.name: c for c in telemetry_checks(torch.device("cpu"))}["energy"]
    counters, reason = counters_for(torch.device("cpu"))
    if counters:
        assert energy.status == "ok" and counters[0].name in energy.detail and " W)" in energy.detail
    else:
        assert energy.status == "not here" and energy.detail == reason and "powercap" in energy.fix


@pytest.mark.parametrize("device, sentence", [
    ("tpu", "argument --device: invalid choice"),
    pytest.param("cuda", "no CUDA GPU is visible", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has CUDA")),
])
def test_a_device_this_machine_lacks_is_one_sentence_and_exit_code_2(device, sentence):
    out = doctor("--device", device)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("error: ") and sentence in out.stderr and out.stderr.count("\n") == 1


def test_a_ctrl_c_a_library_turned_into_its_error_ends_the_doctor_as_an_interrupt(store, calibration):
    """DuckDB ends its query with "Query interrupted" when Ctrl-C lands in it: the doctor stops as interrupted
    rather than reporting the switch it was running as failed."""
    from engine.cli import doctor, interrupts
    from engine.spec import GenConfig

    def interrupted():
        raise RuntimeError("Query interrupted")

    interrupts.interrupted.clear()  # as a command starts
    assert doctor._timed_run("fp32", GenConfig("hi"), interrupted, store, calibration).status == "failed"
    interrupts.interrupted.set()
    try:
        with pytest.raises(KeyboardInterrupt):
            doctor._timed_run("fp32", GenConfig("hi"), interrupted, store, calibration)
    finally:
        interrupts.interrupted.clear()
