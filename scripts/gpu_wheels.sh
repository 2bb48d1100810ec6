#!/usr/bin/env bash
# The wheels `make gpu-check` needs on a GPU machine that has torch, triton and transformers installed system-wide
# but no network and no .venv: the pure-Python or small packages the engine's in-memory path and kvtransfer import
# that such an image lacks. Downloaded here into .whl/ (gitignored; carry it with the working tree), for CPython 3.12
# on x86-64 Linux; `make gpu-check` installs them into a scratch directory when .venv is absent.
#
#   scripts/gpu_wheels.sh [PYTHON_VERSION]     # default 3.12
set -euo pipefail
cd "$(dirname "$0")/.."
PYV="${1:-3.12}"
PY="${PY:-python3}"
[ -x .venv/bin/python ] && PY=.venv/bin/python
# gguf: services/engine/tokenizer.py imports it at module load (the engine imports the tokenizer module even for an
#       in-memory model); pure Python. xxhash: services/kvtransfer/ticket.py (imported by the kvtransfer package,
#       hence by cuda_ipc); a small C extension, so the wheel must match the target's Python.
# Versions: the ones pyproject.toml and `make setup` resolve to.
WHEELS=(gguf==0.19.0 xxhash==3.5.0)
rm -rf .whl && mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
	--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl "${WHEELS[@]}"
ls -l .whl
du -sh .whl
