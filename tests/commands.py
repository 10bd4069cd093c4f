"""`python -m engine ARGS` and `python -c CODE` for the tests, each in a process of its own, forked from a server
that has imported the engine and its libraries once.

A new interpreter spends 5-7 s of CPU importing torch, transformers and DuckDB before a command does anything,
and the suite runs hundreds of commands. The server (one per test process) imports them, then forks a process
for each command: the command has its own pid, environment, working folder, standard streams, exit status
and signals, and runs as `python -m` or `python -c` would run it. A command whose environment changes what the
libraries read as they load (OpenMP's settings, Python's, the store's timing knobs) starts a new interpreter
instead, as do the tests that check what a command imports or what happens while it imports.

Run as a script, this module is the server: it answers on the listening socket it is given and ends when the
pipe on its standard input closes (its test process has gone)."""
from __future__ import annotations

import atexit
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
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PRELOAD = ("torch", "transformers", "transformers.models.llama.modeling_llama", "duckdb", "pandas",
           "engine.cli.main", "engine.run.generate", "openai", "prometheus_client", "scipy.stats",
           "plotly.graph_objects")
# what is read as the interpreter or a library starts: a command that sets one of these gets a new interpreter
READ_AT_START = ("OMP_", "GOMP_", "KMP_", "MKL_", "PYTHON", "LD_", "TOKENPATH_OPENMP", "TOKENPATH_WRITE_EVERY_S",
                 "TOKENPATH_LOCK_WAIT_S", "XDG_DATA_HOME")
HEADER = struct.Struct("!Q")


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise EOFError("the test process closed the connection")
        data += chunk
    return data


def _become_command(conn: socket.socket, listener: socket.socket, fds: list[int], request: dict) -> None:
    """In the forked command process: its streams, folder, environment and signals, as a new process has them."""
    conn.close()
    listener.close()
    for target, fd in enumerate(fds):
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


