"""The run specification: everything that decides what one run does, as plain serialisable data.

The command line, the worker, the pages, sweeps and benchmarks all describe a run as a RunSpec;
prepare(spec) (engine.run.prepare) turns it into a loaded model and Generation runs its GenConfig."""
from __future__ import annotations

import math
import sys
from dataclasses import MISSING, asdict, dataclass, field, fields

from engine.dtypes import KV_CHOICES
from engine.errors import UserError
from engine.switches import names

MAX_NEW_TOKENS_CAP = 4096
MAX_TEMPERATURE = 100.0
MAX_SEED = 2**64 - 1  # torch generators take an unsigned 64-bit seed
STALL_TIMEOUT_S = 120.0  # served: the longest wait for the next token before the run is cut short
MAX_WAIT_S = 86_400.0  # served: the most a stall timeout or a deadline may be
DEADLINE_PER_TOKEN_S = 1.0  # served: without --deadline a run may take the stall timeout plus this per token
# Sequences a batch holds. A decode step in one kernel call keeps each row's arithmetic independent of the rows
# beside it at any size, so a sequence decodes the tokens it decodes alone; the modules' path (another KV precision,
# hooks on modules) runs float32 products above 24 rows in PyTorch's GEMM, whose rows may differ in the last bits.
# The cap is twice vLLM's CPU server's default (engine/serve/vllm.py MAX_NUM_SEQS): at the integer levels a step of
# the default model's 128 rows leaves room within a 100 ms time per token, so that default would end a load sweep
# before the machine does. A sweep that sets the two side by side gives the server the same cap (bench/batching.py).
MAX_BATCH = 256

# What a served run cannot honour: the server decides these, so a served spec that sets them is refused
# (field -> what the user asked for, in words). RunSpec.check reads it, for the command line and the pages.
SERVED_CANNOT = {
    "kv_cache": ("turning the KV cache off", True), "top_k": ("top-k sampling", 0),
    "ignore_eos": ("ignoring the end of text", False), "speculative": ("speculative decoding", "none"),
    "kv_dtype": ("a KV-cache precision", "auto"), "weights": ("a weight level", "fp32"),
    "sparsity": ("activation sparsity", 0.0), "model": ("a local model", "default"),
    "users": ("several users in one batch", 1),
}
LOCAL_CANNOT = {"endpoint": ("a server address", None), "served_model": ("a served model name", None),
                "api_key_env": ("an API key variable", None), "gpu": ("the server's GPU", None),
                "timeout_s": ("a stall timeout", STALL_TIMEOUT_S), "deadline_s": ("a deadline", None)}


class GenerationError(UserError):
    """Bad input for a generation."""


@dataclass(frozen=True)
class Limit:
    """The range a numeric setting accepts, and how a person calls it."""

    low: float
    high: float
    whole: bool
    label: str

    def check(self, value) -> None:
        """Raise GenerationError with one sentence when value is out of range (or not a whole number)."""
        if self.whole:
            _check_int(self.label, value, int(self.low), int(self.high))
        else:
            _check_number(self.label, value, self.low, self.high, f"between {self.low:g} and")


# The one table of the generation settings' limits: GenConfig.check, the command line and the Live page read it.
LIMITS = {
    "max_new_tokens": Limit(1, MAX_NEW_TOKENS_CAP, True, "max_new_tokens"),
    "temperature": Limit(0.0, MAX_TEMPERATURE, False, "temperature (0: greedy)"),
    "top_p": Limit(0.01, 1.0, False, "top_p"),
    "top_k": Limit(0, 1_000_000, True, "top_k (0: off)"),
    "seed": Limit(0, MAX_SEED, True, "The random seed"),
    "sparsity": Limit(0.0, 0.9, False, "Sparsity"),
    "users": Limit(1, MAX_BATCH, True, "users"),
}


