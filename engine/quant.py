"""Weight precision levels. Each level says which kernel runs it and whether that kernel reads the
low-bit format (accelerated) or dequantizes on the fly (emulated): quantization only saves time
when fewer bytes move and a kernel uses the format.

Integer levels quantize every linear layer including the output head, which reads the most bytes
of any single layer (49,152 x 576 in the default model); the head is untied from the input
embedding for that, and the embedding keeps full precision for its row lookups. int4-wo keeps the
head at int8: at 4 bits the head alone costs several points of top-1 agreement. Norms keep the
model's precision."""
from __future__ import annotations

import copy
import gc
import warnings
from collections import OrderedDict
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .cpu_kernels import cpu_has_vnni, has_small_rows_kernel, optional_kernel
from .models import REPO_ROOT, LoadedModel

LEVELS = ("fp32", "bf16", "fp16", "int8-wo", "int8-dyn", "int4-wo")
FLOAT_LEVELS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INT4_GROUPS = (32, 64, 128, 256)
MAX_VARIANTS = 2


class QuantError(Exception):
    """A level this device or model cannot run; the message is one sentence for the user."""


@dataclass(frozen=True)
class LevelInfo:
    level: str
    kernel: str
    accelerated: bool
    note: str


def level_info(level: str, device: torch.device) -> LevelInfo:
    cpu = device.type == "cpu"
    if level == "fp32":
        kernel = ("Tokenpath's small-rows kernel for decode and verification of Llama models (engine/kernels), "
                  "MKL for prefill and other models"
                  if cpu and has_small_rows_kernel() else "dense fp32 GEMV/GEMM")
        return LevelInfo(level, kernel, True, "the reference: 4 bytes per weight")
    if level in ("bf16", "fp16"):
        return LevelInfo(level, f"dense {level} GEMV/GEMM", True,
                         "2 bytes per weight; on CPUs without fast 16-bit matrix units the arithmetic can cost more "
                         "than the bytes save")
    if level == "int8-wo":
        if cpu:
            return LevelInfo(level, "torch._weight_int8pack_mm (int8 weights, bf16 activations)", True,
                             "1 byte per weight plus one scale per output channel, read directly by the kernel")
        return LevelInfo(level, "dequantize to the compute dtype, then dense matmul", False,
                         "int8 weights are stored, but each forward expands them back to 16/32 bits: the bytes "
                         "read from memory shrink, the work grows")
    if level == "int8-dyn":
        if cpu and cpu_has_vnni():
            return LevelInfo(level, "Tokenpath's AVX-512 VNNI kernel (int8 x int8, engine/kernels)", True,
                             "int8 weights and activations quantized per token; 64 byte pairs multiplied and "
                             "summed per instruction, int32 accumulation")
        return LevelInfo(level, "torch.ops.quantized.linear_dynamic (fbgemm int8 x int8)", True,
                         "int8 weights and activations quantized per forward; int32 accumulation")
    if level == "int4-wo":
        if cpu:
            return LevelInfo(level, "torch._weight_int4pack_mm_for_cpu (packed int4, bf16 activations)", True,
                             "half a byte per weight plus a bf16 scale and zero per group; output head at int8")
        return LevelInfo(level, "dequantize to the compute dtype, then dense matmul", False,
                         "int4 weights are stored but expanded on every forward")
    raise QuantError(f"Unknown quantization level '{level}': use one of {', '.join(LEVELS)}.")


