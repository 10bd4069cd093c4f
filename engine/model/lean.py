"""A lean forward pass for Llama-architecture models (the default SmolLM2 is one).

transformers' eager forward spends about a third of a decode step on this 2-core CPU in small
operations around the matrix products (separate q, k and v projections, gate and up, mask
building, dispatch layers). This module runs the same arithmetic with fewer, larger operations:
q, k and v come from one fused projection, gate and up from another, attention is one call to
PyTorch's scaled_dot_product_attention (where the C++ kernels are built, a prompt with nothing cached
before it, or several side by side, attends in their prompt_attention: each position's row as a decode
step at that position computes it). Everything else stays the model's own: its weights, its
rotary embedding (read from a table it fills once), and transformers' DynamicCache (so cache
cropping is the same). Quantized and sparse layers replace the fused
nn.Linear modules exactly as they would replace transformers' ones.

A decode step of one token goes further where the C++ kernels are built: the embedding, every layer,
the last norm and the output head run in one call (the kernels' decode_layers), on the same row
functions the modules call, so the logits are the same to the bit; the modules run it wherever that
call does not apply (see LeanLlama.decode_in_one_call). That call grows each cache in place, with
room for 128 positions at a time, where DynamicCache concatenates, and reports the bytes its caches
moved for the step's accounting.

On the CPU the layers' linear weights sit in one block, in the order a step reads them, on 2 MiB pages where the
kernel gives them (engine.huge_pages), and every other weight in memory of its own (place_weights).

The module tree keeps transformers' names (`model.layers[i].self_attn`, `model.norm`, `lm_head`)
so code that walks it (early-exit drafts, calibration hooks) works on both."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as torch_module
from transformers.cache_utils import (DYNAMIC_LAYER_TYPE_MAPPING, Cache, DynamicCache, DynamicLayer,
                                      get_layer_types_and_kwargs)

from engine import huge_pages
from engine.model.cpu_kernels import has_small_rows_kernel, optional_kernel


@dataclass
class LeanOutput:
    logits: torch.Tensor
    kv_bytes: tuple[int, int] | None = None  # (read, written) of the KV cache, where the forward counted them


class LeanRMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            kernel = cpu_kernel(x)
            if kernel is not None:
                return kernel.rms_norm(x, self.weight, self.eps)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # equal to the steps below in fp32
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


# whether a decode step's layers run in one kernel call (LeanLlama.decode_in_one_call); the module
# by module path computes the same and stays for everything that call does not cover
FUSED_DECODE = True

CACHE_ROOM = 128  # positions a decode grows a full cache by, here and in the kernels' decode_layers (kCacheRoom)
SMALL_ROWS = 24  # up to this many rows (a decode step, a verification of drafts) go to the project's kernel


class LeanLinear(nn.Linear):
    """nn.Linear whose float32 CPU products of a few rows run in the project's kernel: MKL's few-row
    kernels pack the weights first, so verifying drafts cost nearly two plain steps; this one reads each
    weight once for all rows, and a row's result does not depend on how many rows share the call. Other
    dtypes, quantized weights, prefills and machines without the built extension use F.linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (x.dtype == torch.float32 and weight.dtype == torch.float32 and type(weight) is nn.Parameter
                and x.numel() <= SMALL_ROWS * x.shape[-1]):
            kernel = cpu_kernel(x) if weight.is_cpu and has_small_rows_kernel() else None
            if kernel is not None:
                return kernel.small_linear(x, weight, self.bias)
        return F.linear(x, weight, self.bias)

    def decode_form(self) -> tuple | None:
        """This layer as the kernels' decode_layers reads it (None: it runs its forward instead)."""
        weight = self.weight
        if weight.dtype == torch.float32 and type(weight) is nn.Parameter and weight.is_cpu and has_small_rows_kernel():
            return (0, weight, None, None, None, 0, self.bias)
        return None


def _lean_layer(weight: nn.Parameter, bias: nn.Parameter | None) -> LeanLinear:
    layer = LeanLinear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = weight
    if bias is not None:
        layer.bias = bias
    return layer


def lean_linear(linear: nn.Linear) -> LeanLinear:
    """A LeanLinear holding the layer's own parameters (shared, not copied: a tied head stays tied)."""
    return _lean_layer(linear.weight, linear.bias)


def fused_linear(*linears: nn.Linear) -> LeanLinear:
    """One layer whose output is the given layers' outputs side by side."""
    weight = nn.Parameter(torch.cat([lin.weight.detach() for lin in linears]), requires_grad=False)
    bias = (nn.Parameter(torch.cat([lin.bias.detach() for lin in linears]), requires_grad=False)
            if linears[0].bias is not None else None)
    return _lean_layer(weight, bias)


def cpu_kernel(x: torch.Tensor):
    """The project's C++ kernels for a float32 tensor on the CPU, when they are built: on a decode
    step each PyTorch operation they replace costs several microseconds, its code and data evicted
    from the caches by the weights streamed in between; one plain loop costs less than one."""
    return optional_kernel() if x.is_cpu and x.dtype == torch.float32 else None


