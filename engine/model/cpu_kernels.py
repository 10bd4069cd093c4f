"""The project's small C++ extension (engine/model/kernels/: a header and one source per concern): the
few-row float32 products, the int8 and int4 products, activation sparsity and the lean decode step. The
compiler gets two units: the Python bindings, and the other sources together (_units).

Built during setup (`make`, `python -m engine prepare`, or `python -m engine.model.cpu_kernels`) with
PyTorch's cpp_extension into the checkout's git-ignored build/ folder, one folder per version of the
source, flags, CPU and Python environment; later processes import the built library without running
the compiler. A process that finds no built library builds it when a model is loaded, before any run
starts its clock (engine.model.loader), and says so on stderr."""
from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import os
import platform
import sys
from contextlib import contextmanager
from pathlib import Path

from engine.paths import BUILD

KERNELS = Path(__file__).resolve().parent / "kernels"
SOURCES = tuple(sorted(KERNELS.glob("*.cpp")))
FILES = tuple(sorted([*SOURCES, *KERNELS.glob("*.h")]))  # all of them name a build
# the architecture's baseline for a portable build, per machine
BASELINE = {"x86_64": "-march=x86-64", "AMD64": "-march=x86-64", "aarch64": "-march=armv8-a", "arm64": "-march=armv8-a"}
# an x86 CPU with AVX2, FMA and F16C but neither AVX-512 nor VNNI: the vector branches most x86 CPUs take
AVX2 = "-march=haswell"
LDFLAGS = ("-fopenmp",)
_kernel = None
_unavailable: str | None = None


class KernelBuildError(Exception):
    """The extension could not be built here; the message is one sentence."""


def variant() -> str:
    """native (this CPU's instructions), or for tests of the branches other CPUs take, portable
    (TOKENPATH_KERNELS=portable: the architecture's baseline) or avx2 (TOKENPATH_KERNELS=avx2, on x86)."""
    chosen = os.environ.get("TOKENPATH_KERNELS")
    if chosen == "avx2" and platform.machine() not in ("x86_64", "AMD64"):
        return "native"  # an x86 build only
    return chosen if chosen in ("portable", "avx2") else "native"


def cflags() -> tuple[str, ...]:
    march = {"portable": BASELINE.get(platform.machine(), "-march=native"), "avx2": AVX2}.get(variant(), "-march=native")
    # without contracted multiply-adds, so that element-wise kernels round as PyTorch's separate operations do
    return ("-O3", march, "-fopenmp", "-ffp-contract=off")


def _cpu_flags() -> set[str]:
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:  # not Linux
        return set()


def cpu_has_vnni() -> bool:
    """Whether this CPU has AVX-512 VNNI (the native build uses -march=native, so its kernels then use it)."""
    return "avx512_vnni" in _cpu_flags()


def cpu_has_avx2() -> bool:
    """Whether this CPU has AVX2 (the int8 kernels' vector path where VNNI is missing)."""
    return "avx2" in _cpu_flags()


def _cpu_model() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name")), "")
    except OSError:
        return ""


def build_root() -> Path:
    return Path(os.environ.get("TOKENPATH_BUILD", BUILD))


def build_directory() -> Path:
    """The folder of this version: a change of any source or header, flags, CPU (-march=native), Python
    environment or torch gets a folder of its own, so two environments never rebuild each other's."""
    import torch

    sources = [f"{path.name}\n{path.read_text()}" for path in FILES]
    key = "\n".join([*sources, *cflags(), *LDFLAGS, _cpu_model(), sys.prefix, torch.__version__])
    return build_root() / f"cpu_kernels-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def module_name(build: Path) -> str:
    return f"tokenpath_{build.name.replace('-', '_')}"


def _library(build: Path) -> Path:
    return build / f"{module_name(build)}.so"


def _done_marker(build: Path) -> Path:
    # written after a build completed: a library a killed linker left half-written has none
    return build / "built"


def is_built() -> bool:
    build = build_directory()
    return _done_marker(build).exists() and _library(build).exists()


