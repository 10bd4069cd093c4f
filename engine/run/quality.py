"""Quality, measured teacher-forced on an evaluation text (the project ships data/eval.txt; a user may score
their own): perplexity of a variant, and its mean KL divergence and top-1 agreement against a reference
(the fp32 dense model)."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from engine.errors import UserError
from engine.model.loader import LoadedModel
from engine.paths import EVAL_TEXT, text_digest

WINDOW = 512  # tokens per forward; the text is scored in consecutive windows


class QualityError(UserError):
    """The evaluation text cannot be scored."""


def read_text(path=EVAL_TEXT) -> str:
    """The evaluation text, or one sentence of why it cannot be one."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise QualityError(f"{path} cannot be read as UTF-8 text ({exc.reason} at byte {exc.start}).") from None
    except OSError as exc:
        raise QualityError(f"{path} cannot be read as the evaluation text ({exc.strerror}).") from None
    if not text.strip():
        raise QualityError(f"{path} holds no text to score.")
    return text


def eval_ids(lm: LoadedModel, path=EVAL_TEXT) -> list[int]:
    ids = lm.tokenizer(read_text(path))["input_ids"]
    if len(ids) < 2:
        raise QualityError(f"{path} is one token long: scoring needs at least two.")
    return ids


@torch.inference_mode()
def window_logprobs(lm: LoadedModel, ids: list[int], window: int = WINDOW):
    """Log-probabilities (float32, on the CPU) predicting each token after the first of every window."""
    out = []
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window + 1]
        if len(chunk) < 2:
            break
        inputs = torch.tensor([chunk[:-1]], device=lm.device)
        logits = lm.model(input_ids=inputs, use_cache=False).logits[0].float()
        out.append((torch.log_softmax(logits, dim=-1).cpu(), torch.tensor(chunk[1:])))
    return out


def compare(reference, candidate) -> dict:
    """Perplexity of the candidate and its agreement with the reference, position by position."""
    nll = kl = agree = n = 0.0
    for (ref_lp, targets), (cand_lp, _) in zip(reference, candidate):
        nll -= cand_lp.gather(1, targets[:, None]).sum().item()
        kl += (ref_lp.exp() * (ref_lp - cand_lp)).sum().item()
        agree += (ref_lp.argmax(-1) == cand_lp.argmax(-1)).sum().item()
        n += len(targets)
    return {"perplexity": math.exp(nll / n), "kl_mean": kl / n, "top1_agreement": agree / n, "n_tokens": int(n)}


_reference_cache: dict = {}


def reference_logprobs(reference: LoadedModel, path=EVAL_TEXT):
    key = (id(reference.model), text_digest(path))
    if key not in _reference_cache:
        _reference_cache.clear()
        _reference_cache[key] = window_logprobs(reference, eval_ids(reference, path))
    return _reference_cache[key]


def evaluate(reference: LoadedModel, candidate: LoadedModel, path=EVAL_TEXT) -> dict:
    ref = reference_logprobs(reference, path)
    cand = ref if candidate.model is reference.model else window_logprobs(candidate, eval_ids(candidate, path))
    return {**compare(ref, cand), "eval_text_sha": text_digest(path), "window": WINDOW}


DIVERGENCE_PROMPT = "Explain in a few sentences how a lighthouse helps ships at night."


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two greedy outputs differ; None when one is a prefix of the other."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def greedy_ids(lm: LoadedModel, calibration: dict, n: int = 48) -> list[int]:
    from engine.run.generate import Generation, GenConfig

    gen = Generation(lm, GenConfig(DIVERGENCE_PROMPT, max_new_tokens=n, ignore_eos=True), calibration=calibration,
                     telemetry=False)
    return gen.run()["token_ids"]


def measure(base: LoadedModel, candidate: LoadedModel, variant_name: str, calibration: dict, store=None,
            settings: dict | None = None, text=EVAL_TEXT) -> dict:
    """Quality of `candidate` against the fp32 `base` on the evaluation text, plus where its greedy text first
    departs from the base's; recorded when a store is given."""
    import time

    start = time.perf_counter()
    result = evaluate(base, candidate, text)
    result["first_divergence"] = first_divergence(greedy_ids(base, calibration), greedy_ids(candidate, calibration))
    result["seconds"] = time.perf_counter() - start
    result.update(model=base.name, device=str(base.device), variant=variant_name, settings=settings or {},
                  eval_text=str(text))
    if store is not None:
        store.save_quality(result)
    return result
