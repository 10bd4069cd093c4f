"""The Story's capacity chapter: how many requests a second (and users) this machine serves at a latency promise,
and which distance ends it. The planner's queueing simulation predicts it on this machine's calibration; then
`python -m engine capacity --local` measures it in a process of its own (short levels, short prompts and outputs)
into the story's database, and the chapter sets the two side by side."""
from __future__ import annotations

import json
import math
import subprocess

import numpy as np

from engine import launch
from engine.measure import slo as slos
from engine.measure.distances import BUCKETS
from engine.plan import capacity as cap
from engine.plan import simulate as sim
from engine.plan.planner import PlanError

SLO = {"ttft_ms": 2000.0, "tpot_ms": 200.0}  # loose enough for a CPU: a first token within 2 s, 5 tokens/s after it
ATTAINMENT = 0.9
INPUT_TOKENS = 16
OUTPUT_TOKENS = 8
MAX_BATCH = 4
# A level's arrivals last DURATION_S (at least REQUESTS requests); the bracket from the start rate and one
# bisection make about four levels, so a play costs the model's load and some 20-40 s of levels.
REQUESTS = 4
DURATION_S = 3.0
STEPS = 1
SEED = 1
START_RATE = 0.5  # requests/s, where the planner finds no rate that holds
# Where no rate holds, the search halves the rate and each level waits longer for its arrivals: at BUDGET_S it is
# stopped (as the Stop button stops a sweep), keeping the levels that finished.
BUDGET_S = 120.0

EXPLAINED = {
    "tpot_ms": "time per output token broke its target first: every decode step carries the whole batch, so the "
               "more requests share the engine, the longer each of their steps takes",
    "ttft_ms": "time to first token broke its target first: a new request waits behind the running batch for a slot "
               "and for its prefill, which is queueing, the time distance",
    "throughput": "every latency target held, but requests left at under 80% of the rate they arrived over the "
                  "level: the engine fell behind the arrivals, queueing (the time distance), or the level was too "
                  "short to tell",
    "server": "the engine broke before any latency target decided",
}


class CapacityChapterError(Exception):
    """The measurement could not run or gave no answer; the message is one sentence."""


def slo_text() -> str:
    return slos.format_slo(SLO)


def promise() -> str:
    """The SLO in words, with its units."""
    return (f"{ATTAINMENT:.0%} of requests get their first token within {SLO['ttft_ms']:g} ms and each token after "
            f"it within {SLO['tpot_ms']:g} ms")


def predict(calibration: dict | None, model: str = "default") -> dict:
    """The planner's capacity of the local engine at SLO (ATTAINMENT of requests), with the limiting metric and
    the largest bucket of a token at that load; where no rate holds, `why` says which metric and bucket stop it."""
    from engine.run.load_target import planned_setup  # the local engine's module loads torch

    if calibration is None:
        return {"why": "No calibration of this machine is stored or cached yet: playing the chapter measures one."}
    try:
        setup, scheduler = planned_setup(calibration, INPUT_TOKENS, OUTPUT_TOKENS, MAX_BATCH, model)
        workload = sim.Workload(requests=REQUESTS, rate=math.inf, prompt_tokens=setup.prompt_tokens,
                                new_tokens=OUTPUT_TOKENS, seed=SEED)
        rate, best, top, metric, bucket = cap.highest_rate(setup, workload, scheduler, SLO, q=None,
                                                           attainment=ATTAINMENT)
    except cap.Unreachable as exc:
        return {"why": str(exc), "limiting_metric": exc.metric, "limiting_bucket": exc.bucket,
                "calibrated_at": calibration.get("measured_at")}
    except PlanError as exc:
        return {"why": str(exc)}
    s, scored = best["summary"], sim.score(best, SLO)
    response_s = float(np.mean([r["e2e_ms"] for r in best["requests"]])) / 1e3
    return {"capacity_requests_per_s": rate, "saturation_requests_per_s": top, "limiting_metric": metric,
            "limiting_bucket": bucket, "attainment": slos.attainment(best["requests"], SLO),
            "goodput_requests_per_s": scored["goodput_requests_per_s"],
            "ttft_ms_p50": s["ttft_ms_p50"], "tpot_ms_p50": s["tpot_ms_p50"], "batch": s["mean_batch"],
            "users": rate * response_s, "distances_ms_per_token": s["distances_ms_per_token"],
            "calibrated_at": calibration.get("measured_at")}


def stored_calibration(store):
    """The calibration the local engine's runs in this store use, else this machine's cached one; never measures."""
    from engine.measure import hardware
    from engine.model.loader import pick_device

    return hardware.calibration_for(pick_device("auto"), store, measure=False)


