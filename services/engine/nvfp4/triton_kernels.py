"""Triton kernels for NVFP4 on NVIDIA GPUs: a quantizer bit-exact with recipe.py, and a W4A16 dequant-GEMM.

The quantizer must produce the same bytes as the torch reference, so it never uses Triton's fp32->fp8 cast
(under TRITON_INTERPRET=1 that cast rounds ties up, flushes subnormals and turns 465 into NaN): E4M3
rounding is done with integer bit operations, and every division is `tl.math.div_rn` (IEEE round to nearest),
never the approximate reciprocal `/` may compile to.

The GEMM keeps W in NVFP4 in memory and rebuilds each tile as E2M1 * E4M3 — a product with at most 6
significant bits, so it is exact in bf16, fp16 and fp32 — multiplies it with the activations on tensor
cores with fp32 accumulation, and divides by g_e once at the end (docs/nvfp4.md's "alpha applied once").

Both launch with FP fusion off (Triton 3.9 warns that its default turns from on to off in 3.10): neither has a
multiply-add outside tl.dot, so this changes no byte today, and it keeps a later Triton from changing any.

Both kernels run on CPU under TRITON_INTERPRET=1, which is how the tests check them; the variable must be set
before this module is imported.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .recipe import BLOCK_SIZE, NVFP4Tensor, abs_max, check_finite, global_scale_for_amax, padded_size

# ---------------------------------------------------------------------------------------------------------
# Scalar helpers (elementwise on tiles)
# ---------------------------------------------------------------------------------------------------------


@triton.jit
def _e4m3_byte_rne(v):
    """fp32 in [0, 448] -> float8_e4m3fn byte (int32), round to nearest even, subnormals kept.

    Integer arithmetic on the fp32 bits: keep 3 fraction bits for normal E4M3 results (drop 20 of fp32's 23),
    or round to a multiple of 2^-9 for subnormal ones (drop more). Written as
    byte = max(e - 121, 0) * 8 + r, where e is the fp32 biased exponent and r the rounded significand,
    which also handles the carry of a round-up into the next binade.
    """
    bits = v.to(tl.int32, bitcast=True)
    exp = (bits >> 23) & 0xFF
    exp_eff = tl.maximum(exp, 1)  # fp32 subnormals share the exponent of the smallest normal
    sig = (bits & 0x7FFFFF) | tl.where(exp > 0, 0x800000, 0)
    # 20 dropped bits for E4M3 normals; 141 - e for subnormals (their quantum is 2^-9); cap below 32.
    shift = tl.minimum(tl.maximum(141 - exp_eff, 20), 31)
    half_minus_one = (1 << (shift - 1)) - 1
    r = (sig + half_minus_one + ((sig >> shift) & 1)) >> shift
    return tl.maximum(exp_eff - 121, 0) * 8 + r


@triton.jit
def _e4m3_byte_to_f32(b):
    """Non-negative float8_e4m3fn byte (int32) -> fp32, exactly."""
    e = b >> 3
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    subnormal = m.to(tl.float32) * 0.001953125  # m * 2^-9
    return tl.where(e == 0, subnormal, normal)


@triton.jit
def _e2m1_code(y):
    """fp32 -> E2M1 code (int32 0..15): thresholds with ties to even, saturating, sign bit kept."""
    a = tl.abs(y)
    c = (
        (a > 0.25).to(tl.int32)
        + (a >= 0.75).to(tl.int32)
        + (a > 1.25).to(tl.int32)
        + (a >= 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32)
        + (a >= 3.5).to(tl.int32)
        + (a > 5.0).to(tl.int32)
    )
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1  # from the bits, so -0.0 keeps its sign
    return c | (sign << 3)


@triton.jit
def _e2m1_value(c):
    """E2M1 code (int32 0..15) -> fp32 value."""
    e = (c >> 1) & 3
    m = c & 1
    normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)  # 2^(e-1) * (1 + m/2)
    magnitude = tl.where(e == 0, m.to(tl.float32) * 0.5, normal)
    return tl.where((c & 8) != 0, -magnitude, magnitude)


# ---------------------------------------------------------------------------------------------------------
# Quantize
# ---------------------------------------------------------------------------------------------------------


@triton.jit
def _quantize_kernel(
    x_ptr,
    packed_ptr,
    scales_ptr,
    global_scale_ptr,
    M,
    K,
    NB,
    stride_xm,
    BLOCK_M: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_b = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_b * BLOCK_B * 16 + tl.arange(0, BLOCK_B * 16)
    row_ok = rows < M
    # Columns K..Kp-1 are the zero padding of docs/nvfp4.md: read as 0.0, which quantizes to code 0.
    x = tl.load(
        x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :],
        mask=row_ok[:, None] & (cols < K)[None, :],
        other=0.0,
    ).to(tl.float32)
    x = tl.reshape(x, (BLOCK_M, BLOCK_B, 16))

    g = tl.load(global_scale_ptr)
    block_amax = tl.max(tl.abs(x), axis=2)
    # s_b = e4m3(g_e * (a_b * (1/6))), clamped first so the rounding never sees more than 448.
    v = tl.minimum(g * (block_amax * 0.16666666666666666), 448.0)
    scale_byte = _e4m3_byte_rne(v)
    s = _e4m3_byte_to_f32(scale_byte)
    # inv = 1 / (s_b * (1 / g_e)), true division; 0 for a zero block scale.
    denom = s * tl.math.div_rn(1.0, g)
    inv = tl.where(scale_byte == 0, 0.0, tl.math.div_rn(1.0, tl.where(scale_byte == 0, 1.0, denom)))
    codes = _e2m1_code(x * inv[:, :, None])

    even, odd = tl.split(tl.reshape(codes, (BLOCK_M, BLOCK_B, 8, 2)))
    packed = tl.reshape(even | (odd << 4), (BLOCK_M, BLOCK_B * 8)).to(tl.uint8)

    blocks = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    bytes_ = pid_b * BLOCK_B * 8 + tl.arange(0, BLOCK_B * 8)
    tl.store(
        packed_ptr + rows.to(tl.int64)[:, None] * (NB * 8) + bytes_[None, :],
        packed,
        mask=row_ok[:, None] & (bytes_ < NB * 8)[None, :],
    )
    tl.store(
        scales_ptr + rows.to(tl.int64)[:, None] * NB + blocks[None, :],
        scale_byte.to(tl.uint8),
        mask=row_ok[:, None] & (blocks < NB)[None, :],
    )


def quantize_triton(
    x: torch.Tensor,
    *,
    block_rows: int = 32,
    block_blocks: int = 16,
    nonfinite: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
) -> NVFP4Tensor:
    """NVFP4-quantize x along its last dim on the GPU (or the interpreter); same bytes as recipe.quantize.

    `global_scale` (a positive fp32 0-dim tensor on x's device, encode convention) replaces the g_e the amax would
    give, as recipe.quantize's does: a static activation scale from a W4A4 checkpoint. x's amax is still read,
    for the non-finite check.

    block_rows x block_blocks*16 elements per program; both must be powers of two. A non-finite input raises
    (its amax read on the host: a sync), or, with `nonfinite` (a bool tensor on x's device), sets it on the
    device for the caller to read later (a model's activations: blackwell.nonfinite_flag). While a CUDA graph is
    being captured there is no host read: only `nonfinite` can tell.
    """
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"quantize_triton: input must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("quantize_triton: input must have at least one dimension")
    shape = tuple(x.shape)
    k = shape[-1]
    kp = padded_size(k)
    nb = kp // BLOCK_SIZE
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]

    amax = abs_max(x2).to(torch.float32)  # one read of x, no |x| temporary
    # the check reads amax on the host; while a CUDA graph is being captured (W4A4 activations in a decode
    # step) no host read is allowed, and a non-finite activation there is the model's to answer for
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if nonfinite is not None:
        nonfinite |= ~torch.isfinite(amax).reshape(nonfinite.shape)
    elif not capturing and not bool(torch.isfinite(amax)):
        check_finite(x2)  # raises with the count of bad values
    g = (global_scale_for_amax(amax) if global_scale is None else global_scale.to(torch.float32)).reshape(1)

    packed = torch.empty((m, kp // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((m, nb), dtype=torch.uint8, device=x.device)
    if m > 0:
        grid = (triton.cdiv(m, block_rows), triton.cdiv(nb, block_blocks))
        _quantize_kernel[grid](
            x2, packed, scales, g, m, k, nb, x2.stride(0), BLOCK_M=block_rows, BLOCK_B=block_blocks,
            enable_fp_fusion=False,  # the bytes are the contract: no multiply-add contracted on any Triton
        )  # fmt: skip
    lead = shape[:-1]
    return NVFP4Tensor(
        packed=packed.reshape(*lead, kp // 2),
        scales=scales.reshape(*lead, nb),
        global_scale=g.reshape(()),
        shape=shape,
    )


# ---------------------------------------------------------------------------------------------------------
# W4A16 GEMM: out[M, N] = x[M, K] @ W_hat[N, K]^T
# ---------------------------------------------------------------------------------------------------------


# the batch varies per step and only masks rows: M is not specialised on, so no compile per size class
@triton.jit(do_not_specialize=["M"])
def _w4a16_kernel(
    x_ptr,
    packed_ptr,
    scales_ptr,
    global_scale_ptr,
    out_ptr,
    M,
    N,
    K,
    NB,
    stride_xm,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    SCALE_TILE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_cols = packed_ptr + rn.to(tl.int64)[None, :] * (NB * 8)
    s_cols = scales_ptr + rn.to(tl.int64)[None, :] * NB

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, NB * 16, BLOCK_K):
        kx = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + kx[None, :], mask=m_ok[:, None] & (kx < K)[None, :], other=0.0)
        # Split activations into even and odd K so they meet the low and high nibbles of each weight byte.
        x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_K // 2, 2)))

        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # byte index along K, one byte = two elements
        kb_ok = (kb < NB * 8)[:, None] & n_ok[None, :]
        w_bytes = tl.load(w_cols + kb[:, None], mask=kb_ok, other=0).to(tl.int32)  # [BLOCK_K/2, BLOCK_N]
        if SCALE_TILE:
            # one E4M3 scale per 16 elements (8 bytes): load each once, [BLOCK_K/16, BLOCK_N], and widen it to the
            # bytes in registers (a load per byte read every scale 8 times, outside the pipelined loads)
            sb = k0 // 16 + tl.arange(0, BLOCK_K // 16)
            s_blk = tl.load(s_cols + sb[:, None], mask=(sb < NB)[:, None] & n_ok[None, :], other=0)
            s_blk = _e4m3_byte_to_f32(s_blk.to(tl.int32))
            s = tl.reshape(
                tl.broadcast_to(s_blk[:, None, :], (BLOCK_K // 16, 8, BLOCK_N)), (BLOCK_K // 2, BLOCK_N)
            )
        else:
            # before Hopper the widening above spills (mma.sync keeps both operands in registers): one scale
            # load per weight byte, the same scale for 8 bytes in a row
            s = _e4m3_byte_to_f32(tl.load(s_cols + (kb // 8)[:, None], mask=kb_ok, other=0).to(tl.int32))
        # E2M1 * E4M3 is exact in x's dtype, so the cast below loses nothing.
        w_even = (_e2m1_value(w_bytes & 15) * s).to(x.dtype)
        w_odd = (_e2m1_value(w_bytes >> 4) * s).to(x.dtype)
        if DOT_IN_FP32:
            # Interpreter only: it multiplies bf16 operands as raw uint16 bit patterns. A bf16 x bf16 product
            # is exact in fp32, so upcasting reproduces what the tensor cores compute.
            x_even = x_even.to(tl.float32)
            x_odd = x_odd.to(tl.float32)
            w_even = w_even.to(tl.float32)
            w_odd = w_odd.to(tl.float32)
        acc = tl.dot(x_even, w_even, acc, input_precision=INPUT_PRECISION)
        acc = tl.dot(x_odd, w_odd, acc, input_precision=INPUT_PRECISION)

    g = tl.load(global_scale_ptr)
    out = tl.math.div_rn(acc, g)
    tl.store(
        out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


H100_SMS = 132  # the part the tiles are tuned for; the count where there is no GPU to ask (compile checks)


@functools.cache  # asked on every GEMM call, the answer never changes
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return H100_SMS
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


@functools.cache
def _cuda_arch(device: torch.device) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def target_arch(device: torch.device) -> int:
    """The compute capability (major * 10 + minor) a launch on `device` compiles for: the GPU's; off a GPU, the
    target Triton's active driver names (scripts/triton_compile_check.py sets one per arch), else Hopper's."""
    if device.type == "cuda":
        return _cuda_arch(device)
    active = getattr(triton.runtime.driver, "_active", None)
    try:
        return int(active.get_current_target().arch) if active is not None else 90
    except Exception:  # noqa: BLE001 - an interpreter or CPU driver names no CUDA target
        return 90


def _gemm_tiles(
    m: int, fp32: bool = False, n: int = 0, sms: int = H100_SMS, arch: int = 90
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) by batch size: decode-sized M wants narrow M tiles. fp32
    activations are twice as wide, and the dequantized weight tile is fp32 for them too: half the K tile keeps
    the tiles' bytes, and their registers. At the 16-bit K tile an fp32 program spills: 9 KB of stack per thread
    at M=32 on sm_90, 760 B at M=2048; none at half (scripts/triton_compile_check.py). At decode sizes a
    projection with fewer 64-column tiles than the GPU has SMs (an 8B's o_proj and down_proj, N = 4096: 64 on
    132) takes 32-column tiles, so every SM streams weights. Before Hopper (`arch` < 90) a 64 x 64 tile at four
    warps spills (16-24 B of stack per thread on sm_80/89, where both dot operands live in registers): eight
    warps there."""
    if m <= 16:
        bm, bn, bk, warps = 16, 64, 128, 4
        if 0 < n and triton.cdiv(n, 64) < sms:
            bn = 32
    elif m <= 64:
        bm, bn, bk, warps = 64, 64, 128, 4 if arch >= 90 else 8
    else:
        bm, bn, bk, warps = 128, 128, 64, 8
    return bm, bn, bk // 2 if fp32 else bk, warps


def w4a16_matmul(
    x: torch.Tensor,
    w: NVFP4Tensor,
    *,
    tiles: tuple[int, int, int] | None = None,
    scale_tile: bool | None = None,
) -> torch.Tensor:
    """x[..., K] @ W_hat^T -> [..., N] in x's dtype (fp32 accumulation). W is an NVFP4 [N, K] weight.

    fp32 activations use IEEE fp32 dot products (no TF32), so an fp32 caller gets fp32 accuracy.
    `tiles` = (BLOCK_M, BLOCK_N, BLOCK_K) overrides the size heuristic (tests use it to keep the
    interpreter fast). `scale_tile` picks how block scales are loaded (once per block and widened in registers:
    Hopper and later; once per weight byte: earlier parts, where the widening spills); None = by the target.
    """
    if len(w.shape) != 2:
        raise ValueError(f"w4a16_matmul: weight must be 2-D [N, K], got shape {w.shape}")
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"w4a16_matmul: x has K={x.shape[-1]}, weight has K={k}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"w4a16_matmul: activations must be float32, bfloat16 or float16, got {x.dtype}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*lead, n)
    arch = target_arch(x.device)
    bm, bn, bk, warps = _gemm_tiles(m, fp32=x.dtype == torch.float32, n=n, sms=_sm_count(x.device), arch=arch)
    if tiles is not None:
        bm, bn, bk = tiles
    interpreting = bool(triton.knobs.runtime.interpret)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _w4a16_kernel[grid](
        x2,
        w.packed.contiguous(),
        w.scales.contiguous(),
        w.global_scale.reshape(1),
        out,
        m,
        n,
        k,
        w.padded_k // BLOCK_SIZE,
        x2.stride(0),
        out.stride(0),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 or interpreting else "tf32",
        DOT_IN_FP32=interpreting,
        SCALE_TILE=arch >= 90 if scale_tile is None else scale_tile,
        num_warps=warps,
        num_stages=3,
        enable_fp_fusion=False,  # as the quantizer: exact dequantization, whatever Triton's default
    )
    return out.reshape(*lead, n)
