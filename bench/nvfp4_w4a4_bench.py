"""W4A4 on SmolLM2-135M: where quantizing the activations costs quality, and what did not win it back.

    python -m bench.nvfp4_w4a4_bench [--windows N] [--threads T]

Every row is the engine's NVFP4 model (rtn weights, float32 activations before quantization), scored by
teacher-forced perplexity on the first N 512-token windows of /usr/share/common-licenses/GPL-3 (as
nvfp4_quality_bench does) against the unquantized float32 model, with its top-1 agreement. W4A4 is the engine's
CPU emulation (`--nvfp4-gemm w4a4`: each projection's input quantized and dequantized with the recipe, one tensor
scale per call, then the matmul), which gives the FP4 GEMM's product up to its bf16 output rounding.

1. W4A16 and W4A4, and W4A4 on one kind of projection at a time (the rest W4A16), and on all but down.
2. Other ways to quantize the activations, each a valid NVFP4 encoding a GPU kernel could compute:
   static tensor scales calibrated on the calibration text, as `rackserve quantize --activations nvfp4` writes
   them and W4A4 checkpoints carry; one tensor scale per token instead of per call; block scales chosen by
   `four_over_six` or `mse` (services/engine/nvfp4/methods.py) instead of the recipe's.
3. Smoothing (services/engine/nvfp4/smoothing.py, SmoothQuant's migration into the norm-fed projections),
   W4A16 and W4A4, at a few alphas.
4. Block-diagonal Hadamard rotations (QuaRot-style): x W^T = (x H)(W H)^T for orthogonal H, so the weights are
   quantized as W H and the activations as x H, H a Hadamard matrix on each run of 16, 32 or 64 columns.
Writes bench/results/nvfp4_w4a4.md. Benchmarks never assert; this one reports.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from operator import attrgetter
from typing import cast

import torch

from bench.nvfp4_quality_bench import WINDOW_TOKENS, score
from bench.report import publish
from services.engine.engine import EngineConfig, LLMEngine
from services.engine.loader import load_gguf
from services.engine.model import Block, Transformer
from services.engine.model_files import smollm2_gguf_path
from services.engine.nvfp4 import NVFP4Linear, dequantize, quantize
from services.engine.nvfp4.calibration import (
    EVALUATION_TEXT,
    FUSED,
    calibrate_input_scales,
    calibration_windows,
    channel_amax,
    input_scales_from_amax,
)
from services.engine.nvfp4.methods import quantize_with
from services.engine.nvfp4.smoothing import smooth_model
from services.engine.tokenizer import Tokenizer

SMOOTH_ALPHAS = (0.5, 0.75, 0.9)
# the engine's projection kinds (calibration.FUSED), named by their parts: "q/k/v", "o", "gate/up", "down"
KINDS = {"/".join(p.removesuffix("_proj") for p in parts): attr for attr, parts in FUSED}


def blocks(model: Transformer) -> list[Block]:
    return cast(list[Block], list(model.blocks))


def nvfp4_layers(model: Transformer) -> Iterator[tuple[str, str, NVFP4Linear]]:
    """Every NVFP4 layer with its projection kind (KINDS) and the canonical name of its first part."""
    for i, b in enumerate(blocks(model)):
        for kind, (attr, parts) in zip(KINDS, FUSED, strict=True):
            for m in attrgetter(attr)(b).modules():
                if isinstance(m, NVFP4Linear):
                    yield kind, f"layers.{i}.{parts[0]}", m


def static_scales(model: Transformer, scales: dict[str, torch.Tensor] | None) -> None:
    """Every projection quantizes its input under `scales` (canonical names, calibrate_input_scales), or per
    call when None."""
    for _, name, m in nvfp4_layers(model):
        m.set_input_scale(None if scales is None else scales[name])


def w4a4_on(model: Transformer, kinds: tuple[str, ...]) -> None:
    """W4A4 on the projections of `kinds`, W4A16 on the others."""
    for kind, _, m in nvfp4_layers(model):
        m.w4a4 = kind in kinds


@contextmanager
def activations_quantized_by(fn: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Every W4A4 projection quantizes its [M, K] input with `fn` (quantize + dequantize) instead of the recipe."""
    original = NVFP4Linear._emulate_w4a4_activations

    def emulate(self: NVFP4Linear, x: torch.Tensor) -> torch.Tensor:
        return fn(x.reshape(-1, self.in_features)).to(x.dtype).reshape(x.shape)

    NVFP4Linear._emulate_w4a4_activations = emulate  # type: ignore[method-assign]
    try:
        yield
    finally:
        NVFP4Linear._emulate_w4a4_activations = original  # type: ignore[method-assign]


