"""vLLM's CPU build serving the default model on 127.0.0.1 from its own venv (.venv-vllm):
start it, wait until it answers, stop it with everything it started."""
from __future__ import annotations

import ctypes.util
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx2

from engine import foreign_env
from engine.errors import UserError
from engine.paths import DEFAULT_MODEL_NAME, REPO_ROOT

VLLM_VENV = REPO_ROOT / ".venv-vllm"
HOST = "127.0.0.1"
# the first start compiles the model's graphs (minutes on two cores); later starts reuse the cache
START_TIMEOUT_S = 900.0
DTYPES = ("bfloat16", "float32")
MAX_THREADS = 1024
# the scheduler's limits, given explicitly so a plan of this server knows them: vLLM's own defaults for its CPU build's
# API server (vllm/engine/arg_utils.py, get_batch_defaults), with chunked prefill and prefix caching on (its defaults)
MAX_NUM_SEQS = 128
MAX_BATCHED_TOKENS = 2048
KV_CACHE_GIB = 2  # VLLM_CPU_KVCACHE_SPACE: the KV cache's room, kept small beside what else runs here


class VLLMError(UserError):
    """vLLM could not be started; the message is one sentence for the user."""


def vllm_python() -> Path:
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        raise VLLMError(f"vLLM's venv {VLLM_VENV} is missing: build it with `make vllm` (about 3.4 GB, a few minutes).")
    return python


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def server_env(threads: int) -> dict:
    """The environment vLLM's CPU build needs here: offline, a small KV cache, OpenMP threads not
    pinned (the cores are shared), tcmalloc and Intel's OpenMP preloaded, and OpenMP's wait between regions
    its own (or the user's), not the one Tokenpath chose for itself."""
    env = {**foreign_env(), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "OMP_NUM_THREADS": str(threads), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    preload = [p for p in (_tcmalloc(), VLLM_VENV / "lib" / "libiomp5.so") if p and Path(p).exists()]
    if preload:
        env["LD_PRELOAD"] = ":".join(str(p) for p in preload)
    return env


def _tcmalloc() -> str | None:
    for folder in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"):
        candidate = Path(folder) / "libtcmalloc_minimal.so.4"
        if candidate.exists():
            return str(candidate)
    return ctypes.util.find_library("tcmalloc_minimal")


class VLLMServer:
    """One vLLM process group. Use as a context manager, or call start() and stop()."""

    def __init__(self, port: int | None = None, dtype: str = "bfloat16", threads: int = 1,
                 max_model_len: int = 2048, log_path: str | Path | None = None, extra_args: list[str] | None = None,
                 api_key: str | None = None, max_num_seqs: int = MAX_NUM_SEQS):
        if dtype not in DTYPES:
            raise VLLMError(f"Unknown dtype '{dtype}' for vLLM: use one of {', '.join(DTYPES)}.")
        if port is not None and not 1 <= port <= 65535:
            raise VLLMError(f"--port must be a port number from 1 to 65535, not {port}; leave it out for a free one.")
        if not 1 <= threads <= MAX_THREADS:
            raise VLLMError(f"--threads must be a whole number from 1 to {MAX_THREADS}, not {threads}.")
        self.port = port or free_port()
        self.dtype, self.threads, self.max_model_len = dtype, threads, max_model_len
        self.max_num_seqs = max_num_seqs  # sequences a step takes at most
        self.log_path = Path(log_path) if log_path else Path(f"/tmp/tokenpath-vllm-{self.port}.log")
        self.extra_args = list(extra_args or [])
        self.api_key = api_key  # handed over in the environment, so it never shows in the process list
        self.process: subprocess.Popen | None = None
        self.model_name = DEFAULT_MODEL_NAME

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def command(self) -> list[str]:
        from engine.model.loader import default_model_dir  # torch loads only when a server starts
        return [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(default_model_dir()),
                "--served-model-name", self.model_name, "--host", HOST, "--port", str(self.port),
                "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
                "--max-num-seqs", str(self.max_num_seqs), "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS),
                "--disable-uvicorn-access-log", *self.extra_args]

    def start(self, timeout_s: float = START_TIMEOUT_S, on_wait=None) -> str:
        """Start the server and return its URL once it reports itself healthy."""
        if _port_taken(self.port):
            raise VLLMError(f"Port {self.port} on {HOST} is already in use: pick another with --port.")
        command = self.command()
        log = open(self.log_path, "w")
        env = server_env(self.threads)
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        cwd=REPO_ROOT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log_tail()
                self.process = None
                raise VLLMError(f"vLLM exited while starting (log {self.log_path}): {tail}")
            if _answers(self.url):
                return self.url
            if on_wait:
                on_wait(time.monotonic() - (deadline - timeout_s))
            time.sleep(1.0)
        self.stop()
        raise VLLMError(f"vLLM did not answer within {timeout_s:.0f} s (log {self.log_path}).")

    def log_tail(self, lines: int = 3) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "no log"
        return " | ".join(text[-lines:])[-600:]

    def stop(self, timeout_s: float = 30.0) -> None:
        """End the server's whole process group (its engine core runs in a child process)."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=timeout_s)
        except ProcessLookupError:
            pass
        self.process = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()


def _port_taken(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex((HOST, port)) == 0


def _answers(url: str) -> bool:
    try:  # /health needs no key
        return httpx2.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx2.HTTPError:
        return False
