"""What a model argument names, and what a local model folder must hold before any model library sees it:
checked with nothing heavy imported, so a wrong folder is one sentence at once rather than after seconds of
loading torch and transformers."""
from __future__ import annotations

import json
from pathlib import Path

from engine.errors import UserError, first_line
from engine.paths import DEFAULT_MODEL_NAME

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
CONFIG_LIMIT_BYTES = 1 << 20  # a model's config.json is a few kB


class ModelError(UserError):
    """A model could not be found or loaded."""


def is_default(model_id: str | None) -> bool:
    return model_id in (None, "", "default", DEFAULT_MODEL_NAME)


def local_folder(model_id: str | None) -> Path | None:
    """The local folder model_id names, checked; None for the default model and for Hugging Face ids. A path
    that is not there, or a folder that is not a model's, is a ModelError."""
    if is_default(model_id):
        return None
    path = Path(model_id).expanduser()
    if path.exists():
        check_model_folder(path, model_id)
        return path
    if model_id.startswith((".", "/", "~")):
        raise ModelError(f"No model folder at '{model_id}'.")
    return None


def check_model_folder(path: Path, model_id: str) -> None:
    """A local folder must hold a JSON config.json and weights before transformers sees it, so that
    each way it can be wrong is named in one sentence."""
    config = path / "config.json"
    if not path.is_dir() or not config.is_file():
        raise ModelError(f"'{model_id}' is not a folder with a config.json, so it is not a model folder.")
    try:
        with config.open("rb") as f:
            text = f.read(CONFIG_LIMIT_BYTES + 1)
        if len(text) > CONFIG_LIMIT_BYTES:
            raise ValueError("larger than 1 MiB")
        if not isinstance(json.loads(text), dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        raise ModelError(f"The config.json in '{model_id}' is not a readable JSON object ({first_line(exc)}).") from None
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise ModelError(f"'{model_id}' has a config.json but no weights ({' or '.join(WEIGHT_FILES[::2])}).")
