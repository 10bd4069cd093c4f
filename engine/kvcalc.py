"""KV-cache and memory calculator: pure functions, no model needed.

KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per value, with
MLA storing one latent of kv_lora_rank + rope head dim values per layer instead of K and V,
sliding-window layers holding at most `window` tokens, and quantized KV formats paying for a
16-bit scale per group of values."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from .errors import UserError
from .paths import DATA

KV_BITS = {"fp32": 32, "bf16": 16, "fp16": 16, "fp8": 8, "int8": 8, "int4": 4}
GROUPED = {"int8", "int4"}  # integer formats keep a 16-bit scale per group of values
DEFAULT_GROUP = 64
WEIGHT_BITS = {"fp32": 32, "bf16": 16, "fp16": 16, "fp8": 8, "int8": 8, "int4": 4}


class KVCalcError(UserError):
    """Bad calculator input; the message is one sentence for the user."""


@dataclass(frozen=True)
class AttentionSpec:
    name: str
    layers: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    kind: str = "MHA"  # MHA, GQA, MQA or MLA
    latent_dim: int = 0  # MLA: kv_lora_rank + rope head dim
    window: int | None = None  # sliding-window length
    sliding_layers: int = 0  # how many layers use the window
    params: float | None = None
    max_context: int | None = None

    def __post_init__(self):
        for field_name in ("layers", "kv_heads", "head_dim", "attention_heads"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value < 1:
                raise KVCalcError(f"{field_name} must be a whole number of at least 1, not {value!r}.")
        if self.kv_heads > self.attention_heads:
            raise KVCalcError(f"kv_heads ({self.kv_heads}) cannot exceed attention heads ({self.attention_heads}).")
        if self.window is not None and self.window < 1:
            raise KVCalcError(f"The sliding window must be at least 1 token, not {self.window}.")


def attention_kind(heads: int, kv_heads: int) -> str:
    if kv_heads == heads:
        return "MHA"
    return "MQA" if kv_heads == 1 else "GQA"


def spec(name: str = "custom", *, layers: int, kv_heads: int, head_dim: int, attention_heads: int | None = None,
         **extra) -> AttentionSpec:
    heads = attention_heads or kv_heads
    return AttentionSpec(name=name, layers=layers, attention_heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                         kind=extra.pop("kind", None) or attention_kind(heads, kv_heads), **extra)


def _first(config: dict, *names):
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return None


def spec_from_config(config: dict, name: str = "from config.json", params: float | None = None) -> AttentionSpec:
    """An AttentionSpec from a Hugging Face config.json dict (Llama, Mistral, Gemma, Falcon, DeepSeek ...)."""
    if not isinstance(config, dict):
        raise KVCalcError("The config must be a JSON object (a model's config.json).")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    architectures = config.get("architectures") or []
    if architectures and not any(a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"))
                                 for a in architectures):
        raise KVCalcError(f"This config describes {', '.join(architectures)}, not a causal language model, "
                          "so it has no KV cache to size.")
    layers = _first(text, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(text, "num_attention_heads", "n_head", "num_heads")
    hidden = _first(text, "hidden_size", "n_embd", "d_model")
    if not layers or not heads:
        raise KVCalcError("The config has no layer or attention-head count (num_hidden_layers, "
                          "num_attention_heads), so it is not a causal language model config this calculator reads.")
    kv_heads = _first(text, "num_key_value_heads", "num_kv_heads", "n_head_kv")
    if kv_heads is None:
        kv_heads = 1 if text.get("multi_query") else heads
    head_dim = _first(text, "head_dim") or (hidden // heads if hidden else None)
    if not head_dim:
        raise KVCalcError("The config gives neither head_dim nor hidden_size, so the head size is unknown.")
    window, sliding = None, 0
    layer_types = text.get("layer_types")
    if text.get("sliding_window") and text.get("use_sliding_window", True):
        window = int(text["sliding_window"])
        sliding = sum(t == "sliding_attention" for t in layer_types) if layer_types else int(layers)
    common = dict(name=name, params=params, max_context=_first(text, "max_position_embeddings", "n_positions"),
                  window=window if sliding else None, sliding_layers=sliding)
    if text.get("kv_lora_rank"):
        latent = int(text["kv_lora_rank"]) + int(text.get("qk_rope_head_dim") or 0)
        return AttentionSpec(layers=int(layers), attention_heads=int(heads), kv_heads=int(heads),
                             head_dim=int(head_dim), kind="MLA", latent_dim=latent, **common)
    return AttentionSpec(layers=int(layers), attention_heads=int(heads), kv_heads=int(kv_heads),
                         head_dim=int(head_dim), kind=attention_kind(int(heads), int(kv_heads)), **common)


def spec_from_model_config(config, name: str, params: float | None = None) -> AttentionSpec:
    """From a loaded transformers config object."""
    return spec_from_config(config.to_dict(), name=name, params=params)


def spec_from_model_folder(model: str) -> AttentionSpec:
    """From a local model folder (or 'default'): its config.json, and the parameter count summed
    from its safetensors headers without loading any weights."""
    from safetensors import safe_open

    from .models import DEFAULT_MODEL_NAME, default_model_dir

    folder = default_model_dir() if model in ("default", DEFAULT_MODEL_NAME) else Path(model)
    config = read_config_file(folder / "config.json")
    params = 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            params += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    name = DEFAULT_MODEL_NAME if model in ("default", DEFAULT_MODEL_NAME) else folder.name
    return spec_from_config(config, name=name, params=params or None)


def load_presets() -> dict[str, AttentionSpec]:
    raw = json.loads((DATA / "kv_presets.json").read_text())
    return {p["name"]: spec_from_config(p["config"], name=p["name"], params=p["params"]) for p in raw["presets"]}


def load_gpus() -> list[dict]:
    return json.loads((DATA / "gpus.json").read_text())["gpus"]


def bits_per_value(dtype: str, group: int = DEFAULT_GROUP) -> float:
    if dtype not in KV_BITS:
        raise KVCalcError(f"Unknown KV precision '{dtype}': use one of {', '.join(KV_BITS)}.")
    if group < 1:
        raise KVCalcError(f"The quantization group size must be at least 1, not {group}.")
    return KV_BITS[dtype] + (16 / group if dtype in GROUPED else 0)


def values_per_token_per_layer(s: AttentionSpec, tp: int = 1) -> int:
    """Values one layer stores per token on one GPU. With tensor parallelism the KV heads are split
    across GPUs (replicated when there are fewer heads than GPUs); MLA's latent is replicated."""
    if s.kind == "MLA":
        return s.latent_dim
    return 2 * math.ceil(s.kv_heads / tp) * s.head_dim