def _linear_input(x: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    return x.reshape(-1, x.shape[-1]), x.shape[:-1]


class Int8WeightOnlyLinear(torch.nn.Module):
    """Symmetric per-output-channel int8 weights."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scales = w.abs().amax(dim=1).clamp(min=1e-8) / 127
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_int8", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(torch.bfloat16))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2, lead = _linear_input(x)
        if x.device.type == "cpu":
            y = torch._weight_int8pack_mm(x2.to(torch.bfloat16), self.weight_int8, self.scales)
        else:
            y = F.linear(x2, self.weight_int8.to(x.dtype) * self.scales.to(x.dtype)[:, None])
        y = y.to(x.dtype).reshape(*lead, self.out_features)
        return y + self.bias if self.bias is not None else y


class Int8DynamicLinear(torch.nn.Module):
    """int8 weights (per channel) and int8 activations (per token, chosen at run time). On CPUs with
    AVX-512 VNNI the project's kernel (engine/kernels/cpu_kernels.cpp) runs it; elsewhere fbgemm's
    quantized::linear_dynamic."""

    def __init__(self, linear: torch.nn.Linear, smooth: torch.Tensor | None = None, folded: bool = False):
        """smooth: per-input-channel factors multiplied into the weights (SmoothQuant); the inputs must
        be divided by them, which a preceding norm already does when `folded`, else this layer does."""
        super().__init__()
        w = linear.weight.detach().float()
        if smooth is not None:
            w = w * smooth[None, :]
        self.register_buffer("inv_smooth", 1.0 / smooth if smooth is not None and not folded else None)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        scales = w.abs().amax(dim=1).clamp(min=1e-8) / 127
        # a flag, not the extension itself: a module object would stop the layer being deep-copied
        self.vnni = w.device.type == "cpu" and vnni_kernel() is not None
        if self.vnni:
            self.register_buffer("weight_int8", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
            self.register_buffer("scales", scales)
            self.register_buffer("row_sums", self.weight_int8.sum(dim=1, dtype=torch.int32))
            return
        with warnings.catch_warnings():  # qint8 tensors are deprecated in torch 2.13; the pinned torch keeps them
            warnings.simplefilter("ignore", UserWarning)
            q = torch.quantize_per_channel(w, scales.double(), torch.zeros(w.shape[0], dtype=torch.long), 0,
                                           torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(q, None)
        # the packed weights are opaque to model.parameters(): report what they hold
        self.packed_weight_nbytes = q.int_repr().nbytes + q.q_per_channel_scales().nbytes \
            + q.q_per_channel_zero_points().nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2, lead = _linear_input(x.float())
        if self.inv_smooth is not None:
            x2 = x2 * self.inv_smooth
        if self.vnni:
            y = optional_kernel().int8_linear(x2, self.weight_int8, self.scales, self.row_sums)
        elif x2.shape[0] == 1:  # one token (decoding): the per-call activation scale is already per token
            y = torch.ops.quantized.linear_dynamic(x2, self._packed)
        else:
            # fbgemm picks one activation scale per call; scaling every row to the same range first
            # makes it per token (the layer is linear, so the row scale comes back out after)
            row_scale = x2.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8)
            y = torch.ops.quantized.linear_dynamic(x2 / row_scale, self._packed) * row_scale
        y = y.to(x.dtype).reshape(*lead, self.out_features)
        return y + self.bias if self.bias is not None else y


def vnni_kernel():
    """The project's int8 kernel when this CPU has AVX-512 VNNI and the extension builds, else None."""
    if not cpu_has_vnni():
        return None
    kernel = optional_kernel()
    return kernel if kernel is not None and kernel.has_vnni() else None


class Int4WeightOnlyLinear(torch.nn.Module):
    """Asymmetric int4 weights in groups along the input dimension: w = (q - 8) * scale + zero."""

    def __init__(self, linear: torch.nn.Linear, group_size: int, cpu_kernel: bool | None = None):
        super().__init__()
        w = linear.weight.detach().float()
        out_f, in_f = w.shape
        groups = w.reshape(out_f, in_f // group_size, group_size)
        lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        q = torch.round((groups - lo) / scale).clamp(0, 15).to(torch.int32).reshape(out_f, in_f)
        zero = lo + 8 * scale
        self.in_features, self.out_features, self.group_size = in_f, out_f, group_size
        self.cpu_kernel = w.device.type == "cpu" if cpu_kernel is None else cpu_kernel
        if self.cpu_kernel:
            self.register_buffer("weight_int4", torch._convert_weight_to_int4pack_for_cpu(q, 1))
            self.register_buffer("scales_and_zeros", torch.stack(
                [scale.reshape(out_f, -1), zero.reshape(out_f, -1)], dim=-1).transpose(0, 1).contiguous()
                .to(torch.bfloat16))
        else:  # two 4-bit values per byte, dequantized per forward
            self.register_buffer("weight_int4", (q[:, ::2] | (q[:, 1::2] << 4)).to(torch.uint8))
            self.register_buffer("scales_and_zeros", torch.stack([scale[..., 0], zero[..., 0]], dim=-1).to(torch.bfloat16))
        self.bias = linear.bias

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        low, high = self.weight_int4 & 0xF, self.weight_int4 >> 4
        q = torch.stack([low, high], dim=-1).reshape(self.out_features, -1).to(dtype)
        groups = q.reshape(self.out_features, -1, self.group_size)
        scale, zero = self.scales_and_zeros[..., 0:1].to(dtype), self.scales_and_zeros[..., 1:2].to(dtype)
        return ((groups - 8) * scale + zero).reshape(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2, lead = _linear_input(x)
        if self.cpu_kernel:
            y = torch._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16), self.weight_int4, self.group_size,
                                                  self.scales_and_zeros)
        else:
            y = F.linear(x2, self.dequantized(x.dtype))
        y = y.to(x.dtype).reshape(*lead, self.out_features)
        return y + self.bias if self.bias is not None else y


def body_linears(model: torch.nn.Module, with_head: bool = False):
    """(parent, attribute name, linear) for every nn.Linear, the output head only if asked."""
    head = model.get_output_embeddings()
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, torch.nn.Linear) and (with_head or child is not head):
                yield parent, name, child


