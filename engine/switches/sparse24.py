"""2:4 semi-structured weight sparsity on NVIDIA GPUs with sparse tensor cores (Ampere or newer).

In every group of four weights along a row the two smallest in magnitude are pruned; the sparse
tensor cores skip them, so half of the multiplications go and the weights take about 56% of their
dense bytes (the kept half plus 2-bit position metadata). Unlike the activation modes the pattern
is fixed when the model is prepared and does not depend on the input. PyTorch has no CPU kernel
for it, so elsewhere it is refused with the reason. Layers whose shape the kernels cannot take
stay dense."""
from __future__ import annotations

import copy
from dataclasses import replace

import torch
import torch.nn.functional as F

from engine.model.loader import LoadedModel
from engine.switches.quant import body_linears

SPARSITY = 0.5
MIN_ROWS, MIN_COLS = 32, 64  # the strictest fp16/bf16 shape multiples of PyTorch's two 2:4 backends


def prune_2_4(weight: torch.Tensor) -> torch.Tensor:
    """The weight with the two smallest-magnitude values of every group of four (along each row) zeroed."""
    groups = weight.reshape(weight.shape[0], -1, 4)
    keep = groups.abs().topk(2, dim=-1).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True)
    return (groups * mask).reshape(weight.shape)


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """One sentence saying why 2:4 cannot run here, or None when it can."""
    if device.type != "cuda":
        return ("2:4 semi-structured sparsity needs an NVIDIA GPU with sparse tensor cores (Ampere or newer); "
                f"this run is on {device.type}.")
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"2:4 semi-structured sparsity needs compute capability 8.0 or newer; this GPU has {major}.{minor}."
    if dtype not in (torch.float16, torch.bfloat16):
        return "The 2:4 sparse kernels take fp16 or bf16 weights: choose the bf16 or fp16 level."
    return None


class Semi24Linear(torch.nn.Module):
    """A linear layer whose weight is pruned to 2:4 and stored in PyTorch's semi-structured format."""

    multiply_fraction = 0.5  # for the accounting: the pruned half is never multiplied

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        from torch.sparse import to_sparse_semi_structured

        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.sparse_weight = to_sparse_semi_structured(prune_2_4(linear.weight.detach()))
        self.bias = linear.bias
        parts = (getattr(self.sparse_weight, "packed", None), getattr(self.sparse_weight, "meta", None))
        self.packed_weight_nbytes = sum(t.nbytes for t in parts if t is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.sparse_weight, self.bias)


def fits(linear: torch.nn.Linear) -> bool:
    return linear.out_features % MIN_ROWS == 0 and linear.in_features % MIN_COLS == 0


def sparsify(lm: LoadedModel) -> LoadedModel:
    """A copy whose linear layers (not the output head) run 2:4-sparse where their shape allows."""
    model = copy.deepcopy(lm.model)
    for parent, name, linear in list(body_linears(model)):
        if fits(linear):
            setattr(parent, name, Semi24Linear(linear))
    return replace(lm, model=model.eval(), sparsity=SPARSITY, sparsity_mode="2:4")
