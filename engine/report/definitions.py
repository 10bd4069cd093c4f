"""What every metric and bucket means, written once: the pages' help and hovers and the report
read these texts, so a definition never drifts between two places."""
from __future__ import annotations

from engine.serve.metrics import DEFINITIONS as SERVING_DEFINITIONS

BUCKET_MEANING = {
    "physical": "crossing a link: upload to the device, download and device sync",
    "memory": "streaming the forward's bytes (weights, KV cache) at the calibrated bandwidth, capped by the "
              "forward time",
    "compute": "forward time beyond the memory time that the FLOPs at the calibrated peak explain",
    "time": "serial waiting: forward time neither bytes nor FLOPs explain (dispatch, launch), token "
            "selection, host bookkeeping",
    "decision": "the share of the above spent on work whose result was thrown away (recomputing the prefix "
                "without a KV cache, rejected guesses, multiplying zeros)",
}

# a served model's request metrics, as vLLM's benchmark client defines them
SERVED_METRICS = SERVING_DEFINITIONS

BUCKET_NOTE = ("Bandwidth and peak come from the device's calibration; bytes and FLOPs from the loaded model's real "
               "tensors. Memory and compute are estimates from that roofline model; the step times and their sum are "
               "measured. A step's buckets are divided over the tokens it emitted.")

# (name, definition) in the order a reader meets them
METRICS = [
    ("TTFT", "time to first token: from the request's start to the moment the first new token is ready "
             "(prefill included)."),
    ("TPOT", "time per output token after the first: (end-to-end time - TTFT) / (new tokens - 1)."),
    ("ITL", "inter-token latency: the list of gaps between consecutive tokens; p50, p90 and p99 are its "
            "percentiles."),
    ("E2E", "end-to-end time: from the request's start to the last token."),
    ("tokens/s (end to end)", "new tokens / end-to-end time, prefill included."),
    ("tokens/s (decode)", "1 / TPOT: the rate once the first token is out."),
    ("speedup", "a run's decode tokens/s divided by the baseline run's (the first run of the report); above 1 "
                "is faster. The end-to-end speedup divides end-to-end tokens/s the same way."),
    ("bytes per token", "weight bytes one forward reads (in the precision they are stored in) plus the KV cache "
                        "bytes one token adds."),
    ("roofline", "the time a forward's bytes and FLOPs would take at the calibrated bandwidth and peak: "
                 "max(bytes / bandwidth, FLOPs / peak). Roofline / measured forward shows how close the "
                 "forward runs to what the memory and the arithmetic allow; it is an estimate."),
    ("drafted, accepted", "speculative decoding: tokens guessed by the draft method, and those the target "
                          "model confirmed."),
    ("acceptance rate", "accepted / drafted."),
    ("tokens per target forward", "new tokens / forwards of the target model; 1 for plain decoding."),
    ("perplexity", "exp of the mean negative log-likelihood of the shipped evaluation text (data/eval.txt), "
                   "teacher-forced; lower is better."),
    ("KL divergence", "mean over positions of KL(reference || variant) between the next-token distributions "
                      "of the fp32 dense reference and the variant, in nats; 0 means identical."),
    ("top-1 agreement", "share of positions where the variant's most likely next token is the reference's."),
]


def metric(name: str) -> str:
    """The definition of one metric by its name, for a page's help text."""
    return dict(METRICS)[name]