@dataclass
class GenConfig:
    """How to generate: the prompt, sampling, stopping, KV cache and speculative settings."""

    prompt: str
    max_new_tokens: int = 64
    kv_cache: bool = True
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    raw: bool = False
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # for benchmarks: always produce max_new_tokens
    speculative: str = "none"  # speculative method (engine.switches.speculative.METHODS)
    speculative_k: int = 4  # tokens drafted per step (the starting length when adaptive)
    adaptive: bool = False
    draft_model: str | None = None  # for speculative="draft": self-int8, self-exit:K, or a model id or folder
    max_ngram: int = 3  # prompt lookup: the longest n-gram matched; lookahead: the n-gram size N
    window: int = 4  # for speculative="lookahead": W, the columns of the lookahead branch
    guesses: int = 4  # for speculative="lookahead": G, the most n-grams verified per step
    kv_dtype: str = "auto"  # KV-cache precision: auto (the weights' compute dtype), fp32, bf16 or fp16

    def check(self) -> None:
        """Raise GenerationError with one sentence for the first setting that cannot run."""
        # the shipped names stand for the registry until it is loaded, so a refusal imports no torch
        registry = getattr(sys.modules.get("engine.switches.speculative"), "METHODS", None)
        methods = list(registry) if registry else list(names.METHOD_HELP)
        sampling = [n for n, m in registry.items() if m.samples] if registry else list(names.SAMPLING_METHODS)
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise GenerationError("The prompt is empty: type something for the model to continue.")
        for text in [self.prompt, *self.stop]:
            _check_text(text)
        for name in ("max_new_tokens", "temperature", "top_p", "top_k"):
            LIMITS[name].check(getattr(self, name))
        if self.seed is not None:
            LIMITS["seed"].check(self.seed)
        if self.speculative not in methods:
            raise GenerationError(f"Unknown speculative method '{self.speculative}': use one of {', '.join(methods)}.")
        _check_int("The draft length K", self.speculative_k, 1, names.MAX_K)
        if self.kv_dtype not in KV_CHOICES:
            raise GenerationError(f"Unknown KV-cache precision '{self.kv_dtype}': use one of {', '.join(KV_CHOICES)}.")
        if self.speculative not in sampling and self.speculative != "none" and self.temperature != 0:
            raise GenerationError("Prompt lookup, lookahead and Jacobi decoding run greedy here: set the temperature "
                                  "to 0, or sample with a draft model.")


