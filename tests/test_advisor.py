"""The advisor reads bucket shares and speedups, nothing else."""
from engine.report.advisor import advise, bound_by


def run(label, rate, **ms):
    buckets = {"physical": 0.0, "memory": 0.0, "compute": 0.0, "time": 0.0, "decision": 0.0} | ms
    return {"label": label, "decode_tokens_per_s": rate, **{f"{b}_ms": v for b, v in buckets.items()}}


def test_the_largest_group_decides_the_bound():
    assert bound_by(run("a", 1, memory=6, time=3, physical=1))[0] == "movement"
    assert bound_by(run("a", 1, memory=2, time=7))[0] == "waiting"
    assert bound_by(run("a", 1, compute=5, memory=1))[0] == "compute"


def test_the_best_lever_and_the_slower_ones_are_named():
    base = run("fp32", 20, memory=20, time=30)
    lines = advise([base, run("int4", 30, memory=5, time=28), run("bf16", 15, memory=10, time=55)], base)
    assert "bound by waiting" in lines[0]
    assert any("int4, 1.50x" in line for line in lines)
    assert any("Slower than the baseline here: bf16" in line for line in lines)


def test_a_slower_setting_is_never_called_a_lever_that_helped():
    base = run("fp32", 20, memory=20, time=30)
    lines = advise([base, run("bf16", 15, memory=10, time=55), run("int8", 19.8, memory=8, time=40)], base)
    assert not any("lever that helped" in line for line in lines)
    assert any("No setting decoded faster than the baseline" in line for line in lines)
    assert any("Slower than the baseline here: bf16." in line for line in lines)
