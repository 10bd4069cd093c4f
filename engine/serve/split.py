"""The five buckets of a served run, per streamed chunk: the network, the server's queue and work,
the client's waiting, and rejected speculative tokens; each figure says where it came from.

physical: the request's own time on the network, from the HTTP client's trace hooks (engine.serve.network):
  name lookup, connect, TLS, request sent and the wait for the server's first bytes, on the first chunk
  only: later chunks stream over the open connection, so the network adds no serial time to them.
time: the server's queue time (its /metrics) plus what of each gap neither the network nor the
  server's work explains (HTTP, detokenising, the client).
memory and compute: the server's prefill and decode time (its /metrics or llama.cpp's timings),
  split by the planner's model for a named GPU, an estimate; without a GPU it stays one unsplit
  server-work figure (server_work_ms) and memory and compute are left empty.
decision: the share of the server's decode work spent verifying speculative tokens it rejected
  (rejected / verified positions, an estimate from its counters)."""
from __future__ import annotations

from engine.measure.distances import BUCKETS
from engine.serve import network as request_network

CLIENT, SERVER, ESTIMATE, NONE = "client", "server", "estimate", "none"


def speculative_waste(server: dict | None) -> float | None:
    """Rejected share of the positions the server verified, or None when it reports no speculation."""
    if not server or not server.get("drafts"):
        return None
    drafted, accepted = server.get("draft_tokens", 0.0), server.get("accepted_tokens", 0.0)
    verified = drafted + server["drafts"]  # every verify forward also scores the position after the drafts
    return max(drafted - accepted, 0.0) / verified if verified else None


def chunk_buckets(gaps_ms: list[float], network_ms: float | None, server: dict | None,
                  fractions: dict | None = None) -> list[dict]:
    """Per chunk {bucket_ms..., server_work_ms}; buckets sum to the chunk's gap (memory and compute
    are None when unsplit, and server_work_ms then holds their sum)."""
    if not gaps_ms:
        return []
    first, rest = gaps_ms[0], gaps_ms[1:]
    network = min(network_ms or 0.0, first)
    if server:
        left = first - network
        queue = min(server.get("queue_ms") or 0.0, left)
        prefill = min(server.get("prefill_ms") or 0.0, left - queue)
        rows = [(network, left - prefill, prefill)]  # time: the queue and the rest of the first gap
        decode_gaps = sum(rest)
        share = min(1.0, (server.get("decode_ms") or 0.0) / decode_gaps) if decode_gaps > 0 else 0.0
        rows += [(0.0, gap * (1 - share), gap * share) for gap in rest]
    else:
        rows = [(network, 0.0, first - network)] + [(0.0, 0.0, gap) for gap in rest]
    waste = speculative_waste(server) or 0.0
    out = []
    for i, (physical, waiting, work) in enumerate(rows):
        decision = work * waste if i > 0 else 0.0  # the prefill verifies no guesses
        work -= decision
        row = {"physical_ms": physical, "memory_ms": None, "compute_ms": None, "time_ms": waiting,
               "decision_ms": decision, "server_work_ms": work}
        if fractions:
            row["memory_ms"] = row["compute_ms"] = 0.0
            for bucket, f in fractions.items():
                row[f"{bucket}_ms"] += work * f
        out.append(row)
    return out


def normalised(fractions: dict | None) -> dict | None:
    """The planner's split as fractions over the buckets that sum to 1 (None stays None)."""
    if not fractions:
        return None
    kept = {b: float(v) for b, v in fractions.items() if b in BUCKETS and v and v > 0}
    total = sum(kept.values())
    return {b: v / total for b, v in kept.items()} if total > 0 else None


def provenance(token_source: str, server: dict | None, network: dict | None, gpu: str | None,
               fractions: dict | None, token_rows: int | None = None, prefix_cache: dict | None = None) -> dict:
    """{figure: {'source': client|server|estimate|none, 'how': one line}} for a served run; network is its
    request's parts (engine.serve.network), token_rows how many token rows it has, which differs from the
    server's usage count when they were re-tokenised, prefix_cache the server's counters around it."""
    from_server = server.get("source", "vLLM /metrics") if server else None
    rows = f"; its {token_rows} token rows re-tokenised from the streamed text" if token_rows is not None else ""
    tokens_how = {"server": "token ids the server streamed", "usage": "the server's usage count" + rows,
                  "tokenizer": "the model's tokenizer run on the streamed text",
                  "chunks": "counted as one token per chunk (no token ids, no tokenizer)"}[token_source]
    out = {
        "ttft_ms": {"source": CLIENT, "how": "client clock, request sent to first chunk with output"},
        "itl_ms": {"source": CLIENT, "how": "client clock, gaps between chunks"},
        "e2e_ms": {"source": CLIENT, "how": "client clock, request sent to last chunk with output"},
        "tokens": {"source": SERVER if token_source in ("server", "usage") else
                   (ESTIMATE if token_source == "chunks" else CLIENT), "how": tokens_how},
        "physical": {"source": CLIENT if network else NONE, "how": request_network.describe(network)},
        "time": {"source": SERVER if server else CLIENT,
                 "how": (f"queue time ({from_server}) plus the rest of each gap" if server and "queue_ms" in server
                         else "the rest of each gap" if server else "not separable without server metrics: 0")},
        "server_work": {"source": SERVER if server else CLIENT,
                        "how": (f"prefill and decode time ({from_server})" if server else
                                "each gap less the network (no server metrics: includes queueing)")},
    }
    if fractions:
        shares = ", ".join(f"{b} {f:.0%}" for b, f in fractions.items())
        out["memory"] = out["compute"] = {"source": ESTIMATE, "how": f"server work split as the planner's decode "
                                                                     f"step on {gpu}: {shares}"}
    else:
        out["memory"] = out["compute"] = {"source": NONE, "how": "not split: name the server's GPU to estimate"}
    out["prefix_cache"] = (
        {"source": SERVER, "how": "vLLM's prefix-cache counters (prompt tokens found / looked up) differenced "
                                  "around the run"} if prefix_cache else
        {"source": NONE, "how": "the server reports no prefix-cache counters, or other requests shared it"})
    waste = speculative_waste(server)
    if waste is not None:
        out["decision"] = {"source": ESTIMATE, "how": f"rejected share ({waste:.1%}) of verified speculative "
                                                      "positions times the decode work"}
    elif server and "requests" in server and from_server == "vLLM /metrics":
        out["decision"] = {"source": SERVER, "how": "the server ran no speculative decoding: 0"}
    else:
        out["decision"] = {"source": NONE, "how": "unknown without server metrics: 0"}
    return out
