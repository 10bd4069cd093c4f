"""Weight precision levels, one registry entry each: its kernel, its checks, its conversion.

A level says which kernel runs it and whether that kernel reads the low-bit format (accelerated) or
dequantizes on the fly (emulated): quantization only saves time when fewer bytes move and a kernel
uses the format. Integer levels quantize every linear layer including the output head, which reads
the most bytes of any single layer; the head is untied from the input embedding for that, and the
embedding keeps full precision for its row lookups. int4-wo keeps the head at int8: at 4 bits the
head alone costs several points of top-1 agreement. Norms keep the model's precision.

Adding a level is one subclass of WeightLevel and one register() call; the pages' selects and the level
table read LEVELS, and so does the command line where this module is loaded; elsewhere it reads the shipped
levels' names in engine.switches.names, to parse its arguments without importing torch."""
from __future__ import annotations

import copy
import gc
from collections import OrderedDict
from dataclasses import dataclass, replace

import torch

from engine.model.cpu_kernels import cpu_has_avx2, cpu_has_vnni, has_small_rows_kernel, optional_kernel
from engine.dtypes import torch_dtype
from engine.errors import UserError
from engine.model.lean import LeanLlama, place_layer_tensors
from engine.model.loader import LoadedModel
from engine.paths import CALIBRATION_TEXT
from engine.switches.qlinear import (Int4DynamicLinear, Int4WeightOnlyLinear, Int8BlockLinear, Int8DynamicLinear,
                      Int8WeightOnlyLinear, kept_smoothing_plan)
from engine.switches.names import INT4_GROUPS

MAX_VARIANTS = 2


class QuantError(UserError):
    """A level this device or model cannot run."""


@dataclass(frozen=True)
class LevelInfo:
    level: str
    kernel: str
    accelerated: bool
    note: str


class WeightLevel:
    """One weight precision level. Subclasses set name and help and override what differs."""

    name = ""
    help = ""
    uses_group_size = False  # whether --group-size applies

    def info(self, device: torch.device) -> LevelInfo:
        """Which kernel runs the level on this device, and whether it reads the format directly."""
        raise NotImplementedError

    def runs_on(self, device: torch.device) -> bool:
        return True

    def check(self, device: torch.device, model: torch.nn.Module, group_size: int) -> None:
        """Raise QuantError with one sentence when this device or model cannot run the level."""
        if not self.runs_on(device):
            raise QuantError(f"{self.name} does not run on this {device.type}; levels that work here: "
                             f"{', '.join(available_levels(device))}.")

    def convert(self, lm: LoadedModel, model: torch.nn.Module, group_size: int) -> None:
        """Change `model` (a copy of lm.model) in place to this level."""
        raise NotImplementedError


class FloatLevel(WeightLevel):
    def __init__(self, name: str, help: str):
        self.name, self.help = name, help

    def info(self, device):
        if self.name == "fp32":
            kernel = ("Tokenpath's small-rows kernel for decode and verification of Llama models (engine/model/kernels), "
                      "MKL for prefill and other models"
                      if device.type == "cpu" and has_small_rows_kernel() else "dense fp32 GEMV/GEMM")
            return LevelInfo(self.name, kernel, True, self.help)
        return LevelInfo(self.name, f"dense {self.name} GEMV/GEMM", True, self.help)

    def runs_on(self, device):
        return self.name != "fp16" or _fp16_matmul_works(device)

    def convert(self, lm, model, group_size):
        model.to(torch_dtype(self.name))


class IntegerLevel(WeightLevel):
    """Replaces every linear layer, the output head included, by a quantized one."""

    def convert(self, lm, model, group_size):
        head = model.get_output_embeddings()
        make = self.layer_maker(lm, model, group_size)
        for parent, name, linear in list(body_linears(model, with_head=True)):
            setattr(parent, name, make(linear, linear is head))

    def layer_maker(self, lm: LoadedModel, model: torch.nn.Module, group_size: int):
        """A function (linear, is_head) -> the quantized layer that replaces it."""
        raise NotImplementedError


