# One command set for humans, README and CI.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup demo test test-unit test-integration test-e2e lint format bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[worker,api,dev]'
	touch $(STAMP)

## setup: virtualenv with the worker and dev extras (~6 GB, ~2 min)
setup: $(STAMP)

## demo: the main job end to end on the embedded default
demo: setup
	$(BIN)/vlmq demo

## test: the whole suite (unit, integration, e2e), CPU only
test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-unit: setup
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

test-integration: setup
	$(BIN)/python -m pytest tests/integration $(PYTEST_ARGS)

test-e2e: setup
	$(BIN)/python -m pytest tests/e2e $(PYTEST_ARGS)

## lint: ruff and mypy
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

## bench: the performance report (bench/REPORT.md + bench/throughput.png)
bench: setup
	$(BIN)/python -m bench.report

clean:
	rm -rf .vlmq bench/out .pytest_cache .mypy_cache .ruff_cache
