"""Who may reach the dashboard: the loopback address by default; a LAN share only behind a token read
from $TOKENPATH_TOKEN, with model choices limited to the presets and the project's own model folders.

`python -m engine.access --host 0.0.0.0` (or `make share`) checks the token and starts the app; `make run`
starts it the same way on 127.0.0.1. Either way the generation process starts and loads the default model
as the server starts, so a page opened a little later finds it loaded."""
from __future__ import annotations

import argparse
import hmac
import ipaddress
import os
import logging
import socket
import sys
import threading
import time
from pathlib import Path

from engine.errors import UserError
from engine.paths import REPO_ROOT, models_dir

log = logging.getLogger("tokenpath.access")
TOKEN_ENV = "TOKENPATH_TOKEN"
MIN_TOKEN_CHARS = 12
# the largest upload any page accepts (a model's config.json on the KV calculator); the server refuses
# larger ones before any page sees them (.streamlit/config.toml says the same, for `make run`)
UPLOAD_MB = 1
# model choices a shared dashboard accepts besides the folders under data/models
PRESET_MODELS = ("default",)
DRAFT_PRESETS = ("self-int8",)


class AccessError(UserError):
    """The server must not start as asked; the message is one sentence."""


def share_token() -> str | None:
    token = os.environ.get(TOKEN_ENV, "")
    return token or None


def shared_mode() -> bool:
    """A token is set: every page asks for it, and model choices are limited."""
    return share_token() is not None


def token_matches(given: str | None) -> bool:
    token = share_token()
    if token is None or not given:
        return False
    return hmac.compare_digest(given.encode(), token.encode())


class SignInThrottle:
    """Wrong tokens counted per client address, shared by every session of the server: after FREE_TRIES
    wrong ones in a row an address waits, twice as long after each further one; each is logged."""

    FREE_TRIES = 5
    FIRST_WAIT_S = 2.0
    LONGEST_WAIT_S = 300.0

    def __init__(self):
        self._lock = threading.Lock()
        self._failures: dict[str, tuple[int, float]] = {}  # address -> (wrong in a row, may try again at)

    def wait_s(self, address: str) -> float:
        """Seconds before this address may try a token again (0: now)."""
        with self._lock:
            _, until = self._failures.get(address, (0, 0.0))
        return max(0.0, until - time.monotonic())

    def failed(self, address: str) -> None:
        with self._lock:
            count = self._failures.get(address, (0, 0.0))[0] + 1
            over = count - self.FREE_TRIES
            wait = 0.0 if over < 0 else min(self.FIRST_WAIT_S * 2 ** over, self.LONGEST_WAIT_S)
            self._failures[address] = (count, time.monotonic() + wait)
        log.warning("A wrong access token from %s (%d in a row); it may try again in %.0f s.", address, count, wait)

    def succeeded(self, address: str) -> None:
        with self._lock:
            self._failures.pop(address, None)


SIGN_IN = SignInThrottle()


def lan_addresses() -> list[str]:
    """This machine's IPv4 addresses that other machines can reach (not loopback, not link-local)."""
    import psutil

    found = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET:
                ip = ipaddress.ip_address(a.address)
                if not (ip.is_loopback or ip.is_link_local):
                    found.append(a.address)
    return sorted(set(found))


def is_loopback(host: str | None) -> bool:
    """Whether a bind address only accepts this machine's own connections ('' binds every interface)."""
    if not host:
        return False
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str | None) -> None:
    """Refuse to listen beyond this machine without a token worth the name."""
    if is_loopback(host):
        return
    token = share_token()
    if token is None:
        raise AccessError(f"Refusing to listen on '{host or 'every interface'}' without a token: set {TOKEN_ENV} "
                          "to a secret of at least 12 characters, or keep the default 127.0.0.1.")
    if len(token) < MIN_TOKEN_CHARS:
        raise AccessError(f"{TOKEN_ENV} is {len(token)} characters long; a token that guards a LAN share needs at "
                          f"least {MIN_TOKEN_CHARS}.")


def model_folders() -> list[str]:
    """The project's own model folders (data/models/NAME with a config.json), by name."""
    root = models_dir()
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / "config.json").is_file())


