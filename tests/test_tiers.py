"""The tiers read a test's cost from the helpers it uses, classes imported from other test modules included."""
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def collected(*args) -> list[str]:
    """The test ids pytest collects with these arguments, in the order it would run them."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          *map(str, args)], capture_output=True, text=True, timeout=600, cwd=TESTS.parent)
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_a_server_started_through_a_class_of_another_test_module_is_not_in_the_fast_tier():
    fast = collected("-m", "not slow", TESTS / "test_load.py", TESTS / "test_faults.py")
    assert "tests/test_load.py::test_arrival_schedule_keeps_its_rate_and_burstiness_and_repeats_with_its_seed" in fast
    assert not any("goodput_and_throughput_follow_a_server_of_known_service_time" in t for t in fast)
    assert not any(t.startswith("tests/test_faults.py::") for t in fast)


def test_the_modules_with_the_costliest_tests_run_first_each_module_whole():
    tests = collected(TESTS / "test_slo.py", TESTS / "test_load.py", TESTS / "test_browser.py")
    modules = [t.split("::")[0] for t in tests]
    order = [m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m]
    assert order == ["tests/test_browser.py", "tests/test_load.py", "tests/test_slo.py"]
