"""One validation layer for model shapes and sizes: whole numbers, positive, finite, within sane limits.

The KV calculator, the planner and uploaded or read config.json files all pass through these checks;
each failure is one sentence that says what is wrong and what is allowed."""
from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

from engine.errors import UserError


class ShapeError(UserError, ValueError):
    """A bad model shape or size."""


# Far above any real model (the largest published configs are a few hundred layers, 128 heads of
# 256, contexts of ten million tokens), low enough that products of them stay exact and finite.
LIMITS = {
    "layers": 10_000, "attention_heads": 100_000, "kv_heads": 100_000, "head_dim": 100_000,
    "hidden_size": 1_000_000, "intermediate_size": 10_000_000, "vocab_size": 100_000_000,
    "latent_dim": 1_000_000, "window": 1 << 30, "sliding_layers": 10_000, "max_context": 1 << 30,
    "context": 1 << 30, "batch": 1 << 20, "tp": 100_000, "pp": 100_000, "gpus": 100_000, "group": 1 << 20,
    "prompt_tokens": 1 << 30, "new_tokens": 1 << 30, "draft_length": 1024,
}
MAX_PARAMS = 1e15
CONFIG_MAX_BYTES = 1 << 20  # config.json files are a few kB; a megabyte leaves room for long layer lists


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def whole(name: str, value, low: int = 1, high: int | None = None) -> int:
    """value as an int, if it is a whole number in [low, high]; an integral float (4096.0) is accepted."""
    high = LIMITS.get(name, 1 << 30) if high is None else high
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ShapeError(f"{name} must be a whole number from {low:,} to {high:,}, not {_show(value)}.")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise ShapeError(f"{name} must be a whole number from {low:,} to {high:,}, not {_show(value)}.")
    if not low <= value <= high:
        raise ShapeError(f"{name} must be a whole number from {low:,} to {high:,}, not {_show(value)}.")
    return int(value)


def number(name: str, value, low: float = 0.0, high: float = MAX_PARAMS, low_open: bool = True) -> float:
    """value as a finite float in (low, high] (or [low, high] when low_open is False)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ShapeError(f"{name} must be a number above {low:g} and at most {high:g}, not {_show(value)}.")
    value = float(value) if not isinstance(value, int) or abs(value) < 1e300 else math.inf
    below = value <= low if low_open else value < low
    if not math.isfinite(value) or below or value > high:
        bound = "above" if low_open else "at least"
        raise ShapeError(f"{name} must be a finite number {bound} {low:g} and at most {high:g}, not {_show(value)}.")
    return value


def fraction(name: str, value, low: float = 0.0, high: float = 1.0) -> float:
    """value as a finite float in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise ShapeError(f"{name} must be a number from {low:g} to {high:g}, not {_show(value)}.")
    return float(value)


def optional_whole(name: str, value, low: int = 1):
    return None if value is None else whole(name, value, low)


def check_attention(layers, attention_heads, kv_heads, head_dim, kind="MHA", latent_dim=0, window=None,
                    sliding_layers=0) -> dict:
    """The attention fields checked against each other; returns them as ints."""
    out = {"layers": whole("layers", layers), "kv_heads": whole("kv_heads", kv_heads),
           "head_dim": whole("head_dim", head_dim), "attention_heads": whole("attention_heads", attention_heads)}
    if out["kv_heads"] > out["attention_heads"]:
        raise ShapeError(f"kv_heads ({out['kv_heads']}) cannot exceed attention heads ({out['attention_heads']}).")
    if kind != "MLA" and out["attention_heads"] % out["kv_heads"]:
        raise ShapeError(f"kv_heads ({out['kv_heads']}) must divide the attention heads ({out['attention_heads']}) "
                         "evenly: each KV head serves the same number of query heads.")
    out["latent_dim"] = whole("latent_dim", latent_dim) if kind == "MLA" else whole("latent_dim", latent_dim or 0, 0)
    out["sliding_layers"] = whole("sliding_layers", sliding_layers, 0, out["layers"])
    out["window"] = optional_whole("window", window)
    if out["sliding_layers"] and out["window"] is None:
        raise ShapeError("Sliding layers need a sliding window of at least 1 token.")
    return out


def read_json_file(path: str | Path, max_bytes: int = CONFIG_MAX_BYTES, what: str = "config.json") -> dict:
    """A JSON object from a regular file of at most max_bytes, read without following the file past the limit
    (a named pipe or a device is refused before it is opened for reading)."""
    path = Path(path)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ShapeError(f"No {what} at {path}.") from None
    except OSError as exc:
        raise ShapeError(f"{path} cannot be read ({exc.strerror or 'no detail'}).") from None
    if stat.S_ISDIR(info.st_mode):
        raise ShapeError(f"{path} is a folder, not a {what}: give the file inside it.")
    if not stat.S_ISREG(info.st_mode):
        raise ShapeError(f"{path} is not a regular file, so it is not a {what}.")
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise ShapeError(f"{path} cannot be read ({exc.strerror or 'no detail'}).") from None
    return parse_json_bytes(data, str(path), max_bytes, what)


def parse_json_bytes(data: bytes, name: str, max_bytes: int = CONFIG_MAX_BYTES, what: str = "config.json") -> dict:
    """A JSON object from bytes (an upload or a file's head), refusing more than max_bytes."""
    if len(data) > max_bytes:
        raise ShapeError(f"{name} is larger than {max_bytes // 1024:,} KiB, too large for a {what}.")
    try:
        value = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise ShapeError(f"{name} is not valid JSON, so it is not a {what}.") from None
    if not isinstance(value, dict):
        raise ShapeError(f"{name} holds JSON but not an object, so it is not a {what}.")
    return value
