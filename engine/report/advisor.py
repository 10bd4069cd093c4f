"""Reading a set of measured runs the seed's way: is decode here bound by compute, by movement
(memory and links) or by waiting, and which switch helped most?"""
from __future__ import annotations

from engine.measure.distances import BUCKETS

SAME = 1.05  # speed ratios within this factor of 1 count as unchanged


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
    rated = [r for r in runs if r is not baseline and r.get("decode_tokens_per_s")]
    if rated and baseline.get("decode_tokens_per_s"):
        base_rate = baseline["decode_tokens_per_s"]
        # within 5% of the baseline counts as no change: runs on a shared machine wander that much
        faster = [r for r in rated if r["decode_tokens_per_s"] > SAME * base_rate]
        slower = [r["label"] for r in rated if r["decode_tokens_per_s"] < base_rate / SAME]
        if faster:
            best = max(faster, key=lambda r: r["decode_tokens_per_s"])
            lines.append(f"The lever that helped most here: {best['label']}, "
                         f"{best['decode_tokens_per_s'] / base_rate:.2f}x the baseline's decode speed.")
        else:
            lines.append("No setting decoded faster than the baseline here (none beat it by more than "
                         f"{SAME - 1:.0%}), so no lever helped on this workload and machine.")
        if slower:
            lines.append("Slower than the baseline here: " + "; ".join(slower) + ".")
    return lines
