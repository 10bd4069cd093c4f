"""`python -m engine ARGS` and `python -c CODE` for the tests, each in a process of its own, forked by this test
process's launcher (engine.launch), which has imported the engine and its libraries once: a command costs about
a second instead of 5-7 s of imports. The launcher is named in this process's environment, so the pages,
commands and servers the tests start fork their own processes (generation workers, load sweeps, capacity
searches) from it too. A command whose environment changes what the libraries read as they load, and a test
that asks for one (fresh=True: the tests of what a command imports, or of what happens while it imports),
start a new interpreter."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from engine import launch

REPO = Path(__file__).resolve().parent.parent
_launcher: launch.Launcher | None = None
_lock = threading.Lock()


def use_launcher() -> str:
    """This test process's launcher, started once (and again if it died) and named in the environment; its
    socket's path."""
    global _launcher
    with _lock:
        if _launcher is None or _launcher.process.poll() is not None:
            _launcher = launch.Launcher()
            os.environ[launch.LAUNCHER_ENV] = _launcher.path
        return _launcher.path


def start_python(*argv, env: dict | None = None, cwd: Path = REPO, stdout: int = subprocess.PIPE,
                 stderr: int = subprocess.PIPE, fresh: bool = False):
    """`python -m MODULE ARGS` or `python -c CODE ARGS` started, its streams piped as text or sent to /dev/null
    (subprocess.PIPE or DEVNULL), its standard input /dev/null. `env` is the whole environment (default: this
    process's); `fresh` starts a new interpreter."""
    argv = [os.fsdecode(a) if isinstance(a, bytes) else str(a) for a in argv]
    assert argv[0] in ("-m", "-c"), argv
    env = dict(os.environ if env is None else env)
    if not fresh:
        env[launch.LAUNCHER_ENV] = use_launcher()
        forked = launch.fork(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                             text=True)
        if forked is not None:
            return forked
    return subprocess.Popen([sys.executable, *argv], cwd=cwd, env={"PYTHONPATH": str(REPO), **env},
                            stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, text=True)


def run_python(*argv, env: dict | None = None, cwd: Path = REPO, timeout: float = 600,
               fresh: bool = False) -> subprocess.CompletedProcess:
    """`python ARGV` run to its end, its output captured as text (as subprocess.run with capture_output=True,
    text=True): killed and TimeoutExpired past timeout."""
    process = start_python(*argv, env=env, cwd=cwd, fresh=fresh)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def start_engine(*args, **kwargs):
    """`python -m engine ARGS` started (start_python)."""
    return start_python("-m", "engine", *args, **kwargs)


def run_engine(*args, **kwargs) -> subprocess.CompletedProcess:
    """`python -m engine ARGS` run to its end (run_python)."""
    return run_python("-m", "engine", *args, **kwargs)
