"""Device facts, calibration microbenchmarks and telemetry sampling.

No GPU or no NVIDIA driver is a normal state, reported as such."""
from __future__ import annotations

import json
import os
import platform
import statistics
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import psutil
import torch

from engine import FREED_MEMORY, OPENMP_WAIT, huge_pages
from engine.dtypes import INTEGER_LEVELS, weight_level
from engine.measure.distances import Roofline, cache_read_gbps
from engine.paths import cache_dir

# 2: the memory and matmul peaks are the best of several methods and shapes
# 3: adds the cost of one decode-sized matrix-vector product beyond its bytes
# 4: adds the rate of the default model's layer products at prefill chunk rows
# 5: adds the read rate of weights that stay in the last-level cache and the integer levels' product rates
# 6: adds the read rate of weights as large as the whole last-level cache
# 7: reads the memory peak from buffers on the pages the layers' weights stream from (2 MiB where the kernel gives them)
CALIBRATION_VERSION = 7
# versions still read from a database; an older one is measured again, since without the cache's read rate and the
# integer rates the planner would plan the integer levels as float ones read from memory (5 and 6 read the memory
# peak on 4 KiB pages, a little below what reads on huge pages reach)
READABLE_VERSIONS = (5, 6, 7)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_facts() -> dict:
    return {
        "model": _cpu_model(),
        "physical_cores": psutil.cpu_count(logical=False),
        "logical_cores": psutil.cpu_count(logical=True),
        "torch_threads": torch.get_num_threads(),
        "openmp_wait": OPENMP_WAIT,
        "freed_memory": FREED_MEMORY,
        "huge_pages": huge_pages.describe(),
        "ram_bytes": psutil.virtual_memory().total,
    }


