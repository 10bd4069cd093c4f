"""Figures fitted once per model weights and text, and kept in the cache folder (cache_dir()/KIND/): the int8-dyn
level's smoothing factors and the sparsity levels' thresholds. A fit runs the model over a whole text; hashing
its weights takes a fraction of that, so every process and database after the first reads the kept figures."""
from __future__ import annotations

import hashlib
import os
from typing import Callable, TypeVar

import torch

from engine.paths import cache_dir

T = TypeVar("T")


def model_fingerprint(model: torch.nn.Module) -> str:
    """A digest of every parameter and buffer, their names, shapes, types and bytes: the same only for the same
    weights."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def kept(kind: str, key: str, device: torch.device, fit: Callable[[], T]) -> T:
    """What fit() returns for this key (which names the weights, the text and the fit's settings and format),
    read from the cache folder where kept, else fitted and kept."""
    path = cache_dir() / kind / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.pt"
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception:  # none kept yet, or one that cannot be read: fitted again and replaced
        pass
    value = fit()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f"{path.name}.{os.getpid()}")
        torch.save(value, part)
        part.replace(path)  # whole or not at all, for processes that fit the same figures at once
    except OSError:  # a cache folder that cannot be written costs the next process the fit, nothing else
        pass
    return value
