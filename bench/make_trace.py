"""Writes data/traces/chat_and_documents.jsonl, the shipped synthetic trace: Poisson arrivals at 0.5
requests/s, four short chats to one long document, lengths drawn with a fixed seed (rerun to regenerate)."""
import json
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[1] / "data" / "traces" / "chat_and_documents.jsonl"
REQUESTS, RATE, DOCUMENT_SHARE, SEED = 80, 0.5, 0.2, 20261202


def rows(rng: np.random.Generator) -> list[dict]:
    t, out = 0.0, []
    for _ in range(REQUESTS):
        t += rng.exponential(1 / RATE)
        if rng.random() < DOCUMENT_SHARE:  # a document to summarise: long in, medium out
            n_in, n_out = rng.integers(600, 1500), rng.integers(80, 250)
        else:  # a chat turn: short in, short to medium out, skewed towards short
            n_in, n_out = int(rng.lognormal(np.log(60), 0.6)), int(rng.lognormal(np.log(60), 0.5))
        out.append({"t_s": round(t, 3), "input_tokens": int(min(max(n_in, 8), 1500)),
                    "output_tokens": int(min(max(n_out, 8), 400))})
    return out


if __name__ == "__main__":
    OUT.write_text("".join(json.dumps(r) + "\n" for r in rows(np.random.default_rng(SEED))))
    print(OUT)
