"""The lean forward computes what transformers' Llama forward computes."""
import pytest
import torch
from transformers import DynamicCache

from engine import huge_pages
from engine.model import lean
from engine.model.cpu_kernels import has_small_rows_kernel, optional_kernel
from engine.model.lean import LeanLinear, LeanLlama
from engine.model.loader import tiny_model
from engine.run.step import select_token, select_tokens
from engine.spec import GenConfig

IDS = torch.tensor([[1, 15, 27, 300, 4000, 22, 9, 512, 77, 1000]])


@pytest.fixture(scope="module")
def pair():
    return tiny_model(seed=3).model, tiny_model(seed=3, lean_forward=False).model


def test_the_tiny_model_gets_the_lean_forward(pair):
    assert isinstance(pair[0], LeanLlama) and not isinstance(pair[1], LeanLlama)


@torch.inference_mode()
def test_prefill_and_cached_steps_match_transformers(pair):
    caches = [DynamicCache(config=m.config) for m in pair]
    first = [m(input_ids=IDS[:, :6], cache=c, use_cache=True).logits for m, c in zip(pair, caches)]
    torch.testing.assert_close(first[0], first[1], rtol=0, atol=1e-5)
    for step in range(6, 10):
        out = [m(input_ids=IDS[:, step:step + 1], cache=c, use_cache=True).logits for m, c in zip(pair, caches)]
        torch.testing.assert_close(out[0], out[1], rtol=0, atol=1e-5)
    assert caches[0].get_seq_length() == caches[1].get_seq_length() == 10
    torch.testing.assert_close(caches[0].layers[1].keys, caches[1].layers[1].keys, rtol=0, atol=1e-5)


@torch.inference_mode()
def test_several_new_tokens_after_a_cache_match_one_full_forward(pair):
    lean = pair[0]
    cache = DynamicCache(config=lean.config)
    lean(input_ids=IDS[:, :4], cache=cache, use_cache=True)
    chunk = lean(input_ids=IDS[:, 4:], cache=cache, use_cache=True).logits
    full = lean(input_ids=IDS, use_cache=False).logits[:, 4:]
    torch.testing.assert_close(chunk, full, rtol=0, atol=1e-5)


@torch.inference_mode()
def test_a_visibility_mask_runs_two_branches_in_one_forward(pair):
    """Two continuations of one prefix, side by side in one forward, each seeing only itself:
    their logits equal those of running each continuation alone."""
    lean = pair[0]
    prefix, a, b = IDS[:, :5], IDS[:, 5:7], IDS[:, 7:9]
    cache = DynamicCache(config=lean.config)
    lean(input_ids=prefix, cache=cache, use_cache=True)
    visible = torch.zeros(4, 4, dtype=torch.bool)
    visible[:2, :2] = visible[2:, 2:] = torch.ones(2, 2, dtype=torch.bool).tril()
    both = lean(input_ids=torch.cat([a, b], dim=1), cache=cache, use_cache=True,
                position_ids=torch.tensor([[5, 6, 5, 6]]), attention_mask=visible).logits
    for branch, logits in ((a, both[:, :2]), (b, both[:, 2:])):
        alone = lean(input_ids=torch.cat([prefix, branch], dim=1), use_cache=False).logits[:, 5:]
        torch.testing.assert_close(logits, alone, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
@torch.inference_mode()
def test_a_half_precision_cache_holds_half_the_bytes_and_stays_close(pair, kv_dtype):
    lean = pair[0]
    caches = {dt: DynamicCache(config=lean.config) for dt in (None, kv_dtype)}
    logits = {dt: lean(input_ids=IDS, cache=c, use_cache=True, kv_dtype=dt).logits for dt, c in caches.items()}
    full, half = caches[None].layers[0], caches[kv_dtype].layers[0]
    assert half.keys.dtype == kv_dtype and half.keys.nbytes * 2 == full.keys.nbytes
    assert logits[kv_dtype].dtype == torch.float32
    torch.testing.assert_close(logits[kv_dtype], logits[None], rtol=0, atol=0.05)


def test_cpu_kernels_compute_the_pytorch_expressions():
    kernel = optional_kernel()
    if kernel is None:
        pytest.skip("the C++ extension cannot be built here")
    torch.manual_seed(0)
    qkv = torch.randn(1, 3, 6 * 16)
    cos, sin = torch.randn(1, 3, 16), torch.randn(1, 3, 16)
    heads = qkv[..., :4 * 16].view(1, 3, 4, 16).transpose(1, 2)
    rotated = torch.cat((-heads[..., 8:], heads[..., :8]), dim=-1)
    assert torch.equal(kernel.rotary(qkv, cos, sin, 4, 16), heads * cos[:, None] + rotated * sin[:, None])
    x, w = torch.randn(2, 3, 48), torch.randn(48)
    torch.testing.assert_close(kernel.rms_norm(x, w, 1e-5), w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                                                                   + 1e-5)), rtol=1e-6, atol=1e-6)
    gate_up = torch.randn(2, 3, 2 * 40)
    gate, up = gate_up.split(40, dim=-1)
    torch.testing.assert_close(kernel.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, rtol=1e-6, atol=1e-6)


