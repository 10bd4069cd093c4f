"""Tokenpath's engine: models, the instrumented decode loop, attribution, the store.

OpenMP's threads wait for the next parallel region spinning or asleep, as chosen once when PyTorch
loads OpenMP (before `import torch`). A decode step runs about a hundred small regions. On cores
nothing else needs, a short spin keeps the other thread ready for the next region, where waking a
sleeping one costs tens of microseconds each time; on cores that other work holds, spinning threads
take the time the next region needs, and a step can take several times as long. So the engine spins
briefly (GOMP_SPINCOUNT) when the machine is quiet as it starts (1-minute load average below the
core count) and sleeps between regions otherwise. OMP_WAIT_POLICY or GOMP_SPINCOUNT set by the user
are kept. OPENMP_WAIT says which, and why; runs and benchmarks record it. Processes this one starts
inherit the choice; another engine's server measured here gets foreign_env(), which leaves it out.

Freed memory stays in the process for the next allocation (FREED_MEMORY says so, or why not): glibc maps each
allocation above its threshold (128 KiB, rising to 32 MiB) afresh and unmaps it when it is freed, so every tensor of
a prefill's activations, several MB each, is faulted in page by page again, which in a virtual machine costs as
much as the arithmetic that fills it."""
import ctypes
import os
import sys

OPENMP_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
SPIN_COUNT = "30000"  # tens of microseconds: the gaps between a step's regions, not the gaps between steps
SET_HERE = "TOKENPATH_OPENMP_SET"  # names the variable the engine set itself, for the processes it starts


def _choose_openmp_wait() -> str:
    if "TOKENPATH_OPENMP_WAIT" in os.environ:  # chosen by the process that started this one
        return os.environ["TOKENPATH_OPENMP_WAIT"]
    if "torch" in sys.modules:  # OpenMP has read its settings already
        return "OpenMP's own default (torch was imported before the engine)"
    chosen = {k: os.environ[k] for k in OPENMP_WAIT_VARIABLES if k in os.environ}
    cores, load = os.cpu_count() or 1, os.getloadavg()[0]
    if chosen:
        why = "as set: " + ", ".join(f"{k}={v}" for k, v in chosen.items())
    elif load < cores:
        os.environ["GOMP_SPINCOUNT"], os.environ[SET_HERE] = SPIN_COUNT, "GOMP_SPINCOUNT"
        why = f"spin briefly (GOMP_SPINCOUNT={SPIN_COUNT}): load average {load:.1f} at start, {cores} cores"
    else:
        os.environ["OMP_WAIT_POLICY"], os.environ[SET_HERE] = "PASSIVE", "OMP_WAIT_POLICY"
        why = f"sleep (OMP_WAIT_POLICY=PASSIVE): load average {load:.1f} at start, {cores} cores"
    os.environ["TOKENPATH_OPENMP_WAIT"] = why
    return why


def _keep_freed_memory() -> str:
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")) \
            or "malloc.mmap_threshold" in tunables or "malloc.trim_threshold" in tunables:
        return "glibc's malloc as set in the environment"
    if "malloc" in os.environ.get("LD_PRELOAD", ""):  # jemalloc, tcmalloc, mimalloc: mallopt would not reach them
        return "the preloaded allocator's own policy (LD_PRELOAD)"
    try:
        libc = ctypes.CDLL(None) if os.confstr("CS_GNU_LIBC_VERSION") else None
    except (ValueError, OSError, AttributeError):  # no such name outside glibc
        libc = None
    if libc is None:
        return "the C library's own allocation policy"
    trim_threshold, mmap_threshold, limit = -1, -3, 1 << 30
    if not libc.mallopt(mmap_threshold, limit):
        return "glibc's default policy (mallopt refused)"
    kept = "kept for reuse by the process (glibc mallopt: only allocations above 1 GiB mapped afresh"
    if not libc.mallopt(trim_threshold, limit):
        return kept + "; glibc's own threshold for returning free memory)"
    return kept + ", free memory at the heap's top returned beyond 1 GiB)"


def foreign_env() -> dict:
    """This process's environment for another engine's server: without the OpenMP wait the engine chose for
    itself (a server under measurement runs with its own defaults, not with a choice that depends on how busy
    the machine was when Tokenpath started), with any the user set."""
    env = {k: v for k, v in os.environ.items() if k not in ("TOKENPATH_OPENMP_WAIT", SET_HERE)}
    if os.environ.get(SET_HERE):
        env.pop(os.environ[SET_HERE], None)
    return env


OPENMP_WAIT = _choose_openmp_wait()
FREED_MEMORY = _keep_freed_memory()
