"""The project's small C++ extension (engine/kernels/cpu_kernels.cpp): the activation-sparse GEMV
and the masking of engine.sparsity, and the int8 x int8 product of the int8-dyn level. Built with
PyTorch's cpp_extension once per version of its source (about 35 s, needs ninja and a C++
compiler) into ~/.cache/tokenpath/, loaded from there afterwards."""
from __future__ import annotations

import functools
import hashlib
import time
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "kernels" / "cpu_kernels.cpp"
STALE_BUILD_LOCK_S = 600  # a build takes under a minute; an older lock was left by a killed process
_kernel = None
_unavailable = False


def cpu_has_vnni() -> bool:
    """Whether this CPU has AVX-512 VNNI (the build uses -march=native, so the kernel then uses it)."""
    try:
        return "avx512_vnni" in Path("/proc/cpuinfo").read_text().split()
    except OSError:  # not Linux
        return False


def build_directory() -> Path:
    """Where the extension is built: one folder per version of its source."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    return Path.home() / ".cache" / "tokenpath" / f"cpu_kernels-{digest}"


def kernel():
    """The compiled extension, built on first use. With -fopenmp, because ATen's parallel_for is a
    header template: without it the kernels would run on one thread; without contracted
    multiply-adds, so that element-wise kernels round as PyTorch's separate operations do."""
    global _kernel
    if _kernel is None:
        from torch.utils.cpp_extension import load

        build = build_directory()
        build.mkdir(parents=True, exist_ok=True)
        lock = build / "lock"
        # PyTorch waits forever on a lock whose builder died; one that old cannot be a live build
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_BUILD_LOCK_S:
            lock.unlink(missing_ok=True)
        _kernel = load(name=f"tokenpath_{build.name.replace('-', '_')}", sources=[str(SOURCE)],
                       build_directory=str(build), extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
                       extra_ldflags=["-fopenmp"], verbose=False)
    return _kernel


def optional_kernel():
    """The extension, or None where it cannot be built here (no C++ compiler): callers with a
    PyTorch path of their own use this."""
    global _unavailable
    if _unavailable:
        return None
    try:
        return kernel()
    except Exception:  # the build failed; remember, so that it is not retried on every call
        _unavailable = True
        return None


@functools.cache
def has_small_rows_kernel() -> bool:
    """Whether the extension's small_linear runs here: it needs AVX-512 (a plain loop in its place
    would be far slower than MKL)."""
    kernel = optional_kernel()
    return kernel is not None and kernel.has_avx512()
