"""What one forward pass moves and computes, derived from the loaded model's real tensors.

Weight bytes are the bytes of every distinct parameter and buffer tensor, in whatever precision it
is stored (a tied embedding and output head share one tensor and count once; an untied input
embedding is only read for the rows looked up; quantized layers with opaque packed weights
report their size).
KV bytes follow transformers' DynamicCache, which the engine uses: each step concatenates the new
keys and values onto the old ones, so it reads the old cache, writes the whole grown cache, and
attention then reads the grown cache. A forward that grows the cache in place (the lean model's
one-call decode step) counts its own: attention's read of the grown cache, the new position written,
and a copy where a cache's room runs out. FLOPs count the matrix multiplications (2 per
multiply-add) of the linear layers and of attention; element-wise work is left out."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelShape:
    layers: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    kv_elem_bytes: int
    body_linear_params: int  # multiply-adds per token in every linear layer but the output head
    head_linear_params: int  # multiply-adds per kept logit row in the output head
    weight_bytes: int  # bytes of weights read by one forward, input embedding rows excluded
    embed_row_bytes: int  # bytes of one input-embedding row when it is not tied to the head, else 0

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_elem_bytes


@dataclass(frozen=True)
class ForwardWork:
    weight_bytes: int
    kv_read_bytes: int
    kv_write_bytes: int
    flops: float

    @property
    def bytes_moved(self) -> int:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes


def _config_value(config, *names, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def model_shape(model: torch.nn.Module, kv_dtype: torch.dtype | None = None) -> ModelShape:
    config = model.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(_config_value(text_config, "num_attention_heads"))
    hidden = int(_config_value(text_config, "hidden_size"))
    kv_heads = int(_config_value(text_config, "num_key_value_heads", default=heads))
    head_dim = int(_config_value(text_config, "head_dim", default=hidden // heads))
    layers = int(_config_value(text_config, "num_hidden_layers"))

    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    tied = getattr(head, "weight", None) is not None and head.weight.data_ptr() == embed.weight.data_ptr()
    seen: set[int] = set()
    weight_bytes = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        ptr = tensor.data_ptr()
        if ptr in seen or (not tied and ptr == embed.weight.data_ptr()):
            continue
        seen.add(ptr)
        weight_bytes += tensor.nbytes
    # quantized layers whose packed weights are not visible as tensors report their own size
    weight_bytes += sum(getattr(m, "packed_weight_nbytes", 0) for m in model.modules())
    body = sum(int(m.in_features * m.out_features * getattr(m, "multiply_fraction", 1.0)) for m in model.modules()
               if hasattr(m, "in_features") and hasattr(m, "out_features") and m is not head)
    head_params = head.in_features * head.out_features if hasattr(head, "in_features") else 0
    elem = torch.empty((), dtype=kv_dtype or embed.weight.dtype).element_size()
    return ModelShape(
        layers=layers, attention_heads=heads, kv_heads=kv_heads, head_dim=head_dim, kv_elem_bytes=elem,
        body_linear_params=body, head_linear_params=head_params, weight_bytes=weight_bytes,
        embed_row_bytes=0 if tied else embed.weight[0].nbytes,
    )


def forward_work(shape: ModelShape, n_new: int, past_len: int, logits_kept: int = 1,
                 kv_cache: bool = True, kv_bytes: tuple[int, int] | None = None) -> ForwardWork:
    """Work of one forward over n_new tokens that follow past_len cached tokens; kv_bytes, where the
    forward counted them, are the (read, written) bytes of its cache.

    Without a KV cache the forward recomputes keys and values for all n_new tokens (past_len is 0)
    and keeps them only as activations: written once, read once by attention."""
    per_token = shape.kv_bytes_per_token
    total = past_len + n_new
    if kv_bytes is not None:
        kv_read, kv_write = kv_bytes
    elif kv_cache:
        kv_read = per_token * (past_len + total)
        kv_write = per_token * total
    else:
        kv_read = kv_write = per_token * n_new
    # query i (0-based within the new tokens) attends to past_len + i + 1 keys: QK^T and AV
    key_positions = n_new * past_len + n_new * (n_new + 1) // 2
    attention = 4 * shape.layers * shape.attention_heads * shape.head_dim * key_positions
    flops = 2 * shape.body_linear_params * n_new + 2 * shape.head_linear_params * logits_kept + attention
    return ForwardWork(
        weight_bytes=shape.weight_bytes + shape.embed_row_bytes * n_new,
        kv_read_bytes=kv_read, kv_write_bytes=kv_write, flops=float(flops),
    )


def batch_decode_work(shape: ModelShape, pasts: list[int]) -> ForwardWork:
    """One batched decode forward: each of len(pasts) sequences adds one token after its own past positions,
    reading its whole cache and writing one position in place; the weights travel once for all of them, and
    each sequence reads its own input-embedding row."""
    per_token = shape.kv_bytes_per_token
    works = [forward_work(shape, 1, past, kv_bytes=(per_token * (past + 1), per_token)) for past in pasts]
    return ForwardWork(weight_bytes=shape.weight_bytes + shape.embed_row_bytes * len(pasts),
                       kv_read_bytes=sum(w.kv_read_bytes for w in works),
                       kv_write_bytes=sum(w.kv_write_bytes for w in works), flops=sum(w.flops for w in works))


def cache_nbytes(cache) -> int:
    """Bytes of the keys and values a transformers cache holds (a cache the fused decode grows keeps
    room for up to 127 more positions a layer beyond them, which this does not count)."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.is_initialized)


def reduce_work(work: ForwardWork, weight_bytes: int, flops: float) -> ForwardWork:
    """The same forward with some weight bytes and FLOPs taken out (skipped, or counted as waste)."""
    return ForwardWork(weight_bytes=work.weight_bytes - weight_bytes, kv_read_bytes=work.kv_read_bytes,
                       kv_write_bytes=work.kv_write_bytes, flops=work.flops - flops)
