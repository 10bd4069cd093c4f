"""The engine's own Python processes (a generation worker, a load sweep, a capacity search), started as
`python -m MODULE ARGS` would start them, or forked from a launcher that has imported the libraries already.

A new interpreter spends 5-7 s of CPU importing torch, transformers and DuckDB before it does anything. A
launcher (`python -m engine.launch FD`, answering on the listening Unix socket FD; Launcher starts one) imports
them once, then forks a process for each request: the process has its own pid, environment, working folder,
standard streams, the file descriptors it was passed, exit status and signals, and runs its module or code as
`python -m` or `python -c` would. TOKENPATH_LAUNCHER names the launcher's socket; where it names none, the
launcher is gone, or a process's environment changes what the libraries read as they load (OpenMP's settings,
Python's, the data folder), start_python starts a new interpreter instead. The test suite runs one
launcher per test process: its commands, pages and servers start their processes through it."""
from __future__ import annotations

import atexit
import fcntl
import json
import os
import runpy
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import traceback

from engine.paths import REPO_ROOT

LAUNCHER_ENV = "TOKENPATH_LAUNCHER"
# what the engine's processes import, but not a module they run as __main__ (runpy warns of one imported already)
PRELOAD = ("torch", "transformers", "transformers.models.llama.modeling_llama", "duckdb", "pandas",
           "engine.cli.main", "engine.run.generate", "engine.run.open", "engine.run.local", "openai",
           "prometheus_client", "scipy.stats", "plotly.graph_objects", "streamlit.web.cli")
# what is read as the interpreter or a library starts: a process whose environment differs from the launcher's
# in one of these gets a new interpreter
READ_AT_START = ("OMP_", "GOMP_", "KMP_", "MKL_", "PYTHON", "LD_", "TOKENPATH_OPENMP", "XDG_DATA_HOME")
HEADER = struct.Struct("!Q")
REFUSED = "refused"


def read_at_start(env) -> dict:
    return {k: v for k, v in env.items() if k.startswith(READ_AT_START)}


# --- the launcher -----------------------------------------------------------------------------------------------

def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise EOFError("the caller closed the connection")
        data += chunk
    return data


def _become(conn: socket.socket, listener: socket.socket, fds: list[int], request: dict) -> None:
    """In the forked process: its streams and passed descriptors, folder, environment and signals, as a new
    process started with them has them."""
    conn.close()
    listener.close()
    targets = [0, 1, 2, *request["pass_fds"]]
    above = max(targets) + 1  # out of the way of every target before any is overwritten
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, above) for fd in fds]
    for fd in fds:
        os.close(fd)
    for target, fd in zip(targets, moved):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    sys.argv = request["argv"]  # ["-m", MODULE, ...] or ["-c", CODE, ...], read by _run_and_exit
    sys.path[0] = request["cwd"] if sys.argv[0] == "-m" else ""  # the working folder, as `python -m` and `-c` put it


def _answer(conn: socket.socket, listener: socket.socket, started_with: dict) -> bool:
    """One request: refused where its environment differs from the launcher's in what loads at start; else a
    watcher forked, which forks the process, reports its pid and then its exit status. True in the forked
    process (which goes on to run its module or code), False in the launcher."""
    (length,) = HEADER.unpack(_recv_exactly(conn, HEADER.size))
    request = json.loads(_recv_exactly(conn, length))
    _, fds, _, _ = socket.recv_fds(conn, 1, 3 + len(request["pass_fds"]))
    if read_at_start(request["env"]) != started_with:
        conn.sendall(f"{REFUSED}\n".encode())
    elif os.fork() == 0:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        pid = os.fork()
        if pid == 0:
            _become(conn, listener, fds, request)
            return True
        for fd in fds:
            os.close(fd)
        try:
            conn.sendall(f"{pid}\n".encode())
            _, status = os.waitpid(pid, 0)
            conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
        finally:
            os._exit(0)
    conn.close()  # the watcher owns the connection and the descriptors now
    for fd in fds:
        os.close(fd)
    return False


