"""Weight precision levels: real low-bit tensors, kernels that agree with their reference, honest bytes."""
import copy

import pytest
import torch

from engine.switches import qlinear
from engine.model.cpu_kernels import optional_kernel
from engine.measure.accounting import model_shape
from engine.run.generate import Generation, GenConfig
from engine.switches.quant import (LEVELS, Int4DynamicLinear, Int4WeightOnlyLinear, Int8BlockLinear, Int8DynamicLinear, Int8WeightOnlyLinear, QuantError,
                          available_levels, level_info, quantize, variant)


def relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_int8_weight_only_matches_its_dequantized_weights():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96, bias=False)
    q = Int8WeightOnlyLinear(linear)
    assert q.weight_int8.dtype == torch.int8
    x = torch.randn(3, 64)
    reference = x @ (q.weight_int8.float() * q.scales.float()[:, None]).T
    assert relative_error(q(x), reference) < 1e-2
    assert relative_error(q(x), linear(x)) < 2e-2


@pytest.mark.parametrize("rows", [1, 7, 30])  # a decode step, a verification, a prefill (expanded, then MKL)
def test_int8_weight_only_kernel_computes_the_dequantized_product(rows):
    kernel = optional_kernel()
    if kernel is None:
        pytest.skip("the int8 kernel needs the C++ extension, which cannot be built here")
    torch.manual_seed(0)
    w = torch.randint(-127, 128, (1030, 301), dtype=torch.int8)  # split over threads; a width of no round size
    scales = torch.rand(1030).to(torch.bfloat16)
    x = torch.randn(rows, 301)
    y = kernel.int8_wo_linear(x, w, scales)
    reference = x.double() @ (w.double() * scales.double()[:, None]).T
    assert relative_error(y.double(), reference) < 1e-6
    if rows <= 24:  # a row's result does not depend on the rows beside it
        assert torch.equal(kernel.int8_wo_linear(x[2:3] if rows > 1 else x, w, scales)[0], y[2 if rows > 1 else 0])


def test_int4_cpu_kernel_matches_the_portable_dequantized_path():
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 64, bias=False)
    kernel = Int4WeightOnlyLinear(linear, group_size=32)
    portable = Int4WeightOnlyLinear(linear, group_size=32, cpu_kernel=False)
    assert portable.weight_int4.dtype == torch.uint8 and portable.weight_int4.numel() == 128 * 64 // 2
    x = torch.randn(2, 128)
    assert relative_error(kernel(x), portable(x)) < 2e-2
    assert relative_error(portable(x), linear(x)) < 0.1


def _block_activations(x: torch.Tensor) -> torch.Tensor:
    """x quantized per block of 32 to int8 and scaled back, in float64, as [rows, blocks, 32]."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    dx = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.round(blocks / dx).clamp(-127, 127).double() * dx.double()


def _int4_dynamic_reference(layer: Int4DynamicLinear, x: torch.Tensor, magnitude: bool = False) -> torch.Tensor:
    """What int4-dyn computes, in float64 from its stored parts: x quantized per block of 32 to int8,
    times w = q * d + m per block; with `magnitude`, the sum of the products' absolute values instead."""
    q, d, m = layer.unpacked()
    w = q.double() * d.double()[..., None] + m.double()[..., None]
    xq = _block_activations(x)
    return torch.einsum("rbk,nbk->rn", xq.abs(), w.abs()) if magnitude else torch.einsum("rbk,nbk->rn", xq, w)


# 18, 2, 48 and 3 blocks a row; 1030 outputs are 129 groups of eight, the last one alone and part padding, and 1020
# are 128, the last two together with four padded rows (where the kernel takes two groups at a time); rows in groups
# of 8, 4, 2 and 1
@pytest.mark.parametrize("rows, width, outputs", [(1, 576, 1030), (3, 64, 1030), (30, 1536, 1030), (9, 64, 1020),
                                                  (7, 96, 1030)])
