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

from engine.plan import shapes
from engine.dtypes import BITS, FP4_BITS
from engine.paths import DATA, models_dir
from engine.plan.shapes import ShapeError as KVCalcError  # bad calculator input: one sentence for the user

KV_BITS = {**BITS, **FP4_BITS}
GROUPED = {"int8", "int4"}  # integer formats keep a 16-bit scale per group of values
DEFAULT_GROUP = 64
WEIGHT_BITS = BITS


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
        checked = shapes.check_attention(self.layers, self.attention_heads, self.kv_heads, self.head_dim,
                                         self.kind, self.latent_dim, self.window, self.sliding_layers)
        checked["params"] = None if self.params is None else shapes.number("params", self.params)
        checked["max_context"] = shapes.optional_whole("max_context", self.max_context)
        for field_name, value in checked.items():
            object.__setattr__(self, field_name, value)


def attention_kind(heads: int, kv_heads: int) -> str:
    if kv_heads == heads:
        return "MHA"
    return "MQA" if kv_heads == 1 else "GQA"


def spec(name: str = "custom", *, layers: int, kv_heads: int, head_dim: int, attention_heads: int | None = None,
         **extra) -> AttentionSpec:
    heads = attention_heads if attention_heads is not None else kv_heads
    return AttentionSpec(name=name, layers=layers, attention_heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                         kind=extra.pop("kind", None) or attention_kind(heads, kv_heads), **extra)


def _first(config: dict, *names):
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return None


def _field(config: dict, *names, low: int = 1, as_name: str = "layers"):
    """The first of these config fields that is set, checked as a whole number (named as in the config)."""
    for name in names:
        if config.get(name) is not None:
            return shapes.whole(name, config[name], low, shapes.LIMITS[as_name])
    return None


# Gemma-2 alternates sliding and full layers; Gemma-3 makes every sixth layer full. Their hub configs
# often say so only by the model type, a "hybrid" cache or sliding_window_pattern, without layer_types.
HYBRID_PATTERN = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6}


