"""The advisor reads bucket shares and speed ratios with their 95% intervals, nothing else: it names a
lever only where the repeats show a difference."""
from engine.report.advisor import advise, bound_by, settings


def run(label, rate, repeats=(), **ms):
    buckets = {"physical": 0.0, "memory": 0.0, "compute": 0.0, "time": 0.0, "decision": 0.0} | ms
    return {"label": label, "decode_tokens_per_s": rate, "decode_rates": list(repeats),
            **{f"{b}_ms": v for b, v in buckets.items()}}


def test_the_largest_group_decides_the_bound():
    assert bound_by(run("a", 1, memory=6, time=3, physical=1))[0] == "movement"
    assert bound_by(run("a", 1, memory=2, time=7))[0] == "waiting"
    assert bound_by(run("a", 1, compute=5, memory=1))[0] == "compute"


def test_the_best_lever_and_the_slower_ones_are_named_with_their_intervals():
    base = run("fp32", 20, [20.1, 19.8, 20.3], memory=20, time=30)
    lines = advise([base, run("int4", 30, [29.5, 30.4, 30.2], memory=5, time=28),
                    run("bf16", 15, [15.2, 14.7, 15.1], memory=10, time=55)], base)
    assert "bound by waiting" in lines[0]
    assert any("The lever that helped most here: int4, decode speed against the baseline 1.50x (95% interval" in line for line in lines)
    assert any(line.startswith("Slower than the baseline here: bf16: 0.75x (95% interval") for line in lines)


def test_a_slower_setting_is_never_called_a_lever_that_helped():
    base = run("fp32", 20, [20.0, 20.4, 19.7], memory=20, time=30)
    lines = advise([base, run("bf16", 15, [15.0, 15.3, 14.8], memory=10, time=55),
                    run("int8", 19.8, [19.6, 20.3, 19.9], memory=8, time=40)], base)
    assert not any("lever that helped" in line for line in lines)
    assert any("No setting decoded measurably faster than the baseline" in line for line in lines)
    assert any("Not shown to differ from the baseline: int8" in line and "no measurable difference" in line
               for line in lines)


def test_a_faster_mean_inside_the_noise_or_a_single_run_is_no_win():
    base = run("fp32", 20, [17.0, 23.0, 20.0], time=30)
    noisy = run("int8", 22, [18.0, 26.0, 22.0], time=28)
    single_base, single = run("fp32", 20, time=30), run("int4", 30, time=20)
    for runs, b in (([base, noisy], base), ([single_base, single], single_base)):
        lines = advise(runs, b)
        assert not any("lever that helped" in line for line in lines)
        assert any("Not shown to differ" in line for line in lines)


def test_repeats_of_one_setting_become_one_row_in_first_seen_order():
    runs = [{**run(name, rate), "run_id": i} for i, (name, rate) in
            enumerate([("fp32", 20.0), ("int8", 25.0), ("fp32", 21.0), ("int8", float("nan")), ("int8", 26.0)])]
    rows = settings(runs)
    assert [(r["label"], r["repeats"], r["run_ids"], r["decode_rates"]) for r in rows] == [
        ("fp32", 2, [0, 2], [20.0, 21.0]), ("int8", 3, [1, 3, 4], [25.0, 26.0])]
