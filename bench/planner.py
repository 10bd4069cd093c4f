"""The planner against published batch-1 decode speeds: predicted and measured tokens/s for every point of
data/plan_calibration.json, each error and the median absolute error, written to bench/results/planner.md.

    python bench/planner.py            (no model is loaded; it takes a second)"""
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from engine import hardware, plan  # noqa: E402


def predict(point: dict) -> float:
    setup = plan.Setup(model=plan.resolve_model(point["model"]), gpu=plan.get_gpu(point["gpu"]), gpus=point["gpus"],
                       interconnect=point["interconnect"], weights=point["weights"],
                       bits_per_weight=point.get("bits_per_weight"), kv_dtype=point["kv_dtype"], batch=point["batch"],
                       prompt_tokens=point["prompt_tokens"], new_tokens=point["new_tokens"])
    return plan.plan(setup)["tokens_per_s_per_user"]


def table() -> tuple[list[dict], float]:
    points = json.loads((ROOT / "data" / "plan_calibration.json").read_text())["points"]
    rows = []
    for p in points:
        predicted = predict(p)
        rows.append({**p, "predicted": predicted, "error": predicted / p["measured_tokens_per_s"] - 1})
    return rows, statistics.median(abs(r["error"]) for r in rows)


def stamp() -> str:
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    cpu = hardware.cpu_facts()
    return (f"{datetime.date.today().isoformat()}, {cpu['model']} ({cpu['logical_cores']} logical cores), "
            f"command `python bench/planner.py`, commit {commit}")


def render(rows: list[dict], median: float) -> str:
    lines = ["# Planner against published batch-1 decode speeds", "", stamp(), "",
             "Predicted by `engine/plan.py` with its default efficiency factors; measured as published (sources in "
             "`data/plan_calibration.json`). Error = predicted / measured - 1.", "",
             "| model | GPU | GPUs | weights | engine | measured tok/s | predicted tok/s | error |",
             "| --- | --- | ---: | --- | --- | ---: | ---: | ---: |"]
    for r in rows:
        weights = r["weights"] + (f" ({r['bits_per_weight']:g} bits)" if "bits_per_weight" in r else "")
        lines.append(f"| {r['model']} | {r['gpu']} | {r['gpus']} | {weights} | {r['engine']} | "
                     f"{r['measured_tokens_per_s']:.2f} | {r['predicted']:.2f} | {r['error']:+.1%} |")
    worst = max(rows, key=lambda r: abs(r["error"]))
    lines += ["", f"Median absolute error {median:.1%} over {len(rows)} points; largest {worst['error']:+.1%} "
              f"({worst['model']}, {worst['gpus']} x {worst['gpu']}, {worst['weights']}, {worst['engine']})."]
    return "\n".join(lines) + "\n"


def main() -> int:
    rows, median = table()
    text = render(rows, median)
    print(text)
    out = ROOT / "bench" / "results" / "planner.md"
    os.makedirs(out.parent, exist_ok=True)
    out.write_text(text)
    print(f"written to {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
