"""Converts pre-quantized NVFP4 checkpoint tensors into rackserve's NVFP4Tensor convention, and back.

Two layouts exist in the wild, both with the same codes (element 2j in the low nibble) and the same linear
[N, K/16] float8_e4m3fn block scales; they differ in the name and the spelling of the tensor scale:

| layout             | codes           | block scales   | tensor scale                                    |
|--------------------|-----------------|----------------|-------------------------------------------------|
| NVIDIA ModelOpt    | `weight`        | `weight_scale` | `weight_scale_2` = decode g_d = amax / 2688     |
| compressed-tensors | `weight_packed` | `weight_scale` | `weight_global_scale` = encode g_e = 2688 / amax |

A W4A4 checkpoint also carries a static tensor scale for each projection's input activations, calibrated on
sample text, with the same two spellings: ModelOpt's `input_scale` is the decode g_d = amax / 2688,
compressed-tensors' `input_global_scale` the encode g_e = 2688 / amax. (The activations' block scales are
computed per call from the activations themselves; only the tensor scale is static.)

rackserve stores g_e. From compressed-tensors that is a copy. From ModelOpt it is g_e = 1 / g_d in fp32, which
is the same number up to one rounding: fp32 reciprocals do not always round-trip, so a ModelOpt checkpoint
written by to_modelopt can come back with g_e one ulp away (codes and block scales always come back intact).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

import torch

from .recipe import BLOCK_SIZE, NVFP4Tensor

Layout = Literal["modelopt", "compressed-tensors"]

_MODELOPT_SUFFIXES = ("weight", "weight_scale", "weight_scale_2")
_COMPRESSED_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale")


def detect_layout(keys: Iterable[str]) -> Layout | None:
    """Which NVFP4 layout a checkpoint's tensor names use, or None if they hold no NVFP4 weights."""
    keys = list(keys)
    if any(k.endswith(".weight_packed") or k.endswith(".weight_global_scale") for k in keys):
        return "compressed-tensors"
    if any(k.endswith(".weight_scale_2") for k in keys):
        return "modelopt"
    return None


def _key(prefix: str, suffix: str) -> str:
    return f"{prefix.rstrip('.')}.{suffix}" if prefix else suffix


def _fetch(tensors: Mapping[str, torch.Tensor], prefix: str, suffixes: tuple[str, ...], layout: str) -> list:
    missing = [_key(prefix, s) for s in suffixes if _key(prefix, s) not in tensors]
    if missing:
        raise KeyError(f"{layout} NVFP4 weight at {prefix!r}: missing tensor(s) {missing}")
    return [tensors[_key(prefix, s)] for s in suffixes]


def _scale_bytes(scale: torch.Tensor, name: str) -> torch.Tensor:
    if scale.dtype == torch.float8_e4m3fn:
        return scale.view(torch.uint8)
    if scale.dtype == torch.uint8 and scale.dim() == 2:
        return scale
    raise ValueError(
        f"{name}: expected float8_e4m3fn block scales in the linear [N, K/16] layout, got {scale.dtype} with "
        f"shape {tuple(scale.shape)} (1-D uint8 scales are a swizzled TensorRT-LLM layout, not supported)"
    )