def test_int4_dynamic_kernel_computes_its_reference(rows, width, outputs):
    if optional_kernel() is None:
        pytest.skip("int4-dyn needs the C++ extension, which cannot be built here")
    torch.manual_seed(rows)
    linear = torch.nn.Linear(width, outputs, bias=True)  # split over threads
    layer = Int4DynamicLinear(linear)
    padded = -(-outputs // 8) * 8  # 8 rows a group
    assert layer.weight_q4.dtype == torch.uint8 and layer.weight_q4.numel() == padded * width // 2
    assert layer.d.dtype == layer.m.dtype == torch.float16 and layer.d.numel() == padded * width // 32
    x = torch.randn(rows, width)
    x[0, :32] = 0  # a block of zeros
    y = layer(x)
    torch.testing.assert_close(y.double(), _int4_dynamic_reference(layer, x) + linear.bias.double(), rtol=1e-5,
                               atol=1e-5)
    assert relative_error(y, linear(x)) < 0.1
    assert torch.equal(torch.cat([layer(row) for row in x.split(1)]), y)  # nor on the rows beside it


def test_int4_dynamic_weights_are_within_half_a_step_of_the_originals():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 13, bias=False)  # a group of eight rows and a padded one
    layer = Int4DynamicLinear(linear)
    q, d, m = layer.unpacked()
    w = (q.float() * d.float()[..., None] + m.float()[..., None]).reshape(13, 64)
    step = d.float().repeat_interleave(32, dim=1)
    assert ((w - linear.weight).abs() <= step / 2 + 1e-3).all()


@pytest.mark.parametrize("rows, width", [(1, 576), (3, 64), (30, 1536), (5, 96)])  # 96: an odd number of blocks
def test_int8_block_kernel_computes_its_reference(rows, width):
    if optional_kernel() is None:
        pytest.skip("int4-dyn's head needs the C++ extension, which cannot be built here")
    torch.manual_seed(rows)
    linear = torch.nn.Linear(width, 1030, bias=False)
    layer = Int8BlockLinear(linear)
    assert layer.weight_q8.dtype == torch.uint8 and layer.weight_q8.numel() == 1032 * width  # 8 rows a group
    assert layer.d.dtype == torch.float16 and layer.d.numel() == 1032 * width // 32
    x = torch.randn(rows, width)
    x[0, :32] = 0
    q, d = layer.unpacked()
    w = q.double() * d.double()[..., None]
    reference = torch.einsum("rbk,nbk->rn", _block_activations(x), w)
    y = layer(x)
    torch.testing.assert_close(y.double(), reference, rtol=1e-5, atol=1e-5)
    assert relative_error(y, linear(x)) < 3e-2
    assert torch.equal(layer(x[-1:]), y[-1:])


@pytest.mark.parametrize("make", [lambda lin: (lambda x: optional_kernel().small_linear(x, lin.weight, None)),
                                  Int8WeightOnlyLinear, Int8DynamicLinear, Int4DynamicLinear, Int8BlockLinear],
                         ids=["fp32", "int8-wo", "int8-dyn", "int4-dyn", "int8-block"])
def test_row_kernels_give_the_same_rows_on_any_number_of_threads(make):
    """Threads share a product's rows and take more from each other as they finish: whichever thread
    computes a row, and whatever share it came from, the row comes out the same."""
    if optional_kernel() is None:
        pytest.skip("the row kernels need the C++ extension, which cannot be built here")
    torch.manual_seed(0)
    linear = torch.nn.Linear(576, 4001, bias=False)  # megabytes of weights: shared by every thread
    product = make(linear)
    x = torch.randn(1, 576)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = product(x)
        for n in (2, 3, 8):  # more threads than cores: shares left behind are taken by the others
            torch.set_num_threads(n)
            for _ in range(3):
                assert torch.equal(product(x), alone)
    finally:
        torch.set_num_threads(threads)


