"""Training-free activation sparsity: inputs to the linear layers whose magnitude is below a
per-layer threshold are treated as zero. Two execution modes show when that becomes speed:

- mask: the small inputs are zeroed and the whole product runs as before; the arithmetic
  notionally shrinks, the weight bytes moved do not.
- skip: the weight rows of zeroed inputs are never read.

Both modes store the weights transposed (one input channel's weights are one contiguous row) and, on
the CPU in float32, run the same kernel (engine/model/kernels/sparsity.cpp) for decoding and verifying
drafts: each output sums its terms in the same order, so a zero input's term adds exactly nothing
and the two modes give the same logits to the bit. Forwards of more rows than that (the prefill)
need nearly every weight row, so both modes run the same masked product in PyTorch there.

Thresholds are calibrated per layer on data/calibration.txt as the magnitude quantile equal to
the target sparsity, and stored per (model, sparsity) in DuckDB."""
from __future__ import annotations

import copy
from dataclasses import replace

import torch
import torch.nn.functional as F

from engine.switches import sparse24
from engine.switches.fitted import kept, model_fingerprint
from engine.model.cpu_kernels import kernel
from engine.errors import UserError
from engine.model.lean import SMALL_ROWS, LeanLlama, place_layer_tensors
from engine.model.loader import LoadedModel
from engine.paths import CALIBRATION_TEXT
from engine.switches.names import ALL_MODES, MODES


class SparsityError(UserError):
    """A sparsity setting that cannot run; the message is one sentence for the user."""


