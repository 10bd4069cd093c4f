"""Energy from the machine's counters: RAPL read from a directory laid out as sysfs lays out
/sys/class/powercap (its counter wrapping past max_energy_range_uj), and a run on this machine storing its
energy, or NULL and the reason where nothing can be read here."""
from pathlib import Path

import pandas as pd
import pytest
import torch

from streamlit.testing.v1 import AppTest

from engine.measure.energy import EnergyMeter, counters_for, energy_sentence, joules_between, rapl_counters
from engine.run.batch import BatchEngine
from engine.run.generate import Generation, GenConfig
from engine.store.db import Store
from ui import md_escape

CPU = torch.device("cpu")
RANGE_UJ = 262_143_328_850  # a package counter's range on a Xeon


def zone(root: Path, name: str, kind: str, energy_uj: int, range_uj: int = RANGE_UJ) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "name").write_text(f"{kind}\n")
    (folder / "energy_uj").write_text(f"{energy_uj}\n")
    (folder / "max_energy_range_uj").write_text(f"{range_uj}\n")
    return folder


@pytest.fixture
def powercap(tmp_path):
    """Two packages, their core and DRAM zones, a psys zone and the MMIO twin of package 0, as sysfs shows them."""
    root = tmp_path / "powercap"
    root.mkdir()
    (root / "intel-rapl").mkdir()  # the control type's own folder, no zone
    zone(root, "intel-rapl:0", "package-0", RANGE_UJ - 2_000_000)  # two joules before it wraps
    zone(root, "intel-rapl:0:0", "core", 5_000_000)
    zone(root, "intel-rapl:0:1", "dram", 7_000_000, 65_712_999_613)
    zone(root, "intel-rapl:1", "package-1", 40_000_000)
    zone(root, "intel-rapl:2", "psys", 90_000_000)
    zone(root, "intel-rapl-mmio:0", "package-0", 1_000_000)
    return root


def advance(root: Path, name: str, energy_uj: int) -> None:
    (root / name / "energy_uj").write_text(f"{energy_uj}\n")


def test_rapl_reads_the_packages_and_dram_and_counts_across_a_wrap(powercap):
    counters, reason = rapl_counters(powercap)
    assert reason is None
    assert [c.name for c in counters] == ["RAPL intel-rapl:0 package-0", "RAPL intel-rapl:0:1 dram",
                                          "RAPL intel-rapl:1 package-1"]
    meter = EnergyMeter(CPU, powercap)
    advance(powercap, "intel-rapl:0", 3_000_000)  # wrapped: 2 J before the range, 3 J after it
    advance(powercap, "intel-rapl:0:1", 7_500_000)  # 0.5 J
    advance(powercap, "intel-rapl:1", 41_250_000)  # 1.25 J
    advance(powercap, "intel-rapl:0:0", 9_000_000)  # counted in its package already
    advance(powercap, "intel-rapl:2", 99_000_000)  # the whole platform: would count the packages twice
    reading = meter.stop()
    assert reading["energy_j"] == pytest.approx(5.0 + 0.5 + 1.25)
    assert reading["energy_source"] == ", ".join(c.name for c in counters) and reading["energy_note"] is None


def test_a_counter_between_two_readings():
    assert joules_between(10.0, 12.5, 100.0) == 2.5
    assert joules_between(99.0, 1.0, 100.0) == 2.0
    assert joules_between(5.0, 5.0, 100.0) == 0.0


def test_where_rapl_cannot_be_read_the_energy_is_none_with_the_reason(tmp_path, powercap):
    assert rapl_counters(tmp_path / "absent") == ([], f"{tmp_path / 'absent'} does not exist (no RAPL driver, or a "
                                                      "container that hides it)")
    (tmp_path / "empty").mkdir()
    assert rapl_counters(tmp_path / "empty")[1] == f"{tmp_path / 'empty'} has no RAPL package or DRAM zone"
    for name in ("intel-rapl:0", "intel-rapl:0:1", "intel-rapl:1"):  # counters this process cannot read
        (powercap / name / "energy_uj").unlink()
        (powercap / name / "energy_uj").mkdir()
    counters, reason = rapl_counters(powercap)
    assert counters == [] and "cannot be read" in reason and "intel-rapl:0/energy_uj" in reason
    reading = EnergyMeter(CPU, powercap).stop()
    assert reading == {"energy_j": None, "energy_source": None, "energy_note": reason}


def test_a_counter_gone_at_the_end_gives_no_figure_and_says_why(powercap):
    meter = EnergyMeter(CPU, powercap)
    (powercap / "intel-rapl:1" / "energy_uj").unlink()
    reading = meter.stop()
    assert reading["energy_j"] is None and "could not be read at the run's end" in reading["energy_note"]


def test_a_run_here_stores_its_energy_or_null_and_the_reason(tiny_lm, calibration, store):
    """Both a lone run and a batched one: this machine's counters, or NULL (never zero) with why."""
    lone = Generation(tiny_lm, GenConfig("Count the stars", max_new_tokens=4), store=store, calibration=calibration,
                      telemetry=False).run()
    engine = BatchEngine(tiny_lm, store, max_batch=2, calibration=calibration)
    batched = [engine.submit(GenConfig(p, max_new_tokens=4)) for p in ("Hi", "Name a river")]
    engine.run()
    counters, reason = counters_for(CPU)
    runs = store.runs(10).set_index("run_id")
    for run_id in [lone["run_id"]] + [s.run_id for s in batched]:
        run = runs.loc[run_id]
        if counters:
            assert run["energy_j"] >= 0 and run["energy_source"] and pd.isna(run["energy_note"])
        else:
            assert pd.isna(run["energy_j"]) and pd.isna(run["energy_source"]) and run["energy_note"] == reason


def test_the_sentence_names_the_measurement_or_why_there_is_none():
    measured = {"energy_j": 12.0, "energy_source": "RAPL intel-rapl:0 package-0", "energy_note": None,
                "n_new_tokens": 48}
    assert energy_sentence(measured).startswith("Energy measured by RAPL intel-rapl:0 package-0: 12 J over the "
                                                "run, 0.25 J per token")
    none = {"energy_j": float("nan"), "energy_source": None, "energy_note": "no counter", "n_new_tokens": 4}
    assert energy_sentence(none) == "Energy not measured: no counter."
    assert energy_sentence({**none, "energy_note": float("nan")}) == ""  # a served run reads no counter


def test_the_distances_page_says_a_runs_energy_beside_its_telemetry(page_db, tiny_lm, calibration):
    store = Store(page_db)
    run = Generation(tiny_lm, GenConfig("Hi", max_new_tokens=4, ignore_eos=True), store=store,
                     calibration=calibration).run()
    row = store.runs(1).iloc[0]
    at = AppTest.from_file("../app.py", default_timeout=180)
    at.switch_page("pages/distances.py")
    at.query_params["run"] = [str(run["run_id"])]
    at.run()
    assert not at.exception and not at.error
    captions = [c.value for c in at.caption if c.value.startswith("Energy")]
    assert captions == [md_escape(energy_sentence(row))]
    assert energy_sentence(row).startswith("Energy not measured: " if pd.isna(row["energy_j"]) else "Energy measured by ")
