"""Transfer-only KV compression: quantize the KV bytes for the wire, dequantize on arrival, same dtype back.

nvfp4 uses the engine's NVFP4 wire format (services/engine/nvfp4/kv.py, the one recipe); fp8 is e4m3 with one
fp32 scale per head_dim row. The arithmetic of both is services/engine/kv_codec.py's (the host KV tier uses the
same); this module only frames it as bytes. The KV cache itself is never touched; this module must never decide
whether to compress (the caller does) and never change the element count or dtype the receiver gets back.

fp8 payload (little endian), version 1:  magic b"F8KV" | u8 version | u8 dtype code | u16 0 | i64 rows |
i64 head_dim | f32 scales[rows] | e4m3 bytes[rows * head_dim]
"""

from __future__ import annotations

import struct

import torch

from services.engine.host_bytes import bytes_of, joined, view_of
from services.engine.kv_codec import fp8_decode, fp8_encode

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_CODES = {"fp32": 0, "bf16": 1, "fp16": 2}
_NAMES = {v: k for k, v in _CODES.items()}
_FP8 = struct.Struct("<4sBBHqq")


def _as_tensor(payload: bytes | bytearray | memoryview, kv_dtype: str, head_dim: int) -> torch.Tensor:
    if kv_dtype not in DTYPES:
        raise ValueError(f"kv_dtype must be one of {sorted(DTYPES)}, got {kv_dtype!r}")
    raw = memoryview(payload).cast("B")
    elem = torch.tensor([], dtype=DTYPES[kv_dtype]).element_size()
    if head_dim <= 0 or len(raw) % (elem * head_dim):
        raise ValueError(f"{len(raw)} bytes are not whole rows of {head_dim} {kv_dtype} elements")
    return view_of(raw, DTYPES[kv_dtype]).view(-1, head_dim)  # read in place: the encoders only read it


def encode(payload: bytes | bytearray | memoryview, method: str, kv_dtype: str, head_dim: int) -> memoryview:
    kv = _as_tensor(payload, kv_dtype, head_dim)
    if method == "nvfp4":
        from services.engine.nvfp4.kv import quantize_kv_for_wire

        return quantize_kv_for_wire(kv)
    if method == "fp8":
        scale, q = fp8_encode(kv)
        head = _FP8.pack(b"F8KV", 1, _CODES[kv_dtype], 0, kv.shape[0], head_dim)
        return joined((head, scale, q))
    raise ValueError(f"unknown KV wire compression {method!r}; use 'nvfp4' or 'fp8'")


def decode(payload: bytes | bytearray | memoryview, method: str) -> memoryview:
    if method == "nvfp4":
        from services.engine.nvfp4.kv import dequantize_kv_from_wire

        t = dequantize_kv_from_wire(payload, "cpu")
    elif method == "fp8":
        view = memoryview(payload).cast("B")
        magic, version, code, _, rows, head_dim = _FP8.unpack_from(view)
        if magic != b"F8KV" or version != 1 or code not in _NAMES:
            raise ValueError(f"not an fp8 KV payload (magic {magic!r}, version {version}, dtype code {code})")
        if len(view) != _FP8.size + rows * 4 + rows * head_dim:
            raise ValueError(f"fp8 KV payload of {len(view)} bytes does not hold {rows}x{head_dim}")
        raw = view_of(view, torch.uint8, _FP8.size)
        scale = raw[: rows * 4].view(torch.float32)
        q = raw[rows * 4 :].view(torch.float8_e4m3fn).view(rows, head_dim)
        t = fp8_decode(scale, q, DTYPES[_NAMES[code]])
    else:
        raise ValueError(f"unknown KV wire encoding {method!r}")
    return bytes_of(t)
