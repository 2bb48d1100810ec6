"""The NVFP4 recipe in plain torch: the one definition of how rackserve turns floats into NVFP4 and back.

Every other path (Triton, CUDA, the Blackwell `scaled_mm` GEMM, checkpoint loaders, the KV wire format) is
tested against this module byte for byte. It follows docs/nvfp4.md literally: the order of the fp32
operations is part of the contract, so do not "simplify" an expression here (turning a division into a
multiplication by a reciprocal, or `g * (a * (1/6))` into `(g * a) / 6`) — that changes bytes.

This module must never depend on a GPU or on Triton: it is the ground truth on a laptop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

QUANT_RECIPE_ID = "nvfp4-e2m1-e4m3x16-fp32ge-v1"
"""Stable name of this recipe, for model fingerprints. Bump the suffix if any byte could change."""

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
GLOBAL_SCALE_NUMERATOR = E4M3_MAX * E2M1_MAX  # 2688: maps the tensor amax onto the largest block scale

# Magnitudes of the 8 non-negative E2M1 codes; code | 8 is the negative twin.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# The decision points between neighbouring E2M1 magnitudes, with the comparison that sends a tie to the even
# code: 0.25 -> 0 (code 0), 0.75 -> 1 (code 2), 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
# code(|y|) is the number of decision points |y| has passed.
_E2M1_DECISIONS = (
    (0.25, torch.gt),
    (0.75, torch.ge),
    (1.25, torch.gt),
    (1.75, torch.ge),
    (2.5, torch.gt),
    (3.5, torch.ge),
    (5.0, torch.gt),
)


@dataclass(frozen=True)
class NVFP4Tensor:
    """A tensor in rackserve's NVFP4 storage convention.

    packed:       uint8 [..., Kp // 2]; element 2j in the low nibble of byte j.
    scales:       uint8 [..., Kp // 16]; raw float8_e4m3fn bytes, linear (row-major) layout.
    global_scale: float32 0-dim tensor, encode convention g_e = 2688 / amax.
    shape:        the original shape; shape[-1] is the true K (Kp is K rounded up to a multiple of 16).
    """

    packed: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.packed.dtype != torch.uint8 or self.scales.dtype != torch.uint8:
            raise ValueError(
                f"NVFP4Tensor: packed and scales must be uint8, "
                f"got {self.packed.dtype} and {self.scales.dtype}"
            )
        if self.global_scale.dtype != torch.float32 or self.global_scale.dim() != 0:
            raise ValueError(
                "NVFP4Tensor: global_scale must be a 0-dim float32 tensor, got "
                f"{self.global_scale.dtype} with shape {tuple(self.global_scale.shape)}"
            )
        if len(self.shape) == 0:
            raise ValueError("NVFP4Tensor: shape must have at least one dimension")
        kp = padded_size(self.shape[-1])
        lead = tuple(self.shape[:-1])
        if tuple(self.packed.shape) != (*lead, kp // 2) or tuple(self.scales.shape) != (
            *lead,
            kp // BLOCK_SIZE,
        ):
            raise ValueError(
                f"NVFP4Tensor: shape {self.shape} needs packed {(*lead, kp // 2)} and scales "
                f"{(*lead, kp // BLOCK_SIZE)}, got {tuple(self.packed.shape)} and {tuple(self.scales.shape)}"
            )

    @property
    def k(self) -> int:
        """The true size of the last (reduction) dim, before padding to a multiple of 16."""
        return self.shape[-1]

    @property
    def padded_k(self) -> int:
        return self.packed.shape[-1] * 2

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def nbytes(self) -> int:
        """Bytes held: packed codes, block scales and the 4-byte tensor scale."""
        return self.packed.numel() + self.scales.numel() + 4

    def to(self, device: torch.device | str) -> NVFP4Tensor:
        return NVFP4Tensor(
            packed=self.packed.to(device),
            scales=self.scales.to(device),
            global_scale=self.global_scale.to(device),
            shape=self.shape,
        )


def padded_size(k: int) -> int:
    """K rounded up to a whole number of 16-element blocks."""
    return -(-k // BLOCK_SIZE) * BLOCK_SIZE


def check_finite(x: torch.Tensor) -> None:
    """NVFP4 has no NaN or Inf; a non-finite input is a bug upstream, so refuse it loudly."""
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        raise ValueError(
            f"NVFP4 quantize: input has {bad} non-finite value(s) (NaN or Inf) out of {x.numel()}; "
            "NVFP4 cannot represent them"
        )


def global_scale_for_amax(amax: torch.Tensor) -> torch.Tensor:
    """g_e = 2688 / amax in fp32, or 1.0 when amax is not finite-positive.

    Also 1.0 when 2688 / amax overflows fp32 (amax below ~7.9e-36): docs/nvfp4.md's "not finite-positive" rule
    applied to g_e itself, so no path ever multiplies by an infinite scale.
    """
    amax = amax.to(torch.float32)
    # the numerator filled on amax's device, not copied from the host: no synchronising copy, so a forward that
    # quantizes its activations (W4A4) can be captured in a CUDA graph; the same IEEE division either way
    g = torch.full_like(amax, GLOBAL_SCALE_NUMERATOR) / amax
    ok = (amax > 0) & torch.isfinite(amax) & torch.isfinite(g)
    return torch.where(ok, g, torch.ones_like(g)).reshape(())


def e4m3_rne_satfinite(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, round to nearest even, subnormals kept, saturated to +-448.

    The clamp comes first: torch's cast would turn values above 464 into NaN rather than saturate.
    """
    return v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> 4-bit E2M1 codes (uint8 0..15), RNE with ties to even, saturating at 6, sign kept (-0.0 -> 8).

    Identical to PTX `cvt.rn.satfinite.e2m1x2.f32` on finite inputs.
    """
    a = y.abs()
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for threshold, passed in _E2M1_DECISIONS:
        code += passed(a, threshold).view(torch.uint8)  # 7 compares beat bucketize ~2x on CPU
    return code | (torch.signbit(y).view(torch.uint8) << 3)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] codes -> [..., n] bytes, even element in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n] codes; inverse of pack_codes."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """Codes (uint8 0..15) -> their fp32 values."""
    table = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), dtype=torch.float32)
    return table.to(codes.device)[codes.long()]


def e4m3_values(scale_bytes: torch.Tensor) -> torch.Tensor:
    """Raw float8_e4m3fn bytes -> fp32."""
    return scale_bytes.view(torch.float8_e4m3fn).to(torch.float32)


def _as_float32_rows(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 0:
        raise ValueError("NVFP4 quantize: input must have at least one dimension")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"NVFP4 quantize: input must be float32, bfloat16 or float16, got {x.dtype}")
    # bf16 and fp16 upcast exactly, so the recipe only ever sees fp32.
    return x.to(torch.float32)


def abs_max(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """max |x| (over `dim`, or all of x) without materializing |x|; NaN propagates."""
    if dim is None and x.numel() == 0:
        return torch.zeros((), dtype=x.dtype, device=x.device)
    lo, hi = torch.aminmax(x) if dim is None else torch.aminmax(x, dim=dim)
    return torch.maximum(hi, -lo).abs()  # abs: an all -0.0 block must give +0.0, i.e. scale byte 0x00


def quantize(x: torch.Tensor, *, global_scale: torch.Tensor | float | None = None) -> NVFP4Tensor:
    """Quantize along the last dim with the NVFP4 recipe.

    `global_scale` overrides g_e (encode convention); it exists for the benchmark's "no tensor scale"
    column (g_e = 1) and for callers that share one scale across tensors. Leave it None for the recipe.
    """
    xf = _as_float32_rows(x)
    shape = tuple(xf.shape)
    k = shape[-1]
    kp = padded_size(k)
    if kp != k:
        xf = F.pad(xf, (0, kp - k))  # zero padding changes no amax and quantizes to code 0
    blocks = xf.reshape(*shape[:-1], kp // BLOCK_SIZE, BLOCK_SIZE)

    amax = abs_max(xf)
    if not bool(torch.isfinite(amax)):  # NaN and Inf both surface in the max; count them only on failure
        # the caller's elements, not the zero padding: the message counts what was passed in
        check_finite(xf[..., :k])
    if global_scale is None:
        g = global_scale_for_amax(amax)
    else:
        g = torch.as_tensor(global_scale, dtype=torch.float32, device=xf.device).reshape(())
        if not (bool(torch.isfinite(g)) and float(g) > 0):
            raise ValueError(f"NVFP4 quantize: global_scale must be finite and positive, got {float(g)}")

    one_sixth = torch.tensor(1.0 / 6.0, dtype=torch.float32, device=xf.device)
    block_amax = abs_max(blocks, dim=-1)
    # s_b = e4m3(g_e * (a_b * (1/6))): two fp32 roundings in exactly this order.
    scale_fp8 = e4m3_rne_satfinite(g * (block_amax * one_sixth))
    codes = encode_blocks(blocks, scale_fp8, g).reshape(*shape[:-1], kp)

    return NVFP4Tensor(
        packed=pack_codes(codes).contiguous(),
        scales=scale_fp8.view(torch.uint8).contiguous(),
        global_scale=g,
        shape=shape,
    )


def encode_blocks(blocks: torch.Tensor, scale_fp8: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of fp32 `blocks` [..., 16] under chosen block scales (float8_e4m3fn [...]) and g_e.

    The recipe's encode step on its own, so that a calibrated method (methods.py) can pick other block scales
    and still produce exactly the codes the recipe would produce for them.
    """
    s = scale_fp8.to(torch.float32)
    # inv = 1 / (s_b * (1 / g_e)) with true IEEE division; 0 for an all-zero block scale.
    # (torch's `1.0 / t` is `t.reciprocal() * 1.0`; spell the divisions out so they stay true divisions.)
    one = torch.ones((), dtype=torch.float32, device=blocks.device)
    denom = s * torch.div(one, g)
    inv = torch.where(s == 0, torch.zeros_like(s), torch.div(one, torch.where(s == 0, one, denom)))
    return e2m1_codes(blocks * inv.unsqueeze(-1))


def decode_blocks(codes: torch.Tensor, scale_fp8: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """fp32 values of codes [..., 16] under block scales [...] and g_e: the arithmetic of dequantize()."""
    # E2M1 * E4M3 is exact in fp32 (at most 6 significant bits), so the only rounding is the division.
    return (e2m1_values(codes) * scale_fp8.to(torch.float32).unsqueeze(-1)) / g


def dequantize(q: NVFP4Tensor) -> torch.Tensor:
    """x_hat = E2M1[code] * s_b / g_e in fp32, padding stripped: [..., K]."""
    kp = q.padded_k
    lead = q.shape[:-1]
    values = e2m1_values(unpack_codes(q.packed)).reshape(*lead, kp // BLOCK_SIZE, BLOCK_SIZE)
    s = e4m3_values(q.scales).unsqueeze(-1)
    # E2M1 * E4M3 is exact in fp32 (at most 6 significant bits), so the only rounding is the division.
    x_hat = (values * s) / q.global_scale
    return x_hat.reshape(*lead, kp)[..., : q.k]