def _scalar(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.numel() != 1:
        raise ValueError(f"{name}: expected one per-tensor scale, got shape {tuple(t.shape)}")
    return t.detach().reshape(()).to(torch.float32)


def _build(packed: torch.Tensor, scales: torch.Tensor, g_e: torch.Tensor, where: str) -> NVFP4Tensor:
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(
            f"{where}: packed codes must be 2-D uint8 [N, K/2], got {packed.dtype} {tuple(packed.shape)}"
        )
    n, half_k = packed.shape
    k = half_k * 2
    if k % BLOCK_SIZE != 0 or tuple(scales.shape) != (n, k // BLOCK_SIZE):
        raise ValueError(
            f"{where}: codes {tuple(packed.shape)} need block scales of shape {(n, k // BLOCK_SIZE)}, "
            f"got {tuple(scales.shape)}"
        )
    return NVFP4Tensor(
        packed=packed.contiguous(), scales=scales.contiguous(), global_scale=g_e.contiguous(), shape=(n, k)
    )


def from_modelopt(tensors: Mapping[str, torch.Tensor], prefix: str) -> NVFP4Tensor:
    """`{prefix}.weight`, `.weight_scale`, `.weight_scale_2` (ModelOpt / TRT-LLM export) -> NVFP4Tensor."""
    packed, scale, scale_2 = _fetch(tensors, prefix, _MODELOPT_SUFFIXES, "ModelOpt")
    g_d = _scalar(scale_2, _key(prefix, "weight_scale_2"))
    if not (bool(torch.isfinite(g_d)) and float(g_d) >= 0):
        raise ValueError(
            f"{_key(prefix, 'weight_scale_2')}: expected a finite non-negative scale, got {float(g_d)}"
        )
    # amax == 0 exports g_d == 0; rackserve's convention for that tensor is g_e = 1.
    one = torch.ones((), dtype=torch.float32, device=g_d.device)
    g_e = torch.where(g_d > 0, torch.div(one, torch.where(g_d > 0, g_d, one)), one)
    return _build(packed, _scale_bytes(scale, _key(prefix, "weight_scale")), g_e, f"ModelOpt {prefix!r}")


def from_compressed_tensors(tensors: Mapping[str, torch.Tensor], prefix: str) -> NVFP4Tensor:
    """Compressed-tensors `{prefix}.weight_packed`, `.weight_scale`, `.weight_global_scale` -> NVFP4Tensor."""
    packed, scale, global_scale = _fetch(tensors, prefix, _COMPRESSED_SUFFIXES, "compressed-tensors")
    g_e = _scalar(global_scale, _key(prefix, "weight_global_scale"))
    if not (bool(torch.isfinite(g_e)) and float(g_e) > 0):
        raise ValueError(
            f"{_key(prefix, 'weight_global_scale')}: expected a finite positive scale, got {float(g_e)}"
        )
    return _build(
        packed, _scale_bytes(scale, _key(prefix, "weight_scale")), g_e, f"compressed-tensors {prefix!r}"
    )


# a static activation scale's tensor name in each layout (the module docstring says its convention)
INPUT_SCALE_SUFFIX: dict[Layout, str] = {
    "modelopt": "input_scale",
    "compressed-tensors": "input_global_scale",
}


def input_scale_from(layout: Layout, t: torch.Tensor, name: str) -> torch.Tensor:
    """A static activation scale (ModelOpt `input_scale`, compressed-tensors `input_global_scale`) as g_e, fp32
    0-dim. It must be finite and positive: an activation amax of 0 calibrates nothing W4A4 could serve."""
    g = _scalar(t, name)
    if not (bool(torch.isfinite(g)) and float(g) > 0):
        raise ValueError(f"{name}: expected a finite positive activation scale, got {float(g)}")
    if layout == "compressed-tensors":
        return g
    g_e = torch.div(torch.ones((), dtype=torch.float32, device=g.device), g)
    if not bool(torch.isfinite(g_e)):
        raise ValueError(f"{name}: activation scale {float(g)} has no finite fp32 reciprocal")
    return g_e


def input_scale_to(layout: Layout, g_e: torch.Tensor, prefix: str) -> dict[str, torch.Tensor]:
    """A static activation scale g_e as `layout` spells it: {`{prefix}.input_scale`: 1 / g_e} (ModelOpt) or
    {`{prefix}.input_global_scale`: g_e} (compressed-tensors), 1-element fp32 as both export it."""
    g_e = g_e.detach().reshape(()).to(torch.float32)
    stored = g_e.clone() if layout == "compressed-tensors" else torch.div(torch.ones_like(g_e), g_e)
    return {_key(prefix, INPUT_SCALE_SUFFIX[layout]): stored.reshape(1)}


def load_nvfp4_weight(tensors: Mapping[str, torch.Tensor], prefix: str) -> NVFP4Tensor:
    """from_modelopt or from_compressed_tensors, whichever layout the keys under `prefix` use."""
    layout = detect_layout(k for k in tensors if k.startswith(prefix.rstrip(".") + "."))
    if layout == "modelopt":
        return from_modelopt(tensors, prefix)
    if layout == "compressed-tensors":
        return from_compressed_tensors(tensors, prefix)
    raise KeyError(f"no NVFP4 weight (ModelOpt or compressed-tensors) under {prefix!r}")


def _require_2d(q: NVFP4Tensor) -> None:
    if len(q.shape) != 2 or q.k != q.padded_k:
        raise ValueError(f"checkpoint layouts hold 2-D weights with K % 16 == 0, got shape {q.shape}")


def to_modelopt(q: NVFP4Tensor, prefix: str) -> dict[str, torch.Tensor]:
    """NVFP4Tensor -> ModelOpt tensors (weight_scale_2 = 1 / g_e in fp32)."""
    _require_2d(q)
    one = torch.ones((), dtype=torch.float32, device=q.global_scale.device)
    return {
        _key(prefix, "weight"): q.packed,
        _key(prefix, "weight_scale"): q.scales.view(torch.float8_e4m3fn),
        _key(prefix, "weight_scale_2"): torch.div(one, q.global_scale),
    }


def to_compressed_tensors(q: NVFP4Tensor, prefix: str) -> dict[str, torch.Tensor]:
    """NVFP4Tensor -> compressed-tensors tensors (the same g_e, stored as a 1-element tensor)."""
    _require_2d(q)
    return {
        _key(prefix, "weight_packed"): q.packed,
        _key(prefix, "weight_scale"): q.scales.view(torch.float8_e4m3fn),
        _key(prefix, "weight_global_scale"): q.global_scale.reshape(1),
    }
