"""The quantized linear layers: int8 weight-only, int8 dynamic (weights and activations) and
int4 weight-only, each with the kernel that reads its format, and SmoothQuant's factors for int8."""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from engine.model.cpu_kernels import optional_kernel
from engine.switches.fitted import kept, model_fingerprint


def _linear_input(x: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    return x.reshape(-1, x.shape[-1]), x.shape[:-1]


class Int8WeightOnlyLinear(torch.nn.Module):
    """Symmetric per-output-channel int8 weights. On the CPU the project's kernel reads them with
    float32 activations where the extension is built, else PyTorch's int8 kernel (bf16 activations)."""

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
        kernel = optional_kernel() if x.device.type == "cpu" else None
        if kernel is not None:
            y = kernel.int8_wo_linear(x2.float(), self.weight_int8, self.scales)
        elif x.device.type == "cpu":
            y = torch._weight_int8pack_mm(x2.to(torch.bfloat16), self.weight_int8, self.scales)
        else:
            y = F.linear(x2, self.weight_int8.to(x.dtype) * self.scales.to(x.dtype)[:, None])
        y = y.to(x.dtype).reshape(*lead, self.out_features)
        return y + self.bias if self.bias is not None else y

    def decode_form(self) -> tuple | None:
        """This layer as the kernels' decode_layers reads it (None: it runs its forward instead)."""
        return (1, self.weight_int8, self.scales, None, None, 0, self.bias) if optional_kernel() else None


PACKED_OUTPUTS, PACKED_DEPTH = 16, 64  # kernels.h's kOutBlock and kDepthBytes


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 weights [N, K] as the project's int8-dyn kernel reads them (kernels/int8.cpp): [ceil(N / 16), Kp / 4, 64],
    for each block of 16 outputs and each four inputs the 16 outputs' four bytes side by side, zeros past N and K
    (Kp: K rounded up to a multiple of 64)."""
    padded = F.pad(q, (0, -q.shape[1] % PACKED_DEPTH, 0, -q.shape[0] % PACKED_OUTPUTS))
    quads = padded.shape[1] // 4
    blocks = padded.view(-1, PACKED_OUTPUTS, quads, 4).transpose(1, 2)
    return blocks.reshape(-1, quads, 4 * PACKED_OUTPUTS).contiguous()


def unpack_int8(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """pack_int8's [N, K] weights back from what it made of them."""
    blocks, quads, _ = packed.shape
    rows = packed.view(blocks, quads, PACKED_OUTPUTS, 4).transpose(1, 2).reshape(blocks * PACKED_OUTPUTS, 4 * quads)
    return rows[:n, :k]


class Int8DynamicLinear(torch.nn.Module):
    """int8 weights (per channel) and int8 activations (per token, chosen at run time). The project's
    kernel (engine/model/kernels/int8.cpp) runs it where the extension is built, with exact integer
    sums; elsewhere fbgemm's quantized::linear_dynamic."""

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
        self.own_kernel = w.device.type == "cpu" and optional_kernel() is not None
        if self.own_kernel:
            q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
            self.register_buffer("weight_int8", pack_int8(q))
            self.register_buffer("scales", scales)
            self.register_buffer("row_sums", q.sum(dim=1, dtype=torch.int32))
            return
        with warnings.catch_warnings():  # qint8 tensors are deprecated in torch 2.13; the pinned torch keeps them
            warnings.simplefilter("ignore", UserWarning)
            q = torch.quantize_per_channel(w, scales.double(), torch.zeros(w.shape[0], dtype=torch.long), 0,
                                           torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(q, None)
        # the packed weights are opaque to model.parameters(): report what they hold
        self.packed_weight_nbytes = q.int_repr().nbytes + q.q_per_channel_scales().nbytes \
            + q.q_per_channel_zero_points().nbytes

    @property
    def rows_apart(self) -> bool:
        """Whether a row's product does not depend on the rows beside it (the project's kernel; not fbgemm's)."""
        return self.own_kernel

    def weight_rows(self) -> torch.Tensor:
        """The int8 weights [out_features, in_features], a row per output, as the project's kernel multiplies them."""
        return unpack_int8(self.weight_int8, self.out_features, self.in_features)

    @property
    def makes_silu_product(self) -> bool:
        """Whether silu_product runs: the project's kernel, no bias, outputs in two halves."""
        return self.own_kernel and self.bias is None and self.out_features % 2 == 0

    def silu_product(self, x: torch.Tensor) -> torch.Tensor:
        """silu(the first half of the outputs) * the second half, for a fused gate/up product: the kernel makes each
        output row's products as it writes the row, never the outputs themselves (half the bytes written, and no pass
        over them after), the same numbers as the outputs and then the kernels' silu_mul."""
        x2, lead = _linear_input(x.float())
        y = optional_kernel().int8_silu_linear(x2, self.weight_int8, self.scales, self.row_sums, self.inv_smooth)
        return y.to(x.dtype).reshape(*lead, self.out_features // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2, lead = _linear_input(x.float())
        if self.own_kernel:  # it multiplies each row by inv_smooth as it quantizes it
            y = optional_kernel().int8_linear(x2, self.weight_int8, self.scales, self.row_sums, self.inv_smooth)
        else:
            y = self._fbgemm(x2 * self.inv_smooth if self.inv_smooth is not None else x2)
        y = y.to(x.dtype).reshape(*lead, self.out_features)
        return y + self.bias if self.bias is not None else y

    def _fbgemm(self, x2: torch.Tensor) -> torch.Tensor:
        # reduce_range (7-bit activations): fbgemm's AVX2 path sums byte pairs into saturating 16-bit
        # lanes, which full-range activations overflow
        if x2.shape[0] == 1:  # one token (decoding): the per-call activation scale is already per token
            return torch.ops.quantized.linear_dynamic(x2, self._packed, True)
        # fbgemm picks one activation scale per call; scaling every row to the same range first
        # makes it per token (the layer is linear, so the row scale comes back out after)
        row_scale = x2.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8)
        return torch.ops.quantized.linear_dynamic(x2 / row_scale, self._packed, True) * row_scale

    def decode_form(self) -> tuple | None:
        """This layer as the kernels' decode_layers reads it (None: it runs its forward instead)."""
        return (2, self.weight_int8, self.scales, self.row_sums, self.inv_smooth, 0, self.bias) \
            if self.own_kernel else None


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

    def decode_form(self) -> tuple | None:
        """This layer as the kernels' decode_layers reads it (None: it runs its forward instead)."""
        return (3, self.weight_int4, self.scales_and_zeros, None, None, self.group_size, self.bias) \
            if self.cpu_kernel else None


class _BlockLinear(torch.nn.Module):
    """A layer whose weights are quantized in blocks of 32 along the input dimension and whose
    activations the project's kernel quantizes to int8 per block of 32 when it runs (the levels that
    use these run only where the extension is built). Subclasses store the weights and say which
    kernel multiplies them."""

    block = 32
    group = 8  # output rows stored together (engine/model/kernels/int4.cpp and int8.cpp have the layouts)
    rows_apart = True  # a row's product does not depend on the rows beside it

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        self.bias = linear.bias

    def weight_blocks(self, linear: torch.nn.Linear) -> torch.Tensor:
        """The float32 weights as [out, in / 32, 32]."""
        return linear.weight.detach().float().reshape(self.out_features, self.in_features // self.block, self.block)

    def padded(self, *per_row: torch.Tensor) -> list[torch.Tensor]:
        """[out, ...] tensors with zero rows added up to a whole number of groups."""
        pad = -self.out_features % self.group
        return [torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)) for t in per_row]

    def interleaved(self, per_block: torch.Tensor) -> torch.Tensor:
        """[rows, blocks, 1] as fp16 [groups, blocks, 8]: a group's eight values of a block side by side."""
        return per_block[..., 0].reshape(-1, self.group, per_block.shape[1]).transpose(1, 2).to(torch.float16) \
            .contiguous()

    def per_row(self, interleaved: torch.Tensor) -> torch.Tensor:
        """interleaved()'s [groups, blocks, 8] back as [out, blocks], without padding."""
        return interleaved.transpose(1, 2).reshape(-1, interleaved.shape[1])[:self.out_features]

    def product(self, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2, lead = _linear_input(x.float())
        y = self.product(x2).to(x.dtype).reshape(*lead, self.out_features)
        return y + self.bias if self.bias is not None else y


class Int4DynamicLinear(_BlockLinear):
    """4-bit weights, each block with an fp16 scale d and minimum m (w = q * d + m, q in 0..15: the
    arithmetic of llama.cpp's Q4_1); the kernel sums the products with the int8 activations in integers.
    The output rows are stored in groups of eight, interleaved block by block (the last group padded with
    zero rows), so that one vector instruction serves eight rows, or two groups' sixteen with AVX-512
    (engine/model/kernels/int4.cpp has the layout); unpacked() gives the parts back in the rows' order."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__(linear)
        blocks = self.weight_blocks(linear)
        lo, hi = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
        d = ((hi - lo) / 15).clamp(min=1e-8)
        q, d, lo = self.padded(torch.round((blocks - lo) / d).clamp(0, 15).to(torch.uint8), d, lo)
        groups, n_blocks = q.shape[0] // self.group, self.in_features // self.block
        # q[16h + 4k + e] of row i goes to half h of byte (k, i, e) of its group's block
        nibbles = q.reshape(groups, self.group, n_blocks, 2, 4, 4)
        packed = nibbles[:, :, :, 0] | (nibbles[:, :, :, 1] << 4)  # [group, row, block, k, e]
        self.register_buffer("weight_q4", packed.permute(0, 2, 3, 1, 4).reshape(groups, -1).contiguous())
        self.register_buffer("d", self.interleaved(d))
        self.register_buffer("m", self.interleaved(lo))

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stored parts in the rows' order, without padding: q [out, in / 32, 32] (0..15), d and m
        [out, in / 32]."""
        groups, n_blocks = self.weight_q4.shape[0], self.in_features // self.block
        packed = self.weight_q4.reshape(groups, n_blocks, 4, self.group, 4).permute(0, 3, 1, 2, 4)
        q = torch.stack([packed & 0xF, packed >> 4], dim=3).reshape(-1, n_blocks, self.block)
        return q[:self.out_features], self.per_row(self.d), self.per_row(self.m)

    def product(self, x2: torch.Tensor) -> torch.Tensor:
        return optional_kernel().int4_dyn_linear(x2, self.weight_q4, self.d, self.m, self.out_features)

    def decode_form(self) -> tuple:
        """This layer as the kernels' decode_layers reads it (its number of outputs where the others give a
        group size)."""
        return (4, self.weight_q4, self.d, self.m, None, self.out_features, self.bias)


class Int8BlockLinear(_BlockLinear):
    """int8 weights with an fp16 scale per block (w = q * d, q in [-127, 127]: the arithmetic of llama.cpp's
    Q8_0); the kernel sums each block with the int8 activations in integers. int4-dyn's output head. The rows are
    stored as int4-dyn's are, in groups of eight interleaved block by block, each q as q + 128
    (engine/model/kernels/int8.cpp has the layout); unpacked() gives the parts back in the rows' order."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__(linear)
        blocks = self.weight_blocks(linear)
        d = (blocks.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-8)
        q, d = self.padded(torch.round(blocks / d).clamp(-127, 127).to(torch.int16), d)
        groups, n_blocks = q.shape[0] // self.group, self.in_features // self.block
        # q[4k + e] of row i goes to byte (k, i, e) of its group's block
        runs = (q + 128).to(torch.uint8).reshape(groups, self.group, n_blocks, self.block // 4, 4)
        self.register_buffer("weight_q8", runs.permute(0, 2, 3, 1, 4).reshape(groups, -1).contiguous())
        self.register_buffer("d", self.interleaved(d))

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored parts in the rows' order, without padding: q [out, in / 32, 32] (int8) and d [out, in / 32]."""
        groups, n_blocks = self.weight_q8.shape[0], self.in_features // self.block
        runs = self.weight_q8.reshape(groups, n_blocks, self.block // 4, self.group, 4).permute(0, 3, 1, 2, 4)
        q = (runs.to(torch.int16) - 128).to(torch.int8).reshape(-1, n_blocks, self.block)
        return q[:self.out_features], self.per_row(self.d)

    def product(self, x2: torch.Tensor) -> torch.Tensor:
        return optional_kernel().int8_block_linear(x2, self.weight_q8, self.d, self.out_features)

    def decode_form(self) -> tuple:
        """This layer as the kernels' decode_layers reads it (its number of outputs where others give a group
        size, as int4-dyn's)."""
        return (5, self.weight_q8, self.d, None, None, self.out_features, self.bias)


def _is_norm(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return type(module).__name__.endswith("Norm") and isinstance(weight, torch.Tensor) and weight.dim() == 1


SMOOTHING_FORMAT = "1"  # a change of how the factors are fitted makes every kept plan stale


def kept_smoothing_plan(model: torch.nn.Module, ids: list[int], window: int = 512) -> dict[str, tuple]:
    """smoothing_plan, fitted once per model weights, text and window and kept in the cache folder."""
    key = f"{SMOOTHING_FORMAT}|{window}|{model_fingerprint(model)}|{ids}"
    return kept("smoothing", key, next(model.parameters()).device, lambda: smoothing_plan(model, ids, window))


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