class Int8WeightOnly(IntegerLevel):
    name = "int8-wo"
    help = "1 byte per weight plus one scale per output channel, read directly by the kernel"

    def info(self, device):
        if device.type == "cpu" and has_small_rows_kernel():
            return LevelInfo(self.name, "Tokenpath's int8 kernel (int8 weights, float32 activations; engine/model/kernels)",
                             True, self.help)
        if device.type == "cpu":
            return LevelInfo(self.name, "torch._weight_int8pack_mm (int8 weights, bf16 activations)", True, self.help)
        return LevelInfo(self.name, "dequantize to the compute dtype, then dense matmul", False,
                         "int8 weights are stored, but each forward expands them back to 16/32 bits: the bytes "
                         "read from memory shrink, the work grows")

    def layer_maker(self, lm, model, group_size):
        return lambda linear, is_head: Int8WeightOnlyLinear(linear)


def integer_vectors() -> str:
    """The instructions the integer kernels' products run on here (the build uses this CPU's own)."""
    return "AVX-512 VNNI" if cpu_has_vnni() else "AVX2" if cpu_has_avx2() else "plain loops"


class Int8Dynamic(IntegerLevel):
    name = "int8-dyn"
    help = "int8 weights and activations quantized per token; int32 accumulation"

    def info(self, device):
        if device.type == "cpu" and has_small_rows_kernel():
            tiles = ", AMX tiles for two rows and more" if optional_kernel().has_amx_tiles() else ""
            return LevelInfo(self.name, f"Tokenpath's int8 x int8 kernel ({integer_vectors()}{tiles}; "
                             "engine/model/kernels)", True, self.help)
        return LevelInfo(self.name, "torch.ops.quantized.linear_dynamic (fbgemm int8 x int8)", True, self.help)

    def runs_on(self, device):
        return device.type == "cpu"

    def check(self, device, model, group_size):
        if not self.runs_on(device):
            raise QuantError(f"int8-dyn uses PyTorch's CPU int8 kernels (fbgemm) and cannot run on {device.type}; "
                             f"levels that work here: {', '.join(available_levels(device))}.")

    def layer_maker(self, lm, model, group_size):
        # SmoothQuant: factors fitted on the calibration text; a norm that feeds a layer absorbs the division
        plan = kept_smoothing_plan(model, lm.tokenizer(CALIBRATION_TEXT.read_text())["input_ids"])
        names = {id(m): n for n, m in model.named_modules()}
        modules = dict(model.named_modules())
        for factors, norm in {v[1]: v for v in plan.values() if v[1]}.values():
            modules[norm].weight.data /= factors.to(modules[norm].weight.dtype)

        def make(linear, is_head):
            factors, norm = plan[names[id(linear)]]
            return Int8DynamicLinear(linear, factors, folded=norm is not None)
        return make


class Int4WeightOnly(IntegerLevel):
    name = "int4-wo"
    help = "half a byte per weight plus a bf16 scale and zero per group; output head at int8"
    uses_group_size = True

    def info(self, device):
        if device.type == "cpu":
            return LevelInfo(self.name, "torch._weight_int4pack_mm_for_cpu (packed int4, bf16 activations)", True,
                             self.help)
        return LevelInfo(self.name, "dequantize to the compute dtype, then dense matmul", False,
                         "int4 weights are stored but expanded on every forward")

    def check(self, device, model, group_size):
        if group_size not in INT4_GROUPS:
            raise QuantError(f"The int4 group size must be one of {', '.join(map(str, INT4_GROUPS))}, not {group_size}.")
        widths = {lin.in_features for _, _, lin in body_linears(model)}
        if any(w % group_size for w in widths):
            fits = [g for g in INT4_GROUPS if all(w % g == 0 for w in widths)]
            raise QuantError(f"Group size {group_size} does not divide every layer's input width "
                             f"({', '.join(map(str, sorted(widths)))}); use {' or '.join(map(str, fits)) or 'another level'}.")

    def layer_maker(self, lm, model, group_size):
        return lambda linear, is_head: (Int8WeightOnlyLinear(linear) if is_head
                                        else Int4WeightOnlyLinear(linear, group_size))


