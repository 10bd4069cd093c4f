"""The integer levels' products of several rows (a batched decode step, a prefill chunk) on the default model:
rows taken together give each row the bits it gets alone, so a batch of eight decodes each sequence's own
tokens and a prefill's products equal the same rows one by one."""
import pytest
import torch

from engine.model.cpu_kernels import optional_kernel
from engine.switches.qlinear import Int4DynamicLinear, Int8BlockLinear, Int8DynamicLinear
from engine.switches.quant import quantize
from test_batch import PROMPTS, _lockstep_logits, alone, batched, greedy

EIGHT = PROMPTS + ["Explain why the sky is blue", "List the planets",
                   "What is a prime number? Give two examples", "Say hello in French"]
LEVELS = ["int4-dyn", "int8-dyn"]
INTEGER_LAYERS = (Int4DynamicLinear, Int8BlockLinear, Int8DynamicLinear)


@pytest.fixture(scope="module")
def integer_levels(default_lm):
    if optional_kernel() is None:
        pytest.skip("the integer levels' kernels need the C++ extension, which cannot be built here")
    return {level: quantize(default_lm, level) for level in LEVELS}


@pytest.mark.parametrize("level", LEVELS)
def test_a_batch_of_eight_decodes_each_sequences_own_tokens(integer_levels, level, calibration):
    lm = integer_levels[level]
    worst, diverged = _lockstep_logits(lm, EIGHT, 3)
    assert worst == 0.0, f"{level}: logits differ by up to {worst:g}, tokens first at step {diverged}"
    cfgs = [greedy(p, tokens=10) for p in EIGHT]
    seqs = batched(lm, cfgs, calibration, prefill_chunk=4096)
    assert max(s["batch"] for seq in seqs for s in seq.steps) == len(EIGHT)
    for cfg, seq in zip(cfgs, seqs):
        assert seq.status == "ok" and seq.token_ids == alone(lm, cfg, calibration), (level, cfg.prompt)


@pytest.mark.parametrize("level", LEVELS)
@torch.inference_mode()
def test_a_prefills_products_equal_its_rows_one_by_one(integer_levels, level):
    """Every integer product of a prefill (an odd number of rows: the kernels' groups of rows and a last one
    alone), the fused gate/up's SiLU product among them where the layer makes one, equals the layer run on each row
    by itself, to the bit, so the logits do too."""
    lm = integer_levels[level]
    ids = lm.tokenizer(" ".join(EIGHT))["input_ids"][:93]
    seen = []
    layers = [m for m in lm.model.modules() if isinstance(m, INTEGER_LAYERS)]
    handles = [m.register_forward_hook(lambda m, args, out: seen.append((m, args[0], out))) for m in layers]
    for m in layers:
        if getattr(m, "makes_silu_product", False):
            def recorded(x, product=m.silu_product):
                out = product(x)
                seen.append((product, x, out))
                return out
            m.silu_product = recorded
    try:
        lm.model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
        for m in layers:
            m.__dict__.pop("silu_product", None)
    assert len(seen) == len(layers) and all(x.shape[1] == len(ids) for _, x, _ in seen)
    for product, x, out in seen:
        rows = torch.cat([product(x[:, i:i + 1]) for i in range(x.shape[1])], dim=1)
        assert torch.equal(rows, out), (level, getattr(product, "__name__", type(product).__name__))
