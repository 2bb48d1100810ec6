"""`scripts/triton_compile_check.py`: every Triton kernel configuration a GPU worker launches, compiled to a cubin
for Hopper (sm_90) and Blackwell (sm_100) by Triton's real compiler and ptxas, without a GPU.

The interpreter tests prove the kernels' numbers; this proves they lower — through the engine's own launch
wrappers, at the shapes `make gpu-check` builds — and fit: within the shared memory of every sm_80+ part (99 KiB,
the sm_86/89 parts' limit, so an L40S runs them too), and, in bf16 (the serving dtype), without spilled
registers. A real run of the script, its JSON report read back.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO

pytestmark = pytest.mark.cluster  # runs the script, and ptxas, as processes

SMALLEST_SHARED = 99 * 1024


def test_every_kernel_launch_compiles_for_hopper_and_blackwell(tmp_path: Path) -> None:
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("triton built without the NVIDIA backend")
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "triton_compile_check.py"), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=900, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "triton_compile.json").read_text())
    assert report["failures"] == []
    hopper, blackwell = report["targets"]["90"], report["targets"]["100"]
    kernels = {arch: {r["kernel"] for r in rows} for arch, rows in (("90", hopper), ("100", blackwell))}
    attention = {"_decode_kernel", "_reduce_splits_kernel", "_prefill_kernel"}
    assert kernels["90"] == attention | {"_quantize_kernel", "_w4a16_kernel"}
    assert kernels["100"] == attention | {"_quantize_kernel"}  # Blackwell's FP4 GEMM is torch._scaled_mm
    for row in hopper + blackwell:
        assert row["error"] is None, row
        assert 0 < row["shared"] <= SMALLEST_SHARED, row
        assert row["registers"] is not None and row["registers"] <= 255, row
        if "bfloat16" in row["case"]:
            assert row["stack_bytes"] == 0, row  # nothing spilled on the serving path
    # every decode batch of the check, single pass and split-K, for both model shapes
    decode = [r["case"] for r in hopper if r["kernel"] == "_decode_kernel"]
    assert len(decode) == 2 * 2 * 3 * 2  # models x dtypes x batches x contexts
    assert any("16 splits" in c for c in decode) and any("(1 splits)" in c for c in decode)
    assert (tmp_path / "triton_compile.md").read_text().count("| ok |") == len(hopper) + len(blackwell)


def test_the_w4a16_gemm_spills_nothing_in_bf16_on_ampere_and_ada_either(tmp_path: Path) -> None:
    """Before Hopper both dot operands live in registers: the GEMM loads block scales per weight byte there and
    takes eight warps at mid batch. Widening a scale tile (Hopper's way) spilled 2 KB per thread at M = 32 on
    sm_80, and the 64 x 64 tile at four warps 16-24 B."""
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("triton built without the NVIDIA backend")
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "triton_compile_check.py"), "--arch", "80,89", "--only", "w4a16",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=900, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "triton_compile.json").read_text())
    for arch in ("80", "89"):
        rows = [r for r in report["targets"][arch] if "bfloat16" in r["case"]]
        assert len(rows) == 12  # M = 1, 32, 2048 over the 8B's four projections
        for row in rows:
            assert row["error"] is None and row["stack_bytes"] == 0, row
