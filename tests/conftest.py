import pytest
import torch

from engine import hardware
from engine.models import load_model, tiny_model
from engine.store import Store


@pytest.fixture(scope="session")
def calibration():
    return hardware.calibration_for(torch.device("cpu"))


@pytest.fixture(scope="session")
def tiny_lm():
    return tiny_model()


@pytest.fixture(scope="session")
def default_lm():
    return load_model()


@pytest.fixture
def store(tmp_path):
    return Store(tmp_path / "runs.duckdb")