def command(db: str, start_rate: float, model: str = "default") -> list[str]:
    return ["-m", "engine", "capacity", "--local", "--json", "--db", str(db), "--model", model,
            "--slo", slo_text(), "--attainment", f"{ATTAINMENT:g}", "--input-tokens", str(INPUT_TOKENS),
            "--output-tokens", str(OUTPUT_TOKENS), "--requests", str(REQUESTS), "--duration", f"{DURATION_S:g}",
            "--steps", str(STEPS), "--start-rate", f"{start_rate:g}", "--max-batch", str(MAX_BATCH),
            "--seed", str(SEED)]


def measure(db: str, start_rate: float | None = None, model: str = "default", budget_s: float = BUDGET_S) -> dict:
    """The capacity search in a process of its own, stored in db, stopped after budget_s; its summary, or one
    sentence of why there is none."""
    process = launch.start_python(command(db, start_rate or START_RATE, model), text=True, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE)
    try:
        out, err = process.communicate(timeout=budget_s)
    except subprocess.TimeoutExpired:
        process.terminate()  # the command stores what finished and prints its summary
        try:
            out, err = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            raise CapacityChapterError(f"The capacity search did not stop after its {budget_s:g} s.") from None
    try:
        return json.loads(out)
    except ValueError:
        lines = err.strip().splitlines()
        why = lines[-1].removeprefix("error: ") if lines else f"it ended with exit code {process.returncode}"
        raise CapacityChapterError(f"The capacity search gave no answer: {why}") from None


def is_story_sweep(config: dict) -> bool:
    """A capacity sweep made with this chapter's settings (the story's, not one made on the Serving page)."""
    return (config.get("local") is True and config.get("input_tokens") == INPUT_TOKENS
            and config.get("output_tokens") == OUTPUT_TOKENS and config.get("slo") == SLO
            and config.get("duration_s") == DURATION_S and config.get("max_batch") == MAX_BATCH)


def latest(store) -> dict | None:
    """The newest finished capacity sweep of this chapter: its answer, levels, seconds and status."""
    frame = store.query("SELECT sweep_id, status, error, config, levels, result, "
                        "epoch(finished_at) - epoch(started_at) AS seconds FROM load_sweeps WHERE kind = 'capacity' "
                        "AND status != 'running' AND result IS NOT NULL ORDER BY sweep_id DESC")
    for row in frame.itertuples(index=False):
        if is_story_sweep(json.loads(row.config)):
            return {"sweep_id": int(row.sweep_id), "status": row.status, "error": row.error,
                    "levels": json.loads(row.levels), "result": json.loads(row.result), "seconds": float(row.seconds)}
    return None


def level_buckets(store, sweep_id: int, level: int) -> dict[str, float] | None:
    """Milliseconds per output token in each bucket, over the level's requests (each one a recorded run)."""
    sums = ", ".join(f"sum({b}_ms) AS {b}" for b in BUCKETS)
    frame = store.query(f"SELECT {sums}, sum(n_new_tokens) AS n FROM runs WHERE tag LIKE ? AND status = 'ok'",
                        [f"load:{sweep_id}:{level}:%"])
    n = frame["n"].iloc[0]
    if not n or n != n:
        return None
    return {b: float(frame[b].iloc[0] or 0.0) / float(n) for b in BUCKETS}


def failing_level(found: dict) -> dict | None:
    rate = found["result"].get("first_failing_rate")
    return next((lv for lv in found["levels"] if lv["rate"] == rate), None) if rate is not None else None


def level_rows(found: dict) -> list[dict]:
    """One row per measured level, in the order measured: figures with their units."""
    return [{"rate req/s": lv["rate"], "requests": lv["requests"], "goodput req/s": lv.get("goodput_requests_per_s"),
             "attainment": lv.get("attainment"), "TTFT p50 ms": (lv.get("ttft_ms") or {}).get("p50"),
             "TPOT p50 ms": (lv.get("tpot_ms") or {}).get("p50"), "in flight (mean)": lv.get("in_flight_mean"),
             "kept up": lv.get("kept_up"), "status": lv["status"]} for lv in found["levels"]]