def rotate_heads(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of the first `heads` heads of x [batch, length, width], as
    [batch, heads, length, head_dim]; cos and sin are [batch, length, head_dim]."""
    kernel = cpu_kernel(x) if cos.dtype == torch.float32 else None
    if kernel is not None:
        return kernel.rotary(x, cos, sin, heads, head_dim)
    batch, length, _ = x.shape
    x = x[..., :heads * head_dim].view(batch, length, heads, head_dim).transpose(1, 2)
    half = head_dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


# Cache precisions the kernels attend over, widening each value to float32 as they read it
KERNEL_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kernel_reads(kv_dtype: torch.dtype | None) -> bool:
    """Whether the kernels' attention and fused decode read a cache kept in kv_dtype (None: the weights'
    float32)."""
    return kv_dtype is None or kv_dtype in KERNEL_CACHE_DTYPES


def in_cache_precision(q, k, v, kv_dtype):
    """q, k and v for a cache kept in kv_dtype (None: as they are): the keys and values rounded to it; the query
    too, so that attention runs in it, except where the kernels attend (a float32 query on the CPU), which compute
    in float32 over the rounded values."""
    if kv_dtype is None:
        return q, k, v
    if cpu_kernel(q) is None:
        q = q.to(kv_dtype)
    return q, k.to(kv_dtype), v.to(kv_dtype)


class LeanAttention(nn.Module):
    def __init__(self, hf_attention, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scaling = self.head_dim ** -0.5
        self.qkv_proj = fused_linear(hf_attention.q_proj, hf_attention.k_proj, hf_attention.v_proj)
        self.o_proj = lean_linear(hf_attention.o_proj)

    def forward(self, x, cos, sin, cache, mask, kv_dtype=None):
        batch, length, _ = x.shape
        qkv = self.qkv_proj(x)
        # q and k sit side by side in the fused output: rotate them in one pass
        q, k = rotate_heads(qkv, self.heads + self.kv_heads, self.head_dim, cos, sin).split(
            [self.heads, self.kv_heads], dim=1)
        v = qkv[..., (self.heads + self.kv_heads) * self.head_dim:].view(
            batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k, v = in_cache_precision(q, k, v, kv_dtype)
        if isinstance(cache, Packed):  # several sequences' tokens side by side, each attending over its own cache
            return self.o_proj(self.attend_packed(q, k, v, cache, x.dtype))
        return self.o_proj(self.attend(q, k, v, cache, mask, x.dtype))

    def attend_packed(self, q, k, v, packed: Packed, dtype) -> torch.Tensor:
        """[1, positions, heads * head_dim]: each part's positions over its own cache. Consecutive prompts with
        nothing cached before them attend in one call: the kernels' prompt_attention (any lengths, each row the one
        it gets alone), else PyTorch's SDPA for each run of prompts of one length, each a row of its batch (a call
        costs far more to set up than one short prompt's arithmetic)."""
        kernel = cpu_kernel(q)
        outs, fresh = [], []  # fresh: the (positions, cache) of such prompts waiting for their call

        def attend_fresh():
            if not fresh:
                return
            span = slice(fresh[0][0].start, fresh[-1][0].stop)
            lengths = [at.stop - at.start for at, _ in fresh]
            layers = [fresh_layer(part, self.layer_idx) for _, part in fresh]
            if kernel is not None and None not in layers:
                rooms = [room_for(n) for n in lengths]
                for layer, keys, values in zip(layers, kernel.with_rooms(k[:, :, span], lengths, rooms),
                                               kernel.with_rooms(v[:, :, span], lengths, rooms)):
                    start_layer(layer, keys, values)
            else:
                for (at, part), layer in zip(fresh, layers):
                    if layer is not None:
                        start_with_room(layer, k[:, :, at], v[:, :, at])
                    else:
                        part.update(k[:, :, at], v[:, :, at], self.layer_idx)
            if kernel is not None:
                outs.append(kernel.prompt_attention(q[:, :, span], k[:, :, span], v[:, :, span], lengths,
                                                    self.scaling).to(dtype))
            else:
                length = fresh[0][0].stop - fresh[0][0].start
                rows = [t[0, :, span].unflatten(1, (len(fresh), length)).transpose(0, 1) for t in (q, k, v)]
                out = F.scaled_dot_product_attention(*rows, is_causal=True, scale=self.scaling,
                                                     enable_gqa=self.kv_heads != self.heads)
                outs.append(out.transpose(1, 2).reshape(1, -1, self.heads * self.head_dim).to(dtype))
            fresh.clear()

        for at, part, mask in packed.parts:
            length = at.stop - at.start
            if mask is None and length > 1 and part.get_seq_length(self.layer_idx) == 0:
                if fresh and kernel is None and fresh[0][0].stop - fresh[0][0].start != length:
                    attend_fresh()
                fresh.append((at, part))
            else:
                attend_fresh()
                outs.append(self.attend(q[:, :, at], k[:, :, at], v[:, :, at], part, mask, dtype))
        attend_fresh()
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)  # cat copies even one tensor

    def attend(self, q, k, v, cache, mask, dtype) -> torch.Tensor:
        """[batch, length, heads * head_dim]: the new positions' attention over the cache they join."""
        batch, _, length, _ = q.shape
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        kernel = cpu_kernel(q) if mask is None else None
        if kernel is not None and length == 1:  # one new token that sees every cached one: a decode step
            return kernel.decode_attention(q, k, v, self.scaling).to(dtype)
        if kernel is not None and batch == 1 and k.shape[2] == length:  # a prompt with nothing cached before it
            return kernel.prompt_attention(q, k, v, [length], self.scaling).to(dtype)
        causal = mask is None and length > 1
        k, v = k.to(q.dtype), v.to(q.dtype)  # a cache the kernels widen as they read it, widened here
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scaling,
                                             enable_gqa=self.kv_heads != self.heads)
        return out.transpose(1, 2).reshape(batch, length, -1).to(dtype)