def values_per_token(s: AttentionSpec, tp: int = 1) -> int:
    return s.layers * values_per_token_per_layer(s, tp)


def stored_token_layers(s: AttentionSpec, context: int) -> int:
    """Sum over layers of the tokens each layer keeps at this context length."""
    window_cap = min(context, s.window) if s.window else context
    return (s.layers - s.sliding_layers) * context + s.sliding_layers * window_cap


def kv_bytes(s: AttentionSpec, context: int, dtype: str = "fp16", batch: int = 1, tp: int = 1,
             group: int = DEFAULT_GROUP) -> float:
    """KV-cache bytes on one GPU for `batch` sequences of `context` tokens."""
    _check_sizes(context=context, batch=batch, tp=tp)
    values = values_per_token_per_layer(s, tp) * stored_token_layers(s, context) * batch
    return values * bits_per_value(dtype, group) / 8


def _check_sizes(**sizes) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or value < (0 if name == "context" else 1):
            raise KVCalcError(f"{name} must be a whole number of at least {0 if name == 'context' else 1}, not {value!r}.")


def weights_bytes(params: float | None, dtype: str = "bf16", tp: int = 1) -> float | None:
    if params is None:
        return None
    if params <= 0:
        raise KVCalcError(f"The parameter count must be positive, not {params}.")
    return params * WEIGHT_BITS[dtype] / 8 / tp