def test_the_row_kernels_give_each_row_of_a_prefill_what_they_give_it_alone():
    """rms_norm, silu_mul and rotary share a prefill's rows over the threads: a row's result is its own."""
    kernel = optional_kernel()
    if kernel is None:
        pytest.skip("the C++ extension cannot be built here")
    torch.manual_seed(1)
    x, w, gate_up = torch.randn(1, 200, 576), torch.randn(576), torch.randn(1, 200, 2 * 1536)
    qkv, cos, sin = torch.randn(1, 200, 15 * 64), torch.randn(1, 200, 64), torch.randn(1, 200, 64)
    normed, acted, rotated = kernel.rms_norm(x, w, 1e-5), kernel.silu_mul(gate_up), kernel.rotary(qkv, cos, sin, 12, 64)
    for r in range(0, 200, 7):
        at = slice(r, r + 1)
        assert torch.equal(normed[:, at], kernel.rms_norm(x[:, at], w, 1e-5))
        assert torch.equal(acted[:, at], kernel.silu_mul(gate_up[:, at]))
        assert torch.equal(rotated[:, :, at], kernel.rotary(qkv[:, at], cos[:, at], sin[:, at], 12, 64))


def test_silu_mul_follows_pytorch_across_the_float_range_and_gives_a_value_the_same_bits_in_any_lane():
    kernel = optional_kernel()
    if kernel is None:
        pytest.skip("the C++ extension cannot be built here")
    torch.manual_seed(0)
    gate = torch.cat([torch.linspace(-120, 120, 2401), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 87.5, -87.5, 88.7])])
    up = torch.randn_like(gate)
    out = kernel.silu_mul(torch.cat([gate, up])[None])[0]  # 2408 values, eight lanes at a time
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, rtol=1e-6, atol=1e-35)
    # the first 2400 went in vectors; alone, each goes the one-by-one way
    alone = torch.cat([kernel.silu_mul(torch.stack([g, u])[None])[0] for g, u in zip(gate[:2400:6], up[:2400:6])])
    assert torch.equal(alone, out[:2400:6])
    assert kernel.silu_mul(torch.tensor([[float("nan"), 1.0]])).isnan().all()


@pytest.mark.parametrize("n, k", [(64, 48), (67, 37), (3, 16), (1030, 300)])  # the last is split over threads
def test_small_linear_gives_each_row_the_same_result_whatever_the_rows_beside_it(n, k):
    if not has_small_rows_kernel():
        pytest.skip("small_linear needs the C++ extension, which cannot be built here")
    kernel = optional_kernel()
    torch.manual_seed(0)
    x, w, b = torch.randn(1, 11, k), torch.randn(n, k), torch.randn(n)
    y = kernel.small_linear(x, w, b)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)  # sums of up to 300 float32 products
    assert y.shape == (1, 11, n)
    for rows in [slice(0, 1), slice(3, 8), slice(10, 11)]:  # a decode step's row equals the same row verified with others
        assert torch.equal(kernel.small_linear(x[:, rows], w, b), y[:, rows])
    assert torch.equal(kernel.small_linear(x[0], w, None) + b, y[0])


