"""Energy a run used, read from the machine's own counters at its start and its end.

On CPUs that expose RAPL, /sys/class/powercap/intel-rapl:*/energy_uj counts microjoules per zone and
starts again from zero past max_energy_range_uj. On NVIDIA GPUs (Volta and newer), NVML's
nvmlDeviceGetTotalEnergyConsumption counts millijoules since the driver loaded. A run on the CPU reads the
RAPL packages and their DRAM zones; a run on a CUDA GPU reads that GPU's counter. Where nothing can be read
the energy is None with the reason, never zero and never an estimate.

The counters measure the whole package or board, not one process: runs that overlap (the sequences of a
batch) each see the energy of everything that ran during their own time."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

POWERCAP = Path("/sys/class/powercap")


@dataclass(frozen=True)
class Counter:
    """One energy counter: its name, how to read it (joules), and the joules after which it starts again
    from zero (None: it does not within a run)."""
    name: str
    read: Callable[[], float]
    wrap_j: float | None = None


def _microjoules(path: Path) -> float:
    return int(path.read_text().strip()) / 1e6


def _zone_name(zone: Path) -> str:
    return (zone / "name").read_text().strip()


def rapl_counters(root: Path = POWERCAP) -> tuple[list[Counter], str | None]:
    """The RAPL package zones and the DRAM zones (a package's energy counts its cores and uncore, not its
    DRAM; psys, the whole platform where present, would count them twice), each read once to check that it
    can be; or no counter and the reason."""
    if not root.is_dir():
        return [], f"{root} does not exist (no RAPL driver, or a container that hides it)"
    counters, unreadable = [], []
    for zone in sorted(root.glob("intel-rapl:*")):
        try:
            name = _zone_name(zone)
        except OSError:
            continue
        top = zone.name.count(":") == 1
        if not ((top and name.startswith("package")) or name == "dram"):
            continue
        try:
            wrap = _microjoules(zone / "max_energy_range_uj")
            _microjoules(zone / "energy_uj")
        except (OSError, ValueError) as exc:
            unreadable.append(f"{zone / 'energy_uj'}: {exc.strerror or type(exc).__name__}"
                              if isinstance(exc, OSError) else f"{zone / 'energy_uj'}: not a number")
            continue
        counters.append(Counter(f"RAPL {zone.name} {name}", lambda path=zone / "energy_uj": _microjoules(path), wrap))
    if counters:
        return counters, None
    if unreadable:
        return [], (f"the RAPL counters cannot be read ({unreadable[0]}; Linux lets only root read them unless "
                    "their permissions are changed)")
    return [], f"{root} has no RAPL package or DRAM zone"


def nvml_counter(index: int) -> tuple[list[Counter], str | None]:
    """GPU `index`'s total-energy counter through NVML, read once to check that it can be; or the reason."""
    from engine.measure.hardware import _nvml

    nvml, reason = _nvml()
    if nvml is None:
        return [], reason
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        read = lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1e3  # noqa: E731  (mJ)
        read()
        name = nvml.nvmlDeviceGetName(handle)
    except Exception as exc:  # an older GPU or driver without the counter: a normal state
        return [], f"NVML has no energy counter for GPU {index} ({type(exc).__name__}: {str(exc)[:80]})"
    return [Counter(f"NVML GPU {index} {name}", read)], None


def counters_for(device: torch.device, root: Path = POWERCAP) -> tuple[list[Counter], str | None]:
    """The counters that measure a run on this device, or the reason there are none."""
    if device.type == "cuda":
        return nvml_counter(device.index or 0)
    if device.type == "cpu":
        return rapl_counters(root)
    return [], f"no energy counter is read for {device.type} devices"


def joules_between(start: float, end: float, wrap_j: float | None) -> float:
    """The energy between two readings of a counter that starts again from zero past wrap_j (once at most:
    a RAPL package counter takes minutes to hours to wrap)."""
    if end >= start or wrap_j is None:
        return end - start
    return end + wrap_j - start


class EnergyMeter:
    """Reads a device's counters now, then again at stop(): the run's energy columns."""

    def __init__(self, device: torch.device, root: Path = POWERCAP):
        self.counters, self.reason = counters_for(device, root)
        self.start = [c.read() for c in self.counters]

    def stop(self) -> dict:
        """energy_j (None where nothing could be read), energy_source (the counters read) and energy_note (why
        energy_j is None)."""
        if not self.counters:
            return {"energy_j": None, "energy_source": None, "energy_note": self.reason}
        try:
            end = [c.read() for c in self.counters]
        except Exception as exc:  # a file or a driver gone since the start: no figure, and why
            return {"energy_j": None, "energy_source": None,
                    "energy_note": f"a counter could not be read at the run's end ({type(exc).__name__}: {exc})"}
        total = sum(joules_between(a, b, c.wrap_j) for a, b, c in zip(self.start, end, self.counters))
        return {"energy_j": total, "energy_source": ", ".join(c.name for c in self.counters), "energy_note": None}


def _missing(value) -> bool:
    return value is None or value != value  # NULL read back as None, or as NaN through pandas


def energy_sentence(run) -> str:
    """A run's energy in one sentence, from its row (a mapping with energy_j, energy_source, energy_note and
    n_new_tokens); empty for a run that read no counter (a served run, or one recorded before energy was)."""
    if not _missing(run["energy_j"]):
        per_token = f", {run['energy_j'] / run['n_new_tokens']:.3g} J per token" if run["n_new_tokens"] else ""
        return (f"Energy measured by {run['energy_source']}: {run['energy_j']:.3g} J over the run{per_token} (the "
                "whole package or board: runs that overlapped it, such as a batch's, share it).")
    return "" if _missing(run["energy_note"]) else f"Energy not measured: {run['energy_note']}."
