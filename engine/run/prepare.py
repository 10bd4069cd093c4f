"""From a run specification to a model ready to run: load, then quantize, then sparsify.

The base model of the last (model, device) stays loaded; its quantized and sparse variants are
cached by engine.switches.quant.remember, so switching settings back and forth costs each variant once."""
from __future__ import annotations

from engine.switches import quant
from engine.switches import sparsity
from engine.model.loader import LoadedModel, load_model
from engine.spec import RunSpec

_base: dict = {}  # {(model, device): LoadedModel}, at most one entry


def base_model(spec: RunSpec) -> LoadedModel:
    """The fp32 model the spec's variant is made from."""
    key = (spec.model, spec.device)
    if key not in _base:
        _base.clear()  # let the old model go before the new one loads
        _base[key] = load_model(spec.model, device=spec.device)
    return _base[key]


def prepare(spec: RunSpec, store=None) -> LoadedModel:
    """The model at the spec's weight level and sparsity (sparsity thresholds are kept in `store`)."""
    lm = quant.variant(base_model(spec), spec.weights, spec.group_size)
    return sparsity.variant(lm, spec.sparsity, spec.sparsity_mode, store)
