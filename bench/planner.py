"""The planner against published batch-1 decode speeds and published serving throughput: predicted and measured
tokens/s for every point of data/plan_calibration.json, each error and the median absolute error, written to
bench/results/planner.md.
With --local N it also runs the default model N times on this machine (a fresh calibration before each run)
and sets the planner's prediction for each run beside its measured time per output token.

    python bench/planner.py              (no model is loaded; it takes a second)
    python bench/planner.py --local 3    (about a minute per run on a quiet 2-core machine)"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
from engine.measure import hardware
from engine.plan import planner as plan
from engine.plan import simulate


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


def predict_serving(point: dict, efficiency: plan.Efficiency = plan.Efficiency()) -> dict:
    """Output tokens/s for a published serving point: the full engine's closed form (offline, or held at a
    concurrency) or a static batch run start to finish."""
    setup = plan.Setup(model=plan.resolve_model(point["model"]), gpu=plan.get_gpu(point["gpu"]), gpus=point["gpus"],
                       interconnect=point["interconnect"], weights=point["weights"], kv_dtype=point["kv_dtype"],
                       efficiency=efficiency)
    if point["scenario"] == "static":
        return simulate.static_batch(setup, point["batch"], point["prompt_tokens"], point["new_tokens"])
    return simulate.steady_state(setup, point["prompt_tokens"], point["new_tokens"],
                                 simulate.Scheduler(**point["scheduler"]), concurrency=point.get("concurrency"))


def serving_table(held_out: bool = False) -> tuple[list[dict], float]:
    """The serving points the efficiency factors were fitted to, or (held_out) those kept apart to check them."""
    points = [p for p in json.loads((ROOT / "data" / "plan_calibration.json").read_text())["serving_points"]
              if p.get("held_out", False) == held_out]
    rows = []
    for p in points:
        predicted = predict_serving(p)
        rows.append({**p, "predicted": predicted["output_tokens_per_s"], "batch_settled": predicted.get("batch"),
                     "limited_by": predicted.get("limited_by", "the batch"),
                     "error": predicted["output_tokens_per_s"] / p["measured_output_tokens_per_s"] - 1})
    return rows, statistics.median(abs(r["error"]) for r in rows)


def render_serving(rows: list[dict], median: float, title: str = "Published serving throughput (batched, continuous "
                                                                   "batching)") -> str:
    lines = ["", f"## {title}", "",
             "Predicted by `engine/plan/simulate.py`'s closed form of a full engine (`steady_state`: the batch the "
             "sequence limit, KV memory (each request's whole length where the engine reserves it), token budget or "
             "concurrency allows, prompts spread over the decode steps) or "
             "a static batch (`static_batch`); measured as published (sources and assumptions in "
             "`data/plan_calibration.json`, `serving_points`). Error = predicted / measured - 1.", "",
             "| model | GPU | GPUs | weights | scenario | in / out tokens | batch (what limits it) | measured tok/s | "
             "predicted tok/s | error |",
             "| --- | --- | ---: | --- | --- | --- | --- | ---: | ---: | ---: |"]
    for r in rows:
        scenario = r["scenario"] + (f" {r['concurrency']}" if "concurrency" in r else f" {r['batch']}" if "batch" in r
                                    else "")
        batch = f"{r['batch_settled']} ({r['limited_by']})" if r["batch_settled"] else "fixed"
        lines.append(f"| {r['model']} | {r['gpu']} | {r['gpus']} | {r['weights']} | {scenario} | "
                     f"{r['prompt_tokens']} / {r['new_tokens']} | {batch} | {r['measured_output_tokens_per_s']:,.0f} | "
                     f"{r['predicted']:,.0f} | {r['error']:+.1%} |")
    worst = max(rows, key=lambda r: abs(r["error"]))
    lines += ["", f"Median absolute error {median:.1%} over {len(rows)} points; largest {worst['error']:+.1%} "
              f"({worst['model']}, {worst['gpus']} x {worst['gpu']}, {worst['prompt_tokens']} / {worst['new_tokens']} "
              f"tokens, {worst['engine']})."]
    return "\n".join(lines) + "\n"


def local_runs(n: int) -> list[dict]:
    """Planned against measured decode time per token for n real runs of the default model (fp32)."""
    from engine.store.db import Store

    db = Path(tempfile.mkdtemp()) / "planner.duckdb"
    engine = [sys.executable, "-m", "engine"]
    rows = []
    for _ in range(n):
        load = os.getloadavg()[0]
        subprocess.run([*engine, "calibrate", "--db", str(db)], cwd=ROOT, check=True, capture_output=True)
        out = subprocess.run([*engine, "generate", "--prompt", "Why is the sky blue?", "--max-new-tokens", "64",
                              "--json", "--db", str(db)], cwd=ROOT, check=True, capture_output=True, text=True)
        result = json.loads(out.stdout)
        planned = plan.plan_for_run(Store(db).run(result["run_id"]), result["calibration"])
        rows.append({"measured": result["tpot_ms"], "planned": planned["decode_ms_per_token"],
                     "memory_gbps": plan.decode_bandwidth_gbps(result["calibration"]),
                     "matvec_us": result["calibration"].get("matvec_call_us", 0.0), "load": load,
                     "load_after": os.getloadavg()[0], "buckets": planned["distances_ms"]})
    return rows


def render_local(rows: list[dict]) -> str:
    lines = ["", "## On this machine: the default model, fp32, 64 new tokens", "",
             "Command per run: `python -m engine calibrate`, then `python -m engine generate --prompt \"Why is the "
             "sky blue?\" --max-new-tokens 64 --json`; planned = `plan.plan_for_run` with the calibration the run "
             "was attributed with.", "",
             "| run | load average before / after | decode kernel GB/s | us per product | measured TPOT ms | planned ms "
             "| planned / measured |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for i, r in enumerate(rows, 1):
        lines.append(f"| {i} | {r['load']:.1f} / {r['load_after']:.1f} | {r['memory_gbps']:.1f} | {r['matvec_us']:.0f} | "
                     f"{r['measured']:.1f} | "
                     f"{r['planned']:.1f} | {r['planned'] / r['measured']:.3f} |")
    ratios = [r["planned"] / r["measured"] for r in rows]
    loads = [x for r in rows for x in (r["load"], r["load_after"])]
    lines += ["", f"Planned / measured {min(ratios):.3f} to {max(ratios):.3f} (median {statistics.median(ratios):.3f}); "
              f"{os.cpu_count()} logical cores, load average {min(loads):.1f} to {max(loads):.1f} during the runs. "
              "The plan has no term for waiting for a core, which each of a step's operations that runs on both "
              "threads does while other processes hold them."]
    return "\n".join(lines) + "\n"


def stamp() -> str:
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    cpu = hardware.cpu_facts()
    return (f"{datetime.date.today().isoformat()}, {cpu['model']} ({cpu['logical_cores']} logical cores), "
            f"command `python bench/planner.py {' '.join(sys.argv[1:])}`, commit {commit}")


def render(rows: list[dict], median: float) -> str:
    lines = ["# Planner against published batch-1 decode speeds", "", stamp(), "",
             "Predicted by `engine/plan/planner.py` with its default efficiency factors; measured as published (sources in "
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local", type=int, default=0, help="also plan and measure N real runs on this machine")
    args = parser.parse_args()
    rows, median = table()
    text = (render(rows, median) + render_serving(*serving_table())
            + render_serving(*serving_table(held_out=True), title="Held out of the fit: NVFP4 on B200 and mixtures of "
                                                                  "experts"))
    if args.local:
        text += render_local(local_runs(args.local))
    print(text)
    out = ROOT / "bench" / "results" / "planner.md"
    os.makedirs(out.parent, exist_ok=True)
    out.write_text(text)
    print(f"written to {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
