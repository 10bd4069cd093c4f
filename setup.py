"""The package's layout; everything else is in pyproject.toml. An installed package (pip install ., not
-e) has no checkout beside it, so the wheel carries data/'s shipped files (the GPU data sheets, presets,
fitted constants, prompts, texts, traces) as engine/data, where engine.paths looks for them."""
from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["engine*"]), "engine.model.kernels", "engine.data", "engine.data.traces"],
      package_dir={"engine.data": "data"})