@torch.inference_mode()
def test_lean_linear_uses_the_kernel_for_few_float32_rows_only(monkeypatch):
    torch.manual_seed(0)
    layer = lean.lean_linear(torch.nn.Linear(32, 24))
    calls = []
    if not has_small_rows_kernel():
        pytest.skip("small_linear needs the C++ extension, which cannot be built here")
    real = optional_kernel()

    class Spy:
        def small_linear(self, *args):
            calls.append(args[0].shape)
            return real.small_linear(*args)

    monkeypatch.setattr(lean, "optional_kernel", lambda: Spy())
    for rows in [1, lean.SMALL_ROWS, lean.SMALL_ROWS + 1]:
        x = torch.randn(1, rows, 32)
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    monkeypatch.setattr(lean, "has_small_rows_kernel", lambda: False)  # no C++ extension here
    layer(torch.randn(1, 2, 32))
    layer.to(torch.bfloat16)(torch.randn(1, 2, 32, dtype=torch.bfloat16))
    assert calls == [(1, 1, 32), (1, lean.SMALL_ROWS, 32)]


@torch.inference_mode()
def test_the_pytorch_path_without_the_kernels_gives_the_same_logits(pair, monkeypatch):
    with_kernels = pair[0](input_ids=IDS, use_cache=False).logits
    monkeypatch.setattr(lean, "optional_kernel", lambda: None)
    torch.testing.assert_close(pair[0](input_ids=IDS, use_cache=False).logits, with_kernels, rtol=0, atol=1e-5)


@pytest.mark.parametrize("batch, heads, kv_heads, length, dim", [(1, 4, 2, 1, 16), (1, 9, 3, 37, 64), (2, 6, 6, 300, 20)])
def test_decode_attention_computes_what_scaled_dot_product_attention_does(batch, heads, kv_heads, length, dim):
    kernel = optional_kernel()
    if kernel is None:
        pytest.skip("the C++ extension cannot be built here")
    torch.manual_seed(length)
    q = torch.randn(batch, heads, 1, dim)
    k, v = torch.randn(batch, kv_heads, length, dim) * 3, torch.randn(batch, kv_heads, length, dim)
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=dim ** -0.5,
                                                             enable_gqa=heads != kv_heads)
    out = kernel.decode_attention(q, k, v, dim ** -0.5)
    assert out.shape == (batch, 1, heads * dim)
    torch.testing.assert_close(out, plain.transpose(1, 2).reshape(batch, 1, heads * dim), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dim", [40, 48, 64, 80])
def test_a_group_s_heads_attended_together_get_the_bits_each_gets_alone(dim):
    """Where the sequences' grouped-query groups are enough for the threads, up to four heads of a group are
    attended together, each key and value widened once for them; alone, a sequence's heads go one at a time. Each
    head's output is the same to the bit either way, at groups of 4 and 7 heads (4 + 3 together) and at widths
    whose last slice of 16 or 64 is partial."""
    kernel = optional_kernel()
    if kernel is None:
        pytest.skip("the C++ extension cannot be built here")
    g, threads = torch.Generator().manual_seed(dim), torch.get_num_threads()
    torch.set_num_threads(2)  # alone, a sequence's 2 or 4 groups are too few for two threads: one head at a time
    try:
        for heads, kv_heads in [(16, 4), (14, 2)]:
            q = torch.randn(8, heads, 1, dim, generator=g)
            k, v = (torch.randn(8, kv_heads, 45, dim, generator=g).to(torch.bfloat16) for _ in range(2))
            together = kernel.decode_attention(q, k, v, dim ** -0.5)
            for b in range(8):
                alone = kernel.decode_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], dim ** -0.5)
                assert torch.equal(together[b:b + 1], alone)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_over_a_half_precision_cache_is_attention_over_its_values_in_float32(dtype):
    """The kernels widen each cached value as they read it: the same bits as over a float32 copy of the cache, for
    a decode step and for prompts side by side; keys and values of two types, or of another type, are refused."""
    kernel = optional_kernel()
    if kernel is None:
        pytest.skip("the C++ extension cannot be built here")
    g = torch.Generator().manual_seed(1)
    for batch, length, dim in [(2, 37, 64), (1, 5, 64), (3, 70, 40)]:
        q = torch.randn(batch, 9, 1, dim, generator=g)
        k, v = (torch.randn(batch, 3, length, dim, generator=g).to(dtype) for _ in range(2))
        assert torch.equal(kernel.decode_attention(q, k, v, 0.125),
                           kernel.decode_attention(q, k.float(), v.float(), 0.125))
    q = torch.randn(1, 9, 30, 64, generator=g)
    k, v = (torch.randn(1, 3, 30, 64, generator=g).to(dtype) for _ in range(2))
    assert torch.equal(kernel.prompt_attention(q, k, v, [12, 18], 0.125),
                       kernel.prompt_attention(q, k.float(), v.float(), [12, 18], 0.125))
    for keys, values in ((k, v.float()), (k.to(torch.int8), v.to(torch.int8))):
        with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
            kernel.prompt_attention(q, keys, values, [30], 0.125)