@contextmanager
def _builder_lock(build: Path):
    """An exclusive lock on build/owner.lock for the whole build. The kernel releases a flock when
    its holder dies, so a killed builder never leaves it held; PyTorch's own lock file, which it
    waits on forever, is therefore stale whenever this lock is ours, and is removed."""
    build.mkdir(parents=True, exist_ok=True)
    with open(build / "owner.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print("Waiting for another process that is building Tokenpath's C++ kernels...", file=sys.stderr)
            fcntl.flock(handle, fcntl.LOCK_EX)
        (build / "lock").unlink(missing_ok=True)
        yield


def _sources() -> list[Path]:
    """The sources among FILES, read at build time: the build lock's tests build a one-function
    extension through the same code in seconds."""
    return [path for path in FILES if path.suffix == ".cpp"]


def _units(directory: Path) -> list[Path]:
    """What the compiler is given: the Python bindings, whose pybind11 headers take most of a build, on their
    own, and the other sources as one unit (written into the build folder) that includes them all, so that
    ATen's headers are read once rather than once a source; the two compile side by side."""
    sources = _sources()
    bindings = [path for path in sources if path.name == "bindings.cpp"]
    rest = [path for path in sources if path not in bindings]
    if len(rest) < 2:
        return sources
    unit = directory / "kernels_together.cpp"
    unit.write_text("".join(f'#include "{path}"\n' for path in rest))
    return [*bindings, unit]


def build(verbose: bool = False):
    """Compile the extension if this version is not built yet, and return it loaded."""
    from torch.utils.cpp_extension import load

    directory = build_directory()
    with _builder_lock(directory):
        if is_built():
            return _import(directory)
        _done_marker(directory).unlink(missing_ok=True)
        try:
            # copies: PyTorch appends to the lists it is given. -fopenmp also at link time: ATen's
            # parallel_for is a header template, so without it the kernels would run on one thread
            module = load(name=module_name(directory), sources=[str(path) for path in _units(directory)],
                          build_directory=str(directory), extra_cflags=list(cflags()), extra_ldflags=list(LDFLAGS),
                          verbose=verbose)
        except Exception as exc:  # no compiler, no ninja, a compile error: all reported in one sentence
            detail = str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else type(exc).__name__
            raise KernelBuildError(f"The C++ kernels could not be built in {directory} ({detail}).") from None
        _done_marker(directory).write_text("".join(f"{path.name}\n" for path in _sources()))
        return module


def _import(directory: Path):
    spec = importlib.util.spec_from_file_location(module_name(directory), _library(directory))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kernel():
    """The compiled extension: imported when built, else built now (raises KernelBuildError)."""
    global _kernel
    if _kernel is None:
        import torch  # noqa: F401  (the library links against the torch libraries already loaded)

        _kernel = _import(build_directory()) if is_built() else build()
    return _kernel


def optional_kernel():
    """The extension, or None where it cannot be built here (no C++ compiler): callers with a
    PyTorch path of their own use this."""
    global _unavailable
    if _unavailable is not None:
        return None
    try:
        return kernel()
    except Exception as exc:  # remembered, so that a failed build is not retried on every call
        _unavailable = str(exc)
        return None


def release_threads() -> None:
    """Free the calling thread's OpenMP threads until its next parallel region (kernels/decode.cpp says why), where
    the kernels are loaded already: a thread that hands the model to another calls it, and a thread that steps a
    model when it goes idle."""
    if _kernel is not None:
        _kernel.release_threads()


def prepare() -> str:
    """Make sure the kernels are ready before anything is timed; returns what happened, in words."""
    if _kernel is not None:
        return "ready"
    if _unavailable is not None:  # said once already
        return f"unavailable: {_unavailable}"
    if not is_built():
        print("Building Tokenpath's C++ kernels once (setup, before any run starts its clock; "
              "`make` or `python -m engine prepare` does it ahead)...", file=sys.stderr)
    if optional_kernel() is None:
        print(f"{_unavailable} Runs use PyTorch's own operations instead.", file=sys.stderr)
        return f"unavailable: {_unavailable}"
    return "ready"


@functools.cache
def has_small_rows_kernel() -> bool:
    """Whether the extension's small_linear runs here: wherever it builds (four rows at a time with
    AVX-512, else rows the compiler vectorizes for this CPU)."""
    return optional_kernel() is not None


def main() -> int:
    try:
        build(verbose="--verbose" in sys.argv)
    except KernelBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"C++ kernels ready in {build_directory()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
