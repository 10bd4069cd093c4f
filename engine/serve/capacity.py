"""The highest request rate a server holds at a latency target: levels at doubling (or halving) rates
until one holds and one fails, then bisection between them; every level is stored in one sweep. Halving stops at
a failing level whose requests each ran alone: the target is then missed by the unloaded server."""
from __future__ import annotations

from engine.serve import arrivals
from engine.serve.load import Sweep

MAX_BRACKET_LEVELS = 10  # doublings or halvings before the search gives up on finding an edge


def holds(level: dict, attainment: float) -> bool:
    """Met the attainment, and kept up: a level shorter than the queue it builds can meet a loose target
    while the server falls further behind with every request."""
    return level["status"] == "ok" and (level.get("attainment") or 0.0) >= attainment and level.get("kept_up") is not False


def limiting_metric(level: dict, attainment: float = 1.0) -> str:
    """The target that the fewest requests of a failing level met; 'throughput' when every target held
    but the server fell behind the arrivals; 'server' when it broke."""
    if level["status"] != "ok":
        return "server"
    shares = level.get("metric_attainment") or {}
    worst = min(shares, key=shares.get) if shares else None
    if worst is None or (shares[worst] >= attainment and level.get("kept_up") is False):
        return "throughput"
    return worst


def search(sweep: Sweep, *, attainment: float = 0.9, start_rate: float = 1.0, steps: int = 3,
           think_time_s: float = 0.0) -> dict:
    """Bracket, then bisect `steps` times; the answer with Little's law's users and the first metric to fail."""
    arrival = "trace scaled" if sweep.cfg.trace else arrivals.arrival_kind(sweep.cfg.burstiness)
    sweep.open(kind="capacity")
    status, error, result = "ok", None, None
    try:
        good, bad, error = find_edge(lambda rate: _level(sweep, rate, arrival), lambda level: holds(level, attainment),
                                     start_rate, steps, sweep.stopping.is_set)
        if error:
            status = "error"
        elif sweep.stopping.is_set():
            status = "stopped"
        result = answer(good, bad, attainment=attainment, think_time_s=think_time_s, slo=sweep.cfg.slo)
    except BaseException as exc:
        status, error = "error", f"{type(exc).__name__}: {exc}"
        raise
    finally:
        sweep.close(status, error, result)
    return sweep.summary(status, error, **result)


def find_edge(run_level, level_holds, start_rate: float, steps: int, stopped=lambda: False):
    """(the highest level that held, the lowest that failed above it, why a level broke or None): levels at
    doubling (or halving) rates from start_rate until one holds and one fails, then `steps` bisections between
    them. run_level(rate) gives a level (with its status, error and rate); the search ends early when stopped()."""
    good = bad = None
    rate = start_rate
    for _ in range(MAX_BRACKET_LEVELS):
        level = run_level(rate)
        if level["status"] != "ok":
            return good, bad, f"the level at {rate:.3g} req/s broke: {level['error']}"
        if level_holds(level):
            good, rate = level, rate * 2
        else:
            bad, rate = level, rate / 2
        if (good and bad) or stopped() or not arrivals.MIN_RATE <= rate <= arrivals.MAX_RATE or alone_failed(good, bad):
            break
    for _ in range(steps if good and bad else 0):
        if stopped():
            break
        level = run_level((good["rate"] + bad["rate"]) / 2)
        if level["status"] != "ok":
            return good, bad, f"the level at {level['rate']:.3g} req/s broke: {level['error']}"
        good, bad = (level, bad) if level_holds(level) else (good, level)
    return good, bad, None


def alone_failed(good: dict | None, bad: dict | None) -> bool:
    """No level held and the failing one's requests each ran alone: the target is missed unloaded, at any rate."""
    return good is None and bad is not None and bad.get("overlapped") is False


def _level(sweep: Sweep, rate: float, arrival: str) -> dict:
    return sweep.run_level({"kind": "rate", "rate": rate, "arrival": arrival})


def answer(good: dict | None, bad: dict | None, *, attainment: float, think_time_s: float, slo: dict) -> dict:
    """Stable fields: the capacity (the highest offered rate that held), its throughput, the users it
    serves by Little's law (users = rate x (response time + think time)), and what failed first."""
    response_s = None
    if good and good.get("e2e_mean_ms") is not None:
        response_s = (good["e2e_mean_ms"] + (good["client_queue_ms"]["mean"] or 0.0)) / 1e3
    rate = good["rate"] if good else None
    return {
        "slo": slo, "attainment_target": attainment, "think_time_s": think_time_s,
        "capacity_requests_per_s": rate,
        "measured_requests_per_s": good["requests_per_s"] if good else None,
        "output_tokens_per_s": good["output_tokens_per_s"] if good else None,
        "goodput_requests_per_s": good["goodput_requests_per_s"] if good else None,
        "attainment": good["attainment"] if good else None,
        "response_time_s": response_s,
        "users": rate * (response_s + think_time_s) if rate and response_s is not None else None,
        "first_failing_rate": bad["rate"] if bad else None,
        "limiting_metric": limiting_metric(bad, attainment) if bad else None,
        "failed_alone": alone_failed(good, bad),
    }


def describe(s: dict) -> str:
    """The answer in one sentence: the capacity, the users it serves, what failed first."""
    target = ", ".join(f"{k} {v:g}" for k, v in s["slo"].items())
    share = f"{s['attainment_target']:.0%} of requests within {target}"
    if s["capacity_requests_per_s"] is None and s["first_failing_rate"] is None:
        return "capacity: not found, no level finished"
    if s["capacity_requests_per_s"] is None and s.get("failed_alone"):
        return (f"capacity: none for {share}: at {s['first_failing_rate']:.3g} req/s every request ran alone and "
                f"{s['limiting_metric']} still failed, so no lower rate holds")
    if s["capacity_requests_per_s"] is None:
        return (f"capacity: below the lowest rate tried ({s['first_failing_rate']:.3g} req/s) for {share}; "
                f"{s['limiting_metric']} failed first")
    users = (f", about {s['users']:.1f} users at {s['think_time_s']:g} s think time (Little's law: rate x (response "
             f"{s['response_time_s']:.2f} s + think time))") if s["users"] is not None else ""
    edge = (f"; at {s['first_failing_rate']:.3g} req/s {s['limiting_metric']} failed first"
            if s["first_failing_rate"] else "; it held at every rate tried")
    return f"capacity: {s['capacity_requests_per_s']:.3g} req/s for {share}{users}{edge}"
