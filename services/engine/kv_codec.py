"""The KV codecs' arithmetic, in one place: FP8 E4M3 with one fp32 scale per head_dim row, and NVFP4 (the recipe
of services/engine/nvfp4/recipe.py, one tensor scale per call) — tensors in, tensors out, any device.

Two users share it: the wire's transfer-only compression (services/kvtransfer/codec.py frames these tensors as
bytes) and the host tier of the KV cache (services/engine/kv_tier.py keeps them in memory). Neither may compute
a quantized KV any other way.
"""

from __future__ import annotations

import torch

from services.engine.nvfp4.recipe import NVFP4Tensor, dequantize, quantize

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def fp8_encode(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KV [..., head_dim] -> (fp32 scales [...], e4m3 codes [..., head_dim]); scale = row amax / 448."""
    x = kv.float()
    scale = (x.abs().amax(dim=-1) / FP8_MAX).clamp_min(1e-30)
    return scale, (x / scale.unsqueeze(-1)).to(torch.float8_e4m3fn)


def fp8_decode(scale: torch.Tensor, q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of fp8_encode, cast to `dtype`."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def fp8_nbytes(shape: tuple[int, ...]) -> tuple[int, int]:
    """Bytes of fp8_encode's two tensors for a KV tensor of `shape`: the scales (4 per row), the codes (1 per
    element)."""
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return 4 * rows, rows * shape[-1]


def nvfp4_encode(kv: torch.Tensor) -> NVFP4Tensor:
    """KV [..., head_dim] -> NVFP4 along head_dim (16-element blocks, e4m3 block scales, one fp32 tensor scale)."""
    return quantize(kv)


def nvfp4_decode(q: NVFP4Tensor, dtype: torch.dtype) -> torch.Tensor:
    return dequantize(q).to(dtype)


def nvfp4_nbytes(q: NVFP4Tensor) -> int:
    return q.packed.numel() + q.scales.numel() + 4
