"""Reading a set of measured runs the seed's way: is decode here bound by compute, by movement
(memory and links) or by waiting, and which switch helped most, as far as the repeats' 95% intervals show?"""
from __future__ import annotations

import json

from engine.measure.compare import compare, usable
from engine.measure.distances import BUCKETS


def shares(run: dict) -> dict:
    """Fraction of the run's time in each bucket."""
    total = sum(run[f"{b}_ms"] or 0 for b in BUCKETS) or 1.0
    return {b: (run[f"{b}_ms"] or 0) / total for b in BUCKETS}


def bound_by(run: dict) -> tuple[str, dict]:
    """'movement', 'compute', 'waiting' or 'wasted work', with the shares behind it."""
    s = shares(run)
    groups = {"movement": s["memory"] + s["physical"], "compute": s["compute"], "waiting": s["time"],
              "wasted work": s["decision"]}
    return max(groups, key=groups.get), groups


def advise(runs: list[dict], baseline: dict) -> list[str]:
    """Plain sentences: what limits the baseline, and what each lever did against it."""
    kind, groups = bound_by(baseline)
    lines = [f"The baseline ({baseline['label']}) spends {groups['movement']:.0%} of its time moving bytes, "
             f"{groups['compute']:.0%} computing beyond that, {groups['waiting']:.0%} waiting (dispatch, launch, "
             f"host work, kernels below peak) and {groups['wasted work']:.0%} on wasted work: decode on this machine "
             f"is bound by {kind}."]
    if kind == "waiting":
        lines.append("Remedies that shrink bytes (quantization, skipped sparsity) can only act on the movement "
                     "share; fewer, larger operations (fused kernels, compiled graphs, verifying several guessed "
                     "tokens per forward) act on the waiting.")
    elif kind == "movement":
        lines.append("Fewer bytes per token pays here: lower-precision weights with a kernel that reads them, "
                     "or sparsity that skips weight loads.")
    base_rates = rates(baseline)
    rated = [(r, compare(base_rates, rates(r))) for r in runs if r is not baseline and rates(r)] if base_rates else []
    if rated:
        faster = [(r, c) for r, c in rated if c.measurable and c.ratio > 1]
        slower = [f"{r['label']}: {c.text()}" for r, c in rated if c.measurable and c.ratio < 1]
        unclear = [f"{r['label']}: {c.text()}" for r, c in rated if not c.measurable]
        if faster:
            best, c = max(faster, key=lambda rc: rc[1].ratio)
            lines.append(f"The lever that helped most here: {best['label']}, decode speed against the baseline "
                         f"{c.text()}.")
        else:
            lines.append("No setting decoded measurably faster than the baseline here (no 95% interval of a "
                         "speed ratio lies above 1), so no lever is shown to help on this workload and machine.")
        if slower:
            lines.append("Slower than the baseline here: " + "; ".join(slower) + ".")
        if unclear:
            lines.append("Not shown to differ from the baseline: " + "; ".join(unclear) + ".")
    return lines


def rates(run: dict) -> list[float]:
    """A setting's decode speeds: one per repeat (decode_rates), else its single run's."""
    return usable(run.get("decode_rates") or [run.get("decode_tokens_per_s")])


def settings(runs: list[dict]) -> list[dict]:
    """Runs with the same label (the repeats of one setting) as one row, in the order labels first appear:
    the mean of each figure, every repeat's decode speed in decode_rates (end to end in end_to_end_rates) and the
    run ids in run_ids."""
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(r["label"], []).append(r)
    rows = []
    for label, group in groups.items():
        mean = lambda key: (sum(r[key] for r in group) / len(group)  # noqa: E731
                            if all(r.get(key) is not None for r in group) else None)
        rows.append({"label": label, "repeats": len(group), **{f"{b}_ms": mean(f"{b}_ms") for b in BUCKETS},
                     "decode_tokens_per_s": mean("decode_tokens_per_s"), "ttft_ms": mean("ttft_ms"),
                     "tokens_per_s": mean("tokens_per_s"), "decode_rates": usable(r["decode_tokens_per_s"] for r in group),
                     "end_to_end_rates": usable(r.get("tokens_per_s") for r in group),
                     "run_ids": [r["run_id"] for r in group if "run_id" in r],
                     "differs": [name for key, name in REPEAT_ALIKE.items() if len({r.get(key) for r in group}) > 1]})
    return rows


# What the repeats of one setting should share for their spread to be the setting's alone, and its name in words.
REPEAT_ALIKE = {"prompt": "prompt", "n_new_tokens": "number of new tokens", "status": "status"}


def mixed_repeats(arms: list[dict]) -> list[str]:
    """A sentence for each setting whose repeats differ in prompt, length or status: their interval then holds
    those differences as well as the setting's own spread."""
    return [f"Runs {', '.join(f'#{i}' for i in a['run_ids'])} are taken as repeats of one setting but differ in "
            f"{' and '.join(a['differs'])}: the interval holds that difference too." for a in arms if a["differs"]]


# The stored columns that make two runs the same setting, so that their runs are repeats of one arm.
SETTING = ("model", "weights", "kv_cache", "sparsity", "sparsity_mode", "speculative", "backend")


def arms(runs: list[dict]) -> list[dict]:
    """Stored runs as settings (runs alike in every SETTING column and decoded in the same size of batch are one
    arm's repeats), in the order each setting first appears: the first arm is the baseline of every comparison."""
    return settings([{**r, "label": " · ".join(str(r.get(k)) for k in SETTING) + batch_label(r)} for r in runs])


def batch_label(run: dict) -> str:
    """' · batch of up to N' for a run decoded by a batching engine of N sequences (its config's max_batch)."""
    config = run.get("config") or {}
    cap = (json.loads(config) if isinstance(config, str) else config).get("max_batch")
    return f" · batch of up to {cap}" if cap else ""


def against(baseline: list[float], rates: list[float]) -> str:
    """A ratio of speeds against the baseline's, with its 95% interval and verdict; a dash where an arm has none."""
    return compare(baseline, rates).text() if baseline and rates else "-"