def side_by_side(planned: dict, found: dict | None) -> list[dict]:
    """Planned beside measured, one row per figure; a figure one side lacks is None."""
    measured = (found or {}).get("result") or {}
    good = next((lv for lv in (found or {}).get("levels", [])
                 if lv["rate"] == measured.get("capacity_requests_per_s")), {})
    return [{"figure": name, "planned": p, "measured": m} for name, p, m in (
        ("capacity req/s", planned.get("capacity_requests_per_s"), measured.get("capacity_requests_per_s")),
        ("users (Little's law, no think time)", planned.get("users"), measured.get("users")),
        ("goodput req/s at capacity", planned.get("goodput_requests_per_s"), measured.get("goodput_requests_per_s")),
        ("attainment at capacity", planned.get("attainment"), measured.get("attainment")),
        ("TTFT p50 ms at capacity", planned.get("ttft_ms_p50"), (good.get("ttft_ms") or {}).get("p50")),
        ("TPOT p50 ms at capacity", planned.get("tpot_ms_p50"), (good.get("tpot_ms") or {}).get("p50")),
        ("metric that failed first", planned.get("limiting_metric"), measured.get("limiting_metric")))]


def prediction_text(planned: dict) -> str:
    calibrated = (f" (on this machine's calibration measured {planned['calibrated_at']})"
                  if planned.get("calibrated_at") else "")
    if "capacity_requests_per_s" not in planned:
        return f"The planner finds no rate that holds{calibrated}: {planned['why']}"
    buckets = planned["distances_ms_per_token"]
    largest = max(buckets, key=buckets.get)
    return (f"The planner{calibrated} predicts {planned['capacity_requests_per_s']:.3g} requests/s "
            f"({planned['users']:.2g} users with no think time) for {ATTAINMENT:.0%} of requests within "
            f"{slo_text()}, at a mean batch of {planned['batch']:.1f}; at that load the {largest} distance is the "
            f"largest share of a token's time ({buckets[largest]:.0f} of {sum(buckets.values()):.0f} ms per token). "
            f"Beyond it {planned['limiting_metric']} fails first, with the {planned['limiting_bucket']} distance the "
            "largest there.")


def verdict(store, found: dict | None) -> str:
    """What the measurement supports, in words: the capacity, what failed first and which distance."""
    if found is None:
        return "Not measured yet: play the chapter."
    r = found["result"]
    ended = "" if found["status"] == "ok" else f" The search ended early ({found['error'] or found['status']})."
    target = f"{ATTAINMENT:.0%} of requests within {slo_text()}"
    if r.get("capacity_requests_per_s") is None and r.get("first_failing_rate") is None:
        return "The capacity search finished no level, so it found no capacity." + ended
    if r.get("capacity_requests_per_s") is None and r.get("failed_alone"):
        head = (f"No rate tried held {target}: even {r['first_failing_rate']:.3g} requests/s failed with every "
                "request running alone, so no rate holds it on this machine")
    elif r.get("capacity_requests_per_s") is None:
        head = (f"No rate tried held {target}: even {r['first_failing_rate']:.3g} requests/s, "
                "the lowest tried, failed, so the capacity here lies below it")
    else:
        head = (f"Measured: {r['capacity_requests_per_s']:.3g} requests/s held {target} (goodput "
                f"{r['goodput_requests_per_s']:.2f} requests/s, attainment {r['attainment']:.0%}), about "
                f"{r['users']:.2g} users with no think time")
    if r.get("first_failing_rate") is None:
        return f"{head}; it held at every rate tried, so the capacity is at least that." + ended
    edge = f"{head}. At {r['first_failing_rate']:.3g} requests/s {EXPLAINED[r['limiting_metric']]}"
    failing = failing_level(found)
    buckets = level_buckets(store, found["sweep_id"], failing["level"]) if failing else None
    if buckets:
        largest = max(buckets, key=buckets.get)
        edge += (f"; the largest measured bucket there is {largest} ({buckets[largest]:.0f} of "
                 f"{sum(buckets.values()):.0f} ms per output token)")
    return edge + "." + ended


def cell(value) -> str:
    """A figure as the chapter shows it: three significant digits, a share as a percentage, a word as it is."""
    if value is None or (isinstance(value, float) and value != value):
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        return f"{value:.3g}"
    return str(value)


def cost_text(found: dict | None) -> str:
    """What the measurement costs, from the stored sweep's own start and end."""
    budget = (f"Each level sends Poisson arrivals for {DURATION_S:g} s (at least {REQUESTS} requests of "
              f"{INPUT_TOKENS} prompt and {OUTPUT_TOKENS} output tokens, at most {MAX_BATCH} decoded together), then "
              f"{STEPS} bisection after the bracket, all within {BUDGET_S:g} s")
    if found is None:
        return budget + "."
    return (f"{budget}: the stored search, sweep {found['sweep_id']}, took {found['seconds']:.0f} s over "
            f"{len(found['levels'])} levels, plus the model's load in its own process.")
