"""Builds and calls the CUDA NVFP4 quantize kernel (cuda/nvfp4_quant.cu, bound to torch by cuda/binding.cpp).

The extension is compiled on first use with torch.utils.cpp_extension.load for the exact GPU in the machine,
so Blackwell gets the `a` target that has the hardware E2M1 conversion. Nothing here runs at import time: on
a machine without CUDA, importing is free and calling raises CudaKernelUnavailable with the reason.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path

import torch

from .recipe import BLOCK_SIZE, NVFP4Tensor, abs_max, check_finite, global_scale_for_amax, padded_size

CUDA_DIR = Path(__file__).resolve().parent / "cuda"
KERNEL_SOURCE = CUDA_DIR / "nvfp4_quant.cu"
BINDING_SOURCE = CUDA_DIR / "binding.cpp"

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CudaKernelUnavailable(RuntimeError):
    """The CUDA kernel cannot run here (no CUDA device, a CPU-only torch, or no nvcc to build it)."""


def arch_for_capability(major: int, minor: int) -> str:
    """nvcc arch suffix for a compute capability: '90' for Hopper, '100a' for B200, '120a' for RTX 50.

    From Blackwell on, the `a` (architecture-specific) target is what enables cvt.rn.satfinite.e2m1x2.
    """
    return f"{major}{minor}a" if major >= 10 else f"{major}{minor}"


def gencode_flag(arch: str) -> str:
    return f"-gencode=arch=compute_{arch},code=sm_{arch}"


def nvcc_compile_command(nvcc: str, arch: str, output: Path, *, keep_dir: Path | None = None) -> list[str]:
    """The nvcc command that compiles the torch-free kernel file alone to an object (used by the tests)."""
    cmd = [nvcc, "-c", "-std=c++17", "-O3", gencode_flag(arch), "-o", str(output), str(KERNEL_SOURCE)]
    if keep_dir is not None:
        cmd[1:1] = ["--keep", "--keep-dir", str(keep_dir)]
    return cmd


def cuda_unavailable_reason() -> str | None:
    """Why the CUDA kernel cannot run on this machine, or None if it can be built and run."""
    if torch.version.cuda is None:
        return "this torch build has no CUDA support"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    from torch.utils.cpp_extension import CUDA_HOME, is_ninja_available

    nvcc = str(Path(CUDA_HOME) / "bin" / "nvcc") if CUDA_HOME is not None else shutil.which("nvcc")
    if nvcc is None or not Path(nvcc).exists():
        return "nvcc was not found (set CUDA_HOME) to build the extension"
    if not is_ninja_available():
        return "ninja is not installed; torch.utils.cpp_extension.load needs it (pip install ninja)"
    return toolkit_mismatch(nvcc, torch.version.cuda)


def toolkit_mismatch(nvcc: str, torch_cuda: str) -> str | None:
    """Why `nvcc` cannot build an extension for a torch built with CUDA `torch_cuda`, or None: torch's
    cpp_extension refuses a toolkit of another major version (a CUDA 12 toolkit in /usr/local/cuda beside a cu130
    torch), which is a machine without a usable toolkit, not a broken kernel."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{nvcc} --version failed: {e}"
    found = re.search(r"release (\d+)\.(\d+)", out)
    if found is None:
        return f"{nvcc} --version names no CUDA release"
    if found.group(1) != torch_cuda.split(".")[0]:
        return (
            f"{nvcc} is CUDA {found.group(1)}.{found.group(2)} but torch was built with CUDA {torch_cuda}; "
            "torch.utils.cpp_extension builds only with a toolkit of the same major version"
        )
    return None


@functools.cache
def _load_for_arch(arch: str) -> None:
    from torch.utils import cpp_extension

    cpp_extension.load(
        name=f"rackserve_nvfp4_sm{arch}",
        sources=[str(BINDING_SOURCE), str(KERNEL_SOURCE)],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", gencode_flag(arch)],
        is_python_module=False,
        verbose=False,
    )


def load_extension(device: torch.device | None = None) -> None:
    """Compile (first call, ~10-60 s) and load the extension for `device`'s GPU; raise if CUDA is missing."""
    reason = cuda_unavailable_reason()
    if reason is not None:
        raise CudaKernelUnavailable(f"NVFP4 CUDA kernel unavailable: {reason}")
    major, minor = torch.cuda.get_device_capability(device)
    _load_for_arch(arch_for_capability(major, minor))


def quantize_cuda(x: torch.Tensor) -> NVFP4Tensor:
    """NVFP4-quantize a CUDA tensor along its last dim with the CUDA kernel; same bytes as recipe.quantize."""
    if not x.is_cuda:
        raise CudaKernelUnavailable(f"quantize_cuda: input must be a CUDA tensor, got {x.device}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"quantize_cuda: input must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("quantize_cuda: input must have at least one dimension")
    load_extension(x.device)
    shape = tuple(x.shape)
    k = shape[-1]
    nb = padded_size(k) // BLOCK_SIZE
    x2 = x.reshape(-1, k)
    if k > 1 and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    amax = abs_max(x2).to(torch.float32)  # one read of x, no |x| temporary
    if not bool(torch.isfinite(amax)):
        check_finite(x2)
    g = global_scale_for_amax(amax).reshape(1)
    packed = torch.empty((x2.shape[0], nb * 8), dtype=torch.uint8, device=x.device)
    scales = torch.empty((x2.shape[0], nb), dtype=torch.uint8, device=x.device)
    with torch.cuda.device(x.device):
        stream = torch.cuda.current_stream(x.device).cuda_stream
        torch.ops.rackserve_nvfp4.quantize_into(x2, g, packed, scales, stream)
    lead = shape[:-1]
    return NVFP4Tensor(
        packed=packed.reshape(*lead, nb * 8),
        scales=scales.reshape(*lead, nb),
        global_scale=g.reshape(()),
        shape=shape,
    )
