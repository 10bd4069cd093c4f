"""A serving engine's own figures: its Prometheus /metrics scraped with prometheus_client's parser,
differenced between two scrapes, and llama.cpp's per-response `timings` object."""
from __future__ import annotations

import httpx2
from prometheus_client.parser import text_string_to_metric_families

# vLLM's histograms (seconds) read per request: name in the result -> Prometheus family
VLLM_HISTOGRAMS = {
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "decode": "vllm:request_decode_time_seconds",
    "inference": "vllm:request_inference_time_seconds",
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "tpot": "vllm:request_time_per_output_token_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
}
VLLM_GAUGES = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
               "kv_cache_usage": "vllm:kv_cache_usage_perc"}
# counters (the parser drops the _total suffix from a counter family's name)
VLLM_COUNTERS = {"drafts": "vllm:spec_decode_num_drafts", "draft_tokens": "vllm:spec_decode_num_draft_tokens",
                 "accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
                 "prompt_tokens": "vllm:prompt_tokens", "generation_tokens": "vllm:generation_tokens"}
# the prefix cache's counters, in prompt tokens: looked up in the cache, and found there
PREFIX_CACHE = {"queries": "vllm:prefix_cache_queries", "hits": "vllm:prefix_cache_hits"}
# the same counted by the local engine's kept prompts (engine.run.load_target.LocalTarget.snapshot)
LOCAL_PREFIX_CACHE = {"queries": "tokenpath:prefix_cache_queries", "hits": "tokenpath:prefix_cache_hits"}
PREFIX_CACHE_COLUMNS = ("prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hit_rate")


def parse(text: str, families=None) -> dict:
    """{family: {'sum': s, 'count': c} for histograms, a number for gauges and counters}, summed over
    label sets (one per model and engine); `families`: those alone (a gauge sampled every second need not
    parse vLLM's whole page of histograms on the machine it measures)."""
    out: dict = {}
    if families is not None:
        text = only_families(text, set(families))
    for family in text_string_to_metric_families(text):
        if family.type in ("histogram", "summary"):
            entry = out.setdefault(family.name, {"sum": 0.0, "count": 0.0})
            for sample in family.samples:
                if sample.name.endswith("_sum"):
                    entry["sum"] += sample.value
                elif sample.name.endswith("_count"):
                    entry["count"] += sample.value
        elif family.type in ("gauge", "counter"):
            values = [s.value for s in family.samples if not s.name.endswith("_created")]
            out[family.name] = sum(values)
    return out


def only_families(text: str, families: set[str]) -> str:
    """The lines of a Prometheus text page that describe or sample one of `families` (gauges and counters: a
    sample's name is its family's, a counter's with _total after it; the counters' _created samples, which
    parse drops anyway, are left out)."""
    def family(line: str) -> str:
        if line.startswith("#"):
            parts = line.split(None, 3)
            name = parts[2] if len(parts) > 2 else ""
        else:
            name = line.split("{", 1)[0].split(None, 1)[0] if line.strip() else ""
        return name.removesuffix("_total")
    return "\n".join(line for line in text.splitlines() if family(line) in families) + "\n"


def scrape(root: str, client: httpx2.Client | None = None, timeout_s: float = 5.0, families=None) -> dict | None:
    """The parsed /metrics of the server at root (scheme://host:port), or None when it has none; `families`:
    those alone (see parse). A client kept open spares each scrape a new connection and TLS context."""
    try:
        if client is not None:
            response = client.get(f"{root}/metrics", timeout=timeout_s)
        else:
            response = httpx2.get(f"{root}/metrics", timeout=timeout_s)
        if response.status_code != 200:
            return None
        return parse(response.text, families)
    except (httpx2.HTTPError, ValueError):  # no server, or a body that is not Prometheus text
        return None


def is_vllm(snapshot: dict | None) -> bool:
    return bool(snapshot) and any(name.startswith("vllm:") for name in snapshot)


def delta(before: dict | None, after: dict | None) -> dict | None:
    """vLLM's figures for what happened between two scrapes: per histogram the requests it counted
    and their summed milliseconds, the counters' increase, and the gauges as the second scrape saw them."""
    if not is_vllm(before) or not is_vllm(after):
        return None
    out = {"requests": after.get(VLLM_HISTOGRAMS["e2e"], {}).get("count", 0.0)
           - before.get(VLLM_HISTOGRAMS["e2e"], {}).get("count", 0.0)}
    for key, family in VLLM_HISTOGRAMS.items():
        a, b = before.get(family), after.get(family)
        if a is not None and b is not None:
            out[f"{key}_ms"] = (b["sum"] - a["sum"]) * 1e3
            out[f"{key}_count"] = b["count"] - a["count"]
    for key, family in VLLM_COUNTERS.items():
        if family in after:
            out[key] = after[family] - before.get(family, 0.0)
    for key, family in VLLM_GAUGES.items():
        if family in after:
            out[key] = after[family]
    return out


def prefix_cache(before: dict | None, after: dict | None) -> dict | None:
    """The prompt tokens the prefix cache was asked for and found between two scrapes, and the share
    found; None when either scrape lacks vLLM's counters (or the local engine's) or they went back (a restarted
    server)."""
    names = next((n for n in (PREFIX_CACHE, LOCAL_PREFIX_CACHE)
                  if before and after and all(f in before and f in after for f in n.values())), None)
    if names is None:
        return None
    queries = after[names["queries"]] - before[names["queries"]]
    hits = after[names["hits"]] - before[names["hits"]]
    if queries < 0 or hits < 0:
        return None
    return {"prefix_cache_queries": queries, "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries if queries > 0 else None}


def prefix_cache_columns(cache: dict | None) -> dict:
    """The stored columns of prefix_cache()'s answer, all None without one (never zero)."""
    return {c: (cache or {}).get(c) for c in PREFIX_CACHE_COLUMNS}


def gauges(snapshot: dict | None) -> dict:
    """Queue and KV-cache usage as one scrape saw them (empty for a server without vLLM's gauges)."""
    if not snapshot:
        return {}
    return {key: snapshot[family] for key, family in VLLM_GAUGES.items() if family in snapshot}


def llama_cpp_split(timings: dict | None) -> dict | None:
    """llama.cpp's server reports prompt and generation time per response instead of /metrics."""
    if not timings or "prompt_ms" not in timings or "predicted_ms" not in timings:
        return None
    return {"requests": 1.0, "prefill_ms": float(timings["prompt_ms"]), "decode_ms": float(timings["predicted_ms"]),
            "source": "llama.cpp timings"}
