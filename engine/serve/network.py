"""The network part of one served request, timed by the HTTP client's own trace hooks (httpcore's
`trace` request extension): the name lookup, the TCP connect, the TLS handshake, the request sent,
and the wait for the server's first bytes (its response headers).

A host name is resolved inside the connect: the client's network backend (TimedLookupBackend) makes
the one getaddrinfo call itself, times it as dns_ms, and connects to the address it got, so connect_ms
holds the lookup once and the physical time (connect + TLS + send + first byte) counts it once; dns_ms
says how much of connect_ms it was. An address needs no lookup. A request that rides a kept-alive
connection opens none: its name lookup, connect and TLS are 0 and its connection is 'reused'."""
from __future__ import annotations

import ipaddress
import socket
import threading
import time

import httpcore2
import httpx2

PARTS = ("dns_ms", "connect_ms", "tls_ms", "send_ms", "first_byte_ms")
PHYSICAL = ("connect_ms", "tls_ms", "send_ms", "first_byte_ms")  # dns_ms lies inside connect_ms
COLUMNS = PARTS + ("headers_ms", "connection")  # what a request stores of its network
NEW, REUSED = "new", "reused"

_current = threading.local()  # the trace the request this thread is about to send reports to


def attach(request) -> None:
    """httpx's request hook: the request this thread sends reports to the trace it is taking."""
    trace = getattr(_current, "trace", None)
    if trace is not None:
        request.extensions["trace"] = trace


def _needs_lookup(host: str | None) -> bool:
    if not host:
        return False
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return True
    return False


class TimedLookupBackend(httpcore2.SyncBackend):
    """httpcore's own socket backend, but it resolves a host name itself, reports the lookup's time to
    the trace this thread is taking, and connects to the addresses it got (in order, as the socket
    module's create_connection does)."""

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        if not _needs_lookup(host):
            return super().connect_tcp(host, port, timeout, local_address, socket_options)
        start = time.perf_counter_ns()
        try:
            found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise httpcore2.ConnectError(str(exc)) from exc
        trace = getattr(_current, "trace", None)
        if trace is not None:
            trace.dns_ms = (time.perf_counter_ns() - start) / 1e6
        for i, (*_, address) in enumerate(found):
            try:
                return super().connect_tcp(address[0], port, timeout, local_address, socket_options)
            except httpcore2.ConnectError:
                if i == len(found) - 1:
                    raise


def transport(limits: httpx2.Limits) -> httpx2.HTTPTransport:
    """httpx's transport whose connections resolve their host names through TimedLookupBackend."""
    made = httpx2.HTTPTransport(limits=limits)
    made._pool._network_backend = TimedLookupBackend()  # httpx does not take a backend; its pool does
    return made


class RequestTrace:
    """Marks each trace event of one request on the perf_counter clock, from t0_ns (when the request's
    own clock starts). Use as a context around opening the request in the thread that sends it."""

    def __init__(self, t0_ns: int):
        self.t0_ns = t0_ns
        self.marks: dict[str, int] = {}
        self.dns_ms: float | None = None  # TimedLookupBackend's lookup, when the connect made one

    def __enter__(self) -> RequestTrace:
        _current.trace = self
        return self

    def __exit__(self, *exc) -> None:
        _current.trace = None

    def __call__(self, name: str, info: dict) -> None:
        event = name.split(".", 1)[1]  # connection.connect_tcp.started -> connect_tcp.started
        self.marks.setdefault(event, time.perf_counter_ns())

    def _span(self, name: str) -> float | None:
        start, end = self.marks.get(f"{name}.started"), self.marks.get(f"{name}.complete")
        return (end - start) / 1e6 if start is not None and end is not None else None

    def parts(self) -> dict | None:
        """{dns_ms, connect_ms, tls_ms, send_ms, first_byte_ms, headers_ms, connection}, or None when the
        request never reached the server's response headers. headers_ms is when they came, from t0_ns."""
        headers = self.marks.get("receive_response_headers.complete")
        sent = self.marks.get("send_request_body.complete", self.marks.get("send_request_headers.complete"))
        if headers is None or sent is None or "send_request_headers.started" not in self.marks:
            return None
        new = "connect_tcp.started" in self.marks
        return {"dns_ms": (self.dns_ms or 0.0) if new else 0.0,
                "connect_ms": (self._span("connect_tcp") or 0.0) if new else 0.0,
                "tls_ms": self._span("start_tls") or 0.0,
                "send_ms": (sent - self.marks["send_request_headers.started"]) / 1e6,
                "first_byte_ms": (headers - sent) / 1e6,
                "headers_ms": (headers - self.t0_ns) / 1e6,
                "connection": NEW if new else REUSED}


def columns(parts: dict | None) -> dict:
    """The stored columns of a request's network parts, all None when it has none."""
    return {c: (parts or {}).get(c) for c in COLUMNS}


def physical_ms(parts: dict | None) -> float | None:
    """The request's time on the network: its connect (with the name lookup inside it), TLS, sending and
    wait for the first bytes, each counted once."""
    return sum(parts[p] for p in PHYSICAL) if parts else None


def describe(parts: dict | None) -> str:
    """One line of the parts, for a run's provenance."""
    if not parts:
        return "the request reached no response headers, so its network time is unknown: 0"
    named = (("TLS", "tls_ms"), ("request sent", "send_ms"), ("first byte", "first_byte_ms"))
    connect = f"connect {parts['connect_ms']:.2f} (name lookup {parts['dns_ms']:.2f} of it)"
    shown = " + ".join([connect] + [f"{label} {parts[key]:.2f}" for label, key in named])
    how = "a new connection" if parts["connection"] == NEW else "a kept-alive connection, so no connect"
    return f"the HTTP client's trace hooks: {shown} ms ({how}), charged to the first chunk"
