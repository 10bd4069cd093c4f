import gc

import pytest
import torch

from engine import huge_pages


def _smaps_tells() -> bool:
    try:
        with open("/proc/self/smaps") as f:
            return any(line.startswith("THPeligible:") for line in f)
    except OSError:
        return False


needs_huge_pages = pytest.mark.skipif(not (huge_pages.available() and _smaps_tells()),
                                      reason="this kernel gives no transparent huge pages, or does not say where")


def huge_page_eligible(address: int) -> bool:
    """Whether the mapping that holds the address may be backed by transparent huge pages (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0]
            if "-" in first and ":" not in first:
                start, end = (int(x, 16) for x in first.split("-"))
                inside = start <= address < end
            elif inside and first == "THPeligible:":
                return line.split()[1] == "1"
    return False


@needs_huge_pages
@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8, torch.bfloat16])
def test_a_large_tensor_starts_on_a_huge_page_of_a_mapping_that_asked_for_them(dtype):
    numel = (3 << 20) // torch.empty((), dtype=dtype).element_size() + 5
    t = huge_pages.empty(numel, dtype)
    assert t.shape == (numel,) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert huge_page_eligible(t.data_ptr()) and huge_page_eligible(t.data_ptr() + t.nbytes - 1)
    t.fill_(3)  # writable, every element
    assert bool((t == 3).all())


def test_a_tensor_below_one_huge_page_or_without_them_is_torch_s_own(monkeypatch, tmp_path):
    small = huge_pages.empty(1000, torch.float32)
    assert small.untyped_storage().nbytes() == 4000  # no mapping of its own, no slack
    setting = tmp_path / "enabled"
    monkeypatch.setattr(huge_pages, "SETTING", setting)
    setting.write_text("always madvise [never]\n")
    assert not huge_pages.available() and huge_pages.describe() == "4 KiB pages (transparent huge pages set to never)"
    big = huge_pages.empty(1 << 20, torch.float32)
    assert big.untyped_storage().nbytes() == 4 << 20
    setting.unlink()
    assert huge_pages.setting() is None and "not offered by this system" in huge_pages.describe()
    setting.write_text("always [madvise] never\n")
    assert huge_pages.setting() == "madvise"
    assert huge_pages.describe().startswith("2 MiB pages") == huge_pages.available()


@needs_huge_pages
def test_the_mapping_lives_as_long_as_a_view_of_it():
    t = huge_pages.empty(3 << 20, torch.uint8)
    view = t[5 << 19:].view(torch.int32)
    view.fill_(7)
    del t
    gc.collect()
    assert int(view.sum()) == 7 * view.numel()  # still mapped: reading it neither faults nor reads freed memory


@needs_huge_pages
@pytest.mark.parametrize("level", ["fp32", "bf16", "int8-wo", "int8-dyn", "int4-dyn"])
def test_what_a_decode_step_of_the_default_model_streams_lies_on_mappings_that_asked_for_huge_pages(default_lm, level):
    from engine.switches.quant import variant

    lm = variant(default_lm, level)
    model = lm.model
    streamed = [t for layer in model.model.layers for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                                  layer.mlp.gate_up_proj, layer.mlp.down_proj)
                for t in [*linear.parameters(), *linear.buffers()] if t is not None and t.numel()]
    streamed += [t for t in [*model.lm_head.parameters(), *model.lm_head.buffers()] if t.numel()]
    assert len(streamed) > 4 * len(model.model.layers)
    assert all(huge_page_eligible(t.data_ptr()) for t in streamed)


@pytest.mark.parametrize("mode", ["mask", "skip"])
def test_a_sparse_copy_streams_its_layers_from_one_block_as_the_model_it_is_compared_with(tiny_lm, mode):
    from engine.model.lean import _layer_parts
    from engine.switches.sparsity import sparse_targets, sparsify

    sparse = sparsify(tiny_lm, 0.5, mode, {name: 0.05 for name in sparse_targets(tiny_lm.model)})
    layers = [t for layer in sparse.model.model.layers for m in _layer_parts(layer)[5:] for t in m.parameters()]
    assert len(layers) == 4 * len(sparse.model.model.layers)
    assert len({t.untyped_storage().data_ptr() for t in layers}) == 1
    assert all(a.data_ptr() < b.data_ptr() for a, b in zip(layers, layers[1:]))  # in the order a step reads them
