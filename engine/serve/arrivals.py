"""When a load sweep's requests arrive and how long they are: Poisson or gamma-gapped schedules as
`vllm bench serve` draws them, synthetic prompts of a given token length, and JSONL traces replayed or scaled."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.serve.client import ServedError

MAX_RATE = 1000.0  # requests/s
MIN_RATE = 0.01  # a request every 100 s on average: a slower level would take hours
MAX_REQUESTS = 10_000
MAX_INPUT_TOKENS = 32_768
MAX_OUTPUT_TOKENS = 4096
MAX_TRACE_BYTES = 20 * 2**20
# plain words that most tokenizers keep whole, so a prompt of N words is close to N tokens
WORDS = ("time memory model token server request network cache batch queue power river window garden paper music "
         "story number letter table market people family school water light sound order point world level answer "
         "city field state group reason result moment design science picture matter energy system").split()


@dataclass
class Item:
    """One request to send: its prompt (or a length to make one of), its output length, its arrival offset."""
    name: str
    prompt: str | None
    max_tokens: int
    input_tokens: int | None = None
    offset_s: float | None = None


def _number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ServedError(f"'{text.strip()}' is not a {what}: give numbers like 0.5,1,2,4.") from None
    return value


def parse_rates(text: str) -> list[float]:
    """'0.5,1,2' -> [0.5, 1.0, 2.0] requests/s, each between MIN_RATE and MAX_RATE."""
    rates = [_number(part, "request rate") for part in str(text).split(",") if part.strip()]
    if not rates:
        raise ServedError("--rate needs at least one request rate, e.g. 0.5,1,2,4.")
    for r in rates:
        if not math.isfinite(r) or not MIN_RATE <= r <= MAX_RATE:
            raise ServedError(f"A request rate must be a number of requests per second from {MIN_RATE:g} to "
                              f"{MAX_RATE:g}, not {r:g}.")
    return rates


def check_burstiness(burstiness: float) -> None:
    if not math.isfinite(burstiness) or burstiness <= 0:
        raise ServedError(f"--burstiness must be a positive number (1 is Poisson, below 1 burstier), not {burstiness:g}.")


def arrival_kind(burstiness: float) -> str:
    return "poisson" if burstiness == 1 else f"gamma (burstiness {burstiness:g})"


def synthetic_prompt(n_tokens: int, rng: np.random.Generator, tokenizer=None) -> str:
    """A prompt of random plain words: exactly n_tokens tokens with the server's tokenizer, else n_tokens words.
    Each prompt differs, so a server's prefix cache does not shorten its prefill."""
    words = " ".join(rng.choice(WORDS, size=n_tokens).tolist())
    if tokenizer is None:
        return words
    ids = tokenizer(words, add_special_tokens=False)["input_ids"][:n_tokens]
    return tokenizer.decode(ids)


def read_trace(path: str | Path) -> list[dict]:
    """A JSONL trace: one request a line, {"t_s": arrival offset, "prompt": text or "input_tokens": n,
    "output_tokens": n}, offsets in order. Every fault is one sentence naming the line."""
    path = Path(path)
    if not path.is_file():
        raise ServedError(f"The trace {path} is not a file.")
    if path.stat().st_size > MAX_TRACE_BYTES:
        raise ServedError(f"The trace {path} is over {MAX_TRACE_BYTES // 2**20} MB: cut it to at most "
                          f"{MAX_REQUESTS} requests.")
    lines = [(i, line) for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if line.strip()]
    if not lines:
        raise ServedError(f"The trace {path} holds no requests.")
    if len(lines) > MAX_REQUESTS:
        raise ServedError(f"The trace {path} has {len(lines)} requests; the most a sweep sends is {MAX_REQUESTS}.")
    rows, last = [], 0.0
    for number, line in lines:
        where = f"line {number} of the trace {path.name}"
        try:
            row = json.loads(line)
        except ValueError:
            raise ServedError(f"{where} is not JSON.") from None
        if not isinstance(row, dict):
            raise ServedError(f"{where} is not an object with t_s, prompt or input_tokens, and output_tokens.")
        t, out = row.get("t_s"), row.get("output_tokens")
        prompt, n_in = row.get("prompt"), row.get("input_tokens")
        if not _real(t) or t < 0:
            raise ServedError(f"{where} needs t_s, its arrival in seconds from the start (0 or more).")
        if t < last:
            raise ServedError(f"{where} arrives at {t:g} s, before the line above it ({last:g} s): sort the trace by t_s.")
        if not _whole(out, MAX_OUTPUT_TOKENS):
            raise ServedError(f"{where} needs output_tokens, a whole number from 1 to {MAX_OUTPUT_TOKENS}.")
        if not (isinstance(prompt, str) and prompt.strip()) and not _whole(n_in, MAX_INPUT_TOKENS):
            raise ServedError(f"{where} needs a prompt (text) or input_tokens (1 to {MAX_INPUT_TOKENS}).")
        rows.append({"t_s": float(t), "prompt": prompt if isinstance(prompt, str) and prompt.strip() else None,
                     "input_tokens": n_in if prompt is None else None, "output_tokens": out})
        last = float(t)
    return rows


def _real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _whole(x, top: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= top


def trace_rate(rows: list[dict]) -> float | None:
    """The trace's own rate, one over its mean gap between arrivals (None when all arrive at once)."""
    span = rows[-1]["t_s"] - rows[0]["t_s"]
    return (len(rows) - 1) / span if span > 0 else None


def trace_items(rows: list[dict], rate: float | None) -> list[Item]:
    """The trace's requests at its own timing, or with its gaps scaled so that it runs at `rate`."""
    scale = 1.0
    if rate is not None:
        own = trace_rate(rows)
        if own is None:
            raise ServedError("Every request in the trace arrives at the same moment, so it cannot be scaled to a rate: "
                              "leave --rate out to replay it as it is.")
        scale = own / rate
    t0 = rows[0]["t_s"]
    return [Item(name=f"trace #{i}", prompt=r["prompt"], input_tokens=r["input_tokens"], max_tokens=r["output_tokens"],
                 offset_s=(r["t_s"] - t0) * scale) for i, r in enumerate(rows)]