def longest_context(s: AttentionSpec, free_bytes: float, dtype: str, batch: int, tp: int, group: int,
                    limit: int) -> int:
    """Largest context (up to limit) whose cache fits in free_bytes; 0 if not even one token fits."""
    if kv_bytes(s, 1, dtype, batch, tp, group) > free_bytes:
        return 0
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if kv_bytes(s, mid, dtype, batch, tp, group) <= free_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def calculate(s: AttentionSpec, context: int = 2048, dtype: str = "fp16", batch: int = 1, tp: int = 1,
              group: int = DEFAULT_GROUP, weight_dtype: str = "bf16", gpus: list[dict] | None = None) -> dict:
    """Everything the page and `python -m engine kvcalc --json` show."""
    bits = bits_per_value(dtype, group)
    per_token_values = values_per_token(s, tp)
    total = kv_bytes(s, context, dtype, batch, tp, group)
    weights = weights_bytes(s.params, weight_dtype, tp)
    result = {
        "model": s.name, "attention": s.kind, "layers": s.layers, "attention_heads": s.attention_heads,
        "kv_heads": s.kv_heads, "head_dim": s.head_dim, "latent_dim": s.latent_dim or None,
        "sliding_window": s.window, "sliding_layers": s.sliding_layers,
        "kv_dtype": dtype, "bits_per_value": bits, "context": context, "batch": batch, "tp": tp,
        "values_per_token": per_token_values,
        "bytes_per_token": per_token_values * bits / 8,
        "total_bytes": total,
        "weights_bytes": weights, "weight_dtype": weight_dtype, "params": s.params,
        "gpus": [],
    }
    limit = s.max_context or (1 << 20)  # no point looking past what the model can attend to
    for gpu in gpus if gpus is not None else load_gpus():
        memory = gpu["memory_mib"] * 2**20
        free = memory - (weights or 0)
        row = {
            "gpu": gpu["name"], "memory_bytes": memory, "bandwidth_gbps": gpu["bandwidth_gbps"],
            "weights_bytes": weights, "kv_bytes": total,
            "fits": free >= total,
            # one decode step reads the whole cache once: its memory distance
            "kv_read_ms_per_step": total / (gpu["bandwidth_gbps"] * 1e9) * 1e3,
            "weights_read_ms_per_step": (weights / (gpu["bandwidth_gbps"] * 1e9) * 1e3) if weights else None,
            "longest_context": longest_context(s, free, dtype, batch, tp, group, limit) if free > 0 else 0,
            "context_search_limit": limit,
            "largest_batch": (int(free // kv_bytes(s, context, dtype, 1, tp, group)) if free > 0 else 0)
            if context else None,
        }
        result["gpus"].append(row)
    return result


def formula(s: AttentionSpec, dtype: str, context: int, batch: int, tp: int, group: int = DEFAULT_GROUP) -> str:
    """The formula with this case's numbers filled in."""
    bits = bits_per_value(dtype, group)
    if s.kind == "MLA":
        per_layer = f"{s.latent_dim} latent values (kv_lora_rank + rope head dim)"
    else:
        heads = math.ceil(s.kv_heads / tp)
        per_layer = f"2 x {heads} kv heads{f' (of {s.kv_heads}, over {tp} GPUs)' if tp > 1 else ''} x {s.head_dim} head dim"
    tokens = f"{context} tokens"
    if s.sliding_layers:
        tokens = (f"({s.layers - s.sliding_layers} full layers x {context} tokens + {s.sliding_layers} sliding layers "
                  f"x min({context}, {s.window}) tokens)")
        return f"{per_layer} x {tokens} x batch {batch} x {bits:g} bits / 8 = {kv_bytes(s, context, dtype, batch, tp, group):,.0f} bytes"
    return (f"{per_layer} x {s.layers} layers x {tokens} x batch {batch} x {bits:g} bits / 8 = "
            f"{kv_bytes(s, context, dtype, batch, tp, group):,.0f} bytes")


def human(n_bytes: float | None) -> str:
    """Both unit systems, spelled out: '9.66 GB (9.00 GiB)'."""
    if n_bytes is None:
        return "n/a"
    for dec, binary, power in (("GB", "GiB", 3), ("MB", "MiB", 2), ("kB", "KiB", 1)):
        if n_bytes >= 1000**power:
            return f"{n_bytes / 1000**power:,.2f} {dec} ({n_bytes / 1024**power:,.2f} {binary})"
    return f"{n_bytes:,.0f} bytes"


def with_window(s: AttentionSpec, window: int | None, sliding_layers: int | None = None) -> AttentionSpec:
    return replace(s, window=window, sliding_layers=(sliding_layers if sliding_layers is not None else s.layers)
                   if window else 0)


def read_config_file(path: str | Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise KVCalcError(f"No config file at {path}.") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise KVCalcError(f"{path} is not valid JSON, so it is not a config.json.") from None