def per_token(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([dequantize(quantize(row[None])) for row in x]) if len(x) else x


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


class Rotated(torch.nn.Module):
    """x W^T computed as (x H)(W H)^T with both factors NVFP4-quantized (the activations per call)."""

    def __init__(self, weight: torch.Tensor, n: int) -> None:
        super().__init__()
        self.h, self.n = hadamard(n), n
        self.w_hat = dequantize(quantize(self.rotate(weight)))

    def rotate(self, t: torch.Tensor) -> torch.Tensor:
        return (t.reshape(-1, t.shape[-1] // self.n, self.n) @ self.h).reshape(t.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = dequantize(quantize(self.rotate(x.reshape(-1, x.shape[-1]))))
        return (x2 @ self.w_hat.T).reshape(*x.shape[:-1], -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=8, help="512-token windows of GPL-3 to score")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    loaded = load_gguf(smollm2_gguf_path())
    tok = Tokenizer.from_gguf(smollm2_gguf_path())
    corpus = tok.encode(EVALUATION_TEXT.read_text())
    windows = [torch.tensor(corpus[i * WINDOW_TOKENS : (i + 1) * WINDOW_TOKENS]) for i in range(args.windows)]
    ref_ppl, ref_top = score(LLMEngine(loaded, EngineConfig(dtype="float32")).model, windows)
    cfg = EngineConfig(dtype="float32", quant="nvfp4", nvfp4_gemm="w4a4", nvfp4_cache_dequantized=True)
    model = LLMEngine(loaded, cfg).model
    rows: list[tuple[str, float, torch.Tensor]] = []

    def run(label: str, m: Transformer) -> None:
        ppl, top = score(m, windows)
        rows.append((label, ppl, top))
        print(f"{label}: {ppl / ref_ppl:.4f}x", flush=True)

    w4a4_on(model, ())
    run("W4A16", model)
    w4a4_on(model, tuple(KINDS))
    run("**W4A4** (the recipe, one tensor scale per call)", model)
    for kind in KINDS:
        w4a4_on(model, (kind,))
        run(f"W4A4 on {kind} only", model)
    w4a4_on(model, tuple(k for k in KINDS if k != "down"))
    run("W4A4 on all but down", model)
    w4a4_on(model, tuple(KINDS))
    # one calibration pass: its channel maxima give the static scales here and the smoothing factors below
    amax = channel_amax(loaded, calibration_windows(tok))
    calibrated = input_scales_from_amax(loaded, amax)
    static_scales(model, calibrated)
    run(
        "W4A4, static tensor scales (max over the calibration text; `rackserve quantize --activations nvfp4`)",
        model,
    )
    # g_e = 2688 / amax: a multiple of the amax is g_e over it
    clips = "nothing of the evaluation text clips"
    for times, what in ((0.5, "the outliers clip"), (2, clips), (4, clips)):
        static_scales(model, {name: g / times for name, g in calibrated.items()})
        run(f"W4A4, static tensor scales at {times}x the calibrated amax ({what})", model)
    static_scales(model, None)
    variants: list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = [
        ("W4A4, one tensor scale per token", per_token),
        ("W4A4, activation block scales by `four_over_six`", lambda x: dequantize(quantize_with(x, "four_over_six"))),
        ("W4A4, activation block scales by `mse`", lambda x: dequantize(quantize_with(x, "mse"))),
    ]  # fmt: skip
    for label, fn in variants:
        with activations_quantized_by(fn):
            run(label, model)

    for alpha in SMOOTH_ALPHAS:
        smoothed_model = smooth_model(loaded, amax, alpha)
        smoothed = LLMEngine(smoothed_model, cfg).model
        w4a4_on(smoothed, ())
        run(f"smoothed (`rackserve quantize --smooth {alpha}`): W4A16", smoothed)
        w4a4_on(smoothed, tuple(KINDS))
        run(f"smoothed (`rackserve quantize --smooth {alpha}`): W4A4", smoothed)
        if alpha == SMOOTH_ALPHAS[-1]:  # what a W4A4 checkpoint of the smoothed model serves
            static_scales(smoothed, calibrate_input_scales(smoothed_model, calibration_windows(tok)))
            run(f"smoothed (`--smooth {alpha} --activations nvfp4`): W4A4, static tensor scales", smoothed)

    dense = LLMEngine(loaded, EngineConfig(dtype="float32")).model
    weights = loaded.weights
    for n in (16, 32, 64):
        for i, b in enumerate(blocks(dense)):
            for attr, parts in FUSED:
                w = torch.cat([cast(torch.Tensor, weights[f"layers.{i}.{p}"]) for p in parts]).float()
                owner, _, name = attr.rpartition(".")
                setattr(attrgetter(owner)(b), name, Rotated(w, n))
        run(f"W4A4, weights and activations Hadamard-rotated in runs of {n}", dense)

    lines = [
        "# W4A4 on SmolLM2-135M-Instruct",
        "",
        f"`python -m bench.nvfp4_w4a4_bench --windows {args.windows} --threads {args.threads}` — torch "
        f"{torch.__version__}; {args.windows} x {WINDOW_TOKENS}-token windows of {EVALUATION_TEXT}; rtn weights; "
        f"reference: the unquantized model in float32 (perplexity {ref_ppl:.3f}); "
        f"{time.perf_counter() - t_start:.0f} s.",
        "",
        "| weights NVFP4 (rtn), activations | perplexity | ratio | top-1 agreement |",
        "|---|---|---|---|",
        *(f"| {label} | {ppl:.3f} | {ppl / ref_ppl:.4f}x | {float((top == ref_top).float().mean()):.4f} |"
          for label, ppl, top in rows),
    ]  # fmt: skip
    publish(lines, "nvfp4_w4a4.md")


if __name__ == "__main__":
    main()
