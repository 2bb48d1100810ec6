"""Calibrated NVFP4 quantization: other ways to *choose* the bytes of a standard NVFP4 tensor.

NVFP4 fixes how a tensor decodes (recipe.dequantize: E2M1 code x E4M3 block scale / FP32 tensor scale); it does
not fix how the encoder picks the block scales or the codes. Every method here returns an ordinary NVFP4Tensor
(same packed codes, E4M3 scale bytes and tensor scale g_e as the recipe's), so every kernel and checkpoint
layout reads it unchanged. recipe.py stays the one owner of the arithmetic: the methods only pick scale bytes
(and, for gptq, the values being encoded) and call its encode step.

| method          | block scale                                           | codes                           |
|-----------------|-------------------------------------------------------|---------------------------------|
| `rtn`           | the recipe's e4m3(g_e * amax / 6)                      | round to nearest (the recipe)   |
| `four_over_six` | amax/6 or amax/4, whichever errs less (arXiv 2512.02010)| round to nearest                |
| `mse`           | the least-squared-error byte among the rtn byte -5..+1 | round to nearest                |
| `gptq`          | `mse`'s on the original weights, each column's error   | activation order, error feedback|
|                 | weighted by its input's mean square (static groups)    |                                 |

`rtn` is `recipe.quantize`, byte for byte. The tensor scale is the recipe's (2688 / amax) for every method.
`gptq` needs the Hessian of the layer's inputs (2 X^T X over a calibration set, see calibration.py); the
others are data-free and vectorized over all blocks at once (a Python loop over a handful of candidate scales,
never over blocks), so they run at model load.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from services.engine.config import NVFP4_LOAD_METHODS, NVFP4_METHODS

from .recipe import (
    BLOCK_SIZE,
    NVFP4Tensor,
    abs_max,
    check_finite,
    decode_blocks,
    e4m3_rne_satfinite,
    encode_blocks,
    global_scale_for_amax,
    pack_codes,
    padded_size,
    quantize,
)

LOAD_TIME_METHODS = NVFP4_LOAD_METHODS  # data-free; gptq needs calibration (rackserve quantize)
METHODS = NVFP4_METHODS
DEFAULT_METHOD = "rtn"

# `mse` tries the E4M3 bytes next to the recipe's: positive float8_e4m3fn bytes are ordered like their values
# (0x01 .. 0x7E = 448; 0x7F is NaN), each step ~1/8 to 1/16 of the value. -5 reaches amax/4 (the `four_over_six`
# candidate, 6/4 = 2^0.58, ~5 steps), +1 undoes a scale that e4m3 rounded down into saturating the block max.
MSE_BYTE_OFFSETS = (0, -1, -2, -3, -4, -5, 1)
_E4M3_MAX_BYTE = 0x7E

# E2M1 magnitude of |y| by the recipe's decision points (same tie rules as recipe.e2m1_codes): 0.25 -> 0,
# 0.75 -> 1 ... each passed point adds the gap to the next magnitude. Used only to *rank* candidate scales;
# the chosen scale is then encoded exactly by recipe.encode_blocks.
_MAGNITUDE_STEPS = ((0.25, 0.5, False), (0.75, 0.5, True), (1.25, 0.5, False), (1.75, 0.5, True),
                    (2.5, 1.0, False), (3.5, 1.0, True), (5.0, 2.0, False))  # fmt: skip


def check_method(method: str, *, load_time: bool = False) -> str:
    allowed = LOAD_TIME_METHODS if load_time else METHODS
    if method not in allowed:
        hint = (
            " (gptq needs a calibration pass: write a checkpoint with `rackserve quantize --method gptq` and "
            "serve that)"
            if load_time and method == "gptq"
            else ""
        )
        raise ValueError(f"nvfp4 method must be one of {allowed}, got {method!r}{hint}")
    return method


def method_id(method: str) -> str:
    """The method as it enters a model fingerprint: `rtn` keeps the plain recipe id (old fingerprints hold)."""
    return "" if method == "rtn" else f":method={method}"


def _blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """fp32 blocks [..., Kp/16, 16] of x (zero padded) and the recipe's g_e for it."""
    if x.dim() == 0:
        raise ValueError("NVFP4 quantize: input must have at least one dimension")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"NVFP4 quantize: input must be float32, bfloat16 or float16, got {x.dtype}")
    xf = x.to(torch.float32)
    shape = tuple(xf.shape)
    kp = padded_size(shape[-1])
    if kp != shape[-1]:
        xf = F.pad(xf, (0, kp - shape[-1]))
    amax = abs_max(xf)
    if not bool(torch.isfinite(amax)):
        # the caller's elements, not the zero padding: the message counts what was passed in
        check_finite(xf[..., : shape[-1]])
    return xf.reshape(*shape[:-1], kp // BLOCK_SIZE, BLOCK_SIZE), global_scale_for_amax(amax), shape


def _rtn_scale(block_amax: torch.Tensor, g: torch.Tensor, divisor: float) -> torch.Tensor:
    # the recipe's s_b = e4m3(g_e * (a_b * (1/d))), with d = 6 for the recipe, 4 for four_over_six's other pick
    return e4m3_rne_satfinite(g * (block_amax * torch.tensor(1.0 / divisor, dtype=torch.float32)))


def _sq_error(
    blocks: torch.Tensor, scale_fp8: torch.Tensor, g: torch.Tensor, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """Squared error per block of round-to-nearest under `scale_fp8`, computed in float (for ranking); with
    `weight` (broadcast against `blocks`), each element's squared error times its weight."""
    step = scale_fp8.to(torch.float32) / g  # the value of one E2M1 unit in this block
    inv = torch.where(step > 0, 1.0 / torch.where(step > 0, step, 1.0), 0.0).unsqueeze(-1)
    y = blocks * inv
    a = y.abs()
    mag = torch.zeros_like(a)
    for point, gap, inclusive in _MAGNITUDE_STEPS:
        mag += (a >= point if inclusive else a > point) * gap
    err = torch.copysign(mag, y) * step.unsqueeze(-1) - blocks
    if weight is None:
        return (err * err).sum(-1)
    return (err * err * weight).sum(-1)


def _pick_scales(
    blocks: torch.Tensor, g: torch.Tensor, candidates: list[torch.Tensor], weight: torch.Tensor | None = None
) -> torch.Tensor:
    """Per block, the candidate scale (float8_e4m3fn [...]) with the least (weighted: _sq_error) squared error;
    the first wins ties, so the recipe's own scale (listed first) is kept unless another is strictly better."""
    best = candidates[0]
    best_err = _sq_error(blocks, best, g, weight)
    for cand in candidates[1:]:
        err = _sq_error(blocks, cand, g, weight)
        better = err < best_err
        best = torch.where(better, cand.view(torch.uint8), best.view(torch.uint8)).view(torch.float8_e4m3fn)
        best_err = torch.where(better, err, best_err)
    return best


def _four_over_six_candidates(blocks: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    amax = abs_max(blocks, dim=-1)
    return [_rtn_scale(amax, g, 6.0), _rtn_scale(amax, g, 4.0)]


def _mse_candidates(blocks: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    amax = abs_max(blocks, dim=-1)
    rtn = _rtn_scale(amax, g, 6.0)
    base = rtn.view(torch.uint8).to(torch.int16)
    out = [rtn]
    for off in MSE_BYTE_OFFSETS[1:]:
        b = (base + off).clamp(1, _E4M3_MAX_BYTE).to(torch.uint8)
        out.append(torch.where(base == 0, base.to(torch.uint8), b).view(torch.float8_e4m3fn))
    out.append(_rtn_scale(amax, g, 4.0))  # four_over_six's pick, in case e4m3 rounding put it outside -5
    return out


_SCALE_RULES: dict[str, Callable[[torch.Tensor, torch.Tensor], list[torch.Tensor]]] = {
    "four_over_six": _four_over_six_candidates,
    "mse": _mse_candidates,
}


def quantize_with(
    x: torch.Tensor, method: str = DEFAULT_METHOD, *, hessian: torch.Tensor | None = None, **gptq_kw: Any
) -> NVFP4Tensor:
    """Quantize along the last dim with `method` (see the module docstring); a standard NVFP4Tensor.

    `hessian` [K, K] is gptq's input statistics (required by it, refused by the others).
    """
    check_method(method)
    if method == "gptq":
        if hessian is None:
            raise ValueError("nvfp4 method 'gptq' needs the Hessian of the layer's inputs (calibration)")
        return gptq(x, hessian, **gptq_kw)
    if hessian is not None:
        raise ValueError(f"nvfp4 method {method!r} is data-free; only 'gptq' takes a Hessian")
    if method == "rtn":
        return quantize(x)
    blocks, g, shape = _blocks(x)
    scale_fp8 = _pick_scales(blocks, g, _SCALE_RULES[method](blocks, g))
    codes = encode_blocks(blocks, scale_fp8, g).reshape(*shape[:-1], -1)
    return NVFP4Tensor(
        packed=pack_codes(codes).contiguous(),
        scales=scale_fp8.view(torch.uint8).contiguous(),
        global_scale=g,
        shape=shape,
    )


GPTQ_SCALES = ("static", "dynamic")
"""How gptq picks each 16-column block's E4M3 scale: `static` (the default: mse's search on the original
weights, before any error feedback, as GPTQ's static groups, with each column's squared error weighted by the
Hessian's diagonal, its input's mean square: a loud input channel's rounding moves the output more), `dynamic`
(mse's unweighted search on the block's error-corrected weights when the column loop first reaches one of its
columns). Unweighted, the two were within noise of each other in perplexity; weighting the static search lowered
it further, most under W4A4 (docs/nvfp4-quality.md)."""


def gptq(
    w: torch.Tensor,
    hessian: torch.Tensor,
    *,
    damp: float = 0.01,
    block_columns: int = 128,
    act_order: bool = True,
    scales: str = "static",
) -> NVFP4Tensor:
    """GPTQ (Frantar et al. 2022) onto the NVFP4 grid: columns one at a time, each column's rounding error spread
    over the columns not yet quantized through the inverse Hessian, so that the layer's *output* on the
    calibration inputs moves least. The tensor scale is the recipe's, from the original amax; each 16-column
    block's scale is chosen as `scales` says (GPTQ_SCALES). Blocks stay the format's 16 consecutive columns
    whatever the order.

    `act_order` quantizes the columns in order of decreasing Hessian diagonal (the loudest inputs first, while
    the most columns are left to absorb their error), GPTQ's "desc_act"; off, in index order.
    w: [N, K] with K % 16 == 0; hessian: [K, K], 2 X^T X / n of the layer's inputs (any positive multiple).
    `damp` is added to the diagonal as a share of its mean (GPTQ's percdamp), for a stable Cholesky.
    """
    if w.dim() != 2 or w.shape[1] % BLOCK_SIZE != 0:
        raise ValueError(f"gptq: weight must be 2-D [N, K] with K % 16 == 0, got {tuple(w.shape)}")
    n, k = w.shape
    if tuple(hessian.shape) != (k, k):
        raise ValueError(f"gptq: hessian must be [{k}, {k}] for a weight of {tuple(w.shape)}")
    if scales not in GPTQ_SCALES:
        raise ValueError(f"gptq: scales must be one of {GPTQ_SCALES}, got {scales!r}")
    if not damp > 0:
        raise ValueError(f"gptq: damp must be positive, got {damp}")
    blocks, g, _ = _blocks(w)
    h = hessian.detach().to(torch.float64).clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    h += torch.eye(k, dtype=torch.float64) * (damp * float(torch.diag(h).mean()))
    perm = torch.argsort(torch.diag(h), descending=True, stable=True) if act_order else torch.arange(k)
    h = h[perm][:, perm]
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).to(
        torch.float32
    )
    # Transposed and permuted ([K, N]: one column of W is one contiguous row here), float32 like GPTQ.
    wt = w.detach().to(torch.float32).T[perm].contiguous()

    codes = torch.zeros((k, n), dtype=torch.uint8)
    scale_fp8 = torch.zeros((k // BLOCK_SIZE, n), dtype=torch.float8_e4m3fn)
    chosen = torch.zeros(k // BLOCK_SIZE, dtype=torch.bool)
    if scales == "static":
        scale_fp8[:] = _pick_scales(blocks, g, _mse_candidates(blocks, g), input_weights(hessian)).T
        chosen[:] = True
    step = max(BLOCK_SIZE, block_columns // BLOCK_SIZE * BLOCK_SIZE)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny ops: thread wake-ups cost more than they win (~5x, 2 cores)
    try:
        _gptq_columns(wt, hinv, g, perm, codes, scale_fp8, chosen, step)
    finally:
        torch.set_num_threads(threads)
    codes = codes.T.contiguous()
    scale_fp8 = scale_fp8.T.contiguous()
    return NVFP4Tensor(
        packed=pack_codes(codes).contiguous(),
        scales=scale_fp8.view(torch.uint8).contiguous(),
        global_scale=g,
        shape=(n, k),
    )


def input_weights(hessian: torch.Tensor) -> torch.Tensor:
    """gptq's static scale search weights [K/16, 16]: each column's input mean square (H's diagonal, before
    damping), divided by a power of two near their mean (frexp's): exact, so the choice is the raw diagonal's, and
    a large or tiny H neither overflows nor underflows float32. A block none of whose inputs was ever non-zero
    weighs its columns alike (mse's own pick); a column with a silent input among loud ones weighs nothing, as
    its rounding never reaches the output."""
    d = torch.diag(hessian.detach()).to(torch.float64).clamp(min=0)
    mean = float(d.mean())
    if not (mean > 0 and math.isfinite(mean)):
        return torch.ones(d.shape[0] // BLOCK_SIZE, BLOCK_SIZE)
    w = (d * 2.0 ** -math.frexp(mean)[1]).to(torch.float32).reshape(-1, BLOCK_SIZE)
    w[w.sum(-1) == 0] = 1.0
    return w


def _gptq_columns(
    wt: torch.Tensor,
    hinv: torch.Tensor,
    g: torch.Tensor,
    perm: torch.Tensor,
    codes: torch.Tensor,
    scale_fp8: torch.Tensor,
    chosen: torch.Tensor,
    step: int,
) -> None:
    """gptq's loop on the permuted W^T [K, N] in place, filling codes [K, N] and scale_fp8 [K/16, N] (original
    column order). A block whose scale is not `chosen` yet gets it from its 16 columns' current values, all
    still unquantized then (a column is quantized only under its block's scale)."""
    k = wt.shape[0]
    position = torch.empty_like(perm)
    position[perm] = torch.arange(k)
    order = perm.tolist()
    for c1 in range(0, k, step):
        c2 = min(c1 + step, k)
        w1 = wt[c1:c2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[c1:c2, c1:c2]
        for i in range(c2 - c1):
            col = order[c1 + i]
            blk = col // BLOCK_SIZE
            if not chosen[blk]:
                pos = position[blk * BLOCK_SIZE : (blk + 1) * BLOCK_SIZE]
                inside = (pos >= c1) & (pos < c2)
                cur = torch.empty((BLOCK_SIZE, wt.shape[1]), dtype=torch.float32)
                cur[inside] = w1[pos[inside] - c1]
                later = pos[~inside]  # beyond this lazy block: apply its pending updates first
                if len(later):
                    cur[~inside] = wt[later] - hinv[c1 : c1 + i, later].T @ err1[:i]
                grp = cur.T.unsqueeze(1)  # [N, 1, 16]: each row's block, error-corrected so far
                scale_fp8[blk] = _pick_scales(grp, g, _mse_candidates(grp, g)).squeeze(1)
                chosen[blk] = True
            s = scale_fp8[blk]
            code = encode_blocks(w1[i].unsqueeze(-1), s, g)  # [N, 1]: one element of each row's block
            codes[col] = code.squeeze(-1)
            e = (w1[i] - decode_blocks(code, s, g).squeeze(-1)) / hinv1[i, i]
            w1[i:] -= hinv1[i, i:].unsqueeze(1) * e.unsqueeze(0)
            err1[i] = e
        wt[c2:] -= hinv[c1:c2, c2:].T @ err1


def output_error(w: torch.Tensor, w_hat: torch.Tensor, hessian: torch.Tensor) -> float:
    """tr((W - W_hat) H (W - W_hat)^T): the layer's squared output error on the calibration inputs (what
    gptq minimizes), for tests and reports."""
    d = w.to(torch.float64) - w_hat.to(torch.float64)
    return float(torch.einsum("nk,kl,nl->", d, hessian.to(torch.float64), d))


def relative_error(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """||W - W_hat||_F / ||W||_F."""
    w64 = w.to(torch.float64)
    return float(
        torch.linalg.norm(w64 - w_hat.to(torch.float64)) / max(float(torch.linalg.norm(w64)), 1e-300)
    )


__all__ = [
    "DEFAULT_METHOD",
    "LOAD_TIME_METHODS",
    "METHODS",
    "check_method",
    "gptq",
    "method_id",
    "output_error",
    "quantize_with",
    "relative_error",
]
