"""How a command meets Ctrl-C and SIGTERM: the handlers note that an interrupt arrived, so that an error a library
makes of it (DuckDB's "Query interrupted", a wrapped import) is still known for the interrupt it was."""
from __future__ import annotations

import _thread
import signal
import sys
import threading

interrupted = threading.Event()  # set by the handlers below as a Ctrl-C or SIGTERM arrives


def caused_by_interrupt(exc: BaseException) -> bool:
    """Whether this error is a Ctrl-C's (or SIGTERM's) doing. A library that the KeyboardInterrupt passes through
    may raise its own error instead: DuckDB ends its query with "Query interrupted", and a lazy import or a
    dataclass's construction wraps it. So: an interrupt has arrived, or a KeyboardInterrupt lies under the error."""
    if interrupted.is_set():
        return True
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def interrupt_once() -> None:
    """The first Ctrl-C or SIGTERM stops the run; later ones are ignored, so that a second one cannot cut into
    the final write's handling or the words that say what became of the run."""
    def interrupt(signum, frame):
        interrupted.set()
        ignore_interrupts()
        raise KeyboardInterrupt
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, interrupt)


def ignore_interrupts() -> None:
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)


def cancel_on_sigterm() -> None:
    """SIGTERM (timeout, systemd, Docker) ends a run as Ctrl-C does: recorded as cancelled, tokens kept."""
    def interrupt(signum, frame):
        interrupted.set()
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupt)


def redeliver_dropped_interrupt(unraisable) -> None:
    """sys.unraisablehook: a Ctrl-C (or SIGTERM) whose KeyboardInterrupt landed in code Python cannot raise from
    (a weakref callback of the import machinery, a finalizer) would be printed and dropped, and the command would
    run on; it is delivered again in the main thread, at the next line that can raise it. Others as Python does."""
    in_main = threading.current_thread() is threading.main_thread()
    if not isinstance(unraisable.exc_value, KeyboardInterrupt) or not in_main:
        sys.__unraisablehook__(unraisable)
        return
    handler = signal.getsignal(signal.SIGINT)

    def again(signum, frame):
        interrupted.set()
        signal.signal(signal.SIGINT, handler)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, again)
    # from another thread, a moment later: signalled from inside this hook, the handler would run inside it too,
    # and be dropped again
    timer = threading.Timer(0.05, _thread.interrupt_main, args=(signal.SIGINT,))
    timer.daemon = True
    timer.start()