class SparseLinear(torch.nn.Module):
    """A linear layer that ignores inputs below `threshold` and counts what that saved."""

    def __init__(self, linear: torch.nn.Linear, threshold: float, mode: str):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.threshold, self.mode = float(threshold), mode
        weight = linear.weight.detach()
        # the same layout in both modes, so that their products are the same arithmetic
        self.weight_t = torch.nn.Parameter(weight.t().contiguous(), requires_grad=False)
        self.bias = linear.bias
        self.row_bytes = weight.element_size() * self.out_features  # one input channel's weights
        self.reset_counts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        counts = self.counts  # a plain list: nn.Module's attribute assignment costs microseconds per call
        n = x.numel()
        counts[0] += n
        if x.is_cpu and x.dtype == torch.float32 and n <= SMALL_ROWS * self.in_features:  # decoding, verifying
            y, zeroed, skipped = kernel().sparse_linear(x, self.weight_t, self.threshold, self.mode == "skip")
            counts[1] += zeroed
            counts[2] += skipped * (n // self.in_features)
        elif x.is_cpu:
            masked, zeroed = kernel().mask_small(x, self.threshold)
            counts[1] += zeroed
            y = F.linear(masked, self.weight_t.t())
        else:
            keep = x.abs() >= self.threshold
            counts[1] += int(keep.numel() - keep.sum())
            y = F.linear(x * keep, self.weight_t.t())
        return y + self.bias if self.bias is not None else y

    @property
    def inputs_seen(self) -> int:
        return self.counts[0]

    @property
    def inputs_zeroed(self) -> int:
        return self.counts[1]

    @property
    def rows_skipped(self) -> int:
        return self.counts[2]

    def reset_counts(self) -> None:
        self.counts = [0, 0, 0]  # inputs seen, inputs zeroed, weight rows skipped (once per token)


def sparse_layers(model: torch.nn.Module) -> list[SparseLinear]:
    return [m for m in model.modules() if isinstance(m, SparseLinear)]


def forward_savings(layers: list[SparseLinear]) -> dict:
    """What these sparse layers did with zeroed inputs since the last call (then reset the counts):
    weight bytes and FLOPs skipped (never read, never computed), and weight bytes and FLOPs spent
    multiplying zeros (masked). For several tokens a weight row counts as wasted in proportion to
    the tokens whose input for it was zero."""
    totals = dict.fromkeys(("skipped_bytes", "skipped_flops", "zero_bytes", "zero_flops"), 0)
    for layer in layers:
        tokens = max(layer.inputs_seen // layer.in_features, 1)
        masked = layer.inputs_zeroed - layer.rows_skipped
        totals["skipped_bytes"] += layer.rows_skipped * layer.row_bytes // tokens
        totals["skipped_flops"] += 2 * layer.rows_skipped * layer.out_features
        totals["zero_bytes"] += masked * layer.row_bytes // tokens
        totals["zero_flops"] += 2 * masked * layer.out_features
        layer.reset_counts()
    return totals


def sparse_targets(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The linear layers activation sparsity applies to, by name: all but the output head."""
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
            and m is not model.get_output_embeddings()}


THRESHOLDS_FORMAT = "1"  # a change of how thresholds are fitted makes every kept set stale


def calibrate_thresholds(lm: LoadedModel, sparsity: float, text: str | None = None) -> dict:
    """Per linear layer, the input magnitude below which a fraction `sparsity` of inputs falls on
    the calibration text (or `text`), fitted once per model weights and text and kept in the cache folder."""
    ids = lm.tokenizer(CALIBRATION_TEXT.read_text() if text is None else text)["input_ids"]
    key = f"{THRESHOLDS_FORMAT}|{sparsity!r}|{model_fingerprint(lm.model)}|{ids}"
    return kept("sparsity", key, torch.device("cpu"), lambda: fit_thresholds(lm, sparsity, ids))


@torch.inference_mode()
def fit_thresholds(lm: LoadedModel, sparsity: float, ids: list[int]) -> dict:
    """calibrate_thresholds' fit, in two passes: the first on the dense model, the second with those
    thresholds in place, because zeroing a layer's inputs shrinks what the next layers receive
    (with dense thresholds alone, o_proj and down_proj end up to 15 points sparser than asked)."""
    thresholds = _input_quantiles(lm.model, sparse_targets(lm.model), ids, sparsity)
    if sparsity > 0:
        masked = sparsify(lm, sparsity, "mask", thresholds).model
        modules = dict(masked.named_modules())
        thresholds = _input_quantiles(masked, {n: modules[n] for n in thresholds}, ids, sparsity)
    return thresholds


def _input_quantiles(model: torch.nn.Module, targets: dict, ids: list[int], q: float, window: int = 512,
                     sample: int = 1 << 20) -> dict:
    """The q-quantile of each target layer's input magnitudes over the text, in windows."""
    magnitudes: dict[str, list[torch.Tensor]] = {}

    def hook(name):
        def record(module, inputs):
            magnitudes.setdefault(name, []).append(inputs[0].detach().abs().flatten().float().cpu())
        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in targets.items()]
    device = next(model.parameters()).device
    try:
        for start in range(0, len(ids), window):
            model(input_ids=torch.tensor([ids[start:start + window]], device=device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    generator = torch.Generator().manual_seed(0)
    quantiles = {}
    for name, chunks in magnitudes.items():
        values = torch.cat(chunks)
        if values.numel() > sample:  # a sample of a million magnitudes is plenty
            values = values[torch.randint(values.numel(), (sample,), generator=generator)]
        quantiles[name] = quantile(values, q) if q > 0 else 0.0
    return quantiles


def quantile(values: torch.Tensor, q: float) -> float:
    """torch.quantile(values, q) of a 1-D tensor without NaN, to the bit (its rank q * (n - 1) in the values'
    dtype, the two order statistics around it, linearly interpolated), from two selections instead of a
    sort: five times faster on the million magnitudes a layer's calibration takes."""
    rank = torch.tensor(q, dtype=values.dtype) * (values.numel() - 1)
    below, above = int(rank.floor()), int(rank.ceil())
    low = values.kthvalue(below + 1).values
    high = low if above == below else values.kthvalue(above + 1).values
    return float(torch.lerp(low, high, rank - below))


def check(lm: LoadedModel, sparsity: float, mode: str) -> None:
    if not 0 <= sparsity <= 0.9:
        raise SparsityError(f"Sparsity must be between 0 and 0.9 (0-90%), not {sparsity}.")
    if mode == "2:4":
        reason = sparse24.unavailable_reason(lm.device, lm.dtype)
        if reason:
            raise SparsityError(reason)
        if sparsity not in (0, sparse24.SPARSITY):
            raise SparsityError(f"2:4 sparsity always prunes half of the weights: use sparsity 0.5, not {sparsity}.")
        return
    if mode not in MODES:
        raise SparsityError(f"Unknown sparsity mode '{mode}': use mask or skip.")
    if lm.weights not in ("fp32", "bf16", "fp16"):
        raise SparsityError(f"Activation sparsity runs on float weights (fp32, bf16, fp16), not {lm.weights}.")
    if mode == "skip" and (lm.device.type != "cpu" or lm.weights != "fp32"):
        raise SparsityError("The skip kernel runs on the CPU in fp32; use mask mode for other devices and levels.")


def sparsify(lm: LoadedModel, sparsity: float, mode: str, thresholds: dict) -> LoadedModel:
    """A copy of the model whose linear layers (not the output head) ignore small inputs."""
    check(lm, sparsity, mode)
    model = copy.deepcopy(lm.model)
    modules = dict(model.named_modules())
    for name, threshold in thresholds.items():
        parent_name, _, attr = name.rpartition(".")
        setattr(modules[parent_name], attr, SparseLinear(modules[name], threshold, mode))
    if lm.device.type == "cpu":
        kernel()
    if isinstance(model, LeanLlama):
        place_layer_tensors(model)
    return replace(lm, model=model.eval(), sparsity=sparsity, sparsity_mode=mode)


def thresholds_for(lm: LoadedModel, sparsity: float, store=None) -> dict:
    """Stored thresholds for (model, sparsity), or new ones (stored when a store is given)."""
    key = {"model": lm.name, "sparsity": round(sparsity, 4), "text_sha": _calibration_digest()}
    if store is not None:
        stored = store.sparsity_thresholds(**key)
        if stored is not None and set(stored) == set(sparse_targets(lm.model)):  # else the layout changed
            return stored
    thresholds = calibrate_thresholds(lm, sparsity)
    if store is not None:
        store.save_sparsity_thresholds(**key, thresholds=thresholds)
    return thresholds


CALIBRATION_METHOD = b"two passes"  # part of the stored key: thresholds from another method are not reused


def _calibration_digest() -> str:
    import hashlib

    return hashlib.sha256(CALIBRATION_METHOD + CALIBRATION_TEXT.read_bytes()).hexdigest()[:12]


def variant(lm: LoadedModel, sparsity: float, mode: str, store=None) -> LoadedModel:
    """The sparse copy, made once per (model, sparsity, mode) and cached like the quantized ones."""
    from engine.switches.quant import remember

    if sparsity == 0 and mode == "mask":
        return lm
    check(lm, sparsity, mode)
    key = (id(lm.model), str(lm.device), "sparse", round(sparsity, 4), mode)
    if mode == "2:4":
        return remember(key, lambda: sparse24.sparsify(lm))
    return remember(key, lambda: sparsify(lm, sparsity, mode, thresholds_for(lm, sparsity, store)))


def zeroed_fraction(model: torch.nn.Module) -> float:
    seen = sum(layer.inputs_seen for layer in sparse_layers(model))
    return sum(layer.inputs_zeroed for layer in sparse_layers(model)) / seen if seen else 0.0
