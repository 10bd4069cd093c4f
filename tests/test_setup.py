"""Setup: the C++ kernels are built inside the checkout, one folder per environment, a build killed
half-way never holds up the next process, and a missing build happens at model load, not in a run; a
non-editable install is a working command line of its own."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from engine.model import cpu_kernels

ROOT = Path(__file__).resolve().parent.parent


def test_the_kernels_live_in_a_git_ignored_folder_of_the_checkout(monkeypatch):
    monkeypatch.delenv("TOKENPATH_BUILD", raising=False)
    folder = cpu_kernels.build_directory()
    assert folder.parent == ROOT / "build"
    probe = folder / "probe.so"
    ignored = subprocess.run(["git", "check-ignore", "-q", str(probe)], cwd=ROOT)
    assert ignored.returncode == 0, "build/ must be git-ignored"
    assert Path.home() / ".cache" not in folder.parents


def test_each_python_environment_gets_a_folder_of_its_own(monkeypatch):
    here = cpu_kernels.build_directory()
    monkeypatch.setattr(sys, "prefix", "/some/other/venv")
    assert cpu_kernels.build_directory() != here
    assert cpu_kernels.build_directory().parent == here.parent


def test_every_kernel_source_and_header_names_the_build(monkeypatch, tmp_path):
    """The build folder changes with any file of engine/model/kernels, and the builder compiles every source."""
    assert {p.name for p in cpu_kernels.SOURCES} == {p.name for p in cpu_kernels.KERNELS.glob("*.cpp")}
    assert len(cpu_kernels.SOURCES) > 3 and any(p.suffix == ".h" for p in cpu_kernels.FILES)
    here = cpu_kernels.build_directory()
    for original in cpu_kernels.FILES:
        copy = tmp_path / original.name
        copy.write_text(original.read_text() + "\n// changed\n")
        monkeypatch.setattr(cpu_kernels, "FILES", tuple(copy if p == original else p for p in cpu_kernels.FILES))
        assert cpu_kernels.build_directory() != here, original.name
        monkeypatch.undo()
    monkeypatch.setenv("TOKENPATH_KERNELS", "portable")
    assert cpu_kernels.build_directory() != here and "-march=native" not in cpu_kernels.cflags()


def _builder(env, *code):
    return subprocess.Popen([sys.executable, "-c", "; ".join(code)], cwd=ROOT, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# The build lock does not depend on what is compiled: a one-function extension written against Python's own
# C API goes through the same build and lock in a second (the portable build test compiles the real kernels).
ONE_FUNCTION = """#include <Python.h>
#define INIT_NAME(name) INIT_NAME_(name)
#define INIT_NAME_(name) PyInit_##name
static PyObject* add(PyObject*, PyObject* args) {
    long a, b;
    if (!PyArg_ParseTuple(args, "ll", &a, &b)) return nullptr;
    return PyLong_FromLong(a + b);
}
static PyMethodDef methods[] = {{"add", add, METH_VARARGS, nullptr}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef module = {PyModuleDef_HEAD_INIT, "one_function", nullptr, -1, methods};
PyMODINIT_FUNC INIT_NAME(TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module); }
"""


def _one_function_builder(env, source, *code):
    """A process whose kernels are the one-function extension."""
    return _builder(env, "import pathlib", "from engine.model import cpu_kernels",
                    f"cpu_kernels.FILES = (pathlib.Path({str(source)!r}),)", *code)


def test_a_build_killed_half_way_does_not_hold_up_the_next_process(tmp_path):
    """A real build, killed with SIGKILL (its compiler too) while PyTorch's lock file exists; the
    next process, which loads a model, builds at once instead of waiting on that lock."""
    env = {**os.environ, "TOKENPATH_BUILD": str(tmp_path / "build")}
    source = tmp_path / "one_function.cpp"
    source.write_text(ONE_FUNCTION)
    # the first build's compiler waits before compiling, so the kill always lands inside the build
    slow = tmp_path / "slow-c++"
    slow.write_text(f'#!/bin/sh\nsleep 600\nexec {os.environ.get("CXX", "c++")} "$@"\n')
    slow.chmod(0o755)
    first = _one_function_builder({**env, "CXX": str(slow)}, source, "cpu_kernels.build()")
    deadline = time.monotonic() + 300
    while not list(tmp_path.glob("build/cpu_kernels-*/lock")):
        assert first.poll() is None, first.communicate()
        assert time.monotonic() < deadline, "the build never started"
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=60)
    assert list(tmp_path.glob("build/cpu_kernels-*/lock")), "the killed build left its lock, as a real kill does"

    second = _one_function_builder(env, source, "from engine.model.loader import tiny_model", "tiny_model()",
                                   "print(cpu_kernels.is_built(), cpu_kernels.build_directory(), "
                                   "cpu_kernels.kernel().add(2, 3))")
    out, err = second.communicate(timeout=900)
    assert second.returncode == 0, err
    assert out.split()[0] == "True" and str(tmp_path) in out and out.split()[2] == "5"
    assert "Building Tokenpath's C++ kernels once" in err
    assert "Waiting for another process" not in err

    third = _one_function_builder(env, source, "from engine.model.loader import tiny_model", "tiny_model()")
    out, err = third.communicate(timeout=300)
    assert third.returncode == 0 and "Building" not in err, err  # built once, imported afterwards


def test_a_live_builder_is_waited_for(tmp_path, monkeypatch):
    """While another process holds the builder lock, a second build waits for it (and says so)."""
    monkeypatch.setenv("TOKENPATH_BUILD", str(tmp_path))
    folder = cpu_kernels.build_directory()
    folder.mkdir(parents=True)
    holder = _builder({**os.environ, "TOKENPATH_BUILD": str(tmp_path)},
                      "import fcntl, sys, time", f"f = open({str(folder / 'owner.lock')!r}, 'w')",
                      "fcntl.flock(f, fcntl.LOCK_EX)", "print('held', flush=True)", "time.sleep(600)")
    assert holder.stdout.readline().strip() == "held"
    waiter = _builder({**os.environ, "TOKENPATH_BUILD": str(tmp_path)},
                      "import engine.model.cpu_kernels as k",
                      "k.is_built = lambda: True", "k._import = lambda d: 'imported'", "print(k.build())")
    # its first word on the lock, however long its imports take on a busy machine
    said = next((line for line in iter(waiter.stderr.readline, "") if "Waiting for another process" in line), "")
    assert said and waiter.poll() is None, waiter.communicate()  # it says it waits, and still waits
    os.killpg(holder.pid, signal.SIGKILL)
    holder.wait(timeout=60)
    out, err = waiter.communicate(timeout=120)
    assert waiter.returncode == 0 and out.strip() == "imported", err


def test_a_non_editable_install_gives_a_working_command_that_finds_its_data(tmp_path):
    """pip install (not -e) of a copy of the sources into a folder of its own: its `tokenpath` command,
    run from elsewhere, reads the shipped data from the package and writes runs to the user's folder."""
    import json
    import shutil

    source = tmp_path / "source"  # a copy, so the build writes nothing into the checkout
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "requirements.txt", "requirements-test.txt", "ui.py", "browser.py"):
        shutil.copy(ROOT / name, source / name)
    for folder in ("engine", "data"):
        shutil.copytree(ROOT / folder, source / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "models", "*.duckdb*", "journals*"))
    target = tmp_path / "installed"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(target), str(source)], check=True, timeout=600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENPATH_")}
    env.update(PYTHONPATH=str(target), XDG_DATA_HOME=str(tmp_path / "user"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def tokenpath(*args):
        done = subprocess.run([str(target / "bin" / "tokenpath"), *args], cwd=elsewhere, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout

    where = subprocess.run([sys.executable, "-c", "import engine.paths as p; print(p.CHECKOUT, p.DATA)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120).stdout.split()
    assert where == ["False", str(target / "engine" / "data")]  # the installed copy, not the checkout
    kernels = ROOT / "engine" / "model" / "kernels"  # the sources the installed command builds its kernels from
    assert sorted(p.name for p in (target / "engine" / "model" / "kernels").iterdir()) == sorted(
        p.name for p in kernels.iterdir() if p.suffix in (".cpp", ".h"))
    plan = json.loads(tokenpath("plan", "--model", "llama-3.1-8b", "--gpu", "h100-80gb-sxm", "--json"))
    assert plan["decode_ms_per_token"] > 0 and plan["distances_ms"]["memory"] > 0  # the data sheets were read
    assert json.loads(tokenpath("runs", "--json")) == []
    assert (tmp_path / "user" / "tokenpath" / "runs.duckdb").is_file()  # not inside the installed package
    assert not list(target.glob("engine/data/*.duckdb"))
