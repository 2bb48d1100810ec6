"""W4A4 on Blackwell: both operands NVFP4, multiplied on block-scaled FP4 tensor cores via torch._scaled_mm.

This path changes numerics relative to W4A16: activations are quantized to NVFP4 on every call, under the
checkpoint's static activation tensor scale where it carries one (NVFP4Linear.input_scale), else under one
computed from the call's amax. It is used when
a caller asks for it (NVFP4Linear(w4a4=True); the engine asks as --nvfp4-gemm says: `choose_gemm`) and the
device passes a probe: one small FP4 GEMM checked against the recipe's dequantized product, once per device, so a
torch or cuBLASLt build (or a part) without NVFP4 block-scaled GEMMs falls back to W4A16 at load, with the reason.

A non-finite activation cannot be quantized. Reading each linear's amax on the host to refuse one would
synchronise every linear of every eager step, so the check runs on the device into a flag (`nonfinite_flag`) the
engine reads once per step, after its one device-to-host copy (`raise_if_nonfinite`).

torch._scaled_mm takes the two operands as float4_e2m1fn_x2 (A [M, K/2] row-major, B [K/2, N] column-major,
i.e. the transpose of our [N, K/2] weight), their E4M3 block scales in the 128x4 swizzled layout, and computes
sum(code_a * s_a * code_b * s_b). The two tensor scales are applied afterwards as
alpha = 1 / (g_e(A) * g_e(B)), as docs/nvfp4.md prescribes. cuBLAS wants K to be a multiple of 32.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .layouts import swizzle_scales
from .recipe import NVFP4Tensor, quantize

log = logging.getLogger(__name__)


def choose_gemm(asked: str, device: torch.device, declared: str = "") -> tuple[bool, str]:
    """Whether an engine on `device` runs its NVFP4 layers as W4A4, and why (logged once at start-up).

    `asked` is EngineConfig.nvfp4_gemm; `declared` is what a pre-quantized checkpoint says of its activations
    (LoadedModel.nvfp4_activations: "16bit", "nvfp4", or "" when it says nothing or was quantized at load).
    - w4a16: never quantize activations.
    - w4a4: always. On a CPU the step is emulated (activations quantized and dequantized with the recipe, then
      the 16-bit matmul: the numerics of the FP4 GEMM up to its bf16 output rounding, for evaluating them); on a
      GPU without FP4 tensor cores, or whose probe GEMM fails, it is refused with the reason: never silently
      W4A16.
    - auto: W4A4 where the GPU has FP4 tensor cores and the checkpoint does not declare 16-bit activations; a
      W4A16 checkpoint (compressed-tensors' NVFP4A16: `input_activations: null`) was calibrated for them. A GPU
      with FP4 tensor cores that still runs W4A16 (its probe failed) is warned of.
    """
    if asked == "w4a16":
        return False, "--nvfp4-gemm w4a16"
    if device.type != "cuda":
        if asked == "w4a4":
            return True, f"--nvfp4-gemm w4a4, emulated on {device.type}: activations quantized, 16-bit matmul"
        return False, f"{device.type} runs W4A16 (--nvfp4-gemm w4a4 emulates W4A4)"
    why = blackwell_unavailable_reason(device)
    if asked == "w4a4":
        if why is not None:
            raise ValueError(f"--nvfp4-gemm w4a4 on {device}: {why}; use auto or w4a16")
        return True, "--nvfp4-gemm w4a4"
    if declared == "16bit":
        return False, "the checkpoint declares 16-bit activations (W4A16)"
    if why is not None:
        if torch.cuda.get_device_capability(device) >= (10, 0):
            log.warning("NVFP4 W4A4 not used on %s: %s; W4A16 instead", device, why)
        return False, why
    return True, "FP4 tensor cores (auto)"


class BlackwellUnavailable(RuntimeError):
    """The FP4 tensor-core GEMM needs a CUDA GPU of compute capability 10.0 or newer."""


_PROBED: dict[int, str | None] = {}  # device index -> why W4A4 cannot run there (None: it can)


def blackwell_unavailable_reason(device: torch.device | None = None) -> str | None:
    """Why W4A4 cannot run on `device` (default: the current CUDA device), or None if it can. The first ask for a
    GPU of compute capability >= 10 runs the probe (outside a CUDA graph capture; the engine asks at start-up)."""
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    if not hasattr(torch, "float4_e2m1fn_x2"):
        return f"torch {torch.__version__} has no float4_e2m1fn_x2 dtype"
    index = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    at = index.index if index.index is not None else torch.cuda.current_device()
    if at in _PROBED:
        return _PROBED[at]
    major, minor = torch.cuda.get_device_capability(at)
    if major < 10:
        reason: str | None = f"compute capability {major}.{minor} < 10.0 has no block-scaled FP4 tensor cores"
    elif torch.cuda.is_current_stream_capturing():
        return "not probed before a CUDA graph capture"  # not cached: the next eager ask probes
    else:
        reason = _probe(torch.device("cuda", at))
    _PROBED[at] = reason
    return reason


def _probe(device: torch.device) -> str | None:
    """One FP4 GEMM of the shapes that pad (M = 130 rows over two 128-row scale tiles, N = 48, K = 64) against
    the recipe's dequantized product: a failed call or a wrong answer (scales or codes laid out otherwise than
    this build's cuBLASLt reads them) is the reason W4A4 is not used."""
    from .recipe import dequantize

    try:
        g = torch.Generator(device="cpu").manual_seed(7)
        x = quantize(torch.randn(130, 64, generator=g).to(device))
        w = quantize(torch.randn(48, 64, generator=g).to(device))
        got = scaled_mm_nvfp4(x, prepare_weight(w), torch.float32)
        want = dequantize(x) @ dequantize(w).T
        err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
    except Exception as exc:  # noqa: BLE001 - whatever this build or part cannot do, W4A16 still can
        return f"a probe FP4 GEMM failed: {type(exc).__name__}: {str(exc)[:300]}"
    if not err <= 2.0**-7:  # cuBLAS rounds its output to bf16 (the largest error one rounding makes)
        return f"a probe FP4 GEMM gave a wrong product (max error {err:.3g} of the largest value)"
    return None


_NONFINITE: dict[torch.device, torch.Tensor] = {}


def nonfinite_flag(device: torch.device) -> torch.Tensor:
    """The device bool W4A4 activation quantization sets when an activation is NaN or Inf. Made before any CUDA
    graph is captured (the engine makes it at start-up): a capture may not allocate it."""
    flag = _NONFINITE.get(device)
    if flag is None:
        flag = _NONFINITE[device] = torch.zeros((), dtype=torch.bool, device=device)
    return flag


def raise_if_nonfinite(device: torch.device) -> None:
    """Once per step, after the step's own device-to-host copy: refuse a step whose activations held NaN or Inf."""
    flag = _NONFINITE.get(device)
    if flag is not None and bool(flag):
        flag.zero_()
        raise ValueError(
            "NVFP4 W4A4: an activation of this step was NaN or Inf, which NVFP4 cannot represent"
        )


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
    if k % 32 != 0 or n % 16 != 0:
        raise ValueError(f"prepare_weight: the FP4 GEMM needs K % 32 == 0 and N % 16 == 0, got N={n}, K={k}")
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
    if out_dtype == torch.bfloat16:
        # in place: a bf16 tensor times an fp32 0-dim tensor is computed in fp32 and rounded once, the bits of
        # the line below without its [M, N] fp32 temporary (1.9 GB for a 70B gate/up at 8,192 tokens)
        return out.mul_(alpha)
    return (out.float() * alpha).to(out_dtype)


def w4a4_matmul(x: torch.Tensor, w: BlackwellWeight, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x[..., K] @ W_hat^T with x quantized to NVFP4 on the fly; Blackwell only. `input_scale` is a static
    activation tensor scale (g_e, fp32 0-dim on x's device); None computes one from each call's amax."""
    reason = blackwell_unavailable_reason(x.device if x.is_cuda else None)
    if reason is not None or not x.is_cuda:
        raise BlackwellUnavailable(
            f"NVFP4 W4A4 GEMM unavailable: {reason or f'x is on {x.device}, not CUDA'}"
        )
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    a = _quantize_activations(x2, input_scale)
    return scaled_mm_nvfp4(a, w, x.dtype).reshape(*lead, w.n)


def _quantize_activations(x2: torch.Tensor, input_scale: torch.Tensor | None) -> NVFP4Tensor:
    """One linear's activations, checked for NaN/Inf on the device (nonfinite_flag), not on the host: a host
    read per linear would synchronise every eager step ~7 times a layer, and a graph could not read at all."""
    try:
        from .triton_kernels import quantize_triton
    except ImportError:  # Triton missing from the image: the torch recipe gives the same bytes, only slower
        return quantize(x2, global_scale=input_scale)
    return quantize_triton(x2, nonfinite=nonfinite_flag(x2.device), global_scale=input_scale)