@dataclass
class RunSpec:
    """One run: where the model runs and at which settings, and how to generate."""

    gen: GenConfig
    model: str = "default"  # 'default', a local folder or a Hugging Face id
    device: str = "auto"
    weights: str = "fp32"  # weight precision level (engine.switches.quant.LEVELS)
    group_size: int = 32  # for levels that quantize in groups (int4-wo)
    sparsity: float = 0.0  # target activation sparsity, 0 to 0.9
    sparsity_mode: str = "mask"  # mask, skip or 2:4
    backend: str = "local"  # local: this machine's engine; served: an OpenAI-compatible server
    endpoint: str | None = None  # served: the server's base URL
    served_model: str | None = None  # served: the model name the server knows
    api_key_env: str | None = None  # served: the environment variable holding the API key (never the key)
    gpu: str | None = None  # served: the GPU the server runs on, for the planner's memory/compute split
    timeout_s: float = STALL_TIMEOUT_S  # served: the longest wait for the next token (the stall timer)
    deadline_s: float | None = None  # served: the most the whole run may take (default: derived from the budget)
    tag: str | None = None  # stored with the run, so the page that asked for it finds it again (story:memory:fp32)
    users: int = 1  # sequences decoded together: the prompt and users - 1 others (engine.run.local.BatchRun)

    def check(self) -> None:
        self.gen.check()
        if self.backend not in ("local", "served"):
            raise GenerationError(f"Unknown backend '{self.backend}': use local or served.")
        LIMITS["sparsity"].check(self.sparsity)
        LIMITS["users"].check(self.users)
        _check_number("The stall timeout", self.timeout_s, 1e-3, MAX_WAIT_S, "a number of seconds above 0, at most")
        if self.deadline_s is not None:
            _check_number("The deadline", self.deadline_s, 1e-3, MAX_WAIT_S, "a number of seconds above 0, at most")
        if self.backend == "served":
            if not self.endpoint:
                raise GenerationError("A served run needs the server's URL (--endpoint).")
            from engine.address import api_root  # the address is refused before anything is opened

            try:
                api_root(self.endpoint)
            except UserError as exc:  # the spec's own error, which the pages catch
                raise GenerationError(str(exc)) from None
            self._refuse(SERVED_CANNOT, "A served run", "run it on the local engine")
        else:
            from engine.model.folder import local_folder  # a wrong folder is refused before the model stack loads

            try:
                local_folder(self.model)
            except UserError as exc:
                raise GenerationError(str(exc)) from None
            self._refuse(LOCAL_CANNOT, "A local run", "send the run to a server")
            if self.users > 1:
                check_batchable(self.gen, self.sparsity)
        if self.tag is not None and (not isinstance(self.tag, str) or not 0 < len(self.tag) <= 200):
            raise GenerationError(f"A run's tag is a text of 1 to 200 characters, not {self.tag!r}.")

    def _refuse(self, cannot: dict, run: str, instead: str) -> None:
        """One sentence naming every setting in `cannot` that differs from its default: the one place a
        backend refuses what it cannot do, for the command line and the pages alike."""
        asked = [words for name, (words, default) in cannot.items()
                 if (getattr(self.gen, name) if hasattr(self.gen, name) else getattr(self, name)) != default]
        if asked:
            raise GenerationError(f"{run} cannot honour {', '.join(asked)}: leave {'it' if len(asked) == 1 else 'them'}"
                                  f" out, or {instead}.")

    @property
    def deadline(self) -> float:
        """Seconds the whole served run may take: the explicit deadline, else the stall timeout plus
        DEADLINE_PER_TOKEN_S for each token of the budget."""
        return self.deadline_s or self.timeout_s + DEADLINE_PER_TOKEN_S * self.gen.max_new_tokens

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RunSpec:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known and k != "gen"}, gen=GenConfig(**gen_settings(data["gen"])))


def check_batchable(cfg: GenConfig, sparsity: float = 0.0) -> None:
    """Raise GenerationError naming why these settings cannot decode in a batch, if they cannot."""
    if not cfg.kv_cache:
        raise GenerationError("A batch decodes each sequence from its own KV cache: turn the KV cache on, or use one "
                              "user.")
    if cfg.speculative != "none":
        raise GenerationError("Speculative decoding verifies one sequence's guesses per forward here, so it does not "
                              "batch: set the speculative method to none, or use one user.")
    if sparsity:
        raise GenerationError("Activation sparsity skips the weight rows one token leaves idle, and a batch's tokens "
                              "leave different rows idle, so it does not batch: set sparsity to 0, or use one user.")


# GenConfig fields that runs recorded before their rename store under their earlier name
RENAMED = {"spec": "speculative", "spec_k": "speculative_k"}


def gen_settings(data: dict) -> dict:
    """The GenConfig fields among data's keys, those stored under an earlier name (RENAMED) under today's."""
    known = {f.name for f in fields(GenConfig)}
    named = {RENAMED.get(key, key): value for key, value in data.items()}
    return {key: value for key, value in named.items() if key in known}


# GenConfig's and RunSpec's defaults by field name, for the command line's and the Live page's fields
DEFAULTS = {f.name: f.default for cls in (GenConfig, RunSpec) for f in fields(cls) if f.default is not MISSING}


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_number(name: str, value, low: float, high: float, allowed: str) -> None:
    if not _finite(value) or not low <= value <= high:
        raise GenerationError(f"{name} must be {allowed} {high:g}, not {value}.")


def _check_int(name: str, value, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise GenerationError(f"{name} must be a whole number between {low} and {high}, not {value}.")


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise GenerationError("The prompt or a stop string is not valid UTF-8 text: pass it as UTF-8.") from None