def check_level(level: str, device: torch.device, model: torch.nn.Module, group_size: int = 32) -> None:
    """Raise QuantError with one sentence when this device or model cannot run the level."""
    works = ", ".join(available_levels(device))
    level_info(level, device)
    if level == "fp16" and not _fp16_matmul_works(device):
        raise QuantError(f"fp16 matrix products do not run on this {device.type}; levels that work here: {works}.")
    if level == "int8-dyn" and device.type != "cpu":
        raise QuantError(f"int8-dyn uses PyTorch's CPU int8 kernels (fbgemm) and cannot run on {device.type}; "
                         f"levels that work here: {works}.")
    if level == "int4-wo":
        if group_size not in INT4_GROUPS:
            raise QuantError(f"The int4 group size must be one of {', '.join(map(str, INT4_GROUPS))}, not {group_size}.")
        widths = {lin.in_features for _, _, lin in body_linears(model)}
        if any(w % group_size for w in widths):
            fits = [g for g in INT4_GROUPS if all(w % g == 0 for w in widths)]
            raise QuantError(f"Group size {group_size} does not divide every layer's input width "
                             f"({', '.join(map(str, sorted(widths)))}); use {' or '.join(map(str, fits)) or 'another level'}.")


def _fp16_matmul_works(device: torch.device) -> bool:
    try:
        a = torch.ones(4, 4, dtype=torch.float16, device=device)
        return bool(torch.isfinite(a @ a).all())
    except RuntimeError:
        return False


def available_levels(device: torch.device) -> list[str]:
    levels = ["fp32", "bf16"]
    if _fp16_matmul_works(device):
        levels.append("fp16")
    levels += ["int8-wo", "int4-wo"] + (["int8-dyn"] if device.type == "cpu" else [])
    return levels


CALIBRATION_TEXT = REPO_ROOT / "data" / "calibration.txt"


