"""Where the project's files are: the repository, shipped data and texts, runtime folders.

Only pathlib and the environment: pure modules import this without loading torch or DuckDB."""
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA = REPO_ROOT / "data"
EVAL_TEXT = DATA / "eval.txt"  # quality: teacher-forced perplexity, KL and top-1
CALIBRATION_TEXT = DATA / "calibration.txt"  # int8 smoothing factors, sparsity thresholds
WORKLOADS = DATA / "workloads.json"
RESULTS = REPO_ROOT / "bench" / "results"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the model every fresh install carries (see engine.model.loader)


def models_dir() -> Path:
    """Converted and local models ($TOKENPATH_MODELS, default data/models)."""
    return Path(os.environ.get("TOKENPATH_MODELS", DATA / "models"))


def default_db_path() -> Path:
    """The run store ($TOKENPATH_DB, default data/runs.duckdb)."""
    return Path(os.environ.get("TOKENPATH_DB", DATA / "runs.duckdb"))


def workloads() -> dict[str, dict]:
    """The shipped prompts, by name (data/workloads.json)."""
    import json

    data = json.loads(WORKLOADS.read_text())
    return {w["name"]: w for w in data["workloads"]}
