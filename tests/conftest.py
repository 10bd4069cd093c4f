import os

# pytest-xdist's workers share the cores: each takes its share of them for its OpenMP threads (and the commands
# and servers it starts inherit that), since two workers each running as many threads as there are cores wait
# on one another's threads. A thread count set by the user stands; the kernels' tests set their own counts.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _workers)))

import engine  # noqa: E402,F401  (before torch: it chooses how OpenMP threads wait, before torch loads OpenMP)
import atexit
import shutil
import signal
import tempfile

import pytest
import torch

from engine.paths import DATA

# Runs in tests, and in the commands and pages they start, are attributed with one fixed calibration
# instead of each process measuring the machine for minutes; the calibration's own tests measure.
os.environ.setdefault("TOKENPATH_CALIBRATION", str(DATA / "test_calibration.json"))
# What the calibration's own tests measure on a loaded machine stays out of the user's calibration cache. The
# process that makes the folder (pytest's own, whose test processes inherit it) removes it as it exits.
if "TOKENPATH_CACHE" not in os.environ:
    os.environ["TOKENPATH_CACHE"] = tempfile.mkdtemp(prefix="tokenpath-test-cache-")
    atexit.register(shutil.rmtree, os.environ["TOKENPATH_CACHE"], ignore_errors=True)

from engine.measure import hardware
from engine.model.loader import load_model, tiny_model
from engine.store.db import Store
import commands
import tiers

# Tests send Ctrl-C to the commands they start, as a terminal does to a foreground process. A shell
# without job control that starts the suite in the background makes it ignore SIGINT, and an ignored
# signal stays ignored in every process started from it; a handled one is reset to the default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def calibration():
    return hardware.calibration_for(torch.device("cpu"))


@pytest.fixture(scope="session")
def tiny_lm():
    return tiny_model()


@pytest.fixture(scope="session")
def default_lm():
    return load_model()


@pytest.fixture(scope="session")
def hf_lm():
    """The default model on transformers' own forward, to check the lean forward against."""
    return load_model(lean_forward=False)


def _saved_tiny_model(folder, **kwargs):
    lm = tiny_model(lean_forward=False, **kwargs)
    lm.model.save_pretrained(folder)
    lm.tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """A tiny random Llama saved as a model folder, so command-line and page runs load in a second."""
    return _saved_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def long_tiny_folder(tmp_path_factory):
    """The tiny Llama with room for 8192 positions: a run of thousands of its tokens lasts seconds
    however fast the machine, so a signal sent once its first tokens are out lands while it decodes."""
    return _saved_tiny_model(tmp_path_factory.mktemp("long-tiny-model"), positions=8192)


@pytest.fixture
def store(tmp_path):
    return Store(tmp_path / "runs.duckdb")


@pytest.fixture
def page_db(tmp_path, monkeypatch):
    """A fresh database the pages under test write to (through TOKENPATH_DB)."""
    path = tmp_path / "pages.duckdb"
    monkeypatch.setenv("TOKENPATH_DB", str(path))
    monkeypatch.setenv("TOKENPATH_WARM", "0")  # no model loaded ahead for pages that may run nothing
    return path


def pytest_configure(config):
    tiers.register(config)


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    """Each test is marked by what it costs (tiers.py), so `-m "not slow"` is the fast tier, and the costliest
    modules come first; the marks and groups go on before any plugin reads them in this hook (pytest-xdist
    reads the groups)."""
    for item in items:
        tiers.classify(item)
    tiers.longest_first(items)
    result = yield
    tiers.check_groups(config, items)
    return result


def pytest_runtest_setup(item):
    tiers.refuse_ungrouped(item)


@pytest.fixture(autouse=True)
def _launcher(request):
    """A test that starts processes (commands, pages, servers) has them forked by this test process's launcher
    (engine.launch), which has imported the libraries once."""
    if any(request.node.get_closest_marker(m) for m in ("subprocess", "page", "browser")):
        commands.use_launcher()