def model_choice_allowed(text: str | None, draft: bool = False) -> bool:
    """Whether the model field may hold this: anything when not shared; else a preset, a draft preset
    (self-int8, self-exit:K) or a folder of the project's own, by name or by path inside it."""
    if not shared_mode():
        return True
    text = (text or "").strip() or "default"
    if text in PRESET_MODELS or text in model_folders():
        return True
    if draft and (text in DRAFT_PRESETS or (text.startswith("self-exit:") and text[10:].isdigit())):
        return True
    try:
        path = Path(text).expanduser().resolve()
        root = models_dir().resolve()
    except (OSError, RuntimeError):
        return False
    return path.parent == root and path.name in model_folders()


# what a shared dashboard answers wherever a served endpoint could be named (the Live page through the
# worker, the Serving page, the Story): the same sentence, which says nothing of this host's ports or variables
SERVED_REFUSAL = ("This dashboard is shared on the network, so it does not send requests to other servers; measure "
                  "a served model from a dashboard on 127.0.0.1.")


def refusal(text: str) -> str:
    """The sentence shown when a shared dashboard turns a model choice down."""
    choices = ", ".join([*PRESET_MODELS, *model_folders()])
    return (f"This dashboard is shared on the network, so it runs only the project's own models ({choices}); "
            f"'{text[:80]}' is not one of them.")


def allowed_hosts(host: str, extra: list[str]) -> list[str]:
    """The Host names a browser may use to reach the share: loopback, this machine's name and
    addresses (or the one address it binds), and any the user names; anything else is refused,
    which keeps DNS rebinding out."""
    names = {"127.0.0.1", "localhost", "::1", socket.gethostname(), socket.getfqdn(), *extra}
    if host not in ("0.0.0.0", "::", ""):
        names.add(host)
    else:
        import psutil

        names.update(a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs
                     if a.family in (socket.AF_INET, socket.AF_INET6))
    return sorted(n for n in names if n)


# `python -m streamlit`, after ui.py has made the upload endpoint refuse sessions that have not signed in,
# so the refusal holds before the first page runs, and has begun the warm start (ui.warm_up: the generation
# process, the default model loading in it): ui's process-wide resources are the ones every page then uses,
# so the first page finds the process started rather than starting it (ui.py imports Streamlit; this module
# must not)
LAUNCH = ("import sys; sys.path.insert(0, {root!r}); import ui; ui.refuse_uploads_before_sign_in(); ui.warm_up(); "
          "from streamlit.web.cli import main; sys.exit(main())")


def streamlit_command(host: str, port: int, extra_hosts: list[str]) -> list[str]:
    """The server's command; on a loopback address the Host names of .streamlit/config.toml hold."""
    command = [sys.executable, "-c", LAUNCH.format(root=str(REPO_ROOT)), "run", str(REPO_ROOT / "app.py"),
               "--server.address", host, "--server.port", str(port), "--server.maxUploadSize", str(UPLOAD_MB)]
    if is_loopback(host) and not extra_hosts:
        return command
    for name in allowed_hosts(host, extra_hosts):
        command += ["--server.allowedHosts", name]
    return command


def start_message(host: str, port: int) -> str:
    """Where colleagues open the dashboard: the LAN addresses when it listens on every interface."""
    if is_loopback(host):
        return f"Serving on http://{host}:{port} (this machine only)."
    hosts = lan_addresses() if host in ("0.0.0.0", "::", "") else [host]
    urls = ", ".join(f"http://{h}:{port}" for h in hosts) or f"http://{host}:{port}"
    return (f"Serving on {urls}; every page asks for the token in ${TOKEN_ENV}. It crosses the network "
            "unencrypted: put a TLS proxy in front where others could listen.")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.access",
                                     description=f"Start the dashboard, on the LAN only behind ${TOKEN_ENV}.")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8502)
    parser.add_argument("--allow-host", action="append", default=[],
                        help="another name browsers use to reach this machine (repeatable)")
    args = parser.parse_args(argv)
    try:
        check_bind(args.host)
    except AccessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    command = streamlit_command(args.host, args.port, args.allow_host)
    print(start_message(args.host, args.port), flush=True)
    os.execv(command[0], command)


if __name__ == "__main__":
    sys.exit(main())