class _CountingKernel:
    """The real extension, counting its decode_layers calls."""

    def __init__(self, real):
        self.real, self.calls = real, 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def decode_layers(self, *args):
        self.calls += 1
        return self.real.decode_layers(*args)


@torch.inference_mode()
def _prefill_and_steps(model, kv_dtype=None) -> tuple[torch.Tensor, DynamicCache]:
    cache = DynamicCache(config=model.config)
    rows = [model(input_ids=IDS[:, :6], cache=cache, use_cache=True, kv_dtype=kv_dtype).logits[:, -1]]
    rows += [model(input_ids=IDS[:, i:i + 1], cache=cache, use_cache=True, kv_dtype=kv_dtype).logits[:, -1]
             for i in range(6, 10)]
    return torch.cat(rows), cache


@pytest.mark.parametrize("level,kv_dtype", [("fp32", None), ("int8-wo", None), ("int8-dyn", None), ("int4-wo", None),
                                            ("int4-dyn", None), ("fp32", torch.bfloat16), ("int8-dyn", torch.float16)])
def test_a_decode_step_in_one_call_equals_the_modules_to_the_bit(level, kv_dtype, monkeypatch):
    """A cache in half precision too: the new positions rounded as the modules round them."""
    from engine.switches.quant import quantize

    real = optional_kernel()
    if real is None:
        pytest.skip("the C++ extension cannot be built here")
    tiny = tiny_model(seed=5, layers=3)
    model = tiny.model if level == "fp32" else quantize(tiny, level).model
    monkeypatch.setattr(lean, "FUSED_DECODE", False)
    modules, modules_cache = _prefill_and_steps(model, kv_dtype)
    counting = _CountingKernel(real)
    monkeypatch.setattr(lean, "optional_kernel", lambda: counting)
    monkeypatch.setattr(lean, "FUSED_DECODE", True)
    fused, fused_cache = _prefill_and_steps(model, kv_dtype)
    assert counting.calls == 4  # every decode step; the prefill never
    assert torch.equal(fused, modules)
    for a, b in zip(fused_cache.layers, modules_cache.layers):
        assert a.keys.dtype == (kv_dtype or torch.float32)
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("name", ["model.embed_tokens", "model.layers.1.mlp.down_proj", "model.norm", "lm_head",
                                  "every module"])
def test_a_hook_keeps_the_step_on_the_module_path(pair, monkeypatch, name):
    real = optional_kernel()
    if real is None:
        pytest.skip("the C++ extension cannot be built here")
    counting = _CountingKernel(real)
    monkeypatch.setattr(lean, "optional_kernel", lambda: counting)
    seen = []
    hook = lambda m, args: seen.append(m)  # noqa: E731
    handle = (torch.nn.modules.module.register_module_forward_pre_hook(hook) if name == "every module"
              else pair[0].get_submodule(name).register_forward_pre_hook(hook))
    try:
        _prefill_and_steps(pair[0])
    finally:
        handle.remove()
    if name == "every module":
        assert sum(type(m) is LeanLinear for m in seen) > 4 * 5  # every decode step ran its layers' modules
    else:
        assert len(seen) == 1 + 4  # the prefill and every decode step ran the hooked layer's modules
    assert counting.calls == 0


@torch.inference_mode()
def test_the_rotary_table_gives_the_embeddings_own_numbers(pair):
    model = pair[0]
    x = torch.zeros(1, 1, model.config.hidden_size)
    for past, length in [(0, 10), (37, 1), (1500, 3)]:  # the last one grows the table
        positions = torch.arange(past, past + length)[None]
        for got, own in zip(model.rotary(x, None, past, length), model.model.rotary_emb(x, positions)):
            assert torch.equal(got, own)
    tree = torch.tensor([[5, 6, 6, 7, 9]])  # a tree of guesses: positions repeat and skip
    for got, own in zip(model.rotary(x, tree, 5, 5), model.model.rotary_emb(x, tree)):
        assert torch.equal(got, own)


