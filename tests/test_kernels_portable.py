"""The C++ kernels built for the architecture's baseline (no AVX2, no AVX-512: the branches a user's
CPU without them takes), and on x86 for AVX2 without AVX-512 or VNNI (the branches most x86 CPUs take),
give what this CPU's vector build gives: to the bit where both run the same
arithmetic (integer sums, element-wise kernels, the sparse product, argmax), and within 1e-4 where the
vector build sums float products in other lanes or with fused multiply-adds."""
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.model import cpu_kernels
from engine.switches.qlinear import pack_int8

ROOT = Path(__file__).resolve().parent.parent

# kernels whose vector and plain branches do the same operations in the same order
EXACT = {"int8_linear", "int8_linear_odd", "int8_silu_linear", "int8_wo_linear_prefill", "sparse_skip", "sparse_mask",
         "mask_small", "rms_norm", "rotary", "silu_mul", "argmax", "argmax_rows"}
TOLERANCE = dict(rtol=1e-4, atol=1e-4)


def outputs(kernel) -> dict:
    """Every kernel on fixed inputs of the default model's widths."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 576, generator=g)
    w = torch.randn(960, 576, generator=g) / 24
    int8 = torch.randint(-127, 128, (960, 576), generator=g, dtype=torch.int8)
    scales = torch.rand(960, generator=g) / 100
    q4 = torch.randint(0, 256, (120, 18 * 128), generator=g, dtype=torch.uint8)  # 957 rows in groups of 8
    d4, m4 = (torch.rand(120, 18, 8, generator=g) / 50).half(), (torch.randn(120, 18, 8, generator=g) / 50).half()
    q8 = torch.randint(1, 256, (120, 18 * 256), generator=g, dtype=torch.uint8)  # q + 128, q in [-127, 127]
    q, k, v = torch.randn(1, 9, 1, 64, generator=g), torch.randn(1, 3, 40, 64, generator=g), torch.randn(1, 3, 40, 64, generator=g)
    cos, sin = torch.randn(1, 3, 64, generator=g), torch.randn(1, 3, 64, generator=g)
    gate_up = torch.randn(3, 2 * 1536, generator=g) * 4
    w_t = torch.randn(1536, 576, generator=g)
    wide = torch.randn(30, 576, generator=g)
    smooth = torch.rand(576, generator=g) + 0.5
    return {
        "small_linear": kernel.small_linear(x, w, torch.randn(960, generator=g)),
        "int8_linear": kernel.int8_linear(x, pack_int8(int8), scales, int8.sum(dim=1, dtype=torch.int32), None),
        "int8_linear_odd": kernel.int8_linear(wide[:, :100], pack_int8(int8[:957, :100]), scales[:957],
                                              int8[:957, :100].sum(dim=1, dtype=torch.int32), smooth[:100]),
        "int8_silu_linear": kernel.int8_silu_linear(wide, pack_int8(int8), scales, int8.sum(dim=1, dtype=torch.int32),
                                                    smooth),
        "int8_wo_linear": kernel.int8_wo_linear(x, int8, scales.bfloat16()),
        "int8_wo_linear_prefill": kernel.int8_wo_linear(wide, int8, scales.bfloat16()),
        "int8_block_linear": kernel.int8_block_linear(x, q8, d4, 957),
        "int8_block_linear_odd_groups": kernel.int8_block_linear(x, q8[:119], d4[:119], 950),
        "int4_dyn_linear": kernel.int4_dyn_linear(x, q4, d4, m4, 957),
        "int4_dyn_linear_odd_groups": kernel.int4_dyn_linear(x, q4[:119], d4[:119], m4[:119], 950),
        "sparse_skip": kernel.sparse_linear(gate_up[:, :1536], w_t, 0.9, True)[0],
        "sparse_mask": kernel.sparse_linear(gate_up[:, :1536], w_t, 0.9, False)[0],
        "mask_small": kernel.mask_small(gate_up, 1.0)[0],
        "rms_norm": kernel.rms_norm(x, torch.rand(576, generator=g), 1e-5),
        "rotary": kernel.rotary(torch.randn(1, 3, 960, generator=g), cos, sin, 15, 64),
        "silu_mul": kernel.silu_mul(gate_up),
        "decode_attention": kernel.decode_attention(q, k, v, 0.125),
        "prompt_attention": kernel.prompt_attention(torch.randn(1, 9, 40, 64, generator=g), k, v, [7, 1, 32], 0.125),
        "argmax": torch.tensor([kernel.argmax(gate_up[i]) for i in range(3)]),
        "argmax_rows": torch.tensor(kernel.argmax_rows(gate_up)),
    }


VARIANTS = [
    pytest.param("portable", ("%ymm", "%zmm"), marks=pytest.mark.skipif(
        platform.machine() not in cpu_kernels.BASELINE, reason="no baseline known for this machine")),
    pytest.param("avx2", ("%zmm",), marks=pytest.mark.skipif(
        not cpu_kernels.cpu_has_avx2(), reason="an AVX2 build runs only on a CPU with AVX2")),
]


@pytest.mark.parametrize("variant, registers", VARIANTS)
def test_the_portable_and_avx2_builds_equal_the_vector_build(tmp_path, variant, registers):
    saved = tmp_path / f"{variant}.pt"
    code = ("import runpy, sys, torch; from engine.model import cpu_kernels; "
            f"ns = runpy.run_path({str(Path(__file__))!r}); "
            f"torch.save(ns['outputs'](cpu_kernels.kernel()), {str(saved)!r}); "
            "print(cpu_kernels.build_directory())")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=3600,
                          env={**os.environ, "TOKENPATH_KERNELS": variant, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    folder = Path(done.stdout.split()[-1])
    assert folder != cpu_kernels.build_directory()  # a build of its own
    if shutil.which("objdump"):  # nothing in it uses registers wider than the variant's CPU has
        library = next(folder.glob("*.so"))
        listing = subprocess.run(["objdump", "-d", str(library)], capture_output=True, text=True).stdout
        assert not [r for r in registers if r in listing]
    built, native = torch.load(saved), outputs(cpu_kernels.kernel())
    assert set(built) == set(native)
    for name in native:
        if name in EXACT:
            assert torch.equal(built[name], native[name]), (variant, name)
        else:
            torch.testing.assert_close(built[name], native[name], **TOLERANCE, msg=f"{variant}: {name}")
