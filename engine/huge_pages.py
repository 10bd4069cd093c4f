"""Tensors on 2 MiB pages, for what a step streams from memory: the layers' weights, and the buffers the calibration
reads the memory peak from.

On 4 KiB pages a read of hundreds of MB misses the TLB at every page and the hardware prefetchers stop at each
page's end; on 2 MiB pages the same read runs nearer the memory's rate, and the calibration reads the peak from such
pages so that the peak is one the weights' reads can reach. Linux backs an anonymous mapping with transparent huge
pages where its setting allows: always, or for a mapping that asks (madvise), the usual default. The C library's
heap does not ask, so these tensors get mappings of their own. Elsewhere, or where the setting is never, they are
torch.empty's."""
from __future__ import annotations

import mmap
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def setting() -> str | None:
    """The kernel's transparent huge page setting (always, madvise or never), None where there is none."""
    try:
        text = SETTING.read_text()
    except OSError:
        return None
    chosen = text[text.find("[") + 1:text.find("]")] if "[" in text else ""
    return chosen or None


def available() -> bool:
    """Whether a mapping that asks gets transparent huge pages here."""
    return setting() in ("always", "madvise") and hasattr(mmap, "MADV_HUGEPAGE")


def describe() -> str:
    """One line for a run's record: the pages the weights stream from (asked for: the kernel may still fall back to
    small pages where it finds no free 2 MiB run)."""
    if available():
        return (f"2 MiB pages asked for the layers' weights and the calibration's reads (transparent huge pages: "
                f"{setting()})")
    why = "set to never" if setting() == "never" else "not offered by this system"
    return f"4 KiB pages (transparent huge pages {why})"


def empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized 1-D CPU tensor of `numel` elements that starts on a 2 MiB boundary of an anonymous mapping of
    its own, which the kernel is asked to back with huge pages; torch.empty's where they are not available or the
    tensor is smaller than one. The mapping lives as long as any view of the tensor."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not available():
        return torch.empty(numel, dtype=dtype)
    try:
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:  # no mapping of its own to be had: the allocator's memory serves
        return torch.empty(numel, dtype=dtype)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # refused: the mapping still serves, on small pages
        pass
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start:start + nbytes].view(dtype)