@pytest.mark.parametrize("values", [
    torch.randn(49152), torch.randn(13), torch.tensor([1., 3., 3., 2.]), torch.full((20,), -float("inf")),
    torch.tensor([1., float("nan"), 5., float("nan")]), torch.tensor([0.] * 9 + [5., float("nan")]),
    torch.cat([torch.randn(40), torch.tensor([9., 9.])]),
    torch.cat([torch.zeros(41), torch.tensor([7.]), torch.zeros(17), torch.tensor([7.]), torch.zeros(40)]),
    torch.cat([torch.randn(40), torch.tensor([float("nan")]), torch.randn(59), torch.tensor([float("nan")])]),
], ids=["logits", "short", "tie", "all -inf", "nan", "nan in the tail", "tie in the tail", "tie far apart",
        "nan among the lanes"])
def test_the_argmax_kernel_returns_what_torch_argmax_does(values):
    kernel = optional_kernel()
    if kernel is None:
        pytest.skip("the C++ extension cannot be built here")
    assert kernel.argmax(values) == int(torch.argmax(values))
    rows = torch.stack([values, values.flip(0), values.roll(3)] * 3)  # nine rows: shared by the threads
    assert kernel.argmax_rows(rows) == torch.argmax(rows, dim=1).tolist()


def test_a_batch_s_tokens_are_each_rows_own_pick_greedy_or_sampled():
    logits = torch.randn(5, 300)
    cfgs = [GenConfig("x", temperature=0.0), GenConfig("x", temperature=0.8, seed=3), GenConfig("x", temperature=0.0),
            GenConfig("x", temperature=0.0), GenConfig("x", temperature=1.2, seed=4)]
    generators = [None, torch.Generator().manual_seed(3), None, None, torch.Generator().manual_seed(4)]
    alone = [torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)]
    expected = [select_token(logits[0], cfgs[0], None), select_token(logits[1], cfgs[1], alone[0]),
                select_token(logits[2], cfgs[2], None), select_token(logits[3], cfgs[3], None),
                select_token(logits[4], cfgs[4], alone[1])]
    assert select_tokens(logits, cfgs, generators) == expected


@torch.inference_mode()
def test_the_fused_decode_grows_its_cache_in_place_and_a_crop_keeps_it_right(monkeypatch):
    if optional_kernel() is None:
        pytest.skip("the C++ extension cannot be built here")
    model = tiny_model(seed=7, layers=2).model

    def run(fused: bool):
        monkeypatch.setattr(lean, "FUSED_DECODE", fused)
        cache = DynamicCache(config=model.config)
        model(input_ids=IDS[:, :4], cache=cache, use_cache=True)
        rows, storages = [], []
        for i in [4, 5, 6, 7]:
            rows.append(model(input_ids=IDS[:, i:i + 1], cache=cache, use_cache=True).logits)
            storages.append(cache.layers[1].keys.data_ptr())
        cache.crop(-2)  # as after rejected guesses
        rows += [model(input_ids=IDS[:, i:i + 1], cache=cache, use_cache=True).logits for i in [8, 9]]
        return torch.cat(rows), cache, storages

    fused, fused_cache, storages = run(True)
    modules, modules_cache, _ = run(False)
    assert len(set(storages)) == 1  # one storage from the first decode step on: no copy per token
    assert torch.equal(fused, modules)
    assert torch.equal(fused_cache.layers[1].keys, modules_cache.layers[1].keys)
    assert fused_cache.get_seq_length() == 8


@pytest.mark.parametrize("fused,kv", [(False, "auto"), (True, "auto"), (True, "bf16")])
def test_a_step_s_cache_bytes_are_what_its_real_caches_moved(fused, kv, calibration, monkeypatch):
    """Attention reads the grown cache; a step writes its new positions, and a cache that moved to new
    storage was also read and written whole: transformers' cache moves on every step, the one-call
    decode's when its room runs out (in float32 or in half precision alike)."""
    if fused and optional_kernel() is None:
        pytest.skip("the C++ extension cannot be built here")
    from engine.measure.accounting import cache_nbytes
    from engine.run.generate import Generation, GenConfig

    monkeypatch.setattr(lean, "FUSED_DECODE", fused)
    gen = Generation(tiny_model(seed=2), GenConfig("A short prompt", raw=True, max_new_tokens=150, ignore_eos=True,
                                                   kv_dtype=kv), calibration=calibration, telemetry=False)
    before, storage, moves = 0, None, 0
    for event in gen:
        after, now = cache_nbytes(gen.cache), gen.cache.layers[0].keys.untyped_storage().data_ptr()
        moved = before if now != storage else 0
        step = gen.steps[event.step]
        assert (step["kv_read_bytes"], step["kv_write_bytes"]) == (after + moved, after - before + moved)
        before, storage, moves = after, now, moves + (now != storage)
    assert moves == (3 if fused else 150)  # the prefill, then the first step and the one past 128 positions; every step