def test_int8_blocks_recover_weights_already_on_their_grid():
    """Weights that are q * d per block already (a Q8_0 file's, dequantized) come back as the same q and d."""
    torch.manual_seed(0)
    d = (torch.rand(8, 2, 1) * 0.01 + 0.001).to(torch.float16).float()
    q = torch.randint(-127, 128, (8, 2, 32)).float()
    q[:, :, 0] = 127  # the largest magnitude of each block, as the file's quantizer makes it
    linear = torch.nn.Linear(64, 8, bias=False)
    linear.weight.data = (q * d).reshape(8, 64)
    layer = Int8BlockLinear(linear)
    stored_q, stored_d = layer.unpacked()
    assert torch.equal(stored_q.float(), q)
    assert torch.equal(stored_d.float(), d[..., 0])


def test_int8_dynamic_smoothing_is_exact_before_rounding():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32, bias=True)
    smooth = torch.rand(64) + 0.5
    q = Int8DynamicLinear(linear, smooth, folded=False)
    x = torch.randn(5, 64)
    assert relative_error(q(x), linear(x)) < 3e-2
    assert relative_error(q(x[:1]), linear(x[:1])) < 3e-2
    kernel = optional_kernel()
    if q.own_kernel:  # the kernel divides the rows by the factors as it quantizes them, as PyTorch would before
        expected = kernel.int8_linear(x * q.inv_smooth, q.weight_int8, q.scales, q.row_sums, None) + linear.bias
        assert torch.equal(q(x), expected) and torch.equal(q(x[:1]), expected[:1])


# 200 inputs: whole 32- and 64-byte blocks and a remainder; 576 (the default model's width) and 1536 in whole
# 64-byte stretches, which AMX's tiles take where the CPU has them, for two rows and more (one chunk of 16 rows, a
# part of one, two, several), else AVX-512 VNNI in groups of 8, 4, 2 and 1 rows; 96 outputs are three pairs of 16,
# 112 three and a lone 16
@pytest.mark.parametrize("inputs, rows, outputs", [(200, 3, 96), (576, 1, 96), (576, 3, 96), (576, 16, 96),
                                                   (576, 32, 112), (1536, 37, 96), (100, 20, 90), (100, 1, 90)])
def test_int8_dynamic_kernel_gives_the_integer_products_exactly(inputs, rows, outputs):
    torch.manual_seed(0)
    linear = torch.nn.Linear(inputs, outputs, bias=False)
    layer = Int8DynamicLinear(linear)
    if not layer.own_kernel:
        pytest.skip("the int8 kernel needs the C++ extension, which cannot be built here")
    x = torch.randn(rows, inputs)
    x_scale = x.abs().amax(-1, keepdim=True) / 127
    x_int = torch.round(x / x_scale).clamp(-127, 127).long()
    expected = (x_int @ layer.weight_rows().long().T).float() * x_scale * layer.scales
    assert torch.equal(layer(x), expected)
    assert relative_error(layer(x), linear(x)) < 3e-2
    assert torch.equal(copy.deepcopy(layer)(x), expected)


def near_halves(width: int, span: int, seed: int) -> torch.Tensor:
    """A row of `width` values, each `span` of them with one scale (max|x| / 127): their quotients by it land on
    halves k + 0.5 (ties, which round to even), one unit in the last place either side of them and whole numbers,
    where multiplying by the scale's reciprocal instead of dividing could round to another integer."""
    g = torch.Generator().manual_seed(seed)
    row = torch.empty(width)
    for start in range(0, width, span):
        amax = torch.tensor([127 * (torch.rand(1, generator=g).item() * 3 + 0.01)])
        scale = amax / 127
        whole, half = torch.randint(-126, 127, (span - 1,), generator=g), torch.randint(0, 2, (span - 1,), generator=g)
        k = whole.float() + half / 2
        v = k * scale
        step = torch.randint(-1, 2, (span - 1,), generator=g)
        v = torch.where(step != 0, torch.nextafter(v, step * torch.tensor(float("inf"))), v)
        row[start:start + span] = torch.cat([amax, v])[torch.randperm(span, generator=g)]
    return row


