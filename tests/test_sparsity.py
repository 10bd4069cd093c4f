"""Activation sparsity: mask and skip compute the same function; skip reads fewer bytes."""
import pytest
import torch
from transformers import DynamicCache

from engine.model import cpu_kernels
from engine.switches import sparsity
from engine.run.generate import Generation, GenConfig
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
        assert torch.allclose(a, b, atol=1e-4)
    assert not torch.allclose(mask[1], dense[1], atol=1e-3)  # sparsity really changed something


@pytest.mark.parametrize("target", [0.25, 0.5, 0.7])
def test_measured_sparsity_is_near_the_target_on_the_calibration_text(tiny_lm, target):
    lm = sparsify(tiny_lm, target, "mask", calibrate_thresholds(tiny_lm, target))
    ids = lm.tokenizer(sparsity.CALIBRATION_TEXT.read_text())["input_ids"]
    with torch.inference_mode():
        for start in range(0, len(ids), 512):
            lm.model(input_ids=torch.tensor([ids[start:start + 512]]), use_cache=False)
    assert abs(zeroed_fraction(lm.model) - target) < 0.04


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
def test_the_sparse_kernel_equals_the_masked_product(threshold):
    generator = torch.Generator().manual_seed(0)
    x, w_t = torch.randn(1536, generator=generator), torch.randn(1536, 576, generator=generator)
    y, active = cpu_kernels.kernel().sparse_gemv(x, w_t, threshold)
    keep = x.abs() >= threshold
    assert active == int(keep.sum())
    torch.testing.assert_close(y, (x * keep) @ w_t, rtol=0, atol=1e-3)