def _is_norm(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return type(module).__name__.endswith("Norm") and isinstance(weight, torch.Tensor) and weight.dim() == 1


@torch.inference_mode()
def smoothing_plan(model: torch.nn.Module, ids: list[int], window: int = 512) -> dict[str, tuple]:
    """SmoothQuant (alpha 0.5) factors for every linear layer, from the largest input per channel
    over a calibration text: {linear name: (factors, name of the norm that produces its input or None)}.
    Linear layers fed by the same norm share factors, so the norm's weight can absorb the division."""
    peaks: dict[str, torch.Tensor] = {}
    sources: dict[str, str | None] = {}
    norm_outputs: dict[int, tuple] = {}  # data pointer -> (norm name, the output, held so no other tensor reuses it)
    modules = dict(model.named_modules())

    def norm_hook(name):
        def record(module, inputs, output):
            norm_outputs[output.data_ptr()] = (name, output)
        return record

    def linear_hook(name):
        def record(module, inputs):
            x = inputs[0].detach()
            peak = x.abs().reshape(-1, x.shape[-1]).amax(dim=0).float()
            peaks[name] = torch.maximum(peaks[name], peak) if name in peaks else peak
            source = norm_outputs.get(x.data_ptr())
            sources.setdefault(name, source[0] if source and source[1].shape[-1] == x.shape[-1] else None)
        return record

    handles = [m.register_forward_hook(norm_hook(n)) for n, m in modules.items() if _is_norm(m)]
    handles += [m.register_forward_pre_hook(linear_hook(n)) for n, m in modules.items()
                if isinstance(m, torch.nn.Linear)]
    try:
        device = next(model.parameters()).device
        for start in range(0, len(ids), window):
            norm_outputs.clear()
            model(input_ids=torch.tensor([ids[start:start + window]], device=device), use_cache=False)
    finally:
        norm_outputs.clear()
        for h in handles:
            h.remove()
    groups: dict[str, list[str]] = {}
    for name, source in sources.items():
        groups.setdefault(source or name, []).append(name)
    plan = {}
    for key, members in groups.items():
        weight_peak = torch.stack([modules[m].weight.detach().abs().amax(dim=0).float() for m in members]).amax(0)
        factors = peaks[members[0]].clamp(min=1e-5).sqrt() / weight_peak.clamp(min=1e-5).sqrt()
        for m in members:
            plan[m] = (factors, sources[m])
    return plan


def quantize(lm: LoadedModel, level: str, group_size: int = 32) -> LoadedModel:
    """A new LoadedModel at this level; the original model is left as it was."""
    check_level(level, lm.device, lm.model, group_size)
    model = copy.deepcopy(lm.model)
    if level in FLOAT_LEVELS:
        model.to(FLOAT_LEVELS[level])
    else:
        head = model.get_output_embeddings()
        if level == "int8-dyn":
            plan = smoothing_plan(model, lm.tokenizer(CALIBRATION_TEXT.read_text())["input_ids"])
            names = {id(m): n for n, m in model.named_modules()}
            modules = dict(model.named_modules())
            for factors, norm in {v[1]: v for v in plan.values() if v[1]}.values():
                modules[norm].weight.data /= factors.to(modules[norm].weight.dtype)
        for parent, name, linear in list(body_linears(model, with_head=True)):
            if level == "int8-wo" or (level == "int4-wo" and linear is head):
                new = Int8WeightOnlyLinear(linear)
            elif level == "int8-dyn":
                factors, norm = plan[names[id(linear)]]
                new = Int8DynamicLinear(linear, factors, folded=norm is not None)
            else:
                new = Int4WeightOnlyLinear(linear, group_size)
            setattr(parent, name, new)
    model.eval()
    suffix = f" g{group_size}" if level == "int4-wo" else ""
    return replace(lm, model=model, quant=level + suffix)


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


def variant(lm: LoadedModel, level: str, group_size: int = 32) -> LoadedModel:
    """The model at this level, quantized once per (model, device, level)."""
    if level == "fp32" and lm.dtype == torch.float32 and lm.quant == "fp32":
        return lm
    key = (id(lm.model), str(lm.device), level, group_size if level == "int4-wo" else None)
    return remember(key, lambda: quantize(lm, level, group_size))
