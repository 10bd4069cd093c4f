"""Test tiers: each test is marked by what it costs, read from the fixtures it uses and the source
of its function, its module's fixtures and the module's helpers it calls, so no one marks by hand."""
from __future__ import annotations

import ast
import functools
import inspect
import re
import sys
import textwrap

import pytest

# marker: (fixtures that bring the cost, source patterns that bring it)
COSTS = {
    "model": ({"default_lm", "hf_lm"}, [r"\bload_model\((\)|\w+=)", r"\bdefault_model_dir\(", r"\bmodel=\"default\""]),
    "subprocess": (set(), [r"\bsubprocess\.", r"\bPopen\(", r"\bsys\.executable\b", r"\bGenerationWorker\b",
                           r"\bserve_app\b", r"\b(run|start)_(engine|python)\("]),
    "page": (set(), [r"\bAppTest\b"]),
    "browser": (set(), [r"\bplaywright\b", r"^from browser import", r"\bbrowser_page\b"]),
    "vllm": ({"vllm_url"}, [r"\bVLLMServer\b"]),
    "kernel_build": (set(), [r"\bTOKENPATH_BUILD\b", r"\bcpp_extension\b", r"\bcpu_kernels\.build\("]),
}
MARKERS = {
    "slow": "costs seconds or more: any of the markers below (the fast tier is -m 'not slow')",
    "model": "loads the real default model (SmolLM2-135M-Instruct)",
    "subprocess": "starts a process (a command, a server)",
    "page": "runs a page under Streamlit's AppTest",
    "browser": "drives a real browser through Playwright",
    "vllm": "uses the real vLLM server (CPU build, .venv-vllm), started once per session",
    "kernel_build": "builds the C++ kernels",
}
_sources: dict = {}
UNGROUPED = pytest.StashKey[bool]()


def _names(source: str) -> set[str]:
    return {node.id for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Name)}


def _is_test_code(obj) -> bool:
    """A function or class written in the tests (a test module or conftest), whichever module uses it."""
    return ((inspect.isfunction(obj) or inspect.isclass(obj))
            and str(obj.__module__).split(".")[-1].startswith(("test_", "conftest")))


@functools.cache
def _own_source(fn) -> tuple[str, frozenset]:
    """fn's source and the names it uses, read once however many tests use fn (inspect parses a class's whole
    module to find it)."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return "", frozenset()
    return source, frozenset(_names(source))


def _function_source(fn, module, seen: set) -> str:
    """fn's source (a function's or a class's) and, recursively, that of the functions and classes of the tests
    it names, so a helper imported from another test module (a class that starts servers) counts too."""
    if fn in seen:
        return ""
    seen.add(fn)
    source, names = _own_source(fn)
    if not source:
        return ""
    parts = [source]
    for name in names:
        helper = getattr(module, name, None)
        if _is_test_code(helper) or (inspect.isfunction(helper) and helper.__module__ == module.__name__):
            parts.append(_function_source(helper, sys.modules.get(helper.__module__, module), seen))
    return "\n".join(parts)


def _module_imports(module) -> str:
    """The module's import lines: a module that imports Playwright drives a browser in every test."""
    if module not in _sources:
        try:
            tree = ast.parse(inspect.getsource(module))
        except (OSError, TypeError):
            tree = ast.Module(body=[], type_ignores=[])
        _sources[module] = "\n".join(ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)))
    return _sources[module]


def _module_fixtures(item):
    """The fixture definitions of the test's own module among those it uses."""
    defs = getattr(item, "_fixtureinfo", None)
    if defs is None:
        return []
    return [d for name in item.fixturenames for d in defs.name2fixturedefs.get(name, ())
            if getattr(d.func, "__module__", None) == item.module.__name__]


def _test_fixtures(item):
    """The fixture definitions from the tests' own files (any test module or conftest) that the test uses,
    so a fixture imported from another test module (a small server it starts) counts too."""
    defs = getattr(item, "_fixtureinfo", None)
    if defs is None:
        return []
    return [d for name in item.fixturenames for d in defs.name2fixturedefs.get(name, ())
            if str(getattr(d.func, "__module__", "")).split(".")[-1].startswith(("test_", "conftest"))]


def costs(item) -> set[str]:
    """The cost markers that apply to one collected test."""
    module, seen = item.module, set()
    source = "\n".join([_module_imports(module), _function_source(item.function, module, seen),
                        *(_function_source(d.func, sys.modules.get(d.func.__module__, module), seen)
                          for d in _test_fixtures(item))])
    found = {m.name for m in item.iter_markers() if m.name in COSTS}
    if item.get_closest_marker("integration"):  # the hand-set marker for the real default model
        found.add("model")
    for marker, (names, patterns) in COSTS.items():
        if names & set(item.fixturenames) or any(re.search(p, source, re.M) for p in patterns):
            found.add(marker)
    return found


def classify(item) -> None:
    """Add the test's cost markers, `slow` when it has any, and an xdist group where its tests must
    share one process: the vLLM server, or a fixture of its module computed once for all of them."""
    found = costs(item)
    for marker in sorted(found):
        item.add_marker(marker)
    if found:
        item.add_marker("slow")
    if "vllm" in found:
        item.add_marker(pytest.mark.xdist_group("vllm"))
    elif any(d.scope in ("module", "class", "package") for d in _module_fixtures(item)):
        item.add_marker(pytest.mark.xdist_group(item.module.__name__))


# A module's place in the run: the longest tests start first, so that none of them is what the other workers
# wait for at the end of a parallel run. Modules move whole, keeping their module-scoped fixtures together.
LONGEST_FIRST = ("browser", "vllm", "model", "kernel_build", "page", "subprocess")


def longest_first(items: list) -> None:
    """Reorder the collected tests, module by module, by the costliest marker any of a module's tests has."""
    rank: dict = {}
    for item in items:
        found = [LONGEST_FIRST.index(m.name) for m in item.iter_markers() if m.name in LONGEST_FIRST]
        rank[item.module] = min([rank.get(item.module, len(LONGEST_FIRST)), *found])
    items.sort(key=lambda item: rank[item.module])


def check_groups(config, items) -> None:
    """pytest-xdist's loadgroup sends a group to one worker by writing the group into each test's id;
    where it cannot (pytest-xdist 3.8 under pytest 9.2), a group's tests spread over the workers and
    each starts its own vLLM server or module fixture: such a test fails instead of running."""
    if getattr(config.option, "loadgroup", False):
        for item in items:
            item.stash[UNGROUPED] = bool(item.get_closest_marker("xdist_group")) and "@" not in item.nodeid


def refuse_ungrouped(item) -> None:
    if item.stash.get(UNGROUPED, False):
        pytest.fail("pytest-xdist did not keep this test with its group: install the pytest and pytest-xdist "
                    "that requirements-test.txt pins.", pytrace=False)


def register(config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
