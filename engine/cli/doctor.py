"""python -m engine doctor: the first command on a new machine. Runs every switch briefly with the
default model on one device and checks telemetry, the energy counters, the C++ kernels, the store and the
calibration.

It prints one table: what works, how fast (decode tokens per second over a few tokens: a sign of
life, not a benchmark), and what to install or do for what does not. Exit code 1 when a check failed."""
from __future__ import annotations

import json
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.cli.interrupts import caused_by_interrupt, interrupt_once
from engine.errors import UserError, first_line

DEVICES = ("auto", "cpu", "cuda", "mps")
PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
SPECULATIVE = "prompt-lookup"  # drafts from the prompt: no second model to load
SPARSITY = 0.5


@dataclass
class Check:
    """One row of the table. status: ok; not here (this device or install lacks it; `fix` says what
    to do); failed (something that should work broke)."""

    name: str
    status: str
    tokens_per_s: float | None = None
    detail: str = ""
    fix: str = ""
    seconds: float = 0.0  # the check's own time, loading and converting the model included


def timed(check):
    """Run one check function and set the seconds it took."""
    start = time.perf_counter()
    result = check()
    result.seconds = time.perf_counter() - start
    return result


def _timed_run(name: str, gen, make_model, store, calibration) -> Check:
    """A few tokens of one generation config on the model `make_model` makes, recorded in the temporary store."""
    from engine.run.generate import Generation

    try:
        result = Generation(make_model(), gen, store=store, calibration=calibration, telemetry=False).run()
    except Exception as exc:
        _interrupted_by(exc)
        if isinstance(exc, UserError):
            return Check(name, "not here", detail=first_line(exc, 200))
        # a switch that should run here broke: report it and go on to the next
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return Check(name, "failed", detail=f"{first_line(exc, 200)} ({Path(where.filename).name}:{where.lineno})")
    if result["status"] != "ok":
        return Check(name, "failed", detail=f"the run ended with status {result['status']}: {result['error']}")
    rate = result["decode_tokens_per_s"] or result["tokens_per_s"]
    return Check(name, "ok", rate, f"{result['n_new_tokens']} tokens, {result['text'][:24]!r}")


def brief_sparse_model(spec):
    """The spec's sparse model with its thresholds calibrated on the doctor's prompt: a first sparse run
    calibrates on the whole calibration text, twice through every layer, most of a minute on a CPU."""
    from engine.run.prepare import base_model
    from engine.switches import sparsity

    base = base_model(spec)
    sparsity.check(base, spec.sparsity, spec.sparsity_mode)
    thresholds = sparsity.calibrate_thresholds(base, spec.sparsity, text=PROMPT)
    return sparsity.sparsify(base, spec.sparsity, spec.sparsity_mode, thresholds)


def switch_checks(device, tokens: int, store, calibration) -> list[Check]:
    """Every weight level, the KV cache off, each sparsity mode and one speculative method."""
    from engine.run.prepare import prepare
    from engine.spec import GenConfig, RunSpec
    from engine.switches.quant import LEVELS
    from engine.switches.sparsity import MODES

    def spec(**settings) -> RunSpec:
        gen = {k: settings.pop(k) for k in ("kv_cache", "speculative") if k in settings}
        return RunSpec(gen=GenConfig(PROMPT, max_new_tokens=tokens, raw=True, **gen), device=str(device), **settings)

    runs = [(f"weights {name}", spec(weights=name)) for name in LEVELS]
    runs.append(("KV cache off", spec(kv_cache=False)))
    runs += [(f"sparsity {SPARSITY:g} {mode}", spec(sparsity=SPARSITY, sparsity_mode=mode)) for mode in (*MODES, "2:4")]
    runs.append((f"speculative {SPECULATIVE}", spec(speculative=SPECULATIVE)))

    def maker(s: RunSpec):
        brief = s.sparsity and s.sparsity_mode in MODES
        return (lambda: brief_sparse_model(s)) if brief else (lambda: prepare(s, store))
    return [timed(lambda: _timed_run(name, s.gen, maker(s), store, calibration)) for name, s in runs]


