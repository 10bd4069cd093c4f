"""Where the project's files are: the repository, shipped data and texts, runtime folders.

Only pathlib, hashlib and the environment: pure modules import this without loading torch or DuckDB."""
import hashlib
import os
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE.parent
# A checkout reads its shipped files from data/ and keeps runs, models and kernel builds beside them; an
# installed package (pip install .) carries the shipped files as engine/data and keeps what it writes in
# the user's data folder ($XDG_DATA_HOME/tokenpath, default ~/.local/share/tokenpath).
CHECKOUT = (REPO_ROOT / "data" / "workloads.json").is_file()
DATA = REPO_ROOT / "data" if CHECKOUT else PACKAGE / "data"
STATE = DATA if CHECKOUT else Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "tokenpath"
BUILD = REPO_ROOT / "build" if CHECKOUT else STATE / "build"
EVAL_TEXT = DATA / "eval.txt"  # quality: teacher-forced perplexity, KL and top-1
CALIBRATION_TEXT = DATA / "calibration.txt"  # int8 smoothing factors, sparsity thresholds
WORKLOADS = DATA / "workloads.json"
RESULTS = REPO_ROOT / "bench" / "results"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the model every fresh install carries (see engine.model.loader)


def text_digest(path: Path = EVAL_TEXT) -> str:
    """A short fingerprint of a text's bytes, stored beside what was measured on it (quality: eval.txt by default)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]


def models_dir() -> Path:
    """Converted and local models ($TOKENPATH_MODELS, default data/models, or models in the user folder)."""
    return Path(os.environ.get("TOKENPATH_MODELS", STATE / "models"))


CACHE_ENV = "TOKENPATH_CACHE"


def cache_dir() -> Path:
    """What is measured or fitted once per machine or model and reused ($TOKENPATH_CACHE, default
    $XDG_CACHE_HOME/tokenpath, ~/.cache/tokenpath)."""
    return Path(os.environ.get(CACHE_ENV)
                or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokenpath")


def default_db_path() -> Path:
    """The run store ($TOKENPATH_DB, default data/runs.duckdb, or runs.duckdb in the user folder)."""
    return Path(os.environ.get("TOKENPATH_DB", STATE / "runs.duckdb"))


def workloads() -> dict[str, dict]:
    """The shipped prompts, by name (data/workloads.json)."""
    import json

    data = json.loads(WORKLOADS.read_text())
    return {w["name"]: w for w in data["workloads"]}
