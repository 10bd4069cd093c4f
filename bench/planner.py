"""The planner against published batch-1 decode speeds and published serving throughput: predicted and measured
tokens/s for every point of data/plan_calibration.json, each error and the median absolute error, written to
bench/results/planner.md.
With --local N it also runs the default model on this machine in N rounds (a fresh calibration, then each of
fp32, int4-dyn and int8-dyn alone and with 8 users) and sets the planner's prediction for each run beside its
measured time per output token.

    python bench/planner.py              (no model is loaded; it takes a second)
    python bench/planner.py --local 2    (about two minutes a round on a quiet 2-core machine)"""
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


LOCAL_LEVELS = ("fp32", "int4-dyn", "int8-dyn")
LOCAL_USERS = (1, 8)
LOCAL_PROMPT = "Why is the sky blue?"


def local_runs(n: int) -> list[dict]:
    """Planned against measured decode time per token on this machine: n rounds, each a fresh calibration and then
    the default model at each of LOCAL_LEVELS, alone and with LOCAL_USERS users decoded together, every user with
    the same prompt; the first sequence's run is the one planned and measured."""
    from engine.store.db import Store

    folder = Path(tempfile.mkdtemp())
    db, prompts = folder / "planner.duckdb", folder / "prompts.txt"
    prompts.write_text(LOCAL_PROMPT + "\n")  # every user the same prompt: the plan takes one length for all
    engine = [sys.executable, "-m", "engine"]
    rows = []
    for round_ in range(1, n + 1):
        subprocess.run([*engine, "calibrate", "--db", str(db)], cwd=ROOT, check=True, capture_output=True)
        for level in LOCAL_LEVELS:
            for users in LOCAL_USERS:
                load = os.getloadavg()[0]
                batch = ["--users", str(users), "--prompts", str(prompts)] if users > 1 else []
                out = subprocess.run([*engine, "generate", "--prompt", LOCAL_PROMPT, "--max-new-tokens", "64",
                                      "--weights", level, *batch, "--json", "--db", str(db)], cwd=ROOT, check=True,
                                     capture_output=True, text=True)
                result = json.loads(out.stdout)
                run = Store(db).run(result["run_ids"][0] if "run_ids" in result else result["run_id"])
                calibration = json.loads(run["metrics"])["calibration"]
                planned = plan.plan_for_run(run, calibration)
                cached = calibration["cache_read"] if planned["from_cache"] else None
                rows.append({"round": round_, "level": level, "users": users, "measured": run["tpot_ms"],
                             "planned": planned["decode_ms_per_token"], "from_cache": bool(cached),
                             "read_gbps": planned["read_gbps"],
                             "matvec_us": (cached["matvec_call_us"] if cached
                                           else calibration.get("matvec_call_us", 0.0)),
                             "load": load, "load_after": os.getloadavg()[0], "buckets": planned["distances_ms"]})
    return rows


def render_local(rows: list[dict]) -> str:
    lines = ["", "## On this machine: the default model at each level, alone and in a batch, 64 new tokens", "",
             "Command per round: `python -m engine calibrate`, then for each level and user count `python -m engine "
             "generate --prompt \"Why is the sky blue?\" --max-new-tokens 64 --weights LEVEL --users N --prompts FILE "
             "--json`, the file holding the same prompt, so that every user decodes the same lengths; measured = "
             "the prompt's own run's time per output token, planned = `plan.plan_for_run` of that stored run with "
             "the calibration it was attributed with (no figure of these runs went into the planner).", "",
             "| round | level | users | load average before / after | weights read from | read GB/s | us per product "
             "| measured TPOT ms | planned ms | planned / measured | planned memory / compute / time ms |",
             "| ---: | --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        b = r["buckets"]
        lines.append(f"| {r['round']} | {r['level']} | {r['users']} | {r['load']:.1f} / {r['load_after']:.1f} | "
                     f"{'last-level cache' if r['from_cache'] else 'memory'} | {r['read_gbps']:.1f} | "
                     f"{r['matvec_us']:.1f} | {r['measured']:.2f} | {r['planned']:.2f} | "
                     f"{r['planned'] / r['measured']:.3f} | {b['memory']:.2f} / {b['compute']:.2f} / {b['time']:.2f} |")
    ratios = [r["planned"] / r["measured"] for r in rows]
    loads = [x for r in rows for x in (r["load"], r["load_after"])]
    by_level = "; ".join(
        f"{level} {min(g):.2f} to {max(g):.2f}"
        for level in LOCAL_LEVELS if (g := [r["planned"] / r["measured"] for r in rows if r["level"] == level]))
    lines += ["", f"Planned / measured {min(ratios):.3f} to {max(ratios):.3f} (median {statistics.median(ratios):.3f}; "
              f"{by_level}); {os.cpu_count()} logical cores, load average {min(loads):.1f} to {max(loads):.1f} during "
              "the runs. The plan has no term for waiting for a core, which each of a step's operations that runs on "
              "both threads does while other processes hold them."]
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