def _nvml():
    """The pynvml module, initialised, or a reason why not."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml, None
    except Exception as exc:  # no driver, no library, no GPU: all normal here
        return None, f"NVML unavailable ({type(exc).__name__}: {str(exc)[:80] or 'no detail'})"


def _nvml_or_none(fn, *args):
    try:
        return fn(*args)
    except Exception:
        return None


def gpu_facts() -> dict:
    nvml, reason = _nvml()
    if nvml is None:
        return {"available": False, "reason": reason, "gpus": []}
    gpus = []
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        mem = nvml.nvmlDeviceGetMemoryInfo(h)
        gen = _nvml_or_none(nvml.nvmlDeviceGetCurrPcieLinkGeneration, h)
        width = _nvml_or_none(nvml.nvmlDeviceGetCurrPcieLinkWidth, h)
        max_gen = _nvml_or_none(nvml.nvmlDeviceGetMaxPcieLinkGeneration, h)
        max_width = _nvml_or_none(nvml.nvmlDeviceGetMaxPcieLinkWidth, h)
        bus_width = _nvml_or_none(nvml.nvmlDeviceGetMemoryBusWidth, h)
        max_mem_clock = _nvml_or_none(nvml.nvmlDeviceGetMaxClockInfo, h, nvml.NVML_CLOCK_MEM)
        nvlinks = 0
        for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
            if _nvml_or_none(nvml.nvmlDeviceGetNvLinkState, h, link) == 1:
                nvlinks += 1
        gpus.append({
            "index": i,
            "name": nvml.nvmlDeviceGetName(h),
            "memory_total_bytes": mem.total,
            "memory_used_bytes": mem.used,
            "pcie_gen": gen, "pcie_width": width, "pcie_max_gen": max_gen, "pcie_max_width": max_width,
            "pcie_bandwidth_gbps": pcie_bandwidth_gbps(gen, width),
            "pcie_max_bandwidth_gbps": pcie_bandwidth_gbps(max_gen, max_width),
            "memory_bus_width_bits": bus_width,
            "memory_max_clock_mhz": max_mem_clock,
            # DDR/HBM transfer data on both clock edges: 2 transfers per clock per bus bit
            "memory_theoretical_gbps": (2 * max_mem_clock * 1e6 * bus_width / 8 / 1e9)
            if bus_width and max_mem_clock else None,
            "nvlink_links_up": nvlinks,
        })
    return {"available": True, "reason": None, "gpus": gpus}


# usable bandwidth per lane per direction in GB/s, after line encoding
_PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


def pcie_bandwidth_gbps(gen: int | None, width: int | None) -> float | None:
    if not gen or not width or gen not in _PCIE_LANE_GBPS:
        return None
    return _PCIE_LANE_GBPS[gen] * width


def hardware_summary(device: torch.device) -> dict:
    facts = {"device": str(device), "torch": torch.__version__, "cpu": cpu_facts(), "gpu": gpu_facts()}
    if device.type == "cuda":
        facts["cuda_device"] = torch.cuda.get_device_name(device)
    return facts


def device_key(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    if device.type == "mps":
        return f"mps:{platform.machine()}"
    return f"cpu:{_cpu_model()}:{torch.get_num_threads()}threads"


# --- calibration -----------------------------------------------------------------------------

def sync(device: torch.device) -> None:
    """Wait for the device to finish queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _pass_seconds(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _best_seconds(fn, device: torch.device, repeats: int) -> float:
    def run():
        fn()
        sync(device)

    run()
    return min(_pass_seconds(run) for _ in range(repeats))


def _weights_budget_bytes(device: torch.device) -> int:
    """Enough distinct weights that they cannot sit in a last-level cache (300 MiB on this CPU's host,
    tens of MB on GPUs), so every pass reads them from main memory."""
    return 1 << 30


def _ones(numel: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A 1-D tensor of ones to read a memory peak from: on the CPU on the pages the layers' weights stream from
    (engine.huge_pages), so that the peak is the one their reads can reach."""
    if device.type != "cpu":
        return torch.ones(numel, device=device, dtype=dtype)
    return huge_pages.empty(numel, dtype).fill_(1)


def _cold_weights(device: torch.device, dtype: torch.dtype, rows: int = 4096, cols: int = 4096) -> list:
    elem = torch.empty((), dtype=dtype).element_size()
    count = max(2, _weights_budget_bytes(device) // (rows * cols * elem))
    return [_ones(rows * cols, device, dtype).view(rows, cols) for _ in range(count)]


def _nbytes(mats: list) -> int:
    return sum(w.nbytes for w in mats)


def _one_pass(mats: list, product, device: torch.device):
    """A function that runs one product per matrix over all of them and waits for the device."""
    x = torch.ones(1, mats[0].shape[1], device=device, dtype=mats[0].dtype)

    def run():
        for w in mats:
            product(x, w)
        sync(device)

    return run


def _pass_gbps(mats: list, product, device: torch.device) -> float:
    """GB/s of one product per matrix over all of them, best of a few passes."""
    return _nbytes(mats) / _best_seconds(_one_pass(mats, product, device), device, repeats=5) / 1e9


def measure_gemv_bandwidth(device: torch.device, dtype: torch.dtype = torch.float32, mats: list | None = None) -> float:
    """GB/s reading cold weights through matrix-vector products, the access pattern of decoding."""
    return _pass_gbps(mats or _cold_weights(device, dtype), torch.nn.functional.linear, device)


def _small_rows_product(device: torch.device):
    """The project's small-rows kernel (the one fp32 decode steps run) as a product (x, w) -> x w^T,
    or None where it does not run here."""
    from engine.model.cpu_kernels import has_small_rows_kernel, optional_kernel

    if device.type != "cpu" or not has_small_rows_kernel():
        return None
    kernel = optional_kernel()
    return lambda x, w: kernel.small_linear(x, w, None)


def measure_small_rows_bandwidth(device: torch.device, mats: list | None = None) -> float | None:
    """GB/s of the small-rows kernel over cold weights, or None where that kernel does not run here."""
    product = _small_rows_product(device)
    return _pass_gbps(mats or _cold_weights(device, torch.float32), product, device) if product else None


def small_rows_pass(device: torch.device):
    """A function that runs the small-rows kernel (the kernel fp32 decode steps run, and the read
    method the memory peak most often comes from on a CPU) once over cold weights and returns that
    pass's (bytes, seconds): a reading of what memory gives at that moment, to set beside each decode
    step, since the best of a few passes at one moment is no measure of the next second on a machine
    whose bandwidth moves. None where that kernel does not run here."""
    product = _small_rows_product(device)
    if product is None:
        return None
    mats = _cold_weights(device, torch.float32)
    run = _one_pass(mats, product, device)
    return lambda: (_nbytes(mats), _pass_seconds(run))


def measure_stream_bandwidth(device: torch.device) -> float:
    """GB/s of a plain streaming read (a sum over a large buffer, on every thread)."""
    buf = _ones(_weights_budget_bytes(device) // 4, device)
    seconds = _best_seconds(lambda: buf.sum(), device, repeats=3)
    return buf.nbytes / seconds / 1e9


def measure_copy_bandwidth(device: torch.device) -> float:
    """GB/s of bytes read plus bytes written by a large copy (STREAM's convention for copy)."""
    src = _ones(_weights_budget_bytes(device) // 8, device)
    dst = _ones(src.numel(), device)
    seconds = _best_seconds(lambda: dst.copy_(src), device, repeats=3)
    return 2 * src.nbytes / seconds / 1e9


def measure_read_bandwidth(device: torch.device) -> dict[str, float]:
    """Every method's read bandwidth in GB/s: the memory peak is the best of them, because a run's
    kernels can stream no faster than the fastest way these cores were seen to."""
    mats = _cold_weights(device, torch.float32)
    methods = {"gemv": measure_gemv_bandwidth(device, mats=mats),
               "small_rows_kernel": measure_small_rows_bandwidth(device, mats=mats)}
    del mats
    methods["stream_sum"] = measure_stream_bandwidth(device)
    methods["copy"] = measure_copy_bandwidth(device)
    return {name: value for name, value in methods.items() if value is not None}


def best_method(figures: dict) -> tuple[str, float]:
    """The method with the highest figure, and that figure."""
    name = max(figures, key=figures.get)
    return name, figures[name]


def _matmul_shapes(device: torch.device) -> list[tuple[int, int, int]]:
    """(M, K, N) products, smallest first: square ones and a prefill-like one (a few hundred rows
    against a wide weight)."""
    if device.type == "cuda":
        return [(4096, 4096, 4096), (2048, 4096, 16384), (8192, 8192, 8192)]
    return [(512, 512, 512), (1024, 1024, 1024), (256, 2048, 4096), (2048, 2048, 2048)]


# A shape whose measurement would take longer than this at the best rate seen so far is skipped: a
# dtype without fast units here (bf16 on a CPU without AVX-512 BF16) runs at a fraction of a GFLOP/s.
MATMUL_BUDGET_S = 2.0
_MATMUL_REPEATS = 3


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int] | None = None) -> float:
    """GFLOP/s of one matmul shape (M, K, N) at this dtype (square 1024 or 4096 when not given)."""
    m, k, n = shape or ((4096,) * 3 if device.type == "cuda" else (1024,) * 3)
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    seconds = _best_seconds(lambda: a @ b, device, repeats=_MATMUL_REPEATS)
    return 2 * m * k * n / seconds / 1e9


def measure_matmul_peak(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """GFLOP/s of each shape of _matmul_shapes that fits MATMUL_BUDGET_S, keyed "MxKxN" (the first
    always runs); the peak is the best of them."""
    figures: dict[str, float] = {}
    for shape in _matmul_shapes(device):
        flops = 2 * shape[0] * shape[1] * shape[2]
        if figures and (_MATMUL_REPEATS + 1) * flops / (max(figures.values()) * 1e9) > MATMUL_BUDGET_S:
            continue
        figures["x".join(map(str, shape))] = measure_matmul_flops(device, dtype, shape)
    return figures


# rows of the prefill chunks whose products are timed (the rate levels off by 128 rows: the planner takes that
# figure for larger chunks)
PREFILL_ROWS = (16, 32, 64, 128)
# a pass takes milliseconds, and two threads sharing cores with other work meet in step only now and then
PREFILL_ROUNDS = 20


def default_layer_shapes() -> list[tuple[int, int]] | None:
    """(inputs, outputs) of one decoder layer's products in the default model as the engine runs them (fused
    q/k/v, attention output, fused gate/up, down), from its config; None where the model is not here yet."""
    from engine.paths import DEFAULT_MODEL_NAME, models_dir

    try:
        config = json.loads((models_dir() / DEFAULT_MODEL_NAME / "config.json").read_text())
    except (OSError, ValueError):
        return None
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    return [(hidden, (heads + 2 * kv_heads) * head_dim), (heads * head_dim, hidden), (hidden, 2 * inner),
            (inner, hidden)]


def measure_prefill_products(device: torch.device, shapes: list[tuple[int, int]],
                             rows: tuple[int, ...] = PREFILL_ROWS, level: str = "fp32") -> dict[str, float]:
    """GFLOP/s of one layer's products (`shapes`, as (inputs, outputs)) at a weight level over a prefill chunk
    of each count of rows, keyed by the rows, on the threads torch is set to. The products run through the
    engine's own modules (float32: LeanLinear, the project's kernel up to a few rows, PyTorch's GEMM beyond; an
    integer level: its quantized layer), so the figures follow what a prefill runs. One layer's weights stay in
    the caches between its products, as a prefill reads each weight once for all its rows: the weights' trip
    from memory is the memory bucket's. Each round times every count of rows once and each keeps its best
    round, so a quiet moment of a busy machine serves them all alike."""
    from engine.model.lean import LeanLinear

    layers = [LeanLinear(n_in, n_out, bias=False, device=device).requires_grad_(False) for n_in, n_out in shapes]
    if level != "fp32":
        layers = [quantized_layer(layer, level) for layer in layers]
    passes = {n: _layer_pass(layers, n, device) for n in rows}
    best = {n: float("inf") for n in rows}
    with torch.no_grad():
        for run in passes.values():
            run()  # first touches
        for _ in range(PREFILL_ROUNDS):
            for n, run in passes.items():
                best[n] = min(best[n], _pass_seconds(run))
    return {str(n): 2 * n * sum(a * b for a, b in shapes) / best[n] / 1e9 for n in rows}


def quantized_layer(linear: torch.nn.Linear, level: str) -> torch.nn.Module:
    """The layer an integer level makes of a linear one (int8-dyn without SmoothQuant's factors, which change
    the weights' values, not the work)."""
    from engine.switches.qlinear import Int4DynamicLinear, Int8DynamicLinear

    return {"int4-dyn": Int4DynamicLinear, "int8-dyn": Int8DynamicLinear}[level](linear)


def integer_levels_here(device: torch.device) -> tuple[str, ...]:
    """The integer levels whose products the calibration times here (at prefill rows, as the float32 ones): where
    the project's kernels are built, which multiply them at a rate no float matmul gives."""
    from engine.model.cpu_kernels import has_small_rows_kernel

    return INTEGER_LEVELS if device.type == "cpu" and has_small_rows_kernel() else ()


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache this machine reports (Linux's sysfs), or None where it reports none."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = entry.read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes) if sizes else None


# Weights read again and again from at most this share of the last-level cache stay in it: the rest is left to
# the other work the cache serves (other processes, and on a shared host other machines).
CACHE_SHARE = 0.5
CACHE_MATRIX_BYTES = 1 << 20  # a small decode product's weights


def measure_cache_read(device: torch.device, pairs: int = 15) -> dict | None:
    """Reading weights that fit the last-level cache: the small-rows kernel (what decode steps run) over
    CACHE_SHARE of the cache in 4 MiB matrices, pass after pass, so they stay there; and, as
    measure_matvec_call_us does for memory, what a 1 MiB product costs beyond its bytes at that rate, from
    cached matrices (waking the other thread; no read to ramp up from memory); then the same passes over weights
    as large as the whole cache, of which the cache keeps what the other work it serves leaves it. {"bytes": the
    working set, "gbps": its read rate, "matvec_call_us": that cost, "cache_bytes": the cache, "whole": {"bytes",
    "gbps"} of the whole cache's}, or None where the kernel does not run here or the machine reports no cache."""
    product, cache = _small_rows_product(device), last_level_cache_bytes()
    if product is None or not cache:
        return None
    large = _matrices_of(int(cache * CACHE_SHARE), device)
    small = [torch.ones(CACHE_MATRIX_BYTES // 4096, 1024, device=device)
             for _ in range(max(_nbytes(large) // CACHE_MATRIX_BYTES // 4, 1))]
    run_small, run_large = _one_pass(small, product, device), _one_pass(large, product, device)
    run_small(), run_large()  # first touches
    timed = []  # (small pass, large pass) seconds, in alternating order
    for i in range(pairs):
        first, second = (run_small, run_large) if i % 2 == 0 else (run_large, run_small)
        seconds = {first: _pass_seconds(first), second: _pass_seconds(second)}
        timed.append((seconds[run_small], seconds[run_large]))
    excess = [(s / _nbytes(small) - l / _nbytes(large)) * CACHE_MATRIX_BYTES for s, l in timed]
    share = {"bytes": _nbytes(large), "gbps": _nbytes(large) / min(l for _, l in timed) / 1e9}
    del small, large, run_small, run_large  # the whole cache's weights take their place
    whole = _matrices_of(cache, device)
    return {**share, "matvec_call_us": max(statistics.median(excess), 0.0) * 1e6, "cache_bytes": cache,
            "whole": {"bytes": _nbytes(whole), "gbps": _pass_gbps(whole, product, device)}}


def _matrices_of(size: int, device: torch.device) -> list:
    """4 MiB float32 matrices, `size` bytes of them (one at least)."""
    return [_ones(1024 * 1024, device).view(1024, 1024) for _ in range(max(size // (4 << 20), 1))]


def _layer_pass(layers: list, rows: int, device: torch.device):
    """A function that runs each layer's product once over `rows` rows and waits for the device."""
    inputs = [torch.randn(1, rows, layer.in_features, device=device) for layer in layers]

    def run():
        for layer, x in zip(layers, inputs):
            layer(x)
        sync(device)

    return run


def measure_matvec_call_us(device: torch.device, pairs: int = 15) -> float:
    """Microseconds a decode-sized matrix-vector product (1024 x 1024, 4 MB of float32 weights, in the
    kernel fp32 decode steps run) takes beyond its bytes at the rate the same kernel reads 64 MB
    matrices: waking the other threads and ramping the read up, paid once per product. A pass over the
    small matrices and one over as many bytes of large ones make a pair, in alternating order, and the
    median pair's excess is the figure: the machine's bandwidth moves from second to second, and two
    rates measured apart would carry that difference into a cost a step pays a hundred times. 0 when it
    is not above noise."""
    small = _cold_weights(device, torch.float32, rows=1024, cols=1024)
    large = _cold_weights(device, torch.float32)
    product = _small_rows_product(device) or torch.nn.functional.linear
    run_small, run_large = _one_pass(small, product, device), _one_pass(large, product, device)
    run_small(), run_large()  # first touches
    excess = []
    for i in range(pairs):
        if i % 2 == 0:
            small_s, large_s = _pass_seconds(run_small), _pass_seconds(run_large)
        else:
            large_s, small_s = _pass_seconds(run_large), _pass_seconds(run_small)
        excess.append((small_s / _nbytes(small) - large_s / _nbytes(large)) * small[0].nbytes)
    return max(statistics.median(excess), 0.0) * 1e6


def measure_dispatch_us(device: torch.device) -> float:
    """Microseconds per tiny op: the fixed cost every kernel launch or dispatch pays."""
    x = torch.ones(8, device=device)
    n = 2000

    def run():
        for _ in range(n):
            torch.add(x, 1.0)

    return _best_seconds(run, device, repeats=3) / n * 1e6


def measure_host_link(device: torch.device) -> dict:
    """Host-to-device and device-to-host bandwidth (pinned, 256 MB) and latency (4 bytes)."""
    host = torch.empty(64 << 20, dtype=torch.float32).pin_memory()
    dev = torch.empty_like(host, device=device)
    tiny_host, tiny_dev = torch.ones(1).pin_memory(), torch.ones(1, device=device)
    h2d = _best_seconds(lambda: dev.copy_(host, non_blocking=True), device, 3)
    d2h = _best_seconds(lambda: host.copy_(dev, non_blocking=True), device, 3)
    lat_h2d = _best_seconds(lambda: tiny_dev.copy_(tiny_host), device, 20)
    lat_d2h = _best_seconds(lambda: tiny_host.copy_(tiny_dev), device, 20)
    return {"h2d_gbps": host.nbytes / h2d / 1e9, "d2h_gbps": host.nbytes / d2h / 1e9,
            "h2d_latency_us": lat_h2d * 1e6, "d2h_latency_us": lat_d2h * 1e6}


def engine_dtypes(device: torch.device) -> list[torch.dtype]:
    if device.type == "cpu":
        return [torch.float32, torch.bfloat16]
    return [torch.float32, torch.bfloat16, torch.float16]


def calibrate(device: torch.device) -> dict:
    start = time.perf_counter()
    with OtherWork() as other:
        reads = measure_read_bandwidth(device)
        method, peak = best_method(reads)
        matmuls = {str(d).removeprefix("torch."): measure_matmul_peak(device, d) for d in engine_dtypes(device)}
        layer_shapes = default_layer_shapes()
        prefill = ({"float32": measure_prefill_products(device, layer_shapes),
                    **{lv: measure_prefill_products(device, layer_shapes, level=lv)
                       for lv in integer_levels_here(device)}} if layer_shapes else None)
        cache_read = measure_cache_read(device)
    results = {
        "version": CALIBRATION_VERSION,
        "device_key": device_key(device),
        "memory_gbps": peak,
        "memory_method": method,
        "memory_methods_gbps": reads,
        "stream_read_gbps": reads["stream_sum"],
        "matmul_gflops": {d: best_method(shapes)[1] for d, shapes in matmuls.items()},
        "matmul_shape": {d: best_method(shapes)[0] for d, shapes in matmuls.items()},
        "matmul_shapes_gflops": matmuls,
        "dispatch_us": measure_dispatch_us(device),
        "matvec_call_us": measure_matvec_call_us(device),
    }
    if prefill:
        results["prefill_gflops"] = prefill
    if cache_read:
        results["cache_read"] = cache_read
    if device.type == "cuda":
        results["host_link"] = measure_host_link(device)
    results["seconds"] = time.perf_counter() - start
    results["measured_at"] = _utc_now().isoformat(timespec="seconds")
    results["other_work_share"] = other.share
    return results


# Other processes' share of the machine's core time during a calibration above which it was not quiet:
# its peaks then read low, so it is kept in its database but never entered into the machine's cache.
QUIET_OTHER_WORK = 0.10


def _idle_s(t) -> float:
    return t.idle + getattr(t, "iowait", 0.0)


def _total_s(t) -> float:
    return sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)  # Linux counts guest time in user


def _own_cpu_s() -> float:
    own = psutil.Process().cpu_times()
    return own.user + own.system


class OtherWork:
    """The check whether the machine was quiet while a block ran: the share of all cores' time that other
    processes took (system-wide busy time less this process's own), in .share once the block ends."""

    share: float | None = None

    def __enter__(self):
        self._machine, self._own = psutil.cpu_times(), _own_cpu_s()
        return self

    def __exit__(self, *exc):
        now = psutil.cpu_times()
        total = _total_s(now) - _total_s(self._machine)
        busy = total - (_idle_s(now) - _idle_s(self._machine))
        self.share = max(busy - (_own_cpu_s() - self._own), 0.0) / total if total > 0 else 0.0


def measured_quiet(calibration: dict) -> bool:
    """Whether the check at the time found the machine quiet (False where the calibration has no check)."""
    share = calibration.get("other_work_share")
    return share is not None and share <= QUIET_OTHER_WORK


def _utc_now() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


# Two timings of the same work on this machine differ by a few percent; a run this far above the
# calibrated peak is beyond noise: the peak is then too low, not the run too fast.
PEAK_NOISE = 0.05


def cache_read_rows(calibration: dict) -> list[tuple[str, str]]:
    """(what, figure) for the calibration's reads of weights that stay in the last-level cache, none without them."""
    cache = calibration.get("cache_read")
    if not cache:
        return []
    reads = [cache] + ([cache["whole"]] if "whole" in cache else [])
    return [(f"weights re-read in the last-level cache, {read['bytes'] / 2**20:.0f} MiB", f"{read['gbps']:.1f} GB/s")
            for read in reads]


def read_peak(calibration: dict, working_set: float | None = None) -> tuple[float, str]:
    """The read rate a forward moving `working_set` bytes can reach, and where it comes from: the last-level
    cache's (distances.cache_read_gbps) where those bytes stay in it, else the memory peak."""
    cached = cache_read_gbps(calibration, working_set) if working_set is not None else None
    if cached is not None:
        return cached, f"reading {working_set / 2**20:.0f} MiB again and again from the last-level cache"
    return calibration["memory_gbps"], calibration.get("memory_method", "gemv")


def peak_check(bytes_moved: float, seconds: float, calibration: dict, working_set: float | None = None) -> dict:
    """A run's bytes per second against the calibrated peak its forwards' bytes can reach (read_peak; the
    memory peak unless `working_set`, a forward's bytes, fits the cache): the rate, its fraction of that peak
    and, when it beats it by more than PEAK_NOISE, a sentence saying so (else None)."""
    gbps = bytes_moved / seconds / 1e9 if seconds > 0 else 0.0
    peak, method = read_peak(calibration, working_set)
    flag = None
    if gbps > peak * (1 + PEAK_NOISE):
        flag = (f"Its decode moved {gbps:.1f} GB/s, {gbps / peak:.0%} of the calibrated peak of {peak:.1f} GB/s "
                f"({method}): the peak is too low, calibrate again on a quiet machine.")
    return {"gbps": gbps, "peak_fraction": gbps / peak if peak else None, "beyond_peak": flag}


def decode_checks(forwards: list[tuple[float, float, float]], calibration: dict) -> dict:
    """A run's decode forwards, each (bytes it really moved, its roofline estimate in ms, its measured time in
    ms), against the calibration: the roofline estimate over the measured time, and the peak check (against the
    cache's rate where the largest forward's bytes fit it). A batched forward counts whole (the weights once,
    every sequence's cache) for each run that took part in it: a run's share of the weights over the whole
    forward's time would read low by the batch."""
    if not forwards:
        return {"roofline_ratio_decode": None, "peak_check": None}
    moved, roofline_ms, forward_ms = (sum(column) for column in zip(*forwards))
    return {"roofline_ratio_decode": roofline_ms / forward_ms if forward_ms > 0 else None,
            "peak_check": peak_check(moved, forward_ms / 1e3, calibration, max(f[0] for f in forwards))}


# what a run keeps of the calibration it used
RUN_CALIBRATION = ("device_key", "memory_gbps", "memory_method", "memory_methods_gbps", "matmul_gflops",
                   "prefill_gflops", "cache_read", "dispatch_us", "matvec_call_us", "created_at", "measured_at",
                   "reused_from")


def peak_gflops(calibration: dict, dtype: torch.dtype) -> float:
    table = calibration["matmul_gflops"]
    return table.get(str(dtype).removeprefix("torch."), table["float32"])


def roofline(calibration: dict, dtype: torch.dtype, weight_bytes: float, weights: str = "fp32") -> Roofline:
    """The roofline a run's forwards are attributed with: the read rate a forward reading `weight_bytes` of
    weights reaches (read_peak: the cache's where they fit it) and the matmul peak of its dtype, or for an integer
    weight level (`weights`, the model's level) the best rate the calibration timed its own kernels at: they
    multiply integers, faster than any float matmul here."""
    level = weight_level(weights)
    integer = (calibration.get("prefill_gflops") or {}).get(level) if level in INTEGER_LEVELS else None
    peak = max(integer.values()) if integer else peak_gflops(calibration, dtype)
    return Roofline(read_peak(calibration, weight_bytes)[0], peak)


_session_calibrations: dict[str, dict] = {}
# A calibration taken while other work shares the cores reads low; one this far below the recent
# ones of its device is flagged, stored with its flag, and not used while agreeing ones exist.
DISAGREEMENT = 0.75
RECENT = 6


def _headline(calibration: dict) -> dict:
    return {"memory bandwidth": calibration["memory_gbps"], "fp32 matmul peak": calibration["matmul_gflops"]["float32"]}


def recent_calibrations(store, key: str, n: int = RECENT) -> list[dict]:
    """This device's last n stored calibrations of a readable version, newest first."""
    with store.connect() as con:
        return _recent_calibrations(con, key, n)


def _recent_calibrations(con, key: str, n: int) -> list[dict]:
    rows = con.execute("SELECT results, created_at FROM calibration WHERE device_key = ? "
                       "ORDER BY created_at DESC LIMIT ?", [key, n]).fetchall()
    calibrations = [{**json.loads(results), "created_at": created.isoformat(timespec="seconds")}
                    for results, created in rows]
    return [c for c in calibrations if c.get("version") in READABLE_VERSIONS]


def disagreement(results: dict, recent: list[dict]) -> str | None:
    """A sentence when a figure of this calibration is far below the median of the recent agreeing ones."""
    peers = [r for r in recent if not r.get("suspect")]
    if not peers:
        return None
    for name, value in _headline(results).items():
        median = statistics.median(_headline(r)[name] for r in peers)
        if value < DISAGREEMENT * median:
            return (f"Its {name} ({value:,.1f}) is {value / median:.0%} of the median of the {len(peers)} "
                    f"previous calibration(s) of this device ({median:,.1f}): other work probably shared the "
                    "machine while it ran.")
    return None


def choose_calibration(recent: list[dict]) -> dict | None:
    """The newest calibration that agrees with the best recent ones: a loaded machine only ever
    reads low, so the highest recent figures are the reference. A flagged one is used only when
    nothing else is stored, and it carries its flag."""
    if not recent:
        return None
    best = {name: max(_headline(r)[name] for r in recent) for name in _headline(recent[0])}
    for calibration in recent:
        if not calibration.get("suspect") and all(
                value >= DISAGREEMENT * best[name] for name, value in _headline(calibration).items()):
            return calibration
    return next((r for r in recent if not r.get("suspect")), recent[0])


def find_calibration(store, summary: dict | None) -> dict | None:
    """The stored calibration a run summary's metrics["calibration"] came from, if it is still there."""
    if not summary or store is None:
        return None
    return next((r for r in recent_calibrations(store, summary["device_key"], 1000)
                 if r["memory_gbps"] == summary["memory_gbps"]), None)


FIXED_CALIBRATION_ENV = "TOKENPATH_CALIBRATION"


def fixed_calibration(device: torch.device) -> dict | None:
    """The calibration in the JSON file $TOKENPATH_CALIBRATION names, as this device's, or None when
    it is unset: tests (and their subprocesses and pages) attribute runs with one fixed calibration
    instead of measuring the machine in every process."""
    path = os.environ.get(FIXED_CALIBRATION_ENV)
    if not path:
        return None
    with open(path) as f:
        return {**json.load(f), "device_key": device_key(device)}


def calibration_for(device: torch.device, store=None, fresh: bool = False, measure: bool = True) -> dict | None:
    """The calibration to attribute a run with: the stored one choose_calibration picks, else the fixed
    one $TOKENPATH_CALIBRATION names, else a recent one of this machine from the calibration cache
    (reused_calibration), else one this process already made (where the cache cannot be written), else
    a new one (stored, flagged when it disagrees, when a store is given, and kept in the cache only when neither
    flagged nor taken beside other work: measured_quiet). fresh=True always measures;
    measure=False never does, and gives None where nothing can be reused."""
    key = device_key(device)
    if not fresh:
        chosen = choose_calibration(recent_calibrations(store, key)) if store is not None else None
        if chosen:
            return chosen
        results = fixed_calibration(device) or reused_calibration(device) or _session_calibrations.get(key)
        if results:
            if store is not None:
                store.save_calibration(key, results)
            return results
        if not measure:
            return None
    results = _session_calibrations[key] = calibrate(device)
    peers = (recent_calibrations(store, key) if store is not None else []) + cached_calibrations(device)
    flag = disagreement(results, peers)
    if flag:
        results["suspect"] = flag
    if store is not None:
        store.save_calibration(key, results)
    if not flag and measured_quiet(results):
        remember_calibration(device, results)
    return results


# --- the machine's calibration cache ---------------------------------------------------------
# A calibration measures the machine, not a database: each measured one is also kept in the user's
# cache folder, so a new database on the same machine reuses a recent one instead of spending
# seconds of the first run on measuring again. Older than MAX_AGE, a calibration is neither reused
# nor trusted: the machine, its memory or the torch that ran the kernels may have changed since.
MAX_AGE = timedelta(days=30)


def calibration_cache_path() -> Path:
    """$TOKENPATH_CACHE/calibrations.json, default in $XDG_CACHE_HOME/tokenpath (~/.cache/tokenpath)."""
    return cache_dir() / "calibrations.json"


def machine_key(device: torch.device) -> str:
    """What a cached calibration must match to be reused: the device (CPU model and threads, or the
    GPU's name), the machine's cores, the torch that ran the kernels, on a CPU the version of the project's own
    kernels (the integer levels' rates are theirs), and the calibration's version."""
    from engine.model.cpu_kernels import build_directory

    kernels = f"|kernels {build_directory().name}" if device.type == "cpu" else ""
    return f"{device_key(device)}|{psutil.cpu_count(logical=True)} logical cores|torch {torch.__version__}" \
           f"{kernels}|v{CALIBRATION_VERSION}"


def _read_cache() -> dict:
    try:
        return json.loads(calibration_cache_path().read_text())
    except (OSError, ValueError):  # none yet, or unreadable: nothing to reuse
        return {}


def age(calibration: dict) -> timedelta:
    """How long ago the calibration was measured (its store row's time where it has no measured_at)."""
    when = calibration.get("measured_at") or calibration["created_at"]
    return _utc_now() - datetime.fromisoformat(when)


def cached_calibrations(device: torch.device) -> list[dict]:
    """This machine's cached calibrations younger than MAX_AGE, newest first."""
    entries = _read_cache().get(machine_key(device), [])
    return [e for e in entries if isinstance(e, dict) and "measured_at" in e and age(e) <= MAX_AGE]


def remember_calibration(device: torch.device, results: dict) -> None:
    """Keep a measured calibration among the machine's RECENT newest in the cache (calibration_for enters
    only quiet, unflagged ones); a cache folder that cannot be written only means the next database
    measures again."""
    cache = _read_cache()
    key = machine_key(device)
    cache[key] = [results] + [e for e in cache.get(key, []) if isinstance(e, dict)][:RECENT - 1]
    path = calibration_cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(cache, indent=1))
        os.replace(partial, path)  # a reader sees the old file or the new one, never half of one
    except OSError:
        pass


def reused_calibration(device: torch.device) -> dict | None:
    """The cached calibration of this machine choose_calibration picks, marked with where it came from,
    or None when there is none recent or the one picked was taken on a busy machine (flagged, or its check
    at the time found other work, or it was cached before that check existed)."""
    chosen = choose_calibration(cached_calibrations(device))
    if chosen is None or chosen.get("suspect") or not measured_quiet(chosen):
        return None
    return {**chosen, "reused_from": str(calibration_cache_path())}


@dataclass(frozen=True)
class CalibrationVerdict:
    """Whether the calibration runs are attributed with can be trusted on this machine now: the one
    verdict every page shows, with why and what to do."""

    trustworthy: bool
    headline: str  # one sentence: the verdict
    why: str  # the evidence behind it
    action: str | None  # what to do, None when nothing needs doing
    calibration: dict | None  # the calibration in use, if any


# runs whose decode beat the calibrated peak: the last few local ones decide
VERDICT_RUNS = 20


def calibration_verdict(store, key: str) -> CalibrationVerdict:
    """The verdict on this device's calibration in use: missing, flagged when taken on a busy machine,
    or beaten by the runs attributed with it (a peak a run exceeds reads low), else trustworthy."""
    recent, run_metrics = _verdict_evidence(store, key) if store is not None else ([], [])
    chosen = choose_calibration(recent)
    calibrate = "Calibrate now, on a quiet machine (a few seconds)."
    if chosen is None:
        return CalibrationVerdict(False, "Not calibrated on this device yet: memory and compute buckets wait for it.",
                                  "The buckets divide each forward's bytes and FLOPs by this machine's measured peaks; "
                                  "the dashboard calibrates once the model is loaded, and the first generation does "
                                  "where nothing has yet.", calibrate, None)
    figures = f"{chosen['memory_gbps']:.1f} GB/s, {chosen['matmul_gflops']['float32']:,.0f} GFLOP/s fp32"
    if age(chosen) > MAX_AGE:
        return CalibrationVerdict(False, f"The calibration in use ({figures}) is {age(chosen).days} days old.",
                                  f"{provenance(chosen)} Since then the machine, its memory or the torch that ran the "
                                  "kernels may have changed.", calibrate, chosen)
    if chosen.get("suspect"):
        return CalibrationVerdict(False, f"The calibration in use ({figures}) was taken on a busy machine: its "
                                  "peaks read low, so memory and compute estimates read high.", chosen["suspect"],
                                  calibrate, chosen)
    beaten = [check for check in _peak_checks(run_metrics, chosen) if check.get("beyond_peak")]
    if beaten:
        top = max(check["peak_fraction"] for check in beaten)
        return CalibrationVerdict(False, f"The calibration in use ({figures}) reads low: {len(beaten)} recent run(s) "
                                  f"moved more bytes per second than its peak (up to {top:.0%} of it).",
                                  "No run can read memory faster than the machine's peak, so the peak was measured "
                                  "while other work shared the machine; ratios to it above 100% come from that, and "
                                  "the memory bucket reads high.", calibrate, chosen)
    flagged_newer = recent[0] is not chosen and recent[0].get("suspect")
    why = (f"{provenance(chosen)} No recent run beat its peaks."
           + (f" A newer calibration ({recent[0]['created_at']} UTC) was taken on a busy machine and is not used."
              if flagged_newer else ""))
    return CalibrationVerdict(True, f"The calibration in use ({figures}) agrees with the recent runs.", why, None,
                              chosen)


def _ago(delta: timedelta) -> str:
    hours = delta.total_seconds() / 3600
    if hours < 1:
        return f"{max(1, round(hours * 60))} min"
    return f"{hours:.0f} h" if hours < 48 else f"{delta.days} days"


def provenance(calibration: dict) -> str:
    """Where the calibration came from and how old it is, in one sentence."""
    when = calibration.get("measured_at") or calibration["created_at"]
    said = f"Measured {when} UTC ({_ago(age(calibration))} ago)"
    if calibration.get("reused_from"):
        return f"{said} on this machine for another database, reused from its calibration cache " \
               f"({calibration['reused_from']})."
    return f"{said}."


def _verdict_evidence(store, key: str) -> tuple[list[dict], list[str]]:
    """This device's recent calibrations and the metrics JSON of the newest finished local runs (newest first),
    read over one connection: pages show the verdict on every rerun, and each connection opens the file anew."""
    with store.connect() as con:
        recent = _recent_calibrations(con, key, RECENT)
        metrics = con.execute("SELECT metrics FROM runs WHERE status = 'ok' AND metrics IS NOT NULL AND "
                              "coalesce(backend, 'local') = 'local' ORDER BY run_id DESC LIMIT ?",
                              [VERDICT_RUNS]).fetchall()
    return recent, [row[0] for row in metrics]


def _peak_checks(run_metrics: list[str], calibration: dict) -> list[dict]:
    """The peak checks of the runs (their metrics JSON) attributed with this calibration (same memory figure)."""
    checks = []
    for text in run_metrics:
        metrics = json.loads(text) if text else {}
        if (metrics.get("calibration") or {}).get("memory_gbps") == calibration["memory_gbps"] and \
                metrics.get("peak_check"):
            checks.append(metrics["peak_check"])
    return checks


def above_peak_sentence(fraction: float | None) -> str | None:
    """The sentence that must stand beside a ratio above 100% of a calibrated peak, else None."""
    if fraction is None or fraction <= 1 + PEAK_NOISE:
        return None
    return (f"{fraction:.0%} is above 100%: no forward can beat the machine's real peak, so the calibrated peak "
            "reads low (it was measured while other work shared the machine); calibrate again on a quiet machine.")


# --- telemetry -------------------------------------------------------------------------------

MIN_CPU_INTERVAL_S = 0.05


class TelemetrySampler:
    """Samples CPU use and resident memory (and NVML GPU figures on CUDA) in a background thread."""

    def __init__(self, device: torch.device, interval_s: float = 0.1):
        self.interval_s = interval_s
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="tokenpath-telemetry")
        self._process = psutil.Process(os.getpid())
        self._gpu = None
        if device.type == "cuda":
            nvml, _ = _nvml()
            if nvml is not None:
                self._gpu = (nvml, nvml.nvmlDeviceGetHandleByIndex(device.index or 0))
        self._t0 = time.perf_counter()  # t_ms counts from here (or from entering), never from boot
        self._cpu_last = psutil.cpu_times()

    def __enter__(self):
        self._t0 = time.perf_counter()
        self._cpu_last = psutil.cpu_times()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        # A Ctrl-C or SIGTERM can land inside __enter__'s start(), before the thread says it runs: joining it
        # then would raise over the interruption. Once the stop is set, such a thread ends before its first sample.
        if self._thread.is_alive():
            self._thread.join(timeout=2)

    def _cpu_percent(self) -> float | None:
        """Busy share of all cores since this sampler's previous reading. Each sampler keeps its own
        reading (psutil.cpu_percent keeps one per process, which two samplers would split); under
        MIN_CPU_INTERVAL_S since the last one the tick counts are too coarse, so no figure (None)."""
        now = psutil.cpu_times()
        elapsed = _total_s(now) - _total_s(self._cpu_last)
        if elapsed < MIN_CPU_INTERVAL_S * psutil.cpu_count():
            return None
        busy = elapsed - (_idle_s(now) - _idle_s(self._cpu_last))
        self._cpu_last = now
        return min(max(busy / elapsed * 100, 0.0), 100.0)

    def _loop(self):
        while not self._stop.wait(self.interval_s):
            self.samples.append(self.sample())

    def sample(self) -> dict:
        row = {"t_ms": (time.perf_counter() - self._t0) * 1e3,
               "cpu_percent": self._cpu_percent(),
               "rss_bytes": self._process.memory_info().rss,
               "gpu_util_percent": None, "gpu_mem_used_bytes": None, "gpu_power_w": None,
               "gpu_sm_clock_mhz": None, "gpu_mem_clock_mhz": None, "gpu_temp_c": None}
        if self._gpu:
            nvml, h = self._gpu
            util = _nvml_or_none(nvml.nvmlDeviceGetUtilizationRates, h)
            mem = _nvml_or_none(nvml.nvmlDeviceGetMemoryInfo, h)
            power = _nvml_or_none(nvml.nvmlDeviceGetPowerUsage, h)
            row.update({
                "gpu_util_percent": util.gpu if util else None,
                "gpu_mem_used_bytes": mem.used if mem else None,
                "gpu_power_w": power / 1000 if power is not None else None,
                "gpu_sm_clock_mhz": _nvml_or_none(nvml.nvmlDeviceGetClockInfo, h, nvml.NVML_CLOCK_SM),
                "gpu_mem_clock_mhz": _nvml_or_none(nvml.nvmlDeviceGetClockInfo, h, nvml.NVML_CLOCK_MEM),
                "gpu_temp_c": _nvml_or_none(nvml.nvmlDeviceGetTemperature, h, nvml.NVML_TEMPERATURE_GPU),
            })
        return row
