"""Deployment planner: the five buckets of a decode step and of a prefill for a model on GPUs one does not have.

Pure functions of the model's shape, data/gpus.json and a few efficiency factors; no model is loaded.

Per decode step of `batch` sequences at context C, on tensor-parallel degree t and pipeline degree p
(the stages of one step run one after another, so a step crosses every layer once):

    memory   = (weight bytes / t / bandwidth_efficiency + KV bytes read / t / kv_bandwidth_efficiency) / bandwidth
    compute  = max(product FLOPs / t / (peak x compute_efficiency) - weight read time, 0)
               + max(attention FLOPs / t / (peak in the cache's format x compute_efficiency) - KV read time, 0)
                 (each a roofline of its own: the products overlap their weights' reads and attention its
                 cache's, but the two run as separate kernels; on a CPU, whose cores both load and multiply,
                 the products' and attention's time adds to the reads' instead: no max, but for a level whose
                 kernels fetch the weights ahead of their products; a device whose attention
                 was timed apart from its products, a probed server's, gives attention that achieved rate instead)
               + weights / t x dequant ops per weight / fp32 vector peak     (weight-only formats
                 unpack each weight on the vector units between loads, which adds to the step)
    physical = 2 x layers x all-reduce(t, batch x hidden x 2 bytes)   + (p - 1) pipeline sends
               + one host round trip for the sampled tokens
               all-reduce, ring:   collective_fixed + 2 (t - 1) hop latency + 2 (t - 1) / t x bytes / link
               all-reduce, switch: collective_fixed + 2 hop latency         + 2 (t - 1) / t x bytes / link
    time     = step_fixed + kernels per step x launch cost
               (+ sequences x layers x one layer's own work, where a decode step runs its layers in one call:
                 norms, rotary, the cache append and attention are done for each sequence)
               + max(sequences x host work per sequence - the GPU's step, 0)   (the host prepares the next
                 step while the GPU runs this one; on a CPU, whose cores do both, it adds: no max)
    decision = speculative work thrown away (rejected drafts and their share of the verification)

Product FLOPs = batch x 2 x linear parameters (a prefill computes the output head's logits for each sequence's last
row only; a verification of drafts for every row), attention FLOPs = batch x 4 x layers x heads x head_dim x C; weight
bytes count the parameters one token reads (an untied input embedding is only looked up; a mixture of experts
reads the experts its tokens touch)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from engine.dtypes import FP4_BITS, INTEGER_LEVELS, weight_level
from engine.plan import kvcalc
from engine.plan import shapes
from engine.plan.shapes import ShapeError
from engine.measure.distances import BUCKETS, cache_read_gbps

DATA = kvcalc.DATA
# int4: a 16-bit scale per 32 weights; NVFP4: 4-bit E2M1 with an FP8 scale per 16; MXFP4: with an 8-bit scale per 32
LEVEL_BITS = {"fp32": 32.0, "bf16": 16.0, "fp16": 16.0, "fp8": 8.0, "int8": 8.0, "int4": 4.5, **FP4_BITS}
FP4 = tuple(FP4_BITS)
ACT_BYTES = 2  # activations cross links in 16 bits


class PlanError(ShapeError):
    """Bad planner input; the message is one sentence for the user."""


def load_constants() -> dict:
    """The planner's measured, fitted and assumed constants with their origins: data/plan_constants.json, or the
    file $TOKENPATH_PLAN_CONSTANTS names."""
    return json.loads(Path(os.environ.get("TOKENPATH_PLAN_CONSTANTS", DATA / "plan_constants.json")).read_text())


CONSTANTS = load_constants()
FITTED = {name: c["value"] for name, c in CONSTANTS["efficiency"].items()}
ORIGIN = {name: c["origin"] for name, c in CONSTANTS["efficiency"].items()}
LOCAL = {name: c["value"] for name, c in CONSTANTS["local"].items()}
RESERVE_BYTES = CONSTANTS["engine"]["reserve_bytes"]["value"]


@dataclass(frozen=True)
class Efficiency:
    """The factors that turn data-sheet peaks into achieved figures; defaults and origins in data/plan_constants.json."""
    bandwidth: float = FITTED["bandwidth"]
    kv_bandwidth: float = FITTED["kv_bandwidth"]
    compute: float = FITTED["compute"]
    prefill_compute: float = FITTED["prefill_compute"]
    link: float = FITTED["link"]
    collective_fixed_us: float = FITTED["collective_fixed_us"]
    step_fixed_us: float = FITTED["step_fixed_us"]
    launch_us: float = FITTED["launch_us"]
    kernels_per_layer: int = FITTED["kernels_per_layer"]
    matvec_us: float = FITTED["matvec_us"]
    matvecs_per_layer: int = FITTED["matvecs_per_layer"]
    one_call_layer_us: float | None = FITTED["one_call_layer_us"]
    host_sync_us: float = FITTED["host_sync_us"]
    host_us_per_sequence: float = FITTED["host_us_per_sequence"]
    overlap: bool = FITTED["overlap"]  # the products run while their weights stream in; False: the same cores do both
    host_overlap: bool | None = FITTED["host_overlap"]  # the host works while the device computes (None: as overlap)
    dequant_ops: dict = field(default_factory=lambda: dict(FITTED["dequant_ops"]))


@dataclass(frozen=True)
class Model:
    """What the planner needs of a model: its attention shape (the KV calculator's) and its sizes."""
    spec: kvcalc.AttentionSpec
    hidden: int
    vocab: int | None
    tied: bool
    params: float
    active_params: float
    experts: int = 0  # routed experts per mixture-of-experts layer (0: a dense model)
    experts_per_token: int = 0
    expert_params: float = 0.0  # every routed expert's parameters, over all layers
    moe_layers: int = 0  # layers with routed experts

    @property
    def name(self) -> str:
        return self.spec.name

    def read_params(self) -> float:
        """Parameters one decode token reads: an untied input embedding is only looked up (one row)."""
        skipped = self.vocab * self.hidden if self.vocab and not self.tied else 0
        # a parameter count smaller than twice the embedding is a count without it: keep the whole count
        return self.active_params - skipped if self.active_params > 2 * skipped else self.active_params


@dataclass(frozen=True)
class Setup:
    """One configuration to plan."""
    model: Model
    gpu: dict
    gpus: int = 1
    tp: int | None = None
    pp: int = 1
    interconnect: str = "nvlink"
    weights: str = "bf16"
    bits_per_weight: float | None = None
    kv_dtype: str = "bf16"
    batch: int = 1
    prompt_tokens: int = 128
    new_tokens: int = 256
    speculative_acceptance: float | None = None
    speculative_draft_length: int = 4
    speculative_draft_cost: float = 0.05
    ep: int = 1  # expert parallelism: a mixture of experts' routed experts spread over this many of the GPUs
    efficiency: Efficiency = Efficiency()


# --- data -------------------------------------------------------------------------------------

def load_gpu_data() -> dict:
    return json.loads((DATA / "gpus.json").read_text())


def gpu_ids() -> list[str]:
    return [g["id"] for g in load_gpu_data()["gpus"]]


def get_gpu(gpu_id: str) -> dict:
    for g in load_gpu_data()["gpus"]:
        if g["id"] == gpu_id:
            return g
    raise PlanError(f"Unknown GPU {shapes._show(gpu_id)}: use one of {', '.join(gpu_ids())}.")


def interconnects() -> dict:
    return load_gpu_data()["interconnects"]


def _raw_presets() -> list[dict]:
    return json.loads((DATA / "kv_presets.json").read_text())["presets"]


def preset_ids() -> dict[str, str]:
    """Short id -> preset name."""
    return {p["id"]: p["name"] for p in _raw_presets()}


def model_from_config(config: dict, name: str, params: float | None = None,
                      active_params: float | None = None) -> Model:
    """A planner model from a config.json dict; without a parameter count it is estimated from the shape."""
    s = kvcalc.spec_from_config(config, name=name, params=params)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    hidden = kvcalc._field(text, "hidden_size", "n_embd", "d_model", as_name="hidden_size")
    if hidden is None:
        raise PlanError("The config gives no hidden_size, which the planner needs for the all-reduce size.")
    vocab = kvcalc._field(text, "vocab_size", as_name="vocab_size")
    tied = text.get("tie_word_embeddings", True) is not False
    total = shapes.number("params", params) if params is not None else estimate_params(s, hidden, vocab, tied, text)
    active = shapes.number("active_params", active_params) if active_params is not None else total
    experts, per_token, expert_params, moe_layers = moe_shape(text, s.layers, hidden)
    return Model(spec=replace(s, params=total), hidden=hidden, vocab=vocab, tied=tied, params=total,
                 active_params=min(active, total), experts=experts, experts_per_token=per_token,
                 expert_params=min(expert_params, total), moe_layers=moe_layers)


def moe_shape(text: dict, layers: int, hidden: int) -> tuple[int, int, float, int]:
    """(routed experts, experts per token, all routed experts' parameters, layers with them) from a mixture-of-experts config
    (Mixtral's, DeepSeek's and Qwen's field names: a gated MLP of the expert width per expert); zeros if dense."""
    experts = kvcalc._first(text, "num_local_experts", "n_routed_experts", "num_experts")
    per_token = text.get("num_experts_per_tok")
    if not experts or not per_token:
        return 0, 0, 0.0, 0
    width = kvcalc._first(text, "moe_intermediate_size", "intermediate_size")
    moe_layers = layers - (text.get("first_k_dense_replace") or 0)
    return int(experts), int(per_token), float(moe_layers * experts * 3 * hidden * width), moe_layers


def estimate_params(s: kvcalc.AttentionSpec, hidden: int, vocab: int | None, tied: bool, text: dict) -> float:
    """Parameters of a dense decoder from its shape: attention projections, a gated MLP (or 4 x hidden), embeddings."""
    inner = kvcalc._field(text, "intermediate_size", "n_inner", "ffn_dim", as_name="intermediate_size")
    q_out = s.attention_heads * s.head_dim
    attention = hidden * q_out * 2 + 2 * hidden * s.kv_heads * s.head_dim
    mlp = 3 * hidden * inner if inner else 8 * hidden * hidden
    if not vocab:
        raise PlanError("The config gives no parameter count and no vocab_size, so the weights cannot be sized.")
    return float(s.layers * (attention + mlp) + vocab * hidden * (1 if tied else 2))


def load_models() -> dict[str, Model]:
    """Every preset as a planner model, keyed by its id."""
    return {p["id"]: model_from_config(p["config"], p["name"], p["params"], p.get("active_params"))
            for p in _raw_presets()}


def resolve_model(source) -> Model:
    """A preset id or name, a config.json path, a model folder, or a config dict, as a planner model."""
    if isinstance(source, Model):
        return source
    if isinstance(source, dict):
        return model_from_config(source, "from config", source.get("params") if isinstance(source.get("params"),
                                                                                             (int, float)) else None)
    if not isinstance(source, (str, Path)) or not str(source).strip():
        raise PlanError("Give a model as a preset id, a config.json path, a model folder or a config object.")
    text = str(source).strip()
    for p in _raw_presets():
        if text.lower() in (p["id"], p["name"].lower()):
            return model_from_config(p["config"], p["name"], p["params"], p.get("active_params"))
    path = Path(text)
    if text == "default" or (path.is_dir() and list(path.glob("*.safetensors"))):
        s = kvcalc.spec_from_model_folder(text)
        config = kvcalc.read_config_file(path if text != "default" else _default_dir())
        return model_from_config(config, s.name, s.params)
    if path.exists():
        return model_from_config(kvcalc.read_config_file(path), path.name if path.is_file() else path.name)
    raise PlanError(f"Unknown model {shapes._show(text)}: give a preset id ({', '.join(preset_ids())}), "
                    "a config.json path or a model folder.")


def _default_dir() -> Path:
    from engine.model.loader import default_model_dir

    return default_model_dir()


# --- the model of one step ------------------------------------------------------------------

def weight_bits(setup: Setup) -> float:
    if setup.bits_per_weight is not None:
        return shapes.number("bits_per_weight", setup.bits_per_weight, 0.5, 64)
    if setup.weights not in LEVEL_BITS:
        raise PlanError(f"Unknown weight precision {shapes._show(setup.weights)}: use one of {', '.join(LEVEL_BITS)} "
                        "or --bits-per-weight.")
    return LEVEL_BITS[setup.weights]


def weight_format(setup: Setup) -> str:
    """The kernel family the weights go through: a float format, int8/int4 for weight-only integer formats, or
    the local engine's integer level (its products multiply integers)."""
    if setup.bits_per_weight is None or setup.weights in INTEGER_LEVELS:
        return setup.weights
    bits = setup.bits_per_weight
    return "fp32" if bits >= 24 else "bf16" if bits >= 12 else "int8" if bits > 6 else "int4"


def peak_tflops(gpu: dict, dtype: str) -> float:
    """Dense peak at this dtype, falling back to the next wider format the GPU has."""
    table = gpu["peak_tflops"]
    for name in {"fp4": ("fp4", "fp8", "bf16"), "fp8": ("fp8", "bf16"), "int8": ("bf16",),
                 "int4": ("bf16",)}.get(dtype, (dtype, "bf16")):
        if table.get(name):
            return table[name]
    return table["fp32"]


def tp_degree(setup: Setup) -> int:
    return setup.tp if setup.tp is not None else setup.gpus // setup.pp


def all_reduce_us(setup: Setup, message_bytes: float) -> float:
    """One all-reduce of message_bytes over the tensor-parallel group (0 on one GPU)."""
    t = tp_degree(setup)
    if t == 1:
        return 0.0
    link = interconnects()[setup.interconnect]
    gbps = link_gbps(setup) * setup.efficiency.link
    hops = 2 * (t - 1) if link["topology"] == "ring" else 2
    return (setup.efficiency.collective_fixed_us + hops * link["hop_latency_us"]
            + 2 * (t - 1) / t * message_bytes / (gbps * 1e3))


def link_gbps(setup: Setup) -> float:
    link = interconnects()[setup.interconnect]
    if link["link"] == "network":
        return link["gbps_per_direction"]
    if link["link"] == "gpu":
        figure = setup.gpu["gpu_link"]["gbps_per_direction"]
        if figure is None:
            raise PlanError(f"The {setup.gpu['name']} has no GPU-to-GPU link ({setup.gpu['gpu_link']['name']}): "
                            "choose the pcie interconnect.")
        return figure
    return setup.gpu["host_link"]["gbps_per_direction"]


def per_gpu_params(setup: Setup, params: float, routed: float) -> float:
    """Parameters one GPU holds or reads of `params`, `routed` of them in routed experts: the routed ones split
    over the expert-parallel GPUs where there are several, the rest (and else all) over the tensor-parallel ones."""
    t = tp_degree(setup)
    return (params - routed) / t + routed / (setup.ep if setup.ep > 1 else t)


def all_to_all_us(setup: Setup, message_bytes: float) -> float:
    """Dispatching (or combining) a batch's routed token copies over the expert-parallel GPUs: each sends the
    (ep - 1) / ep of its share that lives elsewhere, all at once over its own link."""
    e = setup.ep
    if e == 1:
        return 0.0
    link = interconnects()[setup.interconnect]
    gbps = link_gbps(setup) * setup.efficiency.link
    return (setup.efficiency.collective_fixed_us + link["hop_latency_us"]
            + message_bytes / e * (e - 1) / e / (gbps * 1e3))


def pipeline_send_us(setup: Setup, message_bytes: float) -> float:
    if setup.pp == 1:
        return 0.0
    link = interconnects()[setup.interconnect]
    return (setup.pp - 1) * (setup.efficiency.collective_fixed_us + link["hop_latency_us"]
                             + message_bytes / (link_gbps(setup) * setup.efficiency.link * 1e3))


@dataclass(frozen=True)
class Work:
    """What one forward of a batch does, summed over its sequences: new tokens (rows), cached token-layers
    read (after sliding windows), attention key positions, sequences and the largest new-token count.
    `logits`: the rows the output head computes (None: each sequence's last row, as a prefill or a decode step
    needs; a verification of drafts needs every row)."""
    rows: int
    kv_token_layers: int
    key_positions: int
    sequences: int
    widest: int
    logits: int | None = None


def batch_work(spec: kvcalc.AttentionSpec, new_tokens, contexts) -> Work:
    """Work of a forward where sequence i adds new_tokens[i] after contexts[i] cached ones (a sequence with no
    cache reads none: its keys are its own new tokens)."""
    kv = keys = 0
    for n, c in zip(new_tokens, contexts):
        if c:
            kv += kvcalc.stored_token_layers(spec, c + n)
        keys += n * c + n * (n + 1) // 2
    return Work(rows=sum(new_tokens), kv_token_layers=kv, key_positions=keys, sequences=len(new_tokens),
                widest=max(new_tokens, default=0))


def step_buckets(setup: Setup, tokens: int, context: int, every_logit: bool = False) -> dict:
    """The five buckets (ms) of one forward over `tokens` new tokens per sequence after `context` cached ones;
    every_logit: the output head runs on every new token (a verification of drafts), else on the last."""
    one = batch_work(setup.model.spec, [tokens], [context])
    b = setup.batch
    return forward_buckets(setup, Work(one.rows * b, one.kv_token_layers * b, one.key_positions * b, b, tokens,
                                       logits=one.rows * b if every_logit else None))


def forward_buckets(setup: Setup, work: Work) -> dict:
    """The five buckets (ms) of one forward doing `work` (a decode step, a prefill, or a continuous batch of both)."""
    m, gpu, eff = setup.model, setup.gpu, setup.efficiency
    t = tp_degree(setup)
    read = read_params_at(m, work.rows)
    weight_bytes = per_gpu_params(setup, read, routed_read_params(m, work.rows)) * weight_bits(setup) / 8
    kv_read = (kvcalc.values_per_token_per_layer(m.spec, t) * work.kv_token_layers
               * kvcalc.bits_per_value(setup.kv_dtype) / 8)
    bandwidth = gpu["bandwidth_gbps"] * 1e9 / 1e3  # bytes per ms
    weights_ms, kv_ms = weight_bytes / eff.bandwidth / bandwidth, kv_read / eff.kv_bandwidth / bandwidth
    head = head_params(m)
    body_flops = 2 * (m.read_params() - head) * work.rows / t
    head_flops = 2 * head * (work.sequences if work.logits is None else work.logits) / t
    linear = body_flops + head_flops
    attention = 4 * m.spec.layers * m.spec.attention_heads * m.spec.head_dim * work.key_positions / t
    compute_eff = eff.compute if work.widest <= 1 else eff.prefill_compute
    peak = peak_tflops(gpu, compute_format(setup)) * compute_eff
    linear_ms = body_flops / (product_tflops(setup, work, peak) * 1e9) + head_flops / (peak * 1e9)
    # a device whose attention was timed apart from its products (a probed server's) gives its achieved rate
    attention_ms = (attention / (gpu["attention_tflops"] * 1e9) if gpu.get("attention_tflops")
                    else attention / (peak_tflops(gpu, attention_format(setup)) * compute_eff * 1e9))
    memory, flops = weights_ms + kv_ms, linear + attention
    # the products overlap their weights' reads and attention its cache's, but the two run as kernels of their own
    compute = (max(linear_ms - weights_ms, 0.0) + max(attention_ms - kv_ms, 0.0) if eff.overlap
               else linear_ms + attention_ms)
    dequant = dequant_ms(setup, weight_bytes / (weight_bits(setup) / 8))
    message = work.rows * m.hidden * ACT_BYTES
    moe_layers = m.moe_layers if setup.ep > 1 else 0  # their expert output travels by all-to-all instead
    physical_us = ((2 * m.spec.layers - moe_layers) * all_reduce_us(setup, message)
                   + 2 * moe_layers * all_to_all_us(setup, work.rows * m.experts_per_token * m.hidden * ACT_BYTES)
                   + pipeline_send_us(setup, message)
                   + eff.host_sync_us)
    kernels, layers_us = step_kernels(setup, work.widest, work.sequences)
    matvecs = m.spec.layers * eff.matvecs_per_layer + 1
    fixed_ms = (eff.step_fixed_us + kernels * eff.launch_us + matvecs * eff.matvec_us + layers_us) / 1e3
    gpu_ms = physical_us / 1e3 + memory + compute + dequant + fixed_ms
    # the engine prepares the next step on the host while the GPU runs this one: the GPU waits for what is left over;
    # where the same cores compute (no overlap), the host work adds to the step instead
    host_ms = work.sequences * eff.host_us_per_sequence / 1e3
    host_overlaps = eff.overlap if eff.host_overlap is None else eff.host_overlap
    host_wait = max(host_ms - gpu_ms, 0.0) if host_overlaps else host_ms
    return {"physical": physical_us / 1e3, "memory": memory, "compute": compute + dequant,
            "time": fixed_ms + host_wait, "decision": 0.0,
            "_bytes": weight_bytes + kv_read, "_weight_bytes": weight_bytes, "_flops": flops, "_attention_flops": attention,
            "_host_wait_ms": host_wait, "_roofline_ms": memory + compute}


def head_params(m: Model) -> float:
    """The output head's parameters (vocab x hidden, at most all read_params); 0 where the vocabulary is not known."""
    return min(float(m.vocab * m.hidden), m.read_params()) if m.vocab else 0.0


def product_tflops(setup: Setup, work: Work, peak: float) -> float:
    """The rate a forward's layer products reach: on a device whose calibration timed the model's layer products
    at prefill chunk rows (this machine, in float32), that rate at the forward's rows for a prefill-shaped
    forward (interpolated between the rows timed, the nearest figure beyond them); else `peak`."""
    curve = setup.gpu.get("prefill_tflops", {}).get(compute_format(setup))
    if not curve or work.widest <= 1:
        return peak
    points = sorted(curve.items())
    rows = min(max(work.rows, points[0][0]), points[-1][0])
    for (low, low_rate), (high, high_rate) in zip(points, points[1:]):
        if rows <= high:
            return low_rate + (high_rate - low_rate) * (rows - low) / (high - low)
    return points[-1][1]


def compute_format(setup: Setup) -> str:
    """The tensor-core format the matrix products run in (the local integer levels: their own kernels')."""
    fmt = weight_format(setup)
    return "fp4" if fmt in FP4 else fmt if fmt in ("fp32", "fp8", *INTEGER_LEVELS) else "bf16"


def attention_format(setup: Setup) -> str:
    """The tensor-core format attention runs in: its cache's (an FP8 or FP4 cache is read into FP8 products, an
    integer one is dequantized to 16 bits), whatever format the weights are in."""
    kv = setup.kv_dtype
    return "fp32" if kv == "fp32" else "fp8" if kv == "fp8" or kv in FP4 else "bf16"


def read_params_at(m: Model, rows: int) -> float:
    """Parameters a forward of `rows` tokens reads (see Model.read_params). A mixture of experts reads each expert
    that at least one token picks: with k of E experts per token, an expert is left out by all rows with
    probability (1 - k / E) ^ rows, so the routed weights read are their total x (1 - (1 - k / E) ^ rows)
    (routing taken as uniform; 1 row reads the active k)."""
    if not m.experts:
        return m.read_params()
    return m.read_params() - m.expert_params * m.experts_per_token / m.experts + routed_read_params(m, rows)


def routed_read_params(m: Model, rows: int) -> float:
    """The routed experts' parameters a forward of `rows` tokens reads (see read_params_at); 0 for a dense model."""
    if not m.experts:
        return 0.0
    return m.expert_params * (1 - (1 - m.experts_per_token / m.experts) ** max(rows, 1))


def step_kernels(setup: Setup, tokens: int, sequences: int = 1) -> tuple[int, float]:
    """(dispatches of a step over `tokens` tokens per sequence, microseconds of its layers' work apart from them):
    a decode step that runs its layers in one call dispatches the few operations around that call only, and does
    each layer's own work (norms, rotary, cache append, attention) once per sequence."""
    eff, layers = setup.efficiency, setup.model.spec.layers
    if tokens == 1 and eff.one_call_layer_us is not None:
        return 4, sequences * layers * eff.one_call_layer_us
    return layers * eff.kernels_per_layer + 4, 0.0


def dequant_ms(setup: Setup, weights: float) -> float:
    """Unpacking weight-only formats on the vector units (none where the GPU computes in the stored format)."""
    fmt = weight_format(setup)
    if (fmt == "fp8" and setup.gpu["peak_tflops"].get("fp8")) or (fmt in FP4 and setup.gpu["peak_tflops"].get("fp4")):
        return 0.0
    ops = setup.efficiency.dequant_ops.get(fmt, 0.0)
    return weights * ops / (setup.gpu["peak_tflops"]["fp32"] * 1e12) * 1e3 if ops else 0.0


def speculative(setup: Setup, context: int) -> dict:
    """Buckets per emitted token with speculative decoding: k drafts at draft_cost x a plain step each, one
    verification of k + 1 tokens, and (1 - a^(k+1)) / (1 - a) tokens emitted per step on average."""
    a, k = setup.speculative_acceptance, setup.speculative_draft_length
    emitted = k + 1 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)
    plain = step_buckets(setup, 1, context)
    verify = step_buckets(setup, k + 1, context, every_logit=True)
    useful = step_buckets(setup, max(1, round(emitted)), context, every_logit=True)
    waste = 1 - useful["_roofline_ms"] / verify["_roofline_ms"] if verify["_roofline_ms"] else 0.0
    draft = k * setup.speculative_draft_cost * sum(plain[b] for b in BUCKETS)
    rejected_share = (k - (emitted - 1)) / k
    buckets = {b: verify[b] for b in BUCKETS}
    for b in ("memory", "compute"):
        buckets["decision"] += buckets[b] * waste
        buckets[b] *= 1 - waste
    buckets["time"] += draft * (1 - rejected_share)
    buckets["decision"] += draft * rejected_share
    return {"buckets": {b: v / emitted for b, v in buckets.items()}, "tokens_per_step": emitted}