def _sliding(text: dict, layers: int) -> tuple[int | None, int]:
    """(window, how many layers use it) from sliding_window, use_sliding_window, layer_types and, without
    layer_types, sliding_window_pattern (every pattern-th layer full, as transformers reads it) or a
    hybrid cache; otherwise every layer slides."""
    if not text.get("sliding_window") or text.get("use_sliding_window", True) is False:
        return None, 0
    window = _field(text, "sliding_window", as_name="window")
    layer_types = text.get("layer_types")
    if layer_types is None:
        pattern = _field(text, "sliding_window_pattern", as_name="layers")
        kind = text.get("model_type")
        if pattern is None and (text.get("cache_implementation") == "hybrid" or kind in HYBRID_PATTERN):
            pattern = HYBRID_PATTERN.get(kind, 2)
        return window, (layers - layers // pattern if pattern else layers)
    if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
        raise KVCalcError("layer_types must be a list of layer names such as \"sliding_attention\".")
    if len(layer_types) != layers:
        raise KVCalcError(f"layer_types lists {len(layer_types)} layers but the model has {layers}.")
    sliding = sum(t == "sliding_attention" for t in layer_types)
    return (window if sliding else None), sliding


def spec_from_config(config: dict, name: str = "from config.json", params: float | None = None) -> AttentionSpec:
    """An AttentionSpec from a Hugging Face config.json dict (Llama, Mistral, Gemma, Falcon, DeepSeek ...)."""
    if not isinstance(config, dict):
        raise KVCalcError("The config must be a JSON object (a model's config.json).")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise KVCalcError("architectures must be a list of class names such as \"LlamaForCausalLM\".")
    if architectures and not any(a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"))
                                 for a in architectures):
        raise KVCalcError(f"This config describes {', '.join(architectures)[:200]}, not a causal language model, "
                          "so it has no KV cache to size.")
    layers = _field(text, "num_hidden_layers", "n_layer", "num_layers", as_name="layers")
    heads = _field(text, "num_attention_heads", "n_head", "num_heads", as_name="attention_heads")
    hidden = _field(text, "hidden_size", "n_embd", "d_model", as_name="hidden_size")
    if not layers or not heads:
        raise KVCalcError("The config has no layer or attention-head count (num_hidden_layers, "
                          "num_attention_heads), so it is not a causal language model config this calculator reads.")
    kv_heads = _field(text, "num_key_value_heads", "num_kv_heads", "n_head_kv", as_name="kv_heads")
    if kv_heads is None:
        kv_heads = 1 if text.get("multi_query") is True else heads
    head_dim = _field(text, "head_dim", as_name="head_dim") or (hidden // heads if hidden else None)
    if not head_dim:
        raise KVCalcError("The config gives neither head_dim nor a hidden_size of at least the head count, "
                          "so the head size is unknown.")
    window, sliding = _sliding(text, layers)
    common = dict(name=name, params=params, window=window, sliding_layers=sliding,
                  max_context=_field(text, "max_position_embeddings", "n_positions", as_name="max_context"))
    if text.get("kv_lora_rank"):
        latent = _field(text, "kv_lora_rank", as_name="latent_dim") + (
            _field(text, "qk_rope_head_dim", low=0, as_name="latent_dim") or 0)
        return AttentionSpec(layers=layers, attention_heads=heads, kv_heads=heads, head_dim=head_dim, kind="MLA",
                             latent_dim=latent, **common)
    return AttentionSpec(layers=layers, attention_heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                         kind=attention_kind(heads, kv_heads), **common)


def spec_from_model_config(config, name: str, params: float | None = None) -> AttentionSpec:
    """From a loaded transformers config object."""
    return spec_from_config(config.to_dict(), name=name, params=params)


def spec_from_model_folder(model: str) -> AttentionSpec:
    """From a local model folder (or 'default'): its config.json, and the parameter count summed
    from its safetensors headers without loading any weights."""
    from safetensors import safe_open

    from engine.paths import DEFAULT_MODEL_NAME
    from engine.model.loader import default_model_dir

    folder = default_model_dir() if model in ("default", DEFAULT_MODEL_NAME) else Path(model)
    from safetensors import SafetensorError

    config = read_config_file(folder / "config.json")
    params = 0
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as f:
                params += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
        except (SafetensorError, OSError, ValueError) as exc:
            detail = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
            raise KVCalcError(f"{file} is not a readable safetensors file ({detail}).") from None
    name = DEFAULT_MODEL_NAME if model in ("default", DEFAULT_MODEL_NAME) else folder.name
    return spec_from_config(config, name=name, params=params or None)


def project_model_folders() -> dict[str, Path]:
    """The project's own converted models (data/models/NAME with a config.json), by folder name."""
    return {p.parent.name: p.parent for p in sorted(models_dir().glob("*/config.json"))}


def load_presets() -> dict[str, AttentionSpec]:
    raw = json.loads((DATA / "kv_presets.json").read_text())
    return {p["name"]: spec_from_config(p["config"], name=p["name"], params=p["params"]) for p in raw["presets"]}


def load_gpus() -> list[dict]:
    return json.loads((DATA / "gpus.json").read_text())["gpus"]


def bits_per_value(dtype: str, group: int = DEFAULT_GROUP) -> float:
    if dtype not in KV_BITS:
        raise KVCalcError(f"Unknown KV precision {shapes._show(dtype)}: use one of {', '.join(KV_BITS)}.")
    group = shapes.whole("group", group)
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
        shapes.whole(name, value, 0 if name == "context" else 1)


def weights_bytes(params: float | None, dtype: str = "bf16", tp: int = 1) -> float | None:
    if params is None:
        return None
    if dtype not in WEIGHT_BITS:
        raise KVCalcError(f"Unknown weight precision {shapes._show(dtype)}: use one of {', '.join(WEIGHT_BITS)}.")
    return shapes.number("params", params) * WEIGHT_BITS[dtype] / 8 / shapes.whole("tp", tp)


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
    _check_sizes(context=context, batch=batch, tp=tp)
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
    """The same model with a sliding window on sliding_layers of its layers (all when not given)."""
    if not window:
        if sliding_layers:
            raise KVCalcError("Sliding layers need a sliding window: give the window length too.")
        return replace(s, window=None, sliding_layers=0)
    window = shapes.whole("window", window)
    return replace(s, window=window, sliding_layers=s.layers if sliding_layers is None else sliding_layers)


def read_config_file(path: str | Path) -> dict:
    """A config.json from a file (or from the config.json inside a model folder), read with a size limit."""
    path = Path(path)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    return shapes.read_json_file(path)
