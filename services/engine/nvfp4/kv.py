"""NVFP4 wire format for KV blocks shipped from prefill to decode workers (compression on the wire only).

The KV cache itself stays in the model dtype; only the bytes on the transfer path are NVFP4, quantized along
the last dim (head_dim) with the standard recipe and one tensor scale per payload. About 0.56 bytes per
element instead of 2 for bf16. The receiver gets x_hat = dequantize(...), cast back to the sender's dtype.

Payload layout (little endian), version 1:

    magic  b"NVKV" | u8 version | u8 dtype code | u8 ndim | u8 reserved | ndim x i64 shape
    f32 g_e | scales: rows x (Kp/16) bytes | packed: rows x (Kp/2) bytes

This module must never touch the KV cache in place or decide what to compress; the transfer layer does that.
"""

from __future__ import annotations

import struct

import torch

from services.engine.host_bytes import joined, view_of

from .recipe import BLOCK_SIZE, NVFP4Tensor, dequantize, padded_size, quantize

MAGIC = b"NVKV"
VERSION = 1
_HEADER = struct.Struct("<4sBBBx")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


def wire_size_bytes(shape: tuple[int, ...]) -> int:
    """Size of the payload quantize_kv_for_wire produces for a tensor of `shape`."""
    rows = 1
    for d in shape[:-1]:
        rows *= d
    kp = padded_size(shape[-1])
    return _HEADER.size + 8 * len(shape) + 4 + rows * (kp // BLOCK_SIZE + kp // 2)


def quantize_kv_for_wire(kv: torch.Tensor) -> memoryview:
    """KV tensor [..., head_dim] (fp32/bf16/fp16, any device) -> self-describing NVFP4 payload."""
    if kv.dtype not in _DTYPE_CODES:
        raise ValueError(f"quantize_kv_for_wire: KV must be float32, bfloat16 or float16, got {kv.dtype}")
    if kv.dim() == 0 or kv.dim() > 255:
        raise ValueError(f"quantize_kv_for_wire: KV must have 1..255 dims, got {kv.dim()}")
    q = quantize(kv)
    header = _HEADER.pack(MAGIC, VERSION, _DTYPE_CODES[kv.dtype], kv.dim())
    shape = struct.pack(f"<{kv.dim()}q", *kv.shape)
    g = struct.pack("<f", float(q.global_scale))
    # NVFP4Tensor buffers are contiguous uint8: their bytes are the wire's
    return joined((header + shape + g, q.scales, q.packed))


def dequantize_kv_from_wire(
    payload: bytes | bytearray | memoryview, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Inverse of quantize_kv_for_wire: payload -> x_hat in the sender's dtype and shape, on `device`."""
    view = memoryview(payload)
    if len(view) < _HEADER.size:
        raise ValueError(
            f"NVFP4 KV payload: {len(view)} bytes is shorter than the {_HEADER.size}-byte header"
        )
    magic, version, dtype_code, ndim = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise ValueError(f"NVFP4 KV payload: bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise ValueError(f"NVFP4 KV payload: version {version} is not supported (this build reads {VERSION})")
    if dtype_code not in _CODE_DTYPES:
        raise ValueError(f"NVFP4 KV payload: unknown dtype code {dtype_code}")
    offset = _HEADER.size
    shape = struct.unpack_from(f"<{ndim}q", view, offset)
    offset += 8 * ndim
    if len(view) != wire_size_bytes(shape):
        raise ValueError(
            f"NVFP4 KV payload: a {shape} tensor needs {wire_size_bytes(shape)} bytes, got {len(view)}"
        )
    (g,) = struct.unpack_from("<f", view, offset)
    offset += 4
    lead = shape[:-1]
    kp = padded_size(shape[-1])
    rows = 1
    for d in lead:
        rows *= d
    n_scales = rows * (kp // BLOCK_SIZE)
    raw = view_of(view, torch.uint8, offset)
    q = NVFP4Tensor(
        packed=raw[n_scales:].reshape(*lead, kp // 2),
        scales=raw[:n_scales].reshape(*lead, kp // BLOCK_SIZE),
        global_scale=torch.tensor(g, dtype=torch.float32),
        shape=tuple(shape),
    )
    return dequantize(q.to(device)).to(_CODE_DTYPES[dtype_code])
