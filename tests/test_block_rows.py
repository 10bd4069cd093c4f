"""int4-dyn's block kernels (the 4-bit layers and the int8 output head) on the default model's own weights:
the rows of a batched step, taken eight at a time and then four, two and one, each get what the float64
reference gives, within a few float32 roundings of the products' magnitudes, and, to the bit, what the row
gets alone."""
import pytest
import torch

from engine.model.cpu_kernels import optional_kernel
from engine.switches.qlinear import Int4DynamicLinear, Int8BlockLinear
from engine.switches.quant import quantize
from test_quant import _block_activations, _int4_dynamic_reference

# float32 sums of many products round by a few units of 2^-24 of the products' magnitudes: the bound on
# the distance to the float64 reference, as a fraction of the sum of the products' absolute values
ROUNDING = 1e-6


def _int8_block_reference(layer: Int8BlockLinear, x: torch.Tensor, magnitude: bool = False) -> torch.Tensor:
    """What the int8 head computes, in float64 from its stored parts: x quantized per block of 32 to int8,
    times w = q * d per block; with `magnitude`, the sum of the products' absolute values instead."""
    q, d = layer.unpacked()
    w = q.double() * d.double()[..., None]
    xq = _block_activations(x)
    return torch.einsum("rbk,nbk->rn", xq.abs(), w.abs()) if magnitude else torch.einsum("rbk,nbk->rn", xq, w)


# one group of eight; then eight, four, two and one; then more than a thread's share of rows to quantize
@pytest.mark.parametrize("rows", [8, 15, 61])
def test_the_default_models_int4_dyn_rows_follow_the_reference_and_equal_each_row_alone(default_lm, rows):
    if optional_kernel() is None:
        pytest.skip("int4-dyn needs the C++ extension, which cannot be built here")
    model = quantize(default_lm, "int4-dyn").model
    layer = model.model.layers[0]
    parts = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj,
             model.lm_head]
    assert [type(p) for p in parts] == [Int4DynamicLinear] * 4 + [Int8BlockLinear]
    torch.manual_seed(rows)
    for part in parts:
        x = torch.randn(rows, part.in_features)
        x[0, :32] = 0  # a block of zeros
        y = part.product(x)
        reference = _int4_dynamic_reference if isinstance(part, Int4DynamicLinear) else _int8_block_reference
        error = (y.double() - reference(part, x)).abs()
        assert (error <= ROUNDING * reference(part, x, magnitude=True)).all(), (type(part).__name__, error.max())
        for r in range(rows):
            assert torch.equal(part.product(x[r:r + 1]), y[r:r + 1]), (type(part).__name__, r)
