"""The shape of engine/: imports between its modules and between its wings run one way (no circle, no
wing importing the command line), the planner and the served client load no torch, and every module
says what it is."""
import ast
import subprocess
import sys
from pathlib import Path

from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components

ENGINE = Path(__file__).resolve().parent.parent / "engine"


def module_name(path: Path) -> str:
    parts = path.relative_to(ENGINE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ENGINE.rglob("*.py"))}


def imported(name: str) -> set[str]:
    """The engine modules one module imports, at any depth in its code (a lazy import inside a
    function is still an arrow: it runs whenever that function does)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found |= {f"{base}.{alias.name}" for alias in node.names} | {base}
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imported(name) for name in MODULES}


def circles(arrows: set[tuple[str, str]]) -> list[list[str]]:
    """The groups of names that reach each other through the arrows (a strongly connected part of more than one)."""
    names = sorted({n for arrow in arrows for n in arrow})
    index = {n: i for i, n in enumerate(names)}
    rows, cols = zip(*((index[a], index[b]) for a, b in arrows))
    matrix = csr_matrix(([1] * len(arrows), (rows, cols)), shape=(len(names), len(names)))
    _, labels = connected_components(matrix, directed=True, connection="strong")
    groups = {}
    for name, label in zip(names, labels):
        groups.setdefault(label, []).append(name)
    return [g for g in groups.values() if len(g) > 1]


def wing(name: str) -> str:
    """engine.run.generate's wing is run; a module directly under engine/ is a wing of its own."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else name


def test_no_two_modules_of_engine_import_each_other_through_any_path():
    assert circles({(a, b) for a, targets in GRAPH.items() for b in targets}) == []


def test_no_two_wings_of_engine_import_each_other_through_any_path():
    arrows = {(a, b) for a, targets in GRAPH.items() for b in targets if wing(a) != wing(b)}
    found = circles({(wing(a), wing(b)) for a, b in arrows})
    assert found == [], [sorted(f"{a} -> {b}" for a, b in arrows if {wing(a), wing(b)} <= set(c)) for c in found]


def test_a_circle_between_wings_is_found():
    assert circles({("run", "serve"), ("serve", "store"), ("store", "run"), ("run", "model")}) == [
        ["run", "serve", "store"]]


def test_nothing_outside_the_command_line_imports_it():
    reaching_up = {name: sorted(t for t in targets if t.startswith("engine.cli"))
                   for name, targets in GRAPH.items()
                   if not name.startswith("engine.cli") and name != "engine.__main__"}
    assert {name: found for name, found in reaching_up.items() if found} == {}


def test_the_planner_and_the_served_client_load_no_torch():
    code = "import sys, engine.plan.planner, engine.serve.client; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ENGINE.parent, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_every_module_of_engine_has_a_docstring():
    missing = [name for name, path in MODULES.items()
               if path.stat().st_size and not ast.get_docstring(ast.parse(path.read_text()))]
    assert missing == []