class Packed(NamedTuple):
    """Several sequences' new tokens in one row of positions (LeanLlama.prefill_batch): each part's positions, the
    cache it joins and its visibility mask (None: causal)."""
    parts: list[tuple[slice, object, torch.Tensor | None]]


class LeanMLP(nn.Module):
    def __init__(self, hf_mlp):
        super().__init__()
        self.intermediate = hf_mlp.gate_proj.out_features
        self.gate_up_proj = fused_linear(hf_mlp.gate_proj, hf_mlp.up_proj)
        self.down_proj = lean_linear(hf_mlp.down_proj)

    def forward(self, x):
        if getattr(self.gate_up_proj, "makes_silu_product", False):
            return self.down_proj(self.gate_up_proj.silu_product(x))
        gate_up = self.gate_up_proj(x)
        kernel = cpu_kernel(gate_up)
        if kernel is not None:
            return self.down_proj(kernel.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LeanLayer(nn.Module):
    def __init__(self, hf_layer, config, layer_idx: int):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = LeanRMSNorm(hf_layer.input_layernorm.weight, eps)
        self.self_attn = LeanAttention(hf_layer.self_attn, config, layer_idx)
        self.post_attention_layernorm = LeanRMSNorm(hf_layer.post_attention_layernorm.weight, eps)
        self.mlp = LeanMLP(hf_layer.mlp)
        self.layer_idx = layer_idx

    def forward(self, x, cos, sin, cache, mask, kv_dtype=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, mask, kv_dtype)
        return x + self.mlp(self.post_attention_layernorm(x))


def place_weights(model: nn.Module, layers) -> None:
    """Moves the layers' linear weights (q/k/v, o, gate/up, down of each layer, in the order a decode
    step reads them) into one block of CPU memory, each a view of it, and every other CPU parameter
    into memory of its own. A step starts and ends over a hundred products of a few MB; read one after
    another from one block, rather than from wherever loading left them, each start costs less. The
    rest gets its own memory so that nothing keeps the model file's mapping, whose pages would
    otherwise stay resident beside the copies. The head (the embedding too, which quantized levels
    keep in full) stays out of the block, which would otherwise outlive a level that replaces every
    layer; such a level frees the block with the last of its views. The block, and any other parameter of
    2 MiB or more, lies on 2 MiB pages where the kernel gives them (engine.huge_pages)."""
    weights = [linear.weight for layer in layers for linear in _layer_parts(layer)[5:]]
    weights = [w for w in weights if type(w) is nn.Parameter and w.is_cpu and w.dtype == weights[0].dtype]
    in_block = {id(w) for w in weights}
    with torch.no_grad():
        for weight, view in zip(weights, _in_one_block(weights)):
            weight.data = view
        for parameter in model.parameters():
            if id(parameter) not in in_block and parameter.is_cpu:
                parameter.data = _in_one_block([parameter.detach()])[0]


def place_layer_tensors(model: nn.Module) -> None:
    """After a conversion replaced the layers' products (a weight level, sparsity): the tensors they keep (weights,
    integer weights, scales, sums) in one block in the order a step reads them, and the head's in one of its own,
    as place_weights places the float model's, so that no variant streams from other pages than the model it is
    compared with."""
    layers = model.model.layers
    for modules in ([linear for layer in layers for linear in _layer_parts(layer)[5:]], [model.lm_head]):
        tensors = {id(t): t for module in modules for t in (*module._parameters.values(), *module._buffers.values())
                   if t is not None and t.is_cpu and t.numel()}
        with torch.no_grad():
            for tensor, view in zip(tensors.values(), _in_one_block(list(tensors.values()))):
                tensor.data = view


def _in_one_block(tensors: list) -> list:
    """Copies of the tensors side by side in one block of memory, in the order given, each starting on a cache line:
    on 2 MiB pages where the kernel gives them (engine.huge_pages), since a step streams them all."""
    sizes = [-(-t.nbytes // 64) * 64 for t in tensors]
    block = huge_pages.empty(sum(sizes), torch.uint8)
    views, offset = [], 0
    for tensor, size in zip(tensors, sizes):
        view = block[offset:offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
        views.append(view)
        offset += size
    return views


def _layer_parts(layer: LeanLayer) -> tuple:
    """A layer's modules straight from their dictionaries: nn.Module's attribute lookup costs about two
    microseconds a name, which every layer would pay on every step."""
    top = layer._modules
    attn, mlp = top["self_attn"], top["mlp"]
    return (layer, attn, mlp, top["input_layernorm"], top["post_attention_layernorm"], attn._modules["qkv_proj"],
            attn._modules["o_proj"], mlp._modules["gate_up_proj"], mlp._modules["down_proj"])


def _layer_form(parts: tuple) -> tuple | None:
    """One layer as the kernels' decode_layers reads it: (norm weights, eps, its four linear layers), or
    None where a part is of a kind it does not read (a sparse or 16-bit linear, another norm)."""
    norms, linears = parts[3:5], parts[5:]
    if not all(map(_plain_norm, norms)):
        return None
    forms = [_linear_form(m) for m in linears]
    return None if None in forms else (norms[0].weight, norms[1].weight, norms[0].eps, *forms)


def _head_form(norm, head) -> tuple | None:
    """The last norm and the output head as decode_layers reads them: (norm weight, eps, head), or None."""
    form = _linear_form(head)
    return (norm.weight, norm.eps, form) if _plain_norm(norm) and form is not None else None


def _plain_norm(norm) -> bool:
    return type(norm) is LeanRMSNorm and norm.weight.dtype == torch.float32


def _linear_form(linear) -> tuple | None:
    return getattr(linear, "decode_form", lambda: None)()


class LeanBody(nn.Module):
    def __init__(self, hf_body, config):
        super().__init__()
        self.config = config
        self.embed_tokens = hf_body.embed_tokens
        self.rotary_emb = hf_body.rotary_emb
        self.layers = nn.ModuleList(LeanLayer(layer, config, i) for i, layer in enumerate(hf_body.layers))
        self.norm = LeanRMSNorm(hf_body.norm.weight, config.rms_norm_eps)


class LeanLlama(nn.Module):
    """Drop-in for LlamaForCausalLM in this engine: `model(input_ids=..., cache=..., use_cache=...,
    logits_to_keep=...)` returns an object with `.logits`. `attention_mask`, when given, is a
    boolean (new tokens x new tokens) matrix saying which new tokens see which (True = visible),
    and `position_ids` their positions; the cached tokens are visible to all. Speculative
    methods that verify a tree of guesses in one forward use these two. `kv_dtype` keeps keys and
    values in another precision than the weights, e.g. bf16 beside fp32 (attention runs in it, or on the
    CPU's kernels in float32 over the rounded values)."""

    def __init__(self, hf_model):
        super().__init__()
        self.config = hf_model.config
        self.generation_config = getattr(hf_model, "generation_config", None)
        self.model = LeanBody(hf_model.model, hf_model.config)
        self.lm_head = lean_linear(hf_model.lm_head)
        place_weights(self, self.model.layers)

    def __getstate__(self):
        # a copy (a quantized variant, a draft's twin) works out its own forms: the kept ones hold the
        # original's layers, which a conversion is about to replace, and would keep their memory alive
        state = super().__getstate__()
        state.pop("_kept_plan", None)
        return state

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, cache=None, use_cache=True, logits_to_keep=0, position_ids=None,
                attention_mask=None, kv_dtype=None):
        cache = cache if use_cache else None
        unshare(cache)
        past = cache.get_seq_length() if cache is not None else 0
        length = input_ids.shape[1]
        if length == 1 and attention_mask is None and position_ids is None and cache is not None:
            out = self.decode_in_one_call(input_ids, past, cache, kv_dtype)
            if out is not None:
                return out
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(x, position_ids, past, length)
        mask = _visibility(attention_mask, past, length, x.device) if (attention_mask is not None or
                                                                       (past and length > 1)) else None
        for layer in self.model.layers:
            x = layer(x, cos, sin, cache, mask, kv_dtype)
        x = self.model.norm(x[:, -logits_to_keep:] if logits_to_keep else x)
        return LeanOutput(logits=self.lm_head(x))


    def rotary(self, x, position_ids, past: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [batch, length, head_dim] for the given positions (past .. past + length when
        None): rows of a table the model's rotary embedding fills once, the same numbers it gives per
        call (each is one product of a position and a frequency, then its cosine or sine), at a fraction
        of its cost on every step. Embeddings whose frequencies change with the length are asked each
        time."""
        if self._rope_varies():
            if position_ids is None:
                position_ids = torch.arange(past, past + length, device=x.device)[None]
            # each row's own length: the embedding takes a batch's longest for all its rows
            rows = [self.model.rotary_emb(x, row[None]) for row in position_ids]
            return torch.cat([cos for cos, _ in rows]), torch.cat([sin for _, sin in rows])
        table = self._rope_table(x, past + length if position_ids is None else int(position_ids.max()) + 1)
        if position_ids is None:
            return table[0][:, past:past + length], table[1][:, past:past + length]
        return table[0][0, position_ids], table[1][0, position_ids]

    def _rope_varies(self) -> bool:
        rope_type = getattr(self.model.rotary_emb, "rope_type", "default")
        return "dynamic" in rope_type or rope_type == "longrope"

    def _rope_table(self, x, need: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [1, size, head_dim] of positions 0 .. size - 1 >= need, in x's dtype and device."""
        table = self.__dict__.get("_rope")
        if table is None or table[0].dtype != x.dtype or table[0].device != x.device or table[0].shape[1] < need:
            size = max(need, 1024, 2 * table[0].shape[1] if table is not None else 0)
            table = self.__dict__["_rope"] = self.model.rotary_emb(x, torch.arange(size, device=x.device)[None])
        return table

    def _rope_row(self, x, past: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(cos, sin, row): the table holding position `past`'s cos and sin and the row it is in."""
        if self._rope_varies():
            cos, sin = self.rotary(x, None, past, 1)
            return cos, sin, 0
        cos, sin = self._rope_table(x, past + 1)
        return cos, sin, past

    def decode_in_one_call(self, input_ids, past: int, cache, kv_dtype=None) -> LeanOutput | None:
        """The logits of one new token through the kernels' decode_layers, which computes what the
        modules compute (the embedding, every layer, the last norm, the head), to the bit, in one call
        instead of a dozen per layer, with the bytes its cache moved (it grows each cache in place,
        where transformers' cache concatenates); None where it does not apply: no built extension, a
        part it does not read, an empty cache, a hook on a module or on every module (it would not run), a
        cache in a precision other than kv_dtype's (float32 where None) or one the kernels do not read."""
        kernel = optional_kernel() if FUSED_DECODE and input_ids.is_cpu and kernel_reads(kv_dtype) else None
        if kernel is None:
            return None
        plan = self._decode_plan(kernel)
        if (plan.forms is None or any(plan.hooks) or torch_module._global_forward_hooks
                or torch_module._global_forward_pre_hooks):
            return None
        caches = [cache.layers[i] for i in plan.layers]
        if any(type(c) is not DynamicLayer or not c.is_initialized or c.keys.dtype != (kv_dtype or torch.float32)
               for c in caches):
            return None
        cos, sin, row = self._rope_row(plan.embedding, past)
        logits, copied, read, written = kernel.decode_layers(
            input_ids, plan.forms, cos, sin, [row], [c.keys for c in caches], [c.values for c in caches], [], [],
            *plan.attention)
        for i, keys, values in copied:  # the others grew in place
            caches[i].keys, caches[i].values = keys, values
        return LeanOutput(logits=logits, kv_bytes=(read, written))

    @torch.inference_mode()
    def decode_batch(self, token_ids: list[int], positions: list[int], caches: list, kv_dtype=None) -> LeanOutput:
        """The logits [B, vocabulary] of one new token for each of B sequences, each at its own position
        with its own DynamicCache (lengths free to differ): every product takes the B rows at once, so
        each weight is read once for all of them, and each sequence attends over its own cache, grown
        in place (room for 128 positions at a time); a cache that opens with a kept prompt (OpeningLayer) reads
        that prompt's positions where they are kept. Through the kernels' decode_layers where it applies,
        whose rows are the same to the bit as each sequence decoded alone; else through the modules, the
        products batched, attention and a rotary embedding that changes with the length per sequence (a KV
        precision the kernels do not read, a part the call does not read, such an embedding)."""
        ids = torch.tensor(token_ids, device=self.model.embed_tokens.weight.device)
        kernel, plan = self._batch_plan(kv_dtype)
        if plan is not None:
            layers = [[cache.layers[i] for i in plan.layers] for cache in caches]
            # a sequence's layers hold one type (the call checks it), so its first layer's says it
            want = kv_dtype or torch.float32
            if (all(type(c) in DECODE_LAYERS and c.is_initialized for per_sequence in layers for c in per_sequence)
                    and all(per_sequence[0].keys.dtype == want for per_sequence in layers)):
                cos, sin, _ = self._rope_row(plan.embedding, max(positions))
                flat = [c for per_sequence in layers for c in per_sequence]
                opening = any(type(per_sequence[0]) is OpeningLayer for per_sequence in layers)
                shared = [[getattr(c, name, None) for c in flat] if opening else []
                          for name in ("shared_keys", "shared_values")]
                logits, copied, read, written = kernel.decode_layers(
                    ids, plan.forms, cos, sin, positions, [c.keys for c in flat], [c.values for c in flat], *shared,
                    *plan.attention)
                for i, keys, values in copied:  # the others grew in place
                    flat[i].keys, flat[i].values = keys, values
                return LeanOutput(logits=logits[:, 0], kv_bytes=(read, written))
        for cache in caches:
            unshare(cache)
        return self._decode_batch_modules(ids, positions, caches, kv_dtype)

    def _batch_plan(self, kv_dtype) -> tuple:
        """The kernels and the decode plan decode_batch runs its rows through, or (None, None) where it runs them
        through the modules."""
        # a rotary embedding that changes with the length takes one table per sequence: through the modules
        fused = (FUSED_DECODE and self.model.embed_tokens.weight.is_cpu and kernel_reads(kv_dtype)
                 and not self._rope_varies())
        kernel = optional_kernel() if fused else None
        plan = self._decode_plan(kernel) if kernel is not None else None
        if (plan is None or plan.forms is None or any(plan.hooks) or torch_module._global_forward_hooks
                or torch_module._global_forward_pre_hooks):
            return None, None
        return kernel, plan

    def reads_openings(self, kv_dtype=None) -> bool:
        """Whether decode_batch reads a cache's kept opening (OpeningLayer) where it is kept, keeping only the
        sequence's own positions in the cache; else it copies the opening into the cache first."""
        return self._batch_plan(kv_dtype)[1] is not None

    def prefills_side_by_side(self) -> bool:
        """Whether chunks prefilled side by side (prefill_batch) get the logits each gets alone, to the bit: every
        linear layer is one the project's kernels compute a row at a time, at any count of rows (a `rows_apart`
        layer: int4-dyn's, int8-dyn's where the kernels are built; not a float32 one, which PyTorch's GEMM computes
        above a few rows, nor another level's), and the rotary embedding does not change with the longest
        position (prefill_batch asks it once for all the chunks)."""
        products = [m for m in self.modules() if isinstance(m, nn.Linear) or hasattr(m, "decode_form")
                    or hasattr(m, "rows_apart")]
        return bool(products) and all(getattr(m, "rows_apart", False) for m in products) and not self._rope_varies()

    @torch.inference_mode()
    def prefill_batch(self, chunks: list[list[int]], caches: list, kv_dtype=None) -> torch.Tensor:
        """The logits [len(chunks), vocabulary] of each chunk's last token: the chunks (each a sequence's next
        prompt tokens, its DynamicCache holding the ones before) side by side in one row of positions, so every
        product takes all their rows at once and reads each weight once for them all, and each sequence attends
        over its own cache. A row's products, norms and attention are those of its chunk run alone, so where the
        products do not depend on how many rows share them (the project's kernels) the logits are the same."""
        device = self.model.embed_tokens.weight.device
        for cache in caches:
            unshare(cache)
        pasts = [cache.get_seq_length() for cache in caches]
        x = self.model.embed_tokens(torch.tensor([[t for chunk in chunks for t in chunk]], device=device))
        positions = torch.tensor([[past + i for chunk, past in zip(chunks, pasts) for i in range(len(chunk))]],
                                 device=device)
        cos, sin = self.rotary(x, positions, 0, x.shape[1])
        parts, start = [], 0
        for chunk, past, cache in zip(chunks, pasts, caches):
            mask = _visibility(None, past, len(chunk), device) if past and len(chunk) > 1 else None
            parts.append((slice(start, start + len(chunk)), cache, mask))
            start += len(chunk)
        for layer in self.model.layers:
            x = layer(x, cos, sin, Packed(parts), None, kv_dtype)
        last = torch.tensor([at.stop - 1 for at, _, _ in parts], device=device)
        return self.lm_head(self.model.norm(x[0, last]))

    def _decode_batch_modules(self, ids, positions: list[int], caches: list, kv_dtype) -> LeanOutput:
        x = self.model.embed_tokens(ids[:, None])
        cos, sin = self.rotary(x, torch.tensor(positions, device=x.device)[:, None], 0, 1)
        read = written = 0
        for layer in self.model.layers:
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            qkv = attn.qkv_proj(h)
            q, k = rotate_heads(qkv, attn.heads + attn.kv_heads, attn.head_dim, cos, sin).split(
                [attn.heads, attn.kv_heads], dim=1)
            v = qkv[..., (attn.heads + attn.kv_heads) * attn.head_dim:].view(
                len(positions), 1, attn.kv_heads, attn.head_dim).transpose(1, 2)
            q, k, v = in_cache_precision(q, k, v, kv_dtype)
            kernel, outs = cpu_kernel(q), []
            for b, cache in enumerate(caches):
                keys, values = append_in_place(cache.layers[layer.layer_idx], k[b:b + 1], v[b:b + 1])
                read += keys.nbytes + values.nbytes
                written += 2 * k[b].nbytes
                if kernel is not None:  # as a decode step alone attends, a half-precision cache read as it is
                    outs.append(kernel.decode_attention(q[b:b + 1], keys, values, attn.scaling))
                    continue
                keys, values = keys.to(q.dtype), values.to(q.dtype)
                out = F.scaled_dot_product_attention(q[b:b + 1], keys, values, scale=attn.scaling,
                                                     enable_gqa=attn.kv_heads != attn.heads)
                outs.append(out.transpose(1, 2).reshape(1, 1, -1))
            out = torch.cat(outs).to(x.dtype)
            x = x + attn.o_proj(out)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return LeanOutput(logits=self.lm_head(self.model.norm(x))[:, 0], kv_bytes=(read, written))

    def _decode_plan(self, kernel) -> DecodePlan:
        """What decode_layers reads, worked out once and kept while no module in the process registers
        or replaces a submodule, parameter or buffer (a conversion that replaces a layer makes a new
        plan): walking the modules and their buffers through nn.Module on every step would cost
        hundreds of microseconds."""
        plan = self.__dict__.get("_kept_plan")
        if plan is not None and plan.registrations == _registrations[0]:
            return plan
        registrations = _registrations[0]
        layers = list(self.model._modules["layers"]._modules.values())
        embed = self.model._modules["embed_tokens"]
        parts = (*(p for layer in layers for p in _layer_parts(layer)), self.model._modules["norm"],
                 self._modules["lm_head"], embed)
        size = (len(parts) - 3) // len(layers)
        layer_forms = [_layer_form(parts[i * size:(i + 1) * size]) for i in range(len(layers))]
        head = _head_form(*parts[-3:-1])
        plain_embed = (type(embed) is nn.Embedding and embed.weight.dtype == torch.float32 and embed.max_norm is None
                       and embed.weight.is_cpu and embed.weight.is_contiguous())
        attn = parts[1]
        plan = DecodePlan(registrations, [layer.layer_idx for layer in layers],
                          tuple(d for m in parts for d in (m._forward_hooks, m._forward_pre_hooks)),
                          kernel.DecodeForms(embed.weight, layer_forms, head)
                          if None not in layer_forms and head is not None and plain_embed else None,
                          embed.weight, (attn.heads, attn.kv_heads, attn.head_dim, attn.scaling))
        self.__dict__["_kept_plan"] = plan
        return plan


class DecodePlan(NamedTuple):
    registrations: int  # the count of registrations it was made at
    layers: list  # each layer's index in the cache
    hooks: tuple  # every part's forward hooks and pre-hooks (dictionaries, empty when none)
    forms: object | None  # the kernels' DecodeForms of the embedding, the layers and the head, None where a part has none
    embedding: torch.Tensor  # the token embedding's weight
    attention: tuple  # heads, kv_heads, head_dim, scaling


# Counts every submodule, parameter and buffer any module in this process registers or replaces
# (torch's global registration hooks): a decode plan made at one count holds while the count does.
_registrations = [0]


def _count_registration(*_):
    _registrations[0] += 1


for _register in (torch_module.register_module_module_registration_hook,
                  torch_module.register_module_parameter_registration_hook,
                  torch_module.register_module_buffer_registration_hook):
    _register(_count_registration)


def room_for(positions: int) -> int:
    """The positions a cache holding `positions` keeps room for: the next multiple of CACHE_ROOM."""
    return -(-positions // CACHE_ROOM) * CACHE_ROOM


def with_room(old: torch.Tensor, length: int, dtype, opening: torch.Tensor | None = None) -> torch.Tensor:
    """A [batch, kv_heads, length, head_dim] view of new storage with room for room_for(length) positions, holding
    opening's positions (where given) then old's at its start."""
    store = torch.empty(old.shape[0], old.shape[1], room_for(length), old.shape[3], dtype=dtype, device=old.device)
    at = 0
    for part in (opening, old) if opening is not None else (old,):
        store[:, :, at:at + part.shape[2]] = part
        at += part.shape[2]
    return store[:, :, :length]


def cache_layer_kinds(config) -> list[tuple[type, dict]]:
    """The class and arguments of each layer of the DynamicCache that DynamicCache(config=config) makes."""
    types, arguments = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    return [(DYNAMIC_LAYER_TYPE_MAPPING[kind], kwargs) for kind, kwargs in zip(types, arguments)]


def new_cache(kinds: list[tuple[type, dict]]) -> DynamicCache:
    """An empty DynamicCache of these layers (cache_layer_kinds), as DynamicCache(config=config) makes it: that reads
    the config's layer types anew each time, most of a millisecond, which a burst of arrivals pays per request."""
    cache = DynamicCache.__new__(DynamicCache)
    Cache.__init__(cache, layers=[kind(**kwargs) for kind, kwargs in kinds])
    return cache


def fresh_layer(cache, layer_idx: int) -> DynamicLayer | None:
    """The cache's DynamicLayer for this layer, which start_layer can start, or None where the cache keeps its layers
    otherwise."""
    layers = getattr(cache, "layers", ())
    return layers[layer_idx] if len(layers) > layer_idx and type(layers[layer_idx]) is DynamicLayer else None


def start_with_room(layer: DynamicLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """An empty DynamicLayer started with keys and values [1, kv_heads, length, head_dim], copied into storage with
    room up to the next multiple of CACHE_ROOM positions (none where length is one), which a decode grows them into
    as append_in_place does (transformers' update would concatenate them to an empty tensor, and the first decode
    copy them again)."""
    start_layer(layer, *(with_room(t, t.shape[2], t.dtype) for t in (keys, values)))


class OpeningLayer(DynamicLayer):
    """A cache layer that opens with a kept prompt's keys and values, read where the prompt store keeps them: every
    sequence opening with that prompt attends over the same positions, where a copy each would be read once per
    sequence on every decode step. Its own positions follow in keys and values, storage with room that a decode
    grows into: up to the next multiple of CACHE_ROOM positions counting the opening's, as a copy would have. The
    kernels' decode step reads it as it is; every other path makes it a DynamicLayer holding all its positions first
    (unshare)."""

    def __init__(self, shared_keys: torch.Tensor, shared_values: torch.Tensor):
        super().__init__()
        self.shared_keys, self.shared_values = shared_keys, shared_values
        length = shared_keys.shape[2]
        own = room_for(length + 1) - length  # the room a copy of the opening would have kept after it
        start_layer(self, *(t.new_empty(t.shape[0], t.shape[1], own, t.shape[3])[:, :, :0]
                            for t in (shared_keys, shared_values)))

    def get_seq_length(self) -> int:
        return self.shared_keys.shape[2] + self.keys.shape[2]

    def update(self, *args, **kwargs):
        raise RuntimeError("a cache that opens with a kept prompt is unshared before a forward other than the "
                           "kernels' decode step adds to it")


# the cache layers the kernels' decode step reads
DECODE_LAYERS = (DynamicLayer, OpeningLayer)


def open_with(cache, pairs: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> None:
    """Each layer of the empty cache an OpeningLayer over the first `length` positions of its (keys, values), a kept
    prompt's, which it reads where they are."""
    for i, (keys, values) in enumerate(pairs):
        cache.layers[i] = OpeningLayer(keys[:, :, :length], values[:, :, :length])


def unshare(cache) -> None:
    """Each OpeningLayer of the cache made a DynamicLayer holding its opening's positions then its own (copied into
    storage with room)."""
    layers = getattr(cache, "layers", ())
    for i, layer in enumerate(layers):
        if type(layer) is OpeningLayer:
            layers[i] = DynamicLayer()
            start_layer(layers[i], *(with_room(own, shared.shape[2] + own.shape[2], own.dtype, opening=shared)
                                     for shared, own in ((layer.shared_keys, layer.keys),
                                                         (layer.shared_values, layer.values))))


def first_positions(layer: DynamicLayer, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the cache layer's first `length` keys and values (an OpeningLayer's opening's, then its own)."""
    if type(layer) is not OpeningLayer:
        return layer.keys[:, :, :length].clone(), layer.values[:, :, :length].clone()
    shared = layer.shared_keys.shape[2]
    return tuple(torch.cat([opening[:, :, :length], own[:, :, :max(0, length - shared)]], dim=2)
                 for opening, own in ((layer.shared_keys, layer.keys), (layer.shared_values, layer.values)))


def start_layer(layer: DynamicLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """An empty DynamicLayer holding keys and values that already have their room (with_room's views)."""
    layer.device = keys.device
    layer.keys, layer.values = keys, values
    layer.is_initialized = True


def append_in_place(layer: DynamicLayer, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A DynamicLayer's keys and values with one position [1, kv_heads, 1, head_dim] added, written into
    room its storage keeps after the last position (made CACHE_ROOM positions at a time where it has none),
    as the kernels' decode_layers grows them: concatenating would copy the whole cache on every step."""
    grown = []
    for old, new in ((layer.keys, keys), (layer.values, values)):
        length = old.shape[2]
        room = old.untyped_storage().nbytes() // old.element_size()
        if (old.dtype != new.dtype or old.stride(3) != 1 or old.stride(2) != old.shape[3] or old.storage_offset()
                or old.stride(1) < (length + 1) * old.shape[3] or old.stride(0) * old.shape[0] > room):
            store = with_room(old, length + 1, new.dtype)
        else:  # the storage behind the view, as a tensor of its full capacity
            store = old.as_strided((old.shape[0], old.shape[1], length + 1, old.shape[3]), old.stride())
        store[:, :, length:length + 1] = new
        grown.append(store)
    layer.keys, layer.values = grown
    return layer.keys, layer.values


def _visibility(new: torch.Tensor | None, past: int, length: int, device) -> torch.Tensor:
    """Boolean (length x past + length) mask: every new token sees the cache, and among the new
    tokens what `new` says (causal when not given)."""
    if new is None:
        new = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    return torch.cat([torch.ones(length, past, dtype=torch.bool, device=device), new.to(device)], dim=1)


def supports(hf_model) -> bool:
    """Plain Llama decoders: the architecture this module reproduces exactly."""
    config = hf_model.config
    return (type(hf_model).__name__ == "LlamaForCausalLM" and getattr(config, "hidden_act", "silu") == "silu"
            and getattr(config, "pretraining_tp", 1) == 1 and not getattr(config, "mlp_bias", False))


def lean(hf_model):
    """The lean twin of a supported model (its tensors are reused or fused, the originals of
    fused layers are left to be freed), or the model itself when it is not supported."""
    if not supports(hf_model):
        return hf_model
    return LeanLlama(hf_model).eval()