def serve(listener: socket.socket) -> None:
    """Import the libraries, then answer requests until standard input closes (whoever started the launcher has
    gone); returns only in a forked process."""
    import importlib

    started_with = read_at_start(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the watchers are reaped as they end
    sys.stdout.flush()
    while True:
        ready, _, _ = select.select([listener, sys.stdin], [], [])
        if sys.stdin in ready:
            os._exit(0)
        conn, _ = listener.accept()
        with conn:
            if _answer(conn, listener, started_with):
                return


def _run_and_exit() -> None:
    """Run sys.argv (from _become) and end as the interpreter ends a script (its exit code, its traceback,
    non-daemon threads joined, atexit functions run, streams flushed), but without tearing down the thousands of
    modules the launcher imported, which takes a second a process."""
    option, target, *rest = sys.argv
    try:
        if option == "-m":
            sys.argv = [target, *rest]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *rest]
            exec(compile(target, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if code == -signal.SIGINT:  # as the interpreter does: end by the signal, so the parent sees it
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


class Launcher:
    """A launcher started by this process, ended with it."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="tokenpath-launcher-")
        self.path = os.path.join(self.folder, "socket")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(16)
        self.process = subprocess.Popen([sys.executable, "-m", "engine.launch", str(self.listener.fileno())],
                                        cwd=REPO_ROOT, stdin=subprocess.PIPE, pass_fds=[self.listener.fileno()])
        self.listener.close()  # the launcher's copy alone listens: once it has gone, a caller's connect fails
        atexit.register(self.close)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)
        shutil.rmtree(self.folder, ignore_errors=True)


# --- the processes ----------------------------------------------------------------------------------------------

class _Lines:
    """The launcher's lines on one connection: a pid or "refused", then the exit status."""

    def __init__(self, conn: socket.socket):
        self.conn, self._received = conn, b""

    def next(self, timeout: float | None) -> str | None:
        """The next line, or None if none came within timeout."""
        while b"\n" not in self._received:
            if not select.select([self.conn], [], [], timeout)[0]:
                return None
            chunk = self.conn.recv(64)
            if not chunk:
                raise EOFError("the launcher ended before the process did")
            self._received += chunk
        line, self._received = self._received.split(b"\n", 1)
        return line.decode()


class ForkedProcess:
    """A process forked by the launcher, with subprocess.Popen's interface for what the engine and its tests use."""

    def __init__(self, argv: list[str], lines: _Lines, pid: int, stdout: int | None, stderr: int | None,
                 text: bool):
        self.args, self.pid, self.returncode, self._lines = ["python", *argv], pid, None, lines
        mode = "r" if text else "rb"
        self.stdout = open(stdout, mode) if stdout is not None else None
        self.stderr = open(stderr, mode) if stderr is not None else None
        self._read: dict = {}
        self._readers: list[threading.Thread] = []

    def poll(self) -> int | None:
        if self.returncode is None:
            self._ended(self._lines.next(0))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not self._ended(self._lines.next(timeout)):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def _ended(self, status: str | None) -> bool:
        if status is not None:
            self.returncode = int(status)
            self._lines.conn.close()
        return status is not None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # it ended (its watcher reaped it) and its status is on its way
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, timeout: float | None = None):
        """Both piped streams read to their end and the exit awaited; TimeoutExpired past timeout (the process
        runs on, and a later call goes on reading)."""
        if not self._readers:
            self._readers = [threading.Thread(target=lambda n, f: self._read.update({n: f.read()}), args=(n, f),
                                              daemon=True)
                             for n, f in (("out", self.stdout), ("err", self.stderr)) if f is not None]
            for reader in self._readers:
                reader.start()
        self.wait(timeout)
        for reader in self._readers:
            reader.join()
        return self._read.get("out"), self._read.get("err")


def _stream(choice, own: int, ends: list, close: list) -> int:
    """The forked process's end of one of its streams: inherited (None: this process's own), a pipe whose other
    end the caller keeps (subprocess.PIPE), /dev/null (subprocess.DEVNULL), or a file or descriptor given."""
    if choice is None:
        ends.append(None)
        return own
    if choice == subprocess.PIPE:
        if own == 0:
            raise ValueError("a forked process's standard input is inherited, /dev/null or a file, not a pipe")
        mine, theirs = os.pipe()
        ends.append(mine)
        close.append(theirs)
        return theirs
    ends.append(None)
    if choice == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        close.append(fd)
        return fd
    return choice if isinstance(choice, int) else choice.fileno()


def fork(argv: list[str], *, env: dict, cwd, stdin=None, stdout=None, stderr=None, pass_fds=(),
         text: bool = False) -> ForkedProcess | None:
    """`python ARGV` forked by the launcher TOKENPATH_LAUNCHER names (in env); None where none is named, it is
    gone, or it cannot take this environment."""
    path = env.get(LAUNCHER_ENV)
    if not path:
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ends: list = []
    close: list = []
    try:
        theirs = [_stream(stdin, 0, ends, close), _stream(stdout, 1, ends, close)]
        if stderr == subprocess.STDOUT:
            ends.append(None)
            theirs.append(theirs[1])
        else:
            theirs.append(_stream(stderr, 2, ends, close))
        theirs += pass_fds
        request = json.dumps({"argv": argv, "env": dict(env), "cwd": str(cwd), "pass_fds": list(pass_fds)}).encode()
        conn.connect(path)
        conn.sendall(HEADER.pack(len(request)) + request)
        socket.send_fds(conn, [b"\0"], theirs)
        lines = _Lines(conn)
        first = lines.next(None)
    except (OSError, EOFError):
        first = REFUSED
    finally:
        for fd in close:
            os.close(fd)
    if first == REFUSED:
        conn.close()
        for fd in ends:
            if fd is not None:
                os.close(fd)
        return None
    return ForkedProcess(argv, lines, int(first), ends[1], ends[2], text)


def start_python(argv: list[str], *, env: dict | None = None, cwd=REPO_ROOT, stdin=None, stdout=None, stderr=None,
                 pass_fds=(), text: bool = False) -> ForkedProcess | subprocess.Popen:
    """`python ARGV` (["-m", MODULE, ...] or ["-c", CODE, ...]), forked by the launcher where one is named and
    can take it, else a new interpreter; streams as subprocess.Popen takes them (stderr may be
    subprocess.STDOUT)."""
    env = dict(os.environ if env is None else env)
    forked = fork(argv, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr, pass_fds=pass_fds, text=text)
    if forked is not None:
        return forked
    return subprocess.Popen([sys.executable, *argv], cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr,
                            pass_fds=pass_fds, text=text)


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
    _run_and_exit()
