"""2:4 weight sparsity: the pruning pattern here; the sparse kernels only where a GPU has them."""
import pytest
import torch

from engine.switches import sparse24
from engine.switches import sparsity
from engine.switches.sparsity import SparsityError


def test_pruning_keeps_the_two_largest_of_every_four():
    weight = torch.tensor([[0.1, -3.0, 2.0, 0.5, 4.0, 1.0, -1.5, 0.2]])
    assert sparse24.prune_2_4(weight).tolist() == [[0.0, -3.0, 2.0, 0.0, 4.0, 0.0, -1.5, 0.0]]
    big = sparse24.prune_2_4(torch.randn(64, 128))
    assert ((big.reshape(64, -1, 4) != 0).sum(-1) == 2).all()


def test_off_a_gpu_it_is_refused_with_the_reason(tiny_lm):
    assert "NVIDIA GPU" in sparse24.unavailable_reason(torch.device("cpu"), torch.float16)
    with pytest.raises(SparsityError, match="this run is on cpu"):
        sparsity.variant(tiny_lm, 0.5, "2:4")


def test_the_kernels_take_only_multiples_of_their_tile():
    assert sparse24.fits(torch.nn.Linear(576, 1344)) and not sparse24.fits(torch.nn.Linear(64, 48))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8,
                    reason="2:4 kernels need an NVIDIA GPU of compute capability 8.0 or newer")
def test_on_a_gpu_the_sparse_layers_compute_the_pruned_product():
    linear = torch.nn.Linear(576, 1344, device="cuda", dtype=torch.float16)
    x = torch.randn(3, 576, device="cuda", dtype=torch.float16)
    layer = sparse24.Semi24Linear(linear)
    expected = torch.nn.functional.linear(x, sparse24.prune_2_4(linear.weight.detach()), linear.bias)
    torch.testing.assert_close(layer(x), expected, rtol=1e-2, atol=1e-2)
    assert layer.packed_weight_nbytes < linear.weight.nbytes