@pytest.mark.parametrize("fused", [False, True])
@torch.inference_mode()
def test_a_token_id_beyond_the_vocabulary_is_an_index_error_on_either_path(fused, monkeypatch):
    if fused and optional_kernel() is None:
        pytest.skip("the C++ extension cannot be built here")
    monkeypatch.setattr(lean, "FUSED_DECODE", fused)
    model = tiny_model(seed=4, layers=2).model
    cache = DynamicCache(config=model.config)
    model(input_ids=IDS[:, :4], cache=cache)
    with pytest.raises(IndexError):
        model(input_ids=torch.tensor([[model.config.vocab_size + 3]]), cache=cache)


def test_a_layer_replaced_after_decoding_is_the_one_the_next_step_reads(monkeypatch):
    if optional_kernel() is None:
        pytest.skip("the C++ extension cannot be built here")
    model = tiny_model(seed=3, layers=2).model
    _prefill_and_steps(model)  # the plan is made and kept
    mlp = model.model.layers[1].mlp
    old = mlp.down_proj
    mlp.down_proj = lean._lean_layer(torch.nn.Parameter(old.weight.detach() * 0.5, requires_grad=False), None)
    fused = _prefill_and_steps(model)[0]
    monkeypatch.setattr(lean, "FUSED_DECODE", False)
    assert torch.equal(fused, _prefill_and_steps(model)[0])


def test_a_copy_of_the_model_does_not_keep_the_originals_decode_forms(monkeypatch):
    import copy

    if optional_kernel() is None:
        pytest.skip("the C++ extension cannot be built here")
    model = tiny_model(seed=2, layers=2).model
    _prefill_and_steps(model)
    assert "_kept_plan" in model.__dict__
    twin = copy.deepcopy(model)
    assert "_kept_plan" not in twin.__dict__ and "_kept_plan" in model.__dict__
    assert torch.equal(_prefill_and_steps(twin)[0], _prefill_and_steps(model)[0])