def test_int8_dynamic_rounds_quotients_at_halves_as_the_division_does():
    if optional_kernel() is None:
        pytest.skip("the int8 kernel needs the C++ extension, which cannot be built here")
    torch.manual_seed(0)
    layer = Int8DynamicLinear(torch.nn.Linear(1536, 96, bias=False))
    x = torch.stack([near_halves(1536, 1536, seed) for seed in range(20)])  # 20 rows: AMX's tiles and not
    x_scale = x.abs().amax(-1, keepdim=True) / 127
    x_int = torch.round(x / x_scale).clamp(-127, 127).long()
    assert torch.equal(layer(x), (x_int @ layer.weight_rows().long().T).float() * x_scale * layer.scales)
    assert torch.equal(layer(x[:1]), layer(x)[:1])


@pytest.mark.parametrize("make, top", [(Int8BlockLinear, 127), (Int4DynamicLinear, 15)], ids=["int8-block", "int4-dyn"])
def test_block_quantizers_round_quotients_at_halves_as_the_division_does(make, top):
    """With weights that pick one input each (a block's one nonzero weight is its largest, top times its scale), each
    output is that input's integer times the two scales: the integers read back are the division's."""
    if optional_kernel() is None:
        pytest.skip("the block kernels need the C++ extension, which cannot be built here")
    linear = torch.nn.Linear(576, 576, bias=False)
    linear.weight.data = torch.eye(576)
    layer = make(linear)
    x = torch.stack([near_halves(576, 32, seed) for seed in range(9)])
    blocks = x.view(9, 18, 32)
    dx = blocks.abs().amax(-1, keepdim=True) / 127
    expected = torch.round(blocks / dx).clamp(-127, 127).view(9, 576)
    d = layer.unpacked()[-2 if make is Int4DynamicLinear else 1].float().view(576, 18)
    weight_scale = d[torch.arange(576), torch.arange(576) // 32]
    read = layer(x).double() / (top * weight_scale.double() * dx.view(9, 18).repeat_interleave(32, dim=1).double())
    assert torch.equal(torch.round(read), expected.double())


def test_int8_dynamic_falls_back_to_fbgemm_without_the_kernel(monkeypatch):
    monkeypatch.setattr(qlinear, "optional_kernel", lambda: None)
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32, bias=True)
    layer = Int8DynamicLinear(linear)
    assert layer.packed_weight_nbytes >= 64 * 32
    x = torch.randn(4, 64)
    assert relative_error(layer(x), linear(x)) < 3e-2
    assert relative_error(layer(x[:1]), linear(x[:1])) < 3e-2


@pytest.mark.parametrize("level", [lv for lv in LEVELS if lv != "fp32"])
def test_every_level_generates_and_shrinks_or_keeps_the_bytes(tiny_lm, calibration, level):
    if level not in available_levels(tiny_lm.device):
        pytest.skip(f"{level} does not run on this machine")
    q = quantize(tiny_lm, level)
    assert q.model is not tiny_lm.model and q.weights.startswith(level)
    gen = Generation(q, GenConfig("Hello there", raw=True, max_new_tokens=6, ignore_eos=True), calibration=calibration,
                     telemetry=False)
    assert len(gen.run()["token_ids"]) == 6
    assert model_shape(q.model).weight_bytes < model_shape(tiny_lm.model).weight_bytes
    assert next(tiny_lm.model.parameters()).dtype == torch.float32  # the original is untouched


def test_int8_weight_bytes_are_the_real_tensors(tiny_lm):
    q = quantize(tiny_lm, "int8-wo")
    layers = [m for m in q.model.modules() if isinstance(m, Int8WeightOnlyLinear)]
    expected = sum(m.weight_int8.nbytes + m.scales.nbytes for m in layers)
    embedding = q.model.get_input_embeddings().weight
    norms = sum(p.nbytes for p in q.model.parameters()) - embedding.nbytes
    rotary = sum(b.nbytes for n, b in q.model.named_buffers() if "inv_freq" in n)
    shape = model_shape(q.model)
    assert shape.weight_bytes == expected + norms + rotary
    # the head no longer shares the embedding, which is read only for the looked-up rows
    assert shape.embed_row_bytes == embedding[0].nbytes


