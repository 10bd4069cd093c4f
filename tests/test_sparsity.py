"""Activation sparsity: mask and skip compute the same function to the bit, on the tiny model and on the
default one; skip reads fewer bytes."""
import copy
import dataclasses

import pytest
import torch
from transformers import DynamicCache

from engine.model import cpu_kernels
from engine.switches import sparsity
from engine.run.generate import Generation, GenConfig
from engine.run.text import prompt_ids
from engine.switches.sparsity import SparsityError, calibrate_thresholds, sparsify, zeroed_fraction


@pytest.fixture(scope="module")
def thresholds(tiny_lm):
    return {s: calibrate_thresholds(tiny_lm, s) for s in (0.0, 0.5)}


@torch.inference_mode()
def prefill_and_step(lm, ids=(5, 17, 99, 1034, 7, 300)):
    """Logits of a prefill and of one single-token decode step (the step skip mode accelerates)."""
    cache = DynamicCache(config=lm.config)
    first = lm.model(input_ids=torch.tensor([list(ids)]), cache=cache, use_cache=True).logits[0, -1]
    step = lm.model(input_ids=torch.tensor([[42]]), cache=cache, use_cache=True).logits[0, -1]
    return first, step


def test_at_zero_sparsity_both_modes_give_the_dense_logits(tiny_lm, thresholds):
    dense = prefill_and_step(tiny_lm)
    for mode in sparsity.MODES:
        sparse = prefill_and_step(sparsify(tiny_lm, 0.0, mode, thresholds[0.0]))
        for a, b in zip(sparse, dense):
            assert torch.allclose(a, b, atol=1e-4)


def test_mask_and_skip_give_the_same_logits(tiny_lm, thresholds):
    mask = prefill_and_step(sparsify(tiny_lm, 0.5, "mask", thresholds[0.5]))
    skip = prefill_and_step(sparsify(tiny_lm, 0.5, "skip", thresholds[0.5]))
    dense = prefill_and_step(tiny_lm)
    for a, b in zip(mask, skip):
        assert torch.equal(a, b)
    assert not torch.allclose(mask[1], dense[1], atol=1e-3)  # sparsity really changed something


@pytest.mark.parametrize("target", [0.25, 0.5, 0.7])
def test_measured_sparsity_is_near_the_target_on_the_calibration_text(tiny_lm, target):
    lm = sparsify(tiny_lm, target, "mask", calibrate_thresholds(tiny_lm, target))
    ids = lm.tokenizer(sparsity.CALIBRATION_TEXT.read_text())["input_ids"]
    with torch.inference_mode():
        for start in range(0, len(ids), 512):
            lm.model(input_ids=torch.tensor([ids[start:start + 512]]), use_cache=False)
    assert abs(zeroed_fraction(lm.model) - target) < 0.04


def test_thresholds_are_fitted_once_per_weights_and_text_and_kept(tiny_lm, monkeypatch, tmp_path):
    monkeypatch.setenv("TOKENPATH_CACHE", str(tmp_path))
    lm = dataclasses.replace(tiny_lm, model=copy.deepcopy(tiny_lm.model))
    fits, fit = [], sparsity.fit_thresholds
    monkeypatch.setattr(sparsity, "fit_thresholds", lambda *a: fits.append(a) or fit(*a))
    fitted = calibrate_thresholds(lm, 0.5)
    assert len(fits) == 1 and calibrate_thresholds(lm, 0.5) == fitted and len(fits) == 1  # a new database reads it
    calibrate_thresholds(lm, 0.7)
    calibrate_thresholds(lm, 0.5, text="Another text to fit on.")
    with torch.no_grad():
        next(lm.model.parameters()).mul_(2)  # other weights, other thresholds
    calibrate_thresholds(lm, 0.5)
    assert len(fits) == 4 and len(list((tmp_path / "sparsity").iterdir())) == 4


def test_skip_reads_fewer_bytes_and_mask_reports_waste(tiny_lm, calibration, thresholds):
    runs = {}
    for mode in sparsity.MODES:
        lm = sparsify(tiny_lm, 0.5, mode, thresholds[0.5])
        gen = Generation(lm, GenConfig("Hello there", raw=True, max_new_tokens=6, ignore_eos=True),
                         calibration=calibration, telemetry=False)
        gen.run()
        runs[mode] = [s for s in gen.steps if s["kind"] == "decode"]
    dense_bytes = runs["mask"][0]["weight_bytes"]
    assert all(s["weight_bytes"] < dense_bytes for s in runs["skip"])
    assert all(s["waste_fraction"] > 0 for s in runs["mask"])
    assert all(s["waste_fraction"] == 0 for s in runs["skip"])