def _room(tensors: list) -> int:
    """The most memory tensors placed side by side take (engine.model.lean's blocks): each from a cache line, and on
    a mapping of its own with a huge page's room for its start where they fill one."""
    used = sum(-(-t.nbytes // 64) * 64 for t in tensors)
    return used + (huge_pages.HUGE_PAGE if used >= huge_pages.HUGE_PAGE else 0)


def _layer_weights(model) -> list[torch.Tensor]:
    return [linear.weight for layer in model.model.layers
            for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]


def test_the_layers_weights_sit_in_one_block_in_the_order_a_step_reads_them_and_the_rest_own_theirs():
    model = tiny_model(seed=3, layers=3).model
    weights = _layer_weights(model)
    assert len({w.untyped_storage().data_ptr() for w in weights}) == 1
    starts = [w.data_ptr() for w in weights]
    assert starts == sorted(starts)
    assert all(a.data_ptr() + a.nbytes <= b.data_ptr() and b.data_ptr() % 64 == 0 for a, b in zip(weights, weights[1:]))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tied head stays apart, and tied
    block = weights[0].untyped_storage().data_ptr()
    rest = [p for p in model.parameters() if p.untyped_storage().data_ptr() != block]
    assert len(rest) == sum(1 for _ in model.parameters()) - len(weights)
    assert len({p.untyped_storage().data_ptr() for p in rest}) == len(rest)  # the others own their memory
    assert all(p.untyped_storage().nbytes() <= _room([p]) for p in rest)  # and no more than it
    reference = tiny_model(seed=3, layers=3, lean_forward=False).model
    for ours, theirs in zip(weights[::4], (layer.self_attn for layer in reference.model.layers)):
        assert torch.equal(ours, torch.cat([theirs.q_proj.weight, theirs.k_proj.weight, theirs.v_proj.weight]))


@pytest.mark.parametrize("level", ["bf16", "int8-wo"])
def test_a_level_that_replaces_every_layer_keeps_no_view_of_the_block(level):
    from engine.switches.quant import quantize

    lm = tiny_model(seed=3, layers=2)
    variant = quantize(lm, level)  # converts a copy, whose block is a copy of the original's
    storages = {}
    for t in [*variant.model.parameters(), *variant.model.buffers()]:
        storages.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    # no memory beyond what the tensors in it use: no copy of the block left
    assert all(tensors[0].untyped_storage().nbytes() <= _room(tensors) for tensors in storages.values())
    assert len({w.untyped_storage().data_ptr() for w in _layer_weights(lm.model)}) == 1


def test_prompt_attention_gives_each_prompt_s_rows_what_they_get_alone_and_the_decode_step_s_bits():
    """Prompts of different lengths side by side: each row attends over its own prompt's positions up to it, the
    same bits as the prompt alone, its last row the same bits as a decode step at that position, and within
    float rounding of PyTorch's causal SDPA."""
    kernel = optional_kernel()
    if kernel is None:
        pytest.skip("the C++ extension cannot be built here")
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, lengths = 9, 3, 64, [5, 17, 1, 40, 16]
    q = torch.randn(1, heads, sum(lengths), dim, generator=g)
    k, v = (torch.randn(1, kv_heads, sum(lengths), dim, generator=g) for _ in range(2))
    together = kernel.prompt_attention(q, k, v, lengths, dim ** -0.5)
    start = 0
    for length in lengths:
        at = slice(start, start + length)
        alone = kernel.prompt_attention(q[:, :, at], k[:, :, at], v[:, :, at], [length], dim ** -0.5)
        assert torch.equal(together[:, at], alone)
        last = kernel.decode_attention(q[:, :, at][:, :, -1:], k[:, :, at], v[:, :, at], dim ** -0.5)
        assert torch.equal(alone[:, -1:], last)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q[:, :, at], k[:, :, at], v[:, :, at], is_causal=True,
                                                                scale=dim ** -0.5, enable_gqa=True)
        torch.testing.assert_close(alone, sdpa.transpose(1, 2).reshape(1, length, heads * dim), rtol=1e-5, atol=1e-5)
        start += length
    with pytest.raises(RuntimeError, match="add up"):
        kernel.prompt_attention(q, k, v, lengths[:-1], dim ** -0.5)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_with_rooms_copies_each_prompt_into_storage_of_its_own_with_room_to_grow(dtype):
    """The keys of prompts side by side (transposed out of a fused projection, as a layer makes them) each in storage
    of its own: its positions at the start of room_for(length) positions, which the next decode writes into."""
    kernel = optional_kernel()
    if kernel is None:
        pytest.skip("the C++ extension cannot be built here")
    lengths, kv_heads, dim = [5, 130, 1], 3, 8
    fused = torch.randn(1, sum(lengths), 2 * kv_heads * dim).to(dtype)
    keys = fused[..., kv_heads * dim:].view(1, sum(lengths), kv_heads, dim).transpose(1, 2)  # strided, not contiguous
    rooms = [lean.room_for(n) for n in lengths]
    made = kernel.with_rooms(keys, lengths, rooms)
    start = 0
    for view, length, room in zip(made, lengths, rooms):
        assert view.shape == (1, kv_heads, length, dim) and view.dtype == dtype and view.is_contiguous() is (length == room)
        assert view.untyped_storage().nbytes() == kv_heads * room * dim * view.element_size()
        assert torch.equal(view, keys[:, :, start:start + length])
        start += length
    assert len({v.untyped_storage().data_ptr() for v in made}) == len(lengths)
    with pytest.raises(RuntimeError, match="rooms shorter"):
        kernel.with_rooms(keys, [5, 130, 1], [128, 128, 128])


def test_new_cache_is_the_cache_the_config_makes_for_full_and_sliding_window_layers():
    config = tiny_model(seed=1, layers=3).config
    sliding = config.__class__(**{**config.to_dict(), "sliding_window": 16, "layer_types": [
        "sliding_attention", "full_attention", "sliding_attention"]})
    for cfg in (config, sliding):
        made, reference = lean.new_cache(lean.cache_layer_kinds(cfg)), DynamicCache(config=cfg)
        assert [type(layer) for layer in made.layers] == [type(layer) for layer in reference.layers]
        assert [vars(layer) for layer in made.layers] == [vars(layer) for layer in reference.layers]
        assert {k: v for k, v in vars(made).items() if k != "layers"} == \
            {k: v for k, v in vars(reference).items() if k != "layers"}
    assert type(lean.new_cache(lean.cache_layer_kinds(sliding)).layers[0]).__name__ == "DynamicSlidingWindowLayer"
