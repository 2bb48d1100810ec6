"""The CUDA NVFP4 quantize kernel without a GPU: it compiles with nvcc for Hopper (sm_90, software E2M1) and
Blackwell (sm_100a, hardware cvt.rn.satfinite.e2m1x2), and its block routine — compiled for the host from the
same source — produces the reference's bytes. Skipped only where nvcc is absent."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.engine.nvfp4 import quantize
from services.engine.nvfp4.cuda_kernels import (
    BINDING_SOURCE,
    KERNEL_SOURCE,
    CudaKernelUnavailable,
    arch_for_capability,
    gencode_flag,
    load_extension,
    nvcc_compile_command,
    quantize_cuda,
    toolkit_mismatch,
)
from tests.engine.nvfp4.test_nvfp4_triton import quantize_cases
from tests.support.paths import REPO

pytestmark = pytest.mark.cluster  # starts nvcc and a compiled extension


def find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    candidate = Path(cuda_home) / "bin" / "nvcc"
    return str(candidate) if candidate.exists() else None


NVCC = find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
HW_E2M1 = "cvt.rn.satfinite.e2m1x2.f32"


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Compile once, in parallel: objects for sm_90 and sm_100a (PTX kept) and a host shared library."""
    assert NVCC is not None
    tmp = tmp_path_factory.mktemp("nvcc")
    jobs = {}
    for arch in ("90", "100a"):
        (tmp / arch).mkdir()
        cmd = nvcc_compile_command(NVCC, arch, tmp / arch / "nvfp4_quant.o", keep_dir=tmp / arch)
        jobs[arch] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lib = tmp / "libnvfp4_host.so"
    host_cmd = [NVCC, "-shared", "-Xcompiler", "-fPIC", "-std=c++17", "-O2", gencode_flag("90")]
    jobs["host"] = subprocess.Popen(
        [*host_cmd, "-o", str(lib), str(KERNEL_SOURCE)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    logs = {name: job.communicate(timeout=300)[0] for name, job in jobs.items()}
    codes = {name: job.returncode for name, job in jobs.items()}
    return tmp, lib, codes, logs


@needs_nvcc
@pytest.mark.parametrize(("arch", "hardware_e2m1"), [("90", False), ("100a", True)])
def test_kernel_compiles_and_picks_the_e2m1_path_per_arch(builds, arch, hardware_e2m1):
    tmp, _, codes, logs = builds
    assert codes[arch] == 0, logs[arch]
    assert (tmp / arch / "nvfp4_quant.o").stat().st_size > 0
    ptx = (tmp / arch / "nvfp4_quant.ptx").read_text()
    assert (HW_E2M1 in ptx) == hardware_e2m1
    assert "div.rn.f32" in ptx  # the IEEE divisions survived as such


@needs_nvcc
@pytest.mark.parametrize(
    "name", ["edge_cases", "e4m3_sweep", "e2m1_sweep", "k_not_multiple_of_16", "gaussian"]
)
def test_host_build_of_the_block_routine_matches_the_reference(builds, name):
    _, lib_path, codes, logs = builds
    assert codes["host"] == 0, logs["host"]
    lib = ctypes.CDLL(str(lib_path))
    fn = lib.rackserve_nvfp4_quantize_host
    fn.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_float,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    fn.restype = None

    x = quantize_cases()[name].float().contiguous()
    ref = quantize(x)
    rows, k = x.shape
    packed = torch.full_like(ref.packed, 0xAB)
    scales = torch.full_like(ref.scales, 0xAB)
    fn(x.data_ptr(), rows, k, float(ref.global_scale), packed.data_ptr(), scales.data_ptr())
    assert torch.equal(scales, ref.scales), f"{int((scales != ref.scales).sum())} scale bytes differ"
    assert torch.equal(packed, ref.packed), f"{int((packed != ref.packed).sum())} code bytes differ"


def test_a_toolkit_of_another_cuda_major_than_torchs_is_a_reason_to_skip_not_a_build_failure(tmp_path):
    def fake_nvcc(release: str) -> str:
        path = tmp_path / f"nvcc-{release}"
        path.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.88'\n")
        path.chmod(0o755)
        return str(path)

    assert toolkit_mismatch(fake_nvcc("13.0"), "13.0") is None
    assert toolkit_mismatch(fake_nvcc("13.1"), "13.0") is None  # minor versions build together
    reason = toolkit_mismatch(fake_nvcc("12.8"), "13.0")
    assert reason is not None and "CUDA 12.8" in reason and "13.0" in reason
    assert "names no CUDA release" in str(toolkit_mismatch("/bin/true", "13.0"))
    assert "failed" in str(toolkit_mismatch(str(tmp_path / "absent"), "13.0"))


def test_arch_selection_uses_the_a_target_from_blackwell_on():
    assert arch_for_capability(9, 0) == "90"
    assert arch_for_capability(10, 0) == "100a"
    assert arch_for_capability(12, 0) == "120a"
    assert gencode_flag("100a") == "-gencode=arch=compute_100a,code=sm_100a"


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")
def test_binding_compiles_against_torch_headers():
    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{p}" for p in include_paths()]
    proc = subprocess.run(
        ["g++", "-std=c++20", "-fsyntax-only", "-w", *includes, str(BINDING_SOURCE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on machines without CUDA")
def test_without_cuda_the_loader_raises_a_clear_error():
    with pytest.raises(CudaKernelUnavailable, match="CUDA"):
        load_extension()
    with pytest.raises(CudaKernelUnavailable, match="must be a CUDA tensor"):
        quantize_cuda(torch.randn(4, 16))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_gpu_check_script_without_cuda_says_so_and_exits_zero():
    script = REPO / "scripts" / "gpu_check.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device" in proc.stdout
