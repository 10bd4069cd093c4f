"""The launcher (engine.launch): a process it forks has what a new interpreter started the same way would have:
its own pid, environment, folder, arguments, streams, passed descriptors, exit status and signals; where it
cannot take the environment, or none is running, start_python starts a new interpreter."""
import os
import signal
import subprocess
import sys

import pytest

from engine import launch

SHOW = """
import json, os, sys
os.write(int(sys.argv[1]), b"through the passed descriptor")
print(json.dumps({"pid": os.getpid(), "argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("ONLY_HERE"),
                  "path0": sys.path[0], "sigint": str(__import__("signal").getsignal(2))}))
print("to stderr", file=sys.stderr)
raise SystemExit(7)
"""


@pytest.fixture(scope="module")
def launcher():
    started = launch.Launcher()
    yield started
    started.close()


def env_of(launcher, **extra) -> dict:
    return {**os.environ, launch.LAUNCHER_ENV: launcher.path, **extra}


def show(env, tmp_path):
    """SHOW started through start_python with a pipe passed by its descriptor's number: the process, what it
    printed, and what came through the pipe."""
    read, write = os.pipe()
    try:
        process = launch.start_python(["-c", SHOW, str(write)], env=env, cwd=tmp_path, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(write,), text=True)
    finally:
        os.close(write)
    out, err = process.communicate(timeout=300)
    with os.fdopen(read, "rb") as passed:
        return process, out, err, passed.read()


def test_a_forked_process_has_what_a_new_interpreter_has(launcher, tmp_path):
    import json

    forked, out, err, passed = show(env_of(launcher, ONLY_HERE="yes"), tmp_path)
    new, new_out, new_err, new_passed = show({**os.environ, "ONLY_HERE": "yes", launch.LAUNCHER_ENV: ""}, tmp_path)
    assert isinstance(forked, launch.ForkedProcess) and isinstance(new, subprocess.Popen)
    assert forked.returncode == new.returncode == 7
    assert passed == new_passed == b"through the passed descriptor"
    assert err == new_err == "to stderr\n"
    seen, seen_new = json.loads(out), json.loads(new_out)
    assert seen["pid"] == forked.pid != os.getpid()
    assert seen["argv"][0] == seen_new["argv"][0] == "-c" and len(seen["argv"]) == len(seen_new["argv"]) == 2
    for key in ("cwd", "env", "path0", "sigint"):
        assert seen[key] == seen_new[key], key


@pytest.mark.parametrize("code, expected", [
    ("raise KeyboardInterrupt", -signal.SIGINT),
    ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -signal.SIGTERM),
    ("raise SystemExit('a sentence')", 1),
    ("1 / 0", 1),
    ("import threading, time; threading.Thread(target=lambda: (time.sleep(0.5), print('joined'))).start()", 0),
])
def test_the_exit_status_is_the_one_a_new_interpreter_gives(launcher, code, expected):
    process = launch.start_python(["-c", code], env=env_of(launcher), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
    assert isinstance(process, launch.ForkedProcess)
    out, err = process.communicate(timeout=300)
    assert process.returncode == expected, err
    if expected == 0:
        assert out == "joined\n"  # non-daemon threads are joined before the process ends, as at an interpreter's exit


def test_signals_reach_the_forked_process_and_a_timeout_keeps_reading(launcher):
    process = launch.start_python(["-c", "import time; print('started', flush=True); time.sleep(600)"],
                                  env=env_of(launcher), stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "started\n"
    with pytest.raises(subprocess.TimeoutExpired):
        process.communicate(timeout=0.2)
    assert process.poll() is None
    process.terminate()
    assert process.communicate(timeout=60) == ("", None) and process.returncode == -signal.SIGTERM
    process.kill()  # ended already: nothing to signal, as with Popen


def test_what_the_launcher_cannot_take_starts_a_new_interpreter(launcher, tmp_path):
    other_threads = launch.start_python(["-c", "import os; print(os.environ['OMP_NUM_THREADS'])"],
                                        env=env_of(launcher, OMP_NUM_THREADS="7"), stdout=subprocess.PIPE, text=True)
    assert isinstance(other_threads, subprocess.Popen) and other_threads.communicate(timeout=300)[0] == "7\n"
    none_named = launch.start_python(["-c", "print(1)"], env={**os.environ, launch.LAUNCHER_ENV: ""},
                                     stdout=subprocess.PIPE)
    assert isinstance(none_named, subprocess.Popen) and none_named.communicate(timeout=300)[0] == b"1\n"
    gone = launch.start_python(["-c", "print(1)"], env={**os.environ, launch.LAUNCHER_ENV: str(tmp_path / "gone")},
                               stdout=subprocess.PIPE)
    assert isinstance(gone, subprocess.Popen) and gone.communicate(timeout=300)[0] == b"1\n"


def test_a_module_runs_as_python_dash_m_runs_it(launcher):
    process = launch.start_python(["-m", "engine", "runs", "--no-such-option"], env=env_of(launcher),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = process.communicate(timeout=300)
    new = subprocess.run([sys.executable, "-m", "engine", "runs", "--no-such-option"], capture_output=True, text=True,
                         timeout=300)
    assert isinstance(process, launch.ForkedProcess)
    assert (process.returncode, out, err) == (new.returncode, new.stdout, new.stderr) and process.returncode == 2