def kernel_check(device) -> Check:
    from engine.model import cpu_kernels

    if device.type != "cpu":
        return Check("C++ kernels", "not here", detail=f"CPU kernels; runs on {device.type} use PyTorch's")
    state = cpu_kernels.prepare()
    if state == "ready":
        return Check("C++ kernels", "ok", detail=str(cpu_kernels.build_directory()))
    return Check("C++ kernels", "not here", detail=state.removeprefix("unavailable: "),
                 fix="a C++ compiler (apt-get install g++) and ninja (pip install ninja); runs use PyTorch meanwhile")


ENERGY_FIX = ("on the CPU, read access to /sys/class/powercap/intel-rapl:*/energy_uj (root only by default); on "
              "CUDA, an NVIDIA GPU of Volta or newer with its driver; runs store no energy meanwhile")


def energy_check(reading: dict, seconds: float) -> Check:
    """Whether a run's energy can be measured here: what the counters read over a few tenths of a second."""
    if reading["energy_j"] is None:
        return Check("energy", "not here", detail=reading["energy_note"], fix=ENERGY_FIX)
    return Check("energy", "ok", detail=f"{reading['energy_source']}: {reading['energy_j']:.2f} J over {seconds:.1f} s "
                                        f"({reading['energy_j'] / seconds:.1f} W)")


def telemetry_checks(device) -> list[Check]:
    """psutil's CPU and memory readings always; NVML's GPU readings on CUDA; the energy counters a run reads."""
    from engine.measure.energy import EnergyMeter
    from engine.measure.hardware import TelemetrySampler, gpu_facts

    meter, start = EnergyMeter(device), time.perf_counter()
    with TelemetrySampler(device, interval_s=0.1) as sampler:
        time.sleep(0.6)
    energy = energy_check(meter.stop(), time.perf_counter() - start)
    rows = sampler.samples
    cpu = [r["cpu_percent"] for r in rows if r["cpu_percent"] is not None]
    checks = [Check("telemetry: psutil", "ok" if cpu else "failed",
                    detail=f"{len(rows)} samples, CPU {max(cpu):.0f}% busy at most" if cpu
                    else f"{len(rows)} samples without a CPU reading")]
    if device.type == "cuda":
        gpu = [r["gpu_util_percent"] for r in rows if r["gpu_util_percent"] is not None]
        facts = gpu_facts()
        checks.append(Check("telemetry: NVML", "ok", detail=f"{facts['gpus'][0]['name']}, {len(gpu)} samples")
                      if gpu and facts["available"] else
                      Check("telemetry: NVML", "not here", detail=facts["reason"] or "no GPU readings",
                            fix="nvidia-ml-py (pip) and the NVIDIA driver"))
    return checks + [energy]


def calibration_check(device) -> tuple[Check, dict]:
    """The calibration runs here are attributed with, and the check saying where it came from: the
    fixed one $TOKENPATH_CALIBRATION names, the one the default store holds, or a quick reading."""
    from engine.measure import hardware
    from engine.paths import default_db_path
    from engine.store.db import Store

    fixed = hardware.fixed_calibration(device)
    if fixed:
        return Check("calibration", "ok", detail=f"fixed, from ${hardware.FIXED_CALIBRATION_ENV}"), fixed
    key = hardware.device_key(device)
    if default_db_path().exists():
        try:
            stored = hardware.choose_calibration(hardware.recent_calibrations(Store(default_db_path()), key))
        except UserError as exc:
            return Check("calibration", "failed", detail=first_line(exc, 200)), _quick_calibration(device)
        if stored:
            return Check("calibration", "ok", detail=f"stored {stored['created_at']}: {stored['memory_gbps']:.1f} GB/s, "
                                                      f"{stored['matmul_gflops']['float32']:.0f} GFLOP/s fp32"), stored
    quick = _quick_calibration(device)
    return Check("calibration", "not here",
                 detail=f"none stored for {key}; a quick reading: {quick['memory_gbps']:.1f} GB/s, "
                        f"{quick['matmul_gflops']['float32']:.0f} GFLOP/s fp32",
                 fix="python -m engine calibrate (minutes, on a quiet machine)"), quick