def test_bad_levels_get_one_sentence(tiny_lm):
    with pytest.raises(QuantError, match="Unknown quantization level"):
        quantize(tiny_lm, "int3")
    with pytest.raises(QuantError, match="group size"):
        quantize(tiny_lm, "int4-wo", group_size=48)
    with pytest.raises(QuantError, match="does not divide"):
        quantize(tiny_lm, "int4-wo", group_size=256)
    meta = torch.device("meta")
    with pytest.raises(QuantError, match="levels that work here"):
        from engine.switches.quant import check_level
        check_level("int8-dyn", meta, tiny_lm.model)


def test_variants_are_cached_and_old_ones_dropped(tiny_lm):
    a = variant(tiny_lm, "int8-wo")
    assert variant(tiny_lm, "int8-wo") is a
    variant(tiny_lm, "bf16")
    variant(tiny_lm, "int4-wo")
    assert variant(tiny_lm, "int8-wo") is not a  # evicted after two newer variants
    assert variant(tiny_lm, "fp32") is tiny_lm


def test_every_level_says_its_kernel():
    for level in LEVELS:
        info = level_info(level, torch.device("cpu"))
        assert info.kernel and info.note
    assert not level_info("int8-wo", torch.device("cuda")).accelerated


def test_smoothing_factors_are_fitted_once_per_weights_and_kept(tiny_lm, monkeypatch, tmp_path):
    monkeypatch.setenv("TOKENPATH_CACHE", str(tmp_path))
    model, ids = copy.deepcopy(tiny_lm.model), list(range(5, 300))
    fits, fit = [], qlinear.smoothing_plan
    monkeypatch.setattr(qlinear, "smoothing_plan", lambda *a: fits.append(a) or fit(*a))
    fitted = qlinear.kept_smoothing_plan(model, ids)
    kept = list((tmp_path / "smoothing").iterdir())
    assert len(fits) == 1 and len(kept) == 1
    again = qlinear.kept_smoothing_plan(model, ids)
    assert len(fits) == 1 and again.keys() == fitted.keys()
    for name, (factors, norm) in fitted.items():
        assert torch.equal(again[name][0], factors) and again[name][1] == norm
    kept[0].write_bytes(b"cut short")  # a file that cannot be read is fitted again and replaced
    assert all(torch.equal(qlinear.kept_smoothing_plan(model, ids)[n][0], f) for n, (f, _) in fitted.items())
    assert len(fits) == 2 and torch.load(kept[0], weights_only=True).keys() == fitted.keys()
    with torch.no_grad():
        next(model.parameters()).mul_(2)  # other weights, another plan
    qlinear.kept_smoothing_plan(model, ids)
    assert len(fits) == 3 and len(list((tmp_path / "smoothing").iterdir())) == 2


@pytest.mark.parametrize("outputs, inputs", [(96, 576), (90, 100), (1, 1), (17, 65)])
def test_packed_int8_weights_unpack_to_the_rows_with_zeros_around_them(outputs, inputs):
    q = torch.randint(-127, 128, (outputs, inputs), dtype=torch.int8)
    packed = qlinear.pack_int8(q)
    assert packed.shape == (-(-outputs // 16), -(-inputs // 64) * 16, 64)
    assert torch.equal(qlinear.unpack_int8(packed, outputs, inputs), q)
    assert packed.to(torch.int64).abs().sum() == q.to(torch.int64).abs().sum()  # the padding is zeros


@pytest.mark.parametrize("outputs, rows", [(3072, 1), (3072, 37), (96, 20), (90, 20), (90, 1)])
def test_int8_dynamic_silu_product_equals_the_outputs_then_silu_mul(outputs, rows):
    kernel = optional_kernel()
    if kernel is None:
        pytest.skip("the int8 kernel needs the C++ extension, which cannot be built here")
    torch.manual_seed(0)
    layer = Int8DynamicLinear(torch.nn.Linear(576, outputs, bias=False))
    assert layer.makes_silu_product
    x = torch.randn(rows, 576) * 3
    assert torch.equal(layer.silu_product(x), kernel.silu_mul(layer(x)))
    assert torch.equal(layer.silu_product(x[:1]), layer.silu_product(x)[:1])
    assert not Int8DynamicLinear(torch.nn.Linear(576, outputs, bias=True)).makes_silu_product