@pytest.mark.parametrize("n", [1 << 20, 1000003, 7, 1])
def test_the_quantile_is_torchs_to_the_bit(n):
    values = torch.randn(n, generator=torch.Generator().manual_seed(n)).abs()
    values[: n // 3] = 0.0  # ties, as the masked second pass gives
    for q in (0.5, 0.3, 0.7, 0.9, 0.123, 1.0):
        assert sparsity.quantile(values, q) == float(torch.quantile(values, q)), (n, q)


def test_thresholds_are_stored_and_reused(tiny_lm, store):
    first = sparsity.thresholds_for(tiny_lm, 0.3, store)
    assert store.sparsity_thresholds(tiny_lm.name, 0.3, sparsity._calibration_digest()) == first


@pytest.mark.parametrize("value, mode, words", [
    (1.5, "mask", "between 0 and 0.9"),
    (0.5, "2:4", "NVIDIA GPU"),
    (0.5, "sideways", "Unknown sparsity mode"),
])
def test_bad_settings_get_one_sentence(tiny_lm, value, mode, words):
    with pytest.raises(SparsityError, match=words):
        sparsity.check(tiny_lm, value, mode)


def test_skip_needs_fp32_weights(tiny_lm):
    from engine.switches.quant import quantize

    with pytest.raises(SparsityError, match="fp32"):
        sparsity.check(quantize(tiny_lm, "bf16"), 0.5, "skip")
    with pytest.raises(SparsityError, match="float weights"):
        sparsity.check(quantize(tiny_lm, "int8-wo"), 0.5, "mask")


@pytest.mark.parametrize("threshold", [0.0, 0.7, 2.5, 100.0])
def test_the_sparse_kernel_skips_rows_without_changing_a_bit(threshold):
    generator = torch.Generator().manual_seed(0)
    x, w_t = torch.randn(1536, generator=generator), torch.randn(1536, 576, generator=generator)
    x[::7] = 0.0  # exact zeros are inputs like any other
    keep = x.abs() >= threshold
    skipped, zeroed, rows = cpu_kernels.kernel().sparse_linear(x, w_t, threshold, True)
    masked, zeroed_too, none = cpu_kernels.kernel().sparse_linear(x, w_t, threshold, False)
    assert torch.equal(skipped, masked)
    assert zeroed == zeroed_too == rows == int((~keep).sum()) and none == 0
    torch.testing.assert_close(skipped, (x * keep) @ w_t, rtol=0, atol=1e-3)


def test_the_sparse_kernel_gives_each_row_what_it_gives_that_row_alone():
    """A verification of drafts (several rows) computes each row as a decode step does, in both modes;
    skip reads a weight row when any row needs it."""
    generator = torch.Generator().manual_seed(1)
    x, w_t = torch.randn(5, 1536, generator=generator), torch.randn(1536, 3072, generator=generator)
    x[:, 100:400] = 0.0  # no row needs these 300 weight rows
    kernel = cpu_kernels.kernel()
    for skip in (True, False):
        together, zeroed, rows = kernel.sparse_linear(x, w_t, 0.8, skip)
        alone = torch.stack([kernel.sparse_linear(row, w_t, 0.8, skip)[0] for row in x])
        assert torch.equal(together, alone)
        assert zeroed == int((x.abs() < 0.8).sum())
        assert rows == (int(((x.abs() >= 0.8).sum(0) == 0).sum()) if skip else 0) and (not skip or rows >= 300)


CHAT = "Write one sentence about why memory bandwidth limits language model decoding."


@pytest.fixture(scope="module")
def default_half(default_lm):
    return calibrate_thresholds(default_lm, 0.5)


@torch.inference_mode()
def greedy_logits(lm, ids: list[int], steps: int) -> tuple[list[torch.Tensor], list[int]]:
    """The prefill's logits and those of each greedy decode step after it, with the tokens chosen."""
    cache = DynamicCache(config=lm.config)
    logits = [lm.model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True).logits[0]]
    tokens = [int(logits[-1][-1].argmax())]
    for _ in range(steps):
        logits.append(lm.model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True).logits[0, -1])
        tokens.append(int(logits[-1].argmax()))
    return logits, tokens


def test_mask_and_skip_give_bit_identical_logits_on_the_default_model(default_lm, default_half):
    """The chat-templated prompt of 42 tokens where the two modes used to part (an activation next to its
    threshold kept in one mode and zeroed in the other): the prefill's logits at every position and each
    decode step's logits are the same to the bit, and so is the text."""
    ids = prompt_ids(default_lm, CHAT, raw=False)
    assert len(ids) > 30
    mask, mask_tokens = greedy_logits(sparsify(default_lm, 0.5, "mask", default_half), ids, 24)
    skip, skip_tokens = greedy_logits(sparsify(default_lm, 0.5, "skip", default_half), ids, 24)
    assert mask_tokens == skip_tokens
    for step, (a, b) in enumerate(zip(mask, skip)):
        assert torch.equal(a, b), f"step {step}: largest difference {float((a - b).abs().max())}"


def test_a_generation_gives_the_same_tokens_in_both_modes_on_the_default_model(default_lm, default_half, calibration):
    """The command's own path (Generation, 64 new tokens) on the chat prompt: the same token ids."""
    texts = {}
    for mode in sparsity.MODES:
        lm = sparsify(default_lm, 0.5, mode, default_half)
        gen = Generation(lm, GenConfig(CHAT, max_new_tokens=64), calibration=calibration, telemetry=False)
        gen.run()
        texts[mode] = gen.token_ids
    assert texts["mask"] == texts["skip"] and len(texts["mask"]) > 8
