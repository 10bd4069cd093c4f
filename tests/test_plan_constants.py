"""The planner's constants live in data/plan_constants.json with their origins, and the planner reads them there."""
import json
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from engine.plan import planner as plan

ROOT = Path(__file__).resolve().parent.parent
PLAN = [sys.executable, "-m", "engine", "plan", "--model", "llama-2-7b", "--gpu", "a100-80gb-sxm", "--json"]


def test_every_efficiency_default_and_local_figure_has_a_value_and_an_origin_in_the_data_file():
    data = json.loads((ROOT / "data" / "plan_constants.json").read_text())
    assert {f.name for f in fields(plan.Efficiency)} == set(data["efficiency"])
    for group in ("efficiency", "local", "engine"):
        for name, constant in data[group].items():
            assert "value" in constant and len(constant["origin"]) > 20, (group, name)
    assert plan.Efficiency().bandwidth == data["efficiency"]["bandwidth"]["value"]
    assert plan.LOCAL["host_us"] == data["local"]["host_us"]["value"]


def planned(constants: Path | None = None) -> dict:
    env = {**os.environ, **({"TOKENPATH_PLAN_CONSTANTS": str(constants)} if constants else {})}
    out = subprocess.run(PLAN, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def test_the_planner_reads_its_constants_from_the_file(tmp_path):
    data = json.loads((ROOT / "data" / "plan_constants.json").read_text())
    data["efficiency"]["bandwidth"]["value"] /= 2
    data["efficiency"]["step_fixed_us"]["value"] += 1000
    changed = tmp_path / "plan_constants.json"
    changed.write_text(json.dumps(data))
    before, after = planned(), planned(changed)
    # a batch-1 decode step of a 7B model is its weights over the bandwidth: half the bandwidth, twice the time
    weights = before["distances_ms"]["memory"]
    assert after["distances_ms"]["memory"] > 1.9 * weights
    assert after["distances_ms"]["time"] == pytest.approx(before["distances_ms"]["time"] + 1.0)
    assert after["decode_ms_per_token"] > before["decode_ms_per_token"] + weights
