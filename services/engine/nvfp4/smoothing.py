"""Activation-aware smoothing (SmoothQuant's migration; akin to AWQ's scaling for weight-only): before quantizing, move
part of each projection's input range into its weight, function-preserving in exact arithmetic.

For a projection y = x W^T with input channels j, and per-channel factors s_j > 0:

    y = (x / s) (W * s)^T

The weight's column j is multiplied by s_j, the input divided by it. With s_j = max|x_j|^a / max|W_:,j|^(1-a)
(a = alpha in (0, 1]; SmoothQuant's rule), channels whose activations run large get finer weight codes, and the
activations' outlier channels shrink, which is what 4-bit activations need. The division is never computed at
run time: it is folded into what writes the input. That is done where it is free: the projections fed by an
RMSNorm (q/k/v after the attention norm, gate/up after the FFN norm: one input each, so one factor per group),
whose norm weight takes 1 / s. The result is an ordinary dense model that any engine, and `rackserve
quantize`'s export, quantizes and serves as it would the original.

o and down are left alone. Their inputs could take 1 / s through v's rows and up's rows, but those are
quantized weights themselves: rows scaled by factors spanning orders of magnitude share one NVFP4 tensor scale,
and the small rows' block scales fall to where E4M3 has few bits. Measured on SmolLM2 (4 windows, alpha 0.5),
folding into v and up too cost W4A4 1.345x -> 1.432x perplexity (1.382x with the factors floored at 1/16).

Only the ratio between channels matters (the NVFP4 tensor scale absorbs any overall factor), so each s is
divided by its largest value. The factors come from max |x_j| over the calibration windows, through the float32
model (calibration.channel_amax).
"""

from __future__ import annotations

from typing import Any

import torch

from .calibration import FUSED

ATTN_NORM, FFN_NORM = "input_layernorm", "post_attention_layernorm"
# the fused projections (calibration.FUSED) an RMSNorm feeds, and that norm: the ones smoothed
NORM_FED = {"attn.wqkv": ATTN_NORM, "ffn.w_gate_up": FFN_NORM}


def check_alpha(alpha: float) -> float:
    if not 0 < alpha <= 1:
        raise ValueError(f"smoothing alpha must be in (0, 1], got {alpha}")
    return alpha


def factors(act: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """s_j = max|x_j|^alpha / max|W_:,j|^(1 - alpha), divided by its largest value. A channel with no
    activation or no weight has nothing to move: it takes the largest factor (1 after the division), which
    neither amplifies its activations (a zero weight column's could otherwise become the new outlier) nor
    inflates its norm weight."""
    a = act.to(torch.float32)
    w = weight.to(torch.float32).abs().amax(dim=0)
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(w).all())):
        raise ValueError("smoothing: a calibration activation or a weight is not finite")
    s = a.clamp_min(1e-5).pow(alpha) / w.clamp_min(1e-5).pow(1 - alpha)
    live = (a > 0) & (w > 0)
    top = s[live].max() if bool(live.any()) else torch.ones(())
    s = torch.where(live, s, top)
    return s / s.max()


def smooth_model(loaded: Any, amax: dict[str, torch.Tensor], alpha: float) -> Any:
    """A copy of the dense `loaded` whose norm-fed projections (q/k/v, gate/up) are smoothed by `alpha`, the
    inverse factors folded into the norms (module docstring). float32 throughout: the copy is what gets
    quantized. `amax` is calibration.channel_amax's (only the norm-fed projections' entries are read)."""
    import dataclasses

    check_alpha(alpha)
    cfg = loaded.config
    w: dict[str, torch.Tensor] = {}
    for name, t in loaded.weights.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} is already quantized; smoothing applies to a dense model")
        w[name] = t.to(torch.float32)
    for i in range(cfg.num_layers):
        p = f"layers.{i}"
        for attr, parts in FUSED:
            norm = NORM_FED.get(attr)
            if norm is None:
                continue
            s = factors(amax[f"{p}.{attr}"], torch.cat([w[f"{p}.{n}"] for n in parts]), alpha)
            for n in parts:
                w[f"{p}.{n}"] = w[f"{p}.{n}"] * s
            w[f"{p}.{norm}"] = w[f"{p}.{norm}"] / s
    return dataclasses.replace(loaded, weights=w)