class Int4Dynamic(IntegerLevel):
    name = "int4-dyn"
    help = ("half a byte per weight plus an fp16 scale and minimum per block of 32 (llama.cpp's Q4_1 arithmetic, "
            "rows stored in groups of eight), activations quantized to int8 per block of 32; integer sums; output head "
            "at int8 in blocks of 32 with an fp16 scale each (Q8_0's arithmetic, stored the same way)")

    def info(self, device):
        return LevelInfo(self.name, f"Tokenpath's int4 x int8 kernel ({integer_vectors()}; engine/model/kernels)", True,
                         self.help)

    def runs_on(self, device):
        return device.type == "cpu" and has_small_rows_kernel()

    def check(self, device, model, group_size):
        if not self.runs_on(device):
            raise QuantError(f"int4-dyn runs on Tokenpath's C++ CPU kernel, which is not available on this "
                             f"{device.type}; levels that work here: {', '.join(available_levels(device))}.")
        widths = sorted({lin.in_features for _, _, lin in body_linears(model, with_head=True)})
        if any(w % Int4DynamicLinear.block for w in widths):
            raise QuantError(f"int4-dyn quantizes in blocks of {Int4DynamicLinear.block}, which do not divide every "
                             f"layer's input width ({', '.join(map(str, widths))}); use int4-wo or int8.")

    def layer_maker(self, lm, model, group_size):
        return lambda linear, is_head: Int8BlockLinear(linear) if is_head else Int4DynamicLinear(linear)


LEVELS: dict[str, WeightLevel] = {}


def register(level: WeightLevel) -> WeightLevel:
    LEVELS[level.name] = level
    return level


register(FloatLevel("fp32", "the reference: 4 bytes per weight"))
for _name in ("bf16", "fp16"):
    register(FloatLevel(_name, "2 bytes per weight; on CPUs without fast 16-bit matrix units the arithmetic can cost "
                               "more than the bytes save"))
register(Int8WeightOnly())
register(Int8Dynamic())
register(Int4WeightOnly())
register(Int4Dynamic())


def level(name: str) -> WeightLevel:
    if name not in LEVELS:
        raise QuantError(f"Unknown quantization level '{name}': use one of {', '.join(LEVELS)}.")
    return LEVELS[name]


def level_info(name: str, device: torch.device) -> LevelInfo:
    return level(name).info(device)


def body_linears(model: torch.nn.Module, with_head: bool = False):
    """(parent, attribute name, linear) for every nn.Linear, the output head only if asked."""
    head = model.get_output_embeddings()
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, torch.nn.Linear) and (with_head or child is not head):
                yield parent, name, child


def check_level(name: str, device: torch.device, model: torch.nn.Module, group_size: int = 32) -> None:
    """Raise QuantError with one sentence when this device or model cannot run the level."""
    level(name).check(device, model, group_size)


def _fp16_matmul_works(device: torch.device) -> bool:
    try:
        a = torch.ones(4, 4, dtype=torch.float16, device=device)
        return bool(torch.isfinite(a @ a).all())
    except RuntimeError:
        return False


def available_levels(device: torch.device) -> list[str]:
    return [name for name, lv in LEVELS.items() if lv.runs_on(device)]


def quantize(lm: LoadedModel, name: str, group_size: int = 32) -> LoadedModel:
    """A new LoadedModel at this level; the original model is left as it was."""
    lv = level(name)
    lv.check(lm.device, lm.model, group_size)
    model = copy.deepcopy(lm.model)
    lv.convert(lm, model, group_size)
    if isinstance(model, LeanLlama):
        place_layer_tensors(model)
    model.eval()
    suffix = f" g{group_size}" if lv.uses_group_size else ""
    return replace(lm, model=model, weights=name + suffix)


_variants: OrderedDict = OrderedDict()


def remember(key, make):
    """A derived model (a quantized or sparse copy) made once per key and kept while it is among the
    MAX_VARIANTS most recently used; older ones are dropped and their memory released."""
    if key in _variants:
        _variants.move_to_end(key)
        return _variants[key]
    made = _variants[key] = make()
    while len(_variants) > MAX_VARIANTS:
        _variants.popitem(last=False)
        gc.collect()
    return made


def variant(lm: LoadedModel, name: str, group_size: int = 32) -> LoadedModel:
    """The model at this level, quantized once per (model, device, level)."""
    if name == "fp32" and lm.dtype == torch.float32 and lm.weights == "fp32":
        return lm
    key = (id(lm.model), str(lm.device), name, group_size if level(name).uses_group_size else None)
    return remember(key, lambda: quantize(lm, name, group_size))
