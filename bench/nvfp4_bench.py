"""NVFP4 benchmark: quantization error by scheme and data distribution, and CPU quantize throughput.

    python -m bench.nvfp4_bench

Writes a markdown report to stdout and to bench/results/nvfp4.md:

1. Relative Frobenius error ||Q(x) - x|| / ||x|| on seeded 1024x4096 tensors (Gaussian, Student-t df=3 and
   df=1.5, Gaussian with 0.1 % of entries x50) for NVFP4, NVFP4 without the tensor scale (g_e = 1), MXFP4
   (E8M0 scale per 32, OCP rule) and FP4 with one FP32 scale per tensor, next to docs/nvfp4.md's numbers.
2. CPU quantize throughput (input bytes / time) next to a torch memcpy of the same bytes in the same run.

The model-level comparison (perplexity, token agreement) belongs to the engine benchmark.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from services.engine.nvfp4.recipe import dequantize, e2m1_codes, e2m1_values, quantize

ROWS, COLS = 1024, 4096
RESULTS = Path(__file__).resolve().parent / "results" / "nvfp4.md"

# docs/nvfp4.md's table, measured with an independent implementation: scheme -> distribution -> error.
NVFP4_MD = {
    "NVFP4 (E4M3 per 16 + FP32 per tensor)": (0.095, 0.091, 0.028, 0.074),
    "NVFP4 without the tensor scale": (0.095, 0.091, 0.666, 0.074),
    "MXFP4 (E8M0 per 32)": (0.115, 0.142, 0.137, 0.142),
    "FP4 with one FP32 scale per tensor": (0.137, 0.882, 0.365, 0.544),
}


def distributions(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gaussian = torch.randn(ROWS, COLS, generator=g)
    with torch.random.fork_rng():  # torch.distributions samples from the global generator
        torch.manual_seed(seed + 1)
        t3 = torch.distributions.StudentT(3.0).sample((ROWS, COLS))
        t15 = torch.distributions.StudentT(1.5).sample((ROWS, COLS))
    outliers = torch.randn(ROWS, COLS, generator=g)
    idx = torch.randperm(ROWS * COLS, generator=g)[: ROWS * COLS // 1000]
    outliers.view(-1)[idx] *= 50
    return {
        "Gaussian": gaussian,
        "Student-t df=3": t3,
        "Student-t df=1.5": t15,
        "Gaussian + 0.1 % outliers x50": outliers,
    }


def nvfp4(x: torch.Tensor) -> torch.Tensor:
    return dequantize(quantize(x))


def nvfp4_without_tensor_scale(x: torch.Tensor) -> torch.Tensor:
    return dequantize(quantize(x, global_scale=1.0))


def mxfp4(x: torch.Tensor) -> torch.Tensor:
    """OCP MX: per 32 elements, scale 2^(floor(log2 amax) - 2) in E8M0, elements E2M1 RNE, saturating."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    _, exp = torch.frexp(amax)  # amax = m * 2^exp with m in [0.5, 1): floor(log2 amax) = exp - 1
    shared = (exp - 1 - 2).clamp(-127, 127)
    scale = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), shared), torch.ones_like(amax))
    y = blocks / scale  # a power of two: exact
    return (e2m1_values(e2m1_codes(y)) * scale).reshape(x.shape)


def fp4_per_tensor(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax() / 6
    return e2m1_values(e2m1_codes(x / scale)) * scale


SCHEMES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "NVFP4 (E4M3 per 16 + FP32 per tensor)": nvfp4,
    "NVFP4 without the tensor scale": nvfp4_without_tensor_scale,
    "MXFP4 (E8M0 per 32)": mxfp4,
    "FP4 with one FP32 scale per tensor": fp4_per_tensor,
}


def relative_error(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    return float(torch.linalg.norm(x_hat - x) / torch.linalg.norm(x))


def error_table() -> str:
    data = distributions()
    header = "| scheme | " + " | ".join(data) + " |"
    lines = [header, "|---" * (len(data) + 1) + "|"]
    for scheme, fn in SCHEMES.items():
        cells = [
            f"{relative_error(x, fn(x)):.3f} ({ref:.3f})"
            for x, ref in zip(data.values(), NVFP4_MD[scheme], strict=True)
        ]
        lines.append(f"| {scheme} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def throughput_table(repeats: int = 9) -> str:
    lines = [
        "| input | bytes | CPU threads | quantize GB/s | memcpy GB/s (copy_) | quantize / memcpy |",
        "|---|---|---|---|---|---|",
    ]
    default_threads = torch.get_num_threads()
    try:
        for threads in sorted({1, default_threads}):
            torch.set_num_threads(threads)
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(7)).to(dtype)
                dst = torch.empty_like(x)
                nbytes = x.numel() * x.element_size()
                t_quant = median_seconds(lambda x=x: quantize(x), repeats)
                t_copy = median_seconds(lambda x=x, dst=dst: dst.copy_(x), repeats)
                q_gbs, c_gbs = nbytes / t_quant / 1e9, nbytes / t_copy / 1e9
                lines.append(
                    f"| {ROWS}x{COLS} {str(dtype).removeprefix('torch.')} | {nbytes / 2**20:.0f} MiB | "
                    f"{threads} | {q_gbs:.3f} | {c_gbs:.2f} | {q_gbs / c_gbs:.3f} |"
                )
    finally:
        torch.set_num_threads(default_threads)
    return "\n".join(lines)


def report() -> str:
    env = (
        f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, {platform.machine()}, "
        f"Python {platform.python_version()}"
    )
    return "\n\n".join(
        [
            "# NVFP4 benchmark",
            f"`python -m bench.nvfp4_bench` — {env}.",
            "## Quantization error, relative Frobenius ||Q(x)-x|| / ||x||, 1024x4096, seeded",
            "Each cell: this run (docs/nvfp4.md's independent measurement).",
            error_table(),
            "## CPU quantize throughput (torch reference, input bytes / median time)",
            "Memcpy is `Tensor.copy_` of the same bytes in the same run; the ratio is the figure to compare.",
            throughput_table(),
        ]
    )


def main() -> None:
    # no options; --help says what it does instead of running it (it takes minutes)
    argparse.ArgumentParser(
        prog="python -m bench.nvfp4_bench", description=(__doc__ or "").split("\n\n")[0]
    ).parse_args()
    text = report()
    print(text)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text + "\n")


if __name__ == "__main__":
    main()
