"""Model work in a process of its own, for the dashboard: generations, sweeps, calibration.

The worker is a plain Python process whose main thread runs the model, as the command line does, so
the model never shares a process (or a Python interpreter lock) with the Streamlit server; it keeps
the loaded models between runs and sends new tokens in batches, as often as the page redraws, since
each message wakes the page's process, which then takes a core from the model (bench/ui.py measures
what that costs). A stop message cancels the run, which the engine records as cancelled.

Messages to the worker: a request dict ({"db", "spec": RunSpec.to_dict(), "every_s"} for a
generation, {"db", "device", "calibrate": True} for a fresh calibration (with "missing_only": True, one
only where none can be found or reused), {"db", "spec", "warm": True} to load a model ahead of its first
run), "stop", or None (quit). From it:
("ready", {run_id, special_ids, tokens}) once the first step is out, with its rows (so a page shows the
first token at once), ("tokens", [rows]) in batches, and one message that ends the
request: ("done", summary), ("refused", sentence) for input the engine turns down, or ("failed",
sentence) for an engine failure. A spec with users > 1 runs as one batch (engine.run.local.BatchRun):
its rows carry their run_id and user (0: the spec's own prompt), and its run_id is user 0's. Every
generation's summary carries users, tokens_per_s_total, tokens_per_s_per_user, run_ids and
bytes_per_token (engine.run.local.load_figures), a lone run's with users 1.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

from engine import access, launch
from engine.measure import hardware
from engine.address import ServedRunError
from engine.errors import UserError
from engine.model.loader import pick_device
from engine.run.local import load_figures
from engine.run.open import open_run
from engine.run.prepare import prepare
from engine.store.record import RecordDeferred
from engine.spec import RunSpec
from engine.store.db import Store, store_at


ENDINGS = ("done", "refused", "failed")
# the page shows a spinner only for a start slower than this: the spinner's removal is a redraw that
# would otherwise land on the first decode steps of every run
SLOW_START_S = 0.3


class WorkerRefused(Exception):
    """Input the engine turned down, in one sentence; nothing was run."""


class WorkerFailed(Exception):
    """The engine failed during the run (recorded with status error), or the worker process died."""


class GenerationWorker:
    """One worker process, started on first use and again if it dies; one generation at a time."""

    def __init__(self):
        self._process: subprocess.Popen | launch.ForkedProcess | None = None
        self._conn: _Duplex | None = None
        self._lock = threading.Lock()
        self._running = False  # a request sent whose ending message has not been read yet

    def _connection(self) -> _Duplex:
        if self._process is None or self._process.poll() is not None:
            to_worker_r, to_worker_w = os.pipe()
            from_worker_r, from_worker_w = os.pipe()
            self._process = launch.start_python(["-m", "engine.run.worker", str(to_worker_r), str(from_worker_w)],
                                                pass_fds=(to_worker_r, from_worker_w))
            os.close(to_worker_r)
            os.close(from_worker_w)
            self._conn = _Duplex(from_worker_r, to_worker_w)
        return self._conn

    def generate(self, request: dict, every_s: float, on_run_id=None):
        """Run one request. Yields ("preparing", None) if the first token is not out within
        SLOW_START_S (a model or variant is being loaded), ("ready", {"run_id", "run_ids", "special_ids",
        "tokens"}) once it is (a generation's first rows; run_ids: every run of a batch, the request's own
        first), then ("tokens", new rows) about every `every_s` seconds, and last ("done", summary).
        Closing the generator early stops the run, which is then recorded as cancelled.
        on_run_id(run_id) is called as soon as the run has a number, also when the generator is
        closed before it yielded "ready"."""
        with self._lock:
            conn = self._connection()
            conn.send({**request, "every_s": every_s})
            self._running = True
            try:
                if not conn.poll(SLOW_START_S):
                    yield "preparing", None
                what, payload = self._receive(conn, on_run_id)
                if what != "ready":
                    self._raise(what, payload)
                yield what, payload
                while True:
                    what, payload = self._receive(conn)
                    if what not in ("tokens", "done"):
                        self._raise(what, payload)
                    yield what, payload
                    if what == "done":
                        return
            finally:
                if self._running:
                    self._stop(conn, on_run_id)

    def _receive(self, conn: _Duplex, on_run_id=None):
        try:
            what, payload = conn.recv()
        except (EOFError, OSError):
            self._running = False
            code = self._process.wait()
            self._process = None
            raise WorkerFailed(f"The generation process ended unexpectedly (exit code {code}); it starts again "
                               "with the next run, and a run it had begun is kept as interrupted.") from None
        if what in ENDINGS:
            self._running = False
        elif what == "ready" and on_run_id:
            on_run_id(payload["run_id"])
        return what, payload

    @staticmethod
    def _raise(what: str, payload):
        raise (WorkerRefused if what == "refused" else WorkerFailed)(payload)

    def _stop(self, conn: _Duplex, on_run_id) -> None:
        """Ask the worker to stop the run and wait until it has recorded it."""
        try:
            conn.send("stop")
            while self._running:
                self._receive(conn, on_run_id)
        except WorkerFailed:
            pass


class _Duplex:
    """A Connection pair over two pipes, used as one."""

    def __init__(self, read_fd: int, write_fd: int):
        self._in = Connection(read_fd, writable=False)
        self._out = Connection(write_fd, readable=False)

    def send(self, obj) -> None:
        self._out.send(obj)

    def recv(self):
        return self._in.recv()

    def poll(self, timeout: float) -> bool:
        return self._in.poll(timeout)


def serve(conn) -> None:
    """The worker's loop: one request at a time, in the main thread, until the page's end of the
    pipes closes."""
    try:
        while (request := conn.recv()) is not None:
            if request == "stop":  # a stop that came after its run had ended
                continue
            if request.get("calibrate"):
                calibrate(conn, request)
            elif request.get("warm"):
                warm(conn, request)
            else:
                run(conn, request)
    except EOFError:
        pass


def calibrate(conn, request: dict) -> None:
    """A fresh calibration of the device, stored (with missing_only, the one a run would be attributed
    with, measured only where none is stored or reusable); answered with ("done", {"calibration": ...})."""
    try:
        store = store_at(request["db"])
        results = hardware.calibration_for(pick_device(request["device"]), store,
                                           fresh=not request.get("missing_only"))
    except UserError as exc:
        conn.send(("refused", str(exc)))
        return
    conn.send(("ready", {"run_id": None, "special_ids": []}))
    conn.send(("done", {"calibration": results}))


def warm(conn, request: dict) -> None:
    """Load the model a spec names (kept for the runs that follow) and find the calibration its runs are
    attributed with (stored, or a recent one of this machine reused from the calibration cache) without
    measuring one, so the first run starts at once; answered ("ready", ...) and ("done", {"seconds",
    "device", "calibration"}), calibration None where one has yet to be measured (a calibrate request
    with missing_only does that)."""
    started = time.perf_counter()
    try:
        store = store_at(request["db"])
        lm = prepare(RunSpec.from_dict(request["spec"]), store)
        calibration = hardware.calibration_for(lm.device, store, measure=False)
    except Exception as exc:  # the run that needs the model says why, in one sentence
        conn.send(("failed", f"The model could not be prepared: {type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", {"run_id": None, "special_ids": []}))
    conn.send(("done", {"seconds": time.perf_counter() - started, "device": str(lm.device),
                        "calibration": calibration}))


def start(spec: RunSpec, store: Store):
    """The run a spec describes (engine.run.open), after the shared dashboard's limits: no requests to other
    servers, no models it does not offer."""
    spec.check()
    if spec.backend == "served" and access.shared_mode():  # a shared dashboard sends no requests to typed addresses
        raise access.AccessError(access.SERVED_REFUSAL)
    if spec.backend == "local":
        for text, draft in ((spec.model, False), (spec.gen.draft_model, True)):
            if text and not access.model_choice_allowed(text, draft):
                raise access.AccessError(access.refusal(text))
    return open_run(spec, store)


def run(conn, request: dict) -> None:
    """One generation, its tokens sent in batches; a "stop" from the page cancels it."""
    try:
        gen = start(RunSpec.from_dict(request["spec"]), store_at(request["db"]))
    except UserError as exc:
        conn.send(("refused", str(exc)))
        return
    except Exception as exc:
        conn.send(("failed", f"The model could not be prepared: {type(exc).__name__}: {exc}"))
        return
    sent, last_sent = 0, None
    events = iter(gen)
    try:
        for _ in events:
            if last_sent is None:
                conn.send(("ready", {"special_ids": gen.special_ids, "run_id": gen.run_id,
                                     "run_ids": getattr(gen, "run_ids", [gen.run_id]), "tokens": gen.live_tokens[:]}))
                # the next batch comes every_s later, not on the first decode steps
                sent, last_sent = len(gen.live_tokens), time.monotonic()
            # in batches, as often as the page redraws: each message wakes the page's process, which
            # then takes a core from the model for a moment
            elif time.monotonic() - last_sent >= request["every_s"]:
                conn.send(("tokens", gen.live_tokens[sent:]))
                sent, last_sent = len(gen.live_tokens), time.monotonic()
            if conn.poll(0) and conn.recv() == "stop":
                events.close()
                break
    except (RecordDeferred, ServedRunError) as exc:
        ending = ("failed", str(exc))
    except Exception as exc:  # the engine has recorded the run with status error
        ending = ("failed", f"The run failed and was recorded with status error: {type(exc).__name__}: {exc}")
    else:
        ending = ("done", {"run_id": gen.run_id, "result": gen.result, "stop_reason": gen.result["stop_reason"],
                           "tokens": gen.tokens, "steps": gen.steps, **load_figures(gen)})
    conn.send(ending)


def _stop_on_sigterm() -> None:
    """A SIGTERM to the worker ends its run as a Stop does (recorded as cancelled), then the worker."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupt)


if __name__ == "__main__":
    _stop_on_sigterm()
    serve(_Duplex(int(sys.argv[1]), int(sys.argv[2])))