NODE_GPUS = 8  # the GPUs a GPU-to-GPU link joins where the data sheet states no limit: one server node


def check_setup(setup: Setup) -> Setup:
    """The setup with its counts checked; one sentence for what is wrong and what is allowed."""
    whole = shapes.whole
    gpus, pp = whole("gpus", setup.gpus), whole("pp", setup.pp)
    tp = whole("tp", setup.tp) if setup.tp is not None else None
    if tp is None and gpus % pp:
        raise PlanError(f"{gpus} GPUs do not split into {pp} pipeline stages: make the GPU count a multiple of --pp.")
    if (tp or gpus // pp) * pp > gpus:
        raise PlanError(f"Tensor parallel {tp} x pipeline parallel {pp} needs {tp * pp} GPUs but only {gpus} are "
                        "given: keep tp x pp at most the GPU count.")
    if setup.interconnect not in interconnects():
        raise PlanError(f"Unknown interconnect {shapes._show(setup.interconnect)}: use one of "
                        f"{', '.join(interconnects())}.")
    stated = setup.gpu["gpu_link"].get("max_gpus")
    most = stated or NODE_GPUS
    if interconnects()[setup.interconnect]["link"] == "gpu" and (tp or gpus // pp) > most:
        joins = "joins" if stated else "is assumed (no limit stated for it) to join"
        raise PlanError(f"The {setup.gpu['name']}'s {setup.gpu['gpu_link']['name']} {joins} at most {most} GPUs, "
                        "one node: use the pcie interconnect for tensor parallel over more.")
    if (tp or gpus // pp) > 1 or pp > 1:
        link_gbps(setup)  # refuses an interconnect the GPU does not have
    kvcalc.bits_per_value(setup.kv_dtype)
    weight_bits(setup)
    for name in ("batch", "prompt_tokens", "new_tokens"):
        whole(name, getattr(setup, name))
    if setup.speculative_acceptance is not None:
        shapes.fraction("speculative_acceptance", setup.speculative_acceptance)
        whole("draft_length", setup.speculative_draft_length)
        shapes.fraction("speculative_draft_cost", setup.speculative_draft_cost, 0.0, 10.0)
    t = tp or gpus // pp
    ep = whole("ep", setup.ep)
    if ep > 1 and not setup.model.experts:
        raise PlanError(f"{setup.model.name} has no routed experts to spread: expert parallelism needs a mixture of "
                        "experts.")
    if ep > 1 and (gpus % ep or setup.model.experts % ep):
        raise PlanError(f"Expert parallel {ep} must divide the {gpus} GPUs and the model's {setup.model.experts} "
                        "experts.")
    if t > 1 and setup.model.spec.attention_heads % t:
        raise PlanError(f"Tensor parallel {t} does not divide the model's {setup.model.spec.attention_heads} attention "
                        "heads: choose a degree that divides them.")
    if pp > setup.model.spec.layers:
        raise PlanError(f"{pp} pipeline stages exceed the model's {setup.model.spec.layers} layers.")
    return setup


def memory_per_gpu(setup: Setup, batch: int | None = None) -> dict:
    """Weights (all of them: every expert is resident) and the KV cache at the full context, per GPU."""
    t, m = tp_degree(setup), setup.model
    weights = per_gpu_params(setup, m.params, m.expert_params) * weight_bits(setup) / 8 / setup.pp
    context = setup.prompt_tokens + setup.new_tokens
    kv = kvcalc.kv_bytes(m.spec, context, setup.kv_dtype, batch or setup.batch, t) / setup.pp
    capacity = setup.gpu["memory_mib"] * 2**20
    per_sequence = kvcalc.kv_bytes(m.spec, context, setup.kv_dtype, 1, t) / setup.pp
    free = capacity - weights - RESERVE_BYTES
    return {"weights_bytes": weights, "kv_bytes": kv, "reserve_bytes": RESERVE_BYTES,
            "total_bytes": weights + kv + RESERVE_BYTES, "capacity_bytes": capacity,
            "fits": weights + kv + RESERVE_BYTES <= capacity,
            "largest_batch": int(free // per_sequence) if free > 0 and per_sequence else 0}


def plan(setup: Setup, require_fit: bool = False) -> dict:
    """Everything `python -m engine plan --json` prints, for one configuration."""
    check_setup(setup)
    context = setup.prompt_tokens + setup.new_tokens // 2  # the mean context over the generation
    if setup.speculative_acceptance is not None:
        result = speculative(setup, context)
        buckets, per_step = result["buckets"], result["tokens_per_step"]
    else:
        step = step_buckets(setup, 1, context)
        buckets, per_step = {b: step[b] for b in BUCKETS}, 1.0
    prefill = step_buckets(setup, setup.prompt_tokens, 0)
    memory = memory_per_gpu(setup)
    if require_fit and not memory["fits"]:
        raise PlanError(f"{setup.model.name} does not fit: it needs {kvcalc.human(memory['total_bytes'])} per GPU and "
                        f"a {setup.gpu['name']} holds {kvcalc.human(memory['capacity_bytes'])}; add GPUs or use "
                        "fewer bits per weight.")
    decode_ms = sum(buckets.values())
    return {
        "model": setup.model.name, "gpu": setup.gpu["id"], "gpus": setup.gpus, "tp": tp_degree(setup),
        "pp": setup.pp, "interconnect": setup.interconnect, "weights": setup.weights,
        "bits_per_weight": weight_bits(setup), "kv_dtype": setup.kv_dtype, "batch": setup.batch,
        "prompt_tokens": setup.prompt_tokens, "new_tokens": setup.new_tokens,
        "decode_ms_per_token": decode_ms, "tokens_per_s_per_user": 1e3 / decode_ms,
        "tokens_per_s_total": setup.batch * 1e3 / decode_ms,
        "prefill_ms": sum(prefill[b] for b in BUCKETS),
        "distances_ms": buckets, "prefill_distances_ms": {b: prefill[b] for b in BUCKETS},
        "tokens_per_step": per_step,
        "memory_per_gpu_bytes": memory["total_bytes"], "fits": memory["fits"],
        "largest_batch": memory["largest_batch"], "memory": memory,
        "pipeline_idle_fraction": (setup.pp - 1) / setup.pp,
        "estimate": True,
    }


def gpu_sweep(setup: Setup, counts=(1, 2, 4, 8)) -> list[dict]:
    """Tokens/s per user against GPU count (tensor parallel over all of them), where the model allows it."""
    rows = []
    for n in counts:
        s = replace(setup, gpus=n, tp=None, pp=1)
        try:
            r = plan(s)
        except PlanError:
            continue
        rows.append({"gpus": n, "tokens_per_s_per_user": r["tokens_per_s_per_user"], "fits": r["fits"],
                     **{f"{b}_ms": v for b, v in r["distances_ms"].items()}})
    return rows


def batch_sweep(setup: Setup, batches=(1, 2, 4, 8, 16, 32, 64, 128, 256)) -> list[dict]:
    """Per-user latency against aggregate throughput over batch sizes."""
    rows = []
    for b in batches:
        r = plan(replace(setup, batch=b))
        rows.append({"batch": b, "decode_ms_per_token": r["decode_ms_per_token"],
                     "tokens_per_s_total": r["tokens_per_s_total"], "fits": r["fits"]})
    return rows


def formulas(setup: Setup) -> dict:
    """Each bucket's formula with this configuration's numbers, for the page's expander and the CLI."""
    t, eff, gpu, m = tp_degree(setup), setup.efficiency, setup.gpu, setup.model
    context = setup.prompt_tokens + setup.new_tokens // 2
    step = step_buckets(setup, 1, context)
    link = interconnects()[setup.interconnect]
    ar = all_reduce_us(setup, setup.batch * m.hidden * ACT_BYTES)
    return {
        "memory": f"({kvcalc.human(step['_weight_bytes'])} of weights / {eff.bandwidth} + "
                  f"{kvcalc.human(step['_bytes'] - step['_weight_bytes'])} of KV cache / {eff.kv_bandwidth}, read per "
                  f"GPU) / {gpu['bandwidth_gbps']:,} GB/s = {step['memory']:.3f} ms",
        "compute": (f"max({step['_flops'] - step['_attention_flops']:.3g} product FLOPs per GPU / ({compute_format(setup)} "
                    f"peak x {eff.compute}) - weight read, 0) + max({step['_attention_flops']:.3g} attention FLOPs / "
                    f"({attention_format(setup)} peak x {eff.compute}) - KV read, 0)" if eff.overlap else
                    f"{step['_flops'] - step['_attention_flops']:.3g} product FLOPs / ({compute_format(setup)} peak x "
                    f"{eff.compute}) + {step['_attention_flops']:.3g} attention FLOPs / ({attention_format(setup)} peak "
                    f"x {eff.compute}) (the same cores read and multiply: no overlap)")
                   + f" + dequantization = {step['compute']:.3f} ms",
        "physical": (f"{2 * m.spec.layers - m.moe_layers} all-reduces ({link['topology']}, {t} GPUs: {ar:.1f} us) + "
                     f"2 x {m.moe_layers} expert all-to-alls over {setup.ep} GPUs "
                     f"({all_to_all_us(setup, setup.batch * m.experts_per_token * m.hidden * ACT_BYTES):.1f} us) + "
                     if setup.ep > 1 else
                     f"2 x {m.spec.layers} layers x all-reduce ({link['topology']}, {t} GPUs: {ar:.1f} us) + ")
                    + f"{setup.pp - 1} pipeline sends + {eff.host_sync_us:g} us host round trip = {step['physical']:.3f} ms",
        "time": f"{eff.step_fixed_us:g} us per step + {step_kernels(setup, 1)[0]} kernels x "
                f"{eff.launch_us:g} us" + (f" + {m.spec.layers * eff.matvecs_per_layer + 1} matrix-vector products x "
                                          f"{eff.matvec_us:.1f} us" if eff.matvec_us else "")
                + (f" + {setup.batch} sequences x {m.spec.layers} layers in one call x {eff.one_call_layer_us:g} us"
                   if eff.one_call_layer_us is not None else "")
                + (f" + {step['_host_wait_ms']:.3f} ms waiting for the host's {eff.host_us_per_sequence:g} us per sequence"
                   if step["_host_wait_ms"] else "")
                + f" = {step['time']:.3f} ms",
        "decision": "speculative drafts the target rejects and their share of the verification (0 without "
                    "speculative decoding)",
        **speculative_formula(setup, context),
    }


def speculative_formula(setup: Setup, context: int) -> dict:
    """With speculative decoding the buckets above are of a plain step; this says how a token's are made."""
    if setup.speculative_acceptance is None:
        return {}
    a, k = setup.speculative_acceptance, setup.speculative_draft_length
    emitted = speculative(setup, context)["tokens_per_step"]
    return {"speculative": f"a step drafts {k} tokens at {setup.speculative_draft_cost:g} x a plain step each and verifies "
                           f"{k + 1} at once; it emits (1 - {a:g}^{k + 1}) / (1 - {a:g}) = {emitted:.2f} tokens, so "
                           f"each bucket per token = the verification step's bucket / {emitted:.2f}, with the "
                           "rejected drafts' share moved to decision"}


def server_work_split(model, gpu_id: str, context_tokens: int, batch: int = 1, weights: str = "bf16",
                      kv_dtype: str = "bf16") -> dict:
    """Fractions of a server's decode step that are memory, compute and fixed time on this GPU (they sum to 1)."""
    shapes.whole("context", context_tokens, 0)
    setup = check_setup(Setup(model=resolve_model(model), gpu=get_gpu(gpu_id), weights=weights,
                              kv_dtype=kv_dtype, batch=batch))
    step = step_buckets(setup, 1, context_tokens)
    total = step["memory"] + step["compute"] + step["time"]
    return {b: step[b] / total for b in ("memory", "compute", "time")}


# --- this machine -----------------------------------------------------------------------------

ENGINE_LEVELS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
# the local levels whose kernels fetch each block of weights ahead of the products that need it (int4.cpp's
# prefetch_pair_block), so their products run while the weights stream in
PREFETCHING_LEVELS = ("int4-dyn",)


def decode_bandwidth_gbps(calibration: dict) -> float:
    """The read bandwidth a decode step's matrix-vector products reach here: the calibration's figure
    for the project's small-rows kernel (what fp32 decode steps run), else PyTorch's GEMV, else the
    peak. The peak is the best of several ways to stream memory, a limit no run may beat; a prediction
    needs what the decode's own kernel achieves on cold weights, which can be less."""
    methods = calibration.get("memory_methods_gbps") or {}
    return methods.get("small_rows_kernel") or methods.get("gemv") or calibration["memory_gbps"]


def local_device(calibration: dict, memory_bytes: float = 2**40, cache_gbps: float | None = None) -> dict:
    """This machine as a planner GPU: the bandwidth its decode kernel reaches (cache_gbps where a step's bytes stay
    in the last-level cache: cache_read_gbps), its calibrated matmul
    peaks, the rate of the model's layer products at prefill chunk rows where the calibration timed them (a
    calibration of version 3 did not: its prefills take the peak), the integer levels' rates (their products'
    peak: the rate their kernels reached at the fewest prefill rows timed, the nearest to a decode step's few
    rows), and no links."""
    gflops = calibration["matmul_gflops"]
    peaks = {ENGINE_LEVELS.get(k, k): v / 1e3 for k, v in gflops.items()}
    peaks.setdefault("fp32", gflops.get("float32", 1.0) / 1e3)
    prefill = {ENGINE_LEVELS.get(k, k): {int(rows): v / 1e3 for rows, v in by_rows.items()}
               for k, by_rows in (calibration.get("prefill_gflops") or {}).items()}
    peaks.update({level: by_rows[min(by_rows)] for level, by_rows in prefill.items() if level in INTEGER_LEVELS})
    bandwidth = cache_gbps if cache_gbps is not None else decode_bandwidth_gbps(calibration)
    return {"id": "local", "name": calibration.get("device_key", "this machine"),
            "memory_mib": memory_bytes / 2**20, "bandwidth_gbps": bandwidth,
            "peak_tflops": peaks, "prefill_tflops": prefill,
            "gpu_link": {"name": "none", "gbps_per_direction": None}, "host_link": {"name": "none",
                                                                                  "gbps_per_direction": None}}


def one_call_decode(calibration: dict, weights: str, kv_dtype: str | None = None) -> bool:
    """Whether this machine's decode steps run every layer in one call to the C++ kernels: a float32
    model (the quantized levels among them: their runs compute in float32) or an integer level, with its KV
    cache in float32 or half precision (which the kernels widen as they read it), where the calibration timed
    the kernels' small-rows product (so they were built)."""
    return (weights in ("fp32", *INTEGER_LEVELS) and kv_dtype in (None, "fp32", "bf16", "fp16")
            and "small_rows_kernel" in (calibration.get("memory_methods_gbps") or {}))


def local_efficiency(calibration: dict, weights: str = "fp32", kv_dtype: str | None = None,
                     cached: bool = False) -> Efficiency:
    """The calibration already measures achieved figures (the decode kernel's bandwidth, matmul peak, one
    dispatch, one matrix-vector product's own cost), so the factors are 1 and the fixed cost is the calibrated
    dispatch per operation and cost per product plus the loop's host work (a part of it each sequence's); a
    decode step that runs in one call pays its layers' own work and the Python around the call instead of
    dispatches. The CPU's cores both stream the weights and multiply, so a step's multiplying adds to its reading
    (no overlap): a batch of B sequences costs B times the products' FLOPs at the calibrated peak beyond the
    weights' trip; but the int4-dyn level's kernels fetch each block of weights ahead of the products that need
    it, so its products run while the weights stream in (overlap), the host's work still adding. Where the
    step's bytes stay in the last-level cache (`cached`), a product's own cost is the one timed on cached
    weights, and the layers' own work runs on caches the weights no longer flush."""
    one_call = one_call_decode(calibration, weights, kv_dtype)
    matvec_us = calibration["cache_read"]["matvec_call_us"] if cached else calibration.get("matvec_call_us", 0.0)
    layer_us = LOCAL["one_call_layer_cached_us"] if cached else LOCAL["one_call_layer_us"]
    return Efficiency(bandwidth=1.0, kv_bandwidth=1.0, compute=1.0, prefill_compute=1.0,
                      overlap=weights in PREFETCHING_LEVELS, host_overlap=False, launch_us=calibration["dispatch_us"],
                      kernels_per_layer=LOCAL["ops_per_layer"], matvec_us=matvec_us,
                      one_call_layer_us=layer_us if one_call else None,
                      step_fixed_us=(LOCAL["one_call_host_us"] if one_call else LOCAL["host_us"])
                      - LOCAL["host_us_per_sequence"], host_sync_us=0.0,
                      host_us_per_sequence=LOCAL["host_us_per_sequence"])


def local_plan(model, calibration: dict, weights: str = "fp32", kv_dtype: str | None = None,
               prompt_tokens: int = 32, new_tokens: int = 64, bits_per_weight: float | None = None,
               batch: int = 1) -> dict:
    """The planner's prediction for a run on this machine with this calibration, batch sequences decoded
    together; bytes_per_token is what a decode token moves: its share of the step's weights, its own cache. A
    decode step whose bytes (weights and caches) stay in the last-level cache is planned as read from there at the
    rate cache_read_gbps gives for them (each step reads the same bytes as the one before); read_gbps: the rate
    planned."""
    kv_dtype = kv_dtype or ("fp32" if weights in INTEGER_LEVELS else weights)

    def setup_for(cache_gbps: float | None) -> Setup:
        return Setup(model=resolve_model(model), gpu=local_device(calibration, cache_gbps=cache_gbps),
                     weights=weights, bits_per_weight=bits_per_weight, kv_dtype=kv_dtype, prompt_tokens=prompt_tokens,
                     new_tokens=new_tokens, batch=batch,
                     efficiency=local_efficiency(calibration, weights, kv_dtype, cache_gbps is not None))

    context = prompt_tokens + new_tokens // 2  # plan()'s mean context
    cache_gbps = cache_read_gbps(calibration, step_buckets(setup_for(None), 1, context)["_bytes"])
    setup = setup_for(cache_gbps)
    step = step_buckets(setup, 1, context)
    return {**plan(setup), "bytes_per_token": step["_bytes"] / batch, "from_cache": cache_gbps is not None,
            "read_gbps": setup.gpu["bandwidth_gbps"]}


def plan_for_run(run: dict, calibration: dict) -> dict:
    """local_plan for a stored run's configuration (a row of the runs table as a dict): the model's folder,
    its dtype (or its integer level, whose products multiply integers), the bits per weight its forward really
    read, its KV precision, lengths and batch (a batched sequence's decode steps' mean, 1 for a lone run)."""
    from engine.paths import DEFAULT_MODEL_NAME

    metrics = json.loads(run["metrics"]) if isinstance(run.get("metrics"), str) else (run.get("metrics") or {})
    model = resolve_model("default" if run["model"] == DEFAULT_MODEL_NAME else run["model"])
    read_bytes = metrics.get("weight_bytes_per_forward")
    bits = read_bytes * 8 / model.read_params() if read_bytes else None
    level, dtype = weight_level(run.get("weights") or ""), ENGINE_LEVELS.get(run["dtype"], "fp32")
    weights = level if level in INTEGER_LEVELS and bits else dtype
    return local_plan(model, calibration, weights=weights, kv_dtype=metrics.get("kv_dtype") or dtype,
                      prompt_tokens=int(run["n_prompt_tokens"]), new_tokens=max(int(run["n_new_tokens"] or 1), 1),
                      bits_per_weight=bits, batch=max(round(metrics.get("batch_mean") or 1), 1))
