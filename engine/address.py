"""A server's address, checked before anything is opened: the run specification and the client share it, and it
imports nothing of the client, so checking a spec loads no HTTP library."""
from __future__ import annotations

from urllib.parse import urlsplit

from engine.errors import UserError


class ServedError(UserError):
    """The server cannot be used as asked; the message is one sentence for the user."""


class ServedRunError(ServedError):
    """A served run that started failed or was cut short; it is recorded with the tokens it got."""


def api_root(endpoint: str) -> str:
    """scheme://host:port of an endpoint given with or without /v1; keys never travel in the URL."""
    try:
        parts = urlsplit((endpoint or "").strip())
        hostname = parts.hostname
    except ValueError:  # an unclosed [ of an IPv6 address, and the like
        parts = hostname = None
    if parts is None or parts.scheme not in ("http", "https") or not hostname or any(c.isspace() for c in endpoint):
        raise ServedError(f"'{str(endpoint)[:200]}' is not a server address: give one like http://127.0.0.1:8000.")
    if parts.username or parts.password or parts.query:
        raise ServedError("Put no credentials or query in the server address: name the environment variable that "
                          "holds the API key with --api-key-env.")
    try:
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        raise ServedError(f"'{endpoint}' has a port that is not a number between 0 and 65535.") from None
    path = parts.path.rstrip("/").removesuffix("/v1")
    host = f"[{hostname}]" if ":" in hostname else hostname
    return f"{parts.scheme}://{host}{port}{path}"