def _quick_calibration(device) -> dict:
    """One memory reading and one matmul, enough to attribute the doctor's own runs."""
    import torch

    from engine.measure import hardware

    return {"version": hardware.CALIBRATION_VERSION, "device_key": hardware.device_key(device),
            "memory_gbps": hardware.measure_gemv_bandwidth(device), "memory_method": "gemv",
            "matmul_gflops": {"float32": hardware.measure_matmul_flops(device, torch.float32)}}


def _interrupted_by(exc: Exception) -> None:
    """A Ctrl-C that a library turned into its own error (DuckDB's "Query interrupted", a run's write cut short)
    ends the doctor as the interrupt it was, rather than as a check that failed."""
    if caused_by_interrupt(exc):
        raise KeyboardInterrupt from exc


def store_check(store, runs: int) -> Check:
    import duckdb

    try:
        recorded = len(store.runs(runs + 1))
    except Exception as exc:
        _interrupted_by(exc)
        return Check("store", "failed", detail=first_line(exc, 200))
    status = "ok" if recorded == runs else "failed"
    return Check("store", status, detail=f"DuckDB {duckdb.__version__}: {recorded} of {runs} runs read back")


def diagnose(device, tokens: int) -> list[Check]:
    from engine.store.db import Store

    checks = [timed(lambda: kernel_check(device)), *telemetry_checks(device)]
    start = time.perf_counter()
    calibration, chosen = calibration_check(device)
    calibration.seconds = time.perf_counter() - start
    checks.append(calibration)
    with tempfile.TemporaryDirectory(prefix="tokenpath-doctor-") as folder:
        store = Store(Path(folder) / "doctor.duckdb")
        switches = switch_checks(device, tokens, store, chosen)
        checks.append(store_check(store, sum(c.status == "ok" for c in switches)))
    return checks + switches


def table(checks: list[Check]) -> str:
    rows = [("check", "status", "tokens/s", "seconds", "detail")]
    rows += [(c.name, c.status, f"{c.tokens_per_s:.1f}" if c.tokens_per_s else "", f"{c.seconds:.1f}",
              c.detail + (f"; to fix: {c.fix}" if c.fix else "")) for c in checks]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join(f"{a:<{widths[0]}}  {b:<{widths[1]}}  {t:>{widths[2]}}  {s:>{widths[3]}}  {d}"
                     for a, b, t, s, d in rows)


def cmd_doctor(args) -> int:
    from engine.model.loader import pick_device

    if not 1 <= args.tokens <= 64:
        raise UserError(f"--tokens is a number of tokens from 1 to 64, not {args.tokens}.")
    device = pick_device(args.device)
    interrupt_once()  # a Ctrl-C is noted, so that an error a library makes of it is known for it
    start = time.perf_counter()
    checks = diagnose(device, args.tokens)
    seconds = time.perf_counter() - start
    failed = [c.name for c in checks if c.status == "failed"]
    if args.json:
        print(json.dumps({"device": str(device), "seconds": seconds, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        print(table(checks))
        print(f"\n{device}, default model, {args.tokens} tokens per switch, {seconds:.0f} s"
              + (f"; failed: {', '.join(failed)}" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


def add_parser(sub) -> None:
    d = sub.add_parser("doctor", help="run every switch briefly and check telemetry, kernels, store and calibration")
    d.add_argument("--device", default="auto", choices=DEVICES)
    d.add_argument("--tokens", type=int, default=8, help="tokens per switch (1 to 64)")
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.set_defaults(func=cmd_doctor)
