"""W4A4 on Blackwell: both operands NVFP4, multiplied on block-scaled FP4 tensor cores via torch._scaled_mm.

This path changes numerics relative to W4A16: activations are quantized to NVFP4 on every call. It is only
ever used when a caller asks for it, and only on GPUs with compute capability >= 10.0.

torch._scaled_mm takes the two operands as float4_e2m1fn_x2 (A [M, K/2] row-major, B [K/2, N] column-major,
i.e. the transpose of our [N, K/2] weight), their E4M3 block scales in the 128x4 swizzled layout, and computes
sum(code_a * s_a * code_b * s_b). The two tensor scales are applied afterwards as
alpha = 1 / (g_e(A) * g_e(B)), as docs/nvfp4.md prescribes. cuBLAS wants K to be a multiple of 32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layouts import swizzle_scales
from .recipe import NVFP4Tensor, quantize


class BlackwellUnavailable(RuntimeError):
    """The FP4 tensor-core GEMM needs a CUDA GPU of compute capability 10.0 or newer."""


def blackwell_unavailable_reason(device: torch.device | None = None) -> str | None:
    """Why W4A4 cannot run on `device` (default: the current CUDA device), or None if it can."""
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    if not hasattr(torch, "float4_e2m1fn_x2"):
        return f"torch {torch.__version__} has no float4_e2m1fn_x2 dtype"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 10:
        return f"compute capability {major}.{minor} < 10.0 has no block-scaled FP4 tensor cores"
    return None


@dataclass(frozen=True)
class BlackwellWeight:
    """An NVFP4 [N, K] weight prepared once for _scaled_mm: scales swizzled, codes viewed as FP4 pairs."""

    packed: torch.Tensor  # uint8 [N, K/2]
    scales_swizzled: torch.Tensor  # float8_e4m3fn, flat, swizzled 128x4 layout
    global_scale: torch.Tensor  # fp32 0-dim, encode convention
    n: int
    k: int


def prepare_weight(w: NVFP4Tensor) -> BlackwellWeight:
    """Swizzle the weight's block scales once, at load time."""
    if len(w.shape) != 2:
        raise ValueError(f"prepare_weight: weight must be 2-D [N, K], got shape {w.shape}")
    n, k = w.shape
    if k % 32 != 0:
        raise ValueError(f"prepare_weight: the FP4 GEMM needs K % 32 == 0, got K={k}")
    return BlackwellWeight(
        packed=w.packed.contiguous(),
        scales_swizzled=swizzle_scales(w.scales).view(torch.float8_e4m3fn),
        global_scale=w.global_scale,
        n=n,
        k=k,
    )


def scaled_mm_nvfp4(a: NVFP4Tensor, w: BlackwellWeight, out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K] (NVFP4) @ W^T -> [M, N] in out_dtype. Device-agnostic: runs wherever _scaled_mm does."""
    if len(a.shape) != 2 or a.shape[1] != w.k:
        raise ValueError(f"scaled_mm_nvfp4: activations must be [M, {w.k}], got {a.shape}")
    a_fp4 = a.packed.contiguous().view(torch.float4_e2m1fn_x2)
    w_fp4 = w.packed.view(torch.float4_e2m1fn_x2).t()  # [K/2, N], column-major as cuBLAS wants
    a_scales = swizzle_scales(a.scales).view(torch.float8_e4m3fn)
    # bf16 is the output every cuBLAS FP4 kernel supports; alpha is applied in fp32 on top.
    out = torch._scaled_mm(a_fp4, w_fp4, a_scales, w.scales_swizzled, out_dtype=torch.bfloat16)
    alpha = torch.reciprocal(a.global_scale * w.global_scale)
    return (out.float() * alpha).to(out_dtype)


def w4a4_matmul(x: torch.Tensor, w: BlackwellWeight) -> torch.Tensor:
    """x[..., K] @ W_hat^T with x quantized to NVFP4 on the fly; Blackwell only."""
    reason = blackwell_unavailable_reason(x.device if x.is_cuda else None)
    if reason is not None or not x.is_cuda:
        raise BlackwellUnavailable(
            f"NVFP4 W4A4 GEMM unavailable: {reason or f'x is on {x.device}, not CUDA'}"
        )
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    a = _quantize_activations(x2)
    return scaled_mm_nvfp4(a, w, x.dtype).reshape(*lead, w.n)


def _quantize_activations(x2: torch.Tensor) -> NVFP4Tensor:
    """One linear's activations: no finiteness check (a host sync per linear in every eager step — each prefill's
    ~7 per layer; a NaN reaches the logits as through a 16-bit linear, and graphs could not check anyway)."""
    try:
        from .triton_kernels import quantize_triton
    except ImportError:  # Triton missing from the image: the torch recipe gives the same bytes, only slower
        return quantize(x2)
    return quantize_triton(x2, finite_check=False)