def _answer(conn: socket.socket, listener: socket.socket) -> bool:
    """One request: fork a watcher that forks the command, reports its pid and then its exit status.
    True in the command process (which goes on to run the command), False in the server."""
    (length,) = HEADER.unpack(_recv_exactly(conn, HEADER.size))
    request = json.loads(_recv_exactly(conn, length))
    _, fds, _, _ = socket.recv_fds(conn, 1, 3)
    if os.fork() != 0:  # the server: the watcher owns the connection and the streams now
        conn.close()
        for fd in fds:
            os.close(fd)
        return False
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        _become_command(conn, listener, fds, request)
        return True
    for fd in fds:
        os.close(fd)
    try:
        conn.sendall(f"{pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
    finally:
        os._exit(0)


def serve(listener: socket.socket) -> None:
    """Import the libraries, then answer requests until standard input closes; returns only in a command."""
    sys.path[0] = str(REPO)  # the script's own folder (tests/) would not be on a command's path
    import engine  # noqa: F401  (first: it chooses how OpenMP waits before torch loads OpenMP)
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the watchers are reaped as they end
    sys.stdout.flush()
    while True:
        ready, _, _ = select.select([listener, sys.stdin], [], [])
        if sys.stdin in ready:
            return os._exit(0)
        conn, _ = listener.accept()
        with conn:
            if _answer(conn, listener):
                return


class _Server:
    """This test process's fork server, started at its first command and ended with the process."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="tokenpath-forks-")
        self.path = os.path.join(self.folder, "socket")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(16)
        self.env = _command_env(None)
        self.process = subprocess.Popen([sys.executable, __file__, str(self.listener.fileno())], cwd=REPO,
                                        stdin=subprocess.PIPE, pass_fds=[self.listener.fileno()], env=self.env)
        atexit.register(self.close)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)
        self.listener.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def takes(self, env: dict) -> bool:
        """Whether a command with this environment can be forked from the server's libraries as they loaded."""
        names = set(env) | set(self.env)
        return all(env.get(k) == self.env.get(k) for k in names if k.startswith(READ_AT_START))


_server: _Server | None = None
_lock = threading.Lock()


def _fork_server() -> _Server:
    global _server
    with _lock:
        if _server is None or _server.process.poll() is not None:
            _server = _Server()
        return _server


class ForkedProcess:
    """A command forked by the server, with the part of subprocess.Popen's interface the tests use (text streams)."""

    def __init__(self, argv: list[str], conn: socket.socket, stdout: int | None, stderr: int | None):
        self.args, self.returncode, self._conn, self._received = ["python", *argv], None, conn, b""
        self.stdout = open(stdout, "r") if stdout is not None else None
        self.stderr = open(stderr, "r") if stderr is not None else None
        self.pid = int(self._line(None))

    def _line(self, timeout: float | None) -> str | None:
        """The server's next line (the pid, then the exit status), or None if none came within timeout."""
        while b"\n" not in self._received:
            if not select.select([self._conn], [], [], timeout)[0]:
                return None
            chunk = self._conn.recv(64)
            if not chunk:
                raise EOFError("the fork server ended before the command did")
            self._received += chunk
        line, self._received = self._received.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        if self.returncode is None:
            self._ended(self._line(0))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not self._ended(self._line(timeout)):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def _ended(self, status: str | None) -> bool:
        if status is not None:
            self.returncode = int(status)
            self._conn.close()
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

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        """Both streams read to their end and the exit awaited; TimeoutExpired past timeout (the command runs on)."""
        read = {}
        readers = [threading.Thread(target=lambda name, f: read.update({name: f.read()}), args=(name, f), daemon=True)
                   for name, f in (("out", self.stdout), ("err", self.stderr)) if f is not None]
        for reader in readers:
            reader.start()
        self.wait(timeout)
        for reader in readers:
            reader.join()
        return read.get("out"), read.get("err")


def _stream(choice: int, ends: list) -> int:
    """The command's end of one of its streams: a pipe whose other end the caller keeps, or /dev/null."""
    if choice == subprocess.PIPE:
        mine, theirs = os.pipe()
        ends.append(mine)
        return theirs
    ends.append(None)
    return os.open(os.devnull, os.O_RDWR)


def _command_env(env: dict | None) -> dict:
    """The environment as given (default: this process's), with the checkout on Python's path."""
    return {"PYTHONPATH": str(REPO), **(os.environ if env is None else env)}


def start_python(*argv, env: dict | None = None, cwd: Path = REPO, stdout: int = subprocess.PIPE,
                 stderr: int = subprocess.PIPE, fresh: bool = False) -> ForkedProcess | subprocess.Popen:
    """`python -m MODULE ARGS` or `python -c CODE ARGS` started, its streams piped as text or sent to /dev/null
    (subprocess.PIPE or DEVNULL), its standard input /dev/null. `env` is the whole environment (default: this
    process's); `fresh` starts a new interpreter."""
    argv = [os.fsdecode(a) if isinstance(a, bytes) else str(a) for a in argv]
    assert argv[0] in ("-m", "-c"), argv
    env = _command_env(env)
    server = None if fresh else _fork_server()
    if server is None or not server.takes(env):
        return subprocess.Popen([sys.executable, *argv], cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=stdout,
                                stderr=stderr, text=True)
    request = json.dumps({"argv": argv, "env": env, "cwd": str(cwd)}).encode()
    ends: list = []
    theirs = [os.open(os.devnull, os.O_RDONLY), _stream(stdout, ends), _stream(stderr, ends)]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(server.path)
        conn.sendall(HEADER.pack(len(request)) + request)
        socket.send_fds(conn, [b"\0"], theirs)
    finally:
        for fd in theirs:
            os.close(fd)
    return ForkedProcess(argv, conn, *ends)


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


def start_engine(*args, **kwargs) -> ForkedProcess | subprocess.Popen:
    """`python -m engine ARGS` started (start_python)."""
    return start_python("-m", "engine", *args, **kwargs)


def run_engine(*args, **kwargs) -> subprocess.CompletedProcess:
    """`python -m engine ARGS` run to its end (run_python)."""
    return run_python("-m", "engine", *args, **kwargs)


def _run_and_exit() -> None:
    """Run sys.argv (from _become_command) and end as the interpreter ends a script (its exit code, its traceback,
    non-daemon threads joined, atexit functions run, streams flushed), but without tearing down the thousands of
    modules the server imported, which takes a second a command."""
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


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
    _run_and_exit()
