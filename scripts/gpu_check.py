"""GPU check for the NVFP4 kernels: correctness against the torch reference, then speed.

    python scripts/gpu_check.py [--iters N]

On a CUDA machine, each kernel runs on fresh random inputs and is checked against the torch reference
(services/engine/nvfp4/recipe.py): quantizers must produce identical bytes (codes, block and tensor scales),
GEMMs must match x @ dequantize(W).T within the output dtype's rounding. Then each is timed with CUDA events
after warmup and reported as GB/s (bytes read + written / time) and, for GEMMs, TFLOP/s, next to a dense bf16
cuBLAS matmul of the same shape. Exit status 1 if any check fails. Without CUDA it says so and exits 0.

Kernels: Triton quantize, Triton W4A16 GEMM, CUDA quantize (built on first use), the torch recipe itself on
the GPU, and the Blackwell W4A4 torch._scaled_mm path when the GPU has compute capability >= 10.0.
Sized to finish well under 3 minutes on an H100/H200, the CUDA extension build included.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Row:
    kernel: str
    shape: str
    status: str  # "ok", "FAIL: ...", "skipped: ..."
    ms: float | None = None
    gb_per_s: float | None = None
    tflops: float | None = None


def time_cuda(iters: int, fn: Callable[..., object], *args: object) -> float:
    """Mean seconds per fn(*args) over `iters` back-to-back calls after 3 warmup calls, with CUDA events."""
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn(*args)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / iters


def bytes_equal(name: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    got, want = got.cpu(), want.cpu()
    if got.shape != want.shape:
        return f"{name} shape {tuple(got.shape)} != {tuple(want.shape)}"
    if not torch.equal(got, want):
        return f"{int((got != want).sum())} of {want.numel()} {name} differ"
    return None


def check_quantizer(label: str, fn: Callable, shapes: list, iters: int) -> list[Row]:
    from services.engine.nvfp4.recipe import quantize

    rows = []
    for shape, dtype in shapes:
        desc = f"{'x'.join(map(str, shape))} {str(dtype).removeprefix('torch.')}"
        x = torch.randn(shape, device="cuda").to(dtype)
        x.view(-1)[::997] *= 40  # a few outliers so blocks use the whole E4M3 range
        try:
            got = fn(x)
            want = quantize(x.cpu())
            problems = [
                p
                for p in (
                    bytes_equal("tensor scale", got.global_scale.reshape(()), want.global_scale),
                    bytes_equal("scale bytes", got.scales, want.scales),
                    bytes_equal("code bytes", got.packed, want.packed),
                )
                if p
            ]
            if problems:
                rows.append(Row(label, desc, "FAIL: " + "; ".join(problems)))
                continue
            t = time_cuda(iters, fn, x)
            moved = x.numel() * x.element_size() + got.packed.numel() + got.scales.numel()
            rows.append(Row(label, desc, "ok", t * 1e3, moved / t / 1e9))
        except Exception as exc:  # noqa: BLE001 - report every kernel, then fail at the end
            rows.append(Row(label, desc, f"FAIL: {type(exc).__name__}: {exc}"))
            traceback.print_exc()
    return rows


def gemm_rows(iters: int) -> list[Row]:
    from services.engine.nvfp4.recipe import dequantize, quantize
    from services.engine.nvfp4.triton_kernels import w4a16_matmul

    rows = []
    for m, n, k, dtype in [
        (1, 8192, 8192, torch.bfloat16),
        (16, 8192, 8192, torch.bfloat16),
        (4096, 4096, 4096, torch.bfloat16),
        (16, 4096, 4096, torch.float32),
    ]:
        desc = f"M={m} N={n} K={k} {str(dtype).removeprefix('torch.')}"
        w_dense = torch.randn(n, k, device="cuda")
        w = quantize(w_dense)  # the torch recipe, so this check does not lean on the Triton quantizer
        x = torch.randn(m, k, device="cuda").to(dtype)
        flops = 2 * m * n * k
        try:
            out = w4a16_matmul(x, w)
            ref = x.float() @ dequantize(w).T  # fp32, torch disables TF32 for matmul by default
            rel = float(torch.linalg.norm(out.float() - ref) / torch.linalg.norm(ref))
            tol = 1e-5 if dtype == torch.float32 else 4e-3  # fp32 summation order / one bf16 rounding
            if not rel <= tol:
                rows.append(Row("triton W4A16 GEMM", desc, f"FAIL: relative error {rel:.2e} > {tol:.0e}"))
                continue
            t = time_cuda(iters, w4a16_matmul, x, w)
            moved = w.packed.numel() + w.scales.numel() + (x.numel() + out.numel()) * x.element_size()
            rows.append(
                Row(
                    "triton W4A16 GEMM",
                    desc,
                    f"ok (rel err {rel:.1e})",
                    t * 1e3,
                    moved / t / 1e9,
                    flops / t / 1e12,
                )
            )
            if dtype == torch.bfloat16:
                w_bf16 = dequantize(w).to(dtype)
                t = time_cuda(iters, torch.matmul, x, w_bf16.T)
                moved = (w_bf16.numel() + x.numel() + out.numel()) * 2
                rows.append(
                    Row(
                        "  bf16 cuBLAS, same shape",
                        desc,
                        "baseline",
                        t * 1e3,
                        moved / t / 1e9,
                        flops / t / 1e12,
                    )
                )
        except Exception as exc:  # noqa: BLE001
            rows.append(Row("triton W4A16 GEMM", desc, f"FAIL: {type(exc).__name__}: {exc}"))
            traceback.print_exc()
    return rows


def blackwell_rows(iters: int) -> list[Row]:
    from services.engine.nvfp4.blackwell import blackwell_unavailable_reason, prepare_weight, w4a4_matmul
    from services.engine.nvfp4.recipe import dequantize, quantize

    reason = blackwell_unavailable_reason()
    if reason is not None:
        return [Row("blackwell W4A4 _scaled_mm", "-", f"skipped: {reason}")]
    rows = []
    for m, n, k in [(16, 8192, 8192), (4096, 4096, 4096)]:
        desc = f"M={m} N={n} K={k} bfloat16"
        try:
            w_q = quantize(torch.randn(n, k, device="cuda"))
            w = prepare_weight(w_q)
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            out = w4a4_matmul(x, w)
            ref = dequantize(quantize(x)) @ dequantize(w_q).T  # both operands through the recipe
            rel = float(torch.linalg.norm(out.float() - ref) / torch.linalg.norm(ref))
            if not rel <= 8e-3:  # bf16 output rounded once before alpha, once after
                rows.append(Row("blackwell W4A4 _scaled_mm", desc, f"FAIL: relative error {rel:.2e}"))
                continue
            t = time_cuda(iters, w4a4_matmul, x, w)
            moved = w.packed.numel() + w.scales_swizzled.numel() + (x.numel() + out.numel()) * 2
            flops = 2 * m * n * k
            rows.append(
                Row(
                    "blackwell W4A4 _scaled_mm",
                    desc,
                    f"ok (rel err {rel:.1e})",
                    t * 1e3,
                    moved / t / 1e9,
                    flops / t / 1e12,
                )
            )
        except Exception as exc:  # noqa: BLE001
            rows.append(Row("blackwell W4A4 _scaled_mm", desc, f"FAIL: {type(exc).__name__}: {exc}"))
            traceback.print_exc()
    return rows


def cuda_quantize_rows(shapes: list, iters: int) -> list[Row]:
    from services.engine.nvfp4.cuda_kernels import CudaKernelUnavailable, load_extension, quantize_cuda

    start = time.perf_counter()
    try:
        load_extension()
    except CudaKernelUnavailable as exc:
        return [Row("CUDA quantize", "-", f"skipped: {exc}")]
    except Exception as exc:  # noqa: BLE001 - a build failure is a failure
        traceback.print_exc()
        return [Row("CUDA quantize", "-", f"FAIL: extension build: {type(exc).__name__}: {exc}")]
    print(f"CUDA extension ready in {time.perf_counter() - start:.1f} s", flush=True)
    return check_quantizer("CUDA quantize", quantize_cuda, shapes, iters)


def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=20, help="timed calls per kernel (after 3 warmup calls)")
    args = parser.parse_args()

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing to check.")
        return 0
    sys.path.insert(0, str(REPO))
    from services.engine.nvfp4.recipe import quantize
    from services.engine.nvfp4.triton_kernels import quantize_triton

    props = torch.cuda.get_device_properties(0)
    print(
        f"gpu_check: {props.name}, compute capability {props.major}.{props.minor}, torch {torch.__version__}"
    )
    began = time.perf_counter()
    # 64-128 MiB inputs: well past the 50 MB L2 of an H100/H200, small enough for a quick CPU reference.
    shapes = [((8192, 4096), torch.bfloat16), ((8192, 4096), torch.float32), ((1000, 1007), torch.float32)]
    rows: list[Row] = []
    rows += check_quantizer("triton quantize", quantize_triton, shapes, args.iters)
    rows += check_quantizer("torch recipe on GPU", quantize, shapes[:1], max(3, args.iters // 4))
    rows += cuda_quantize_rows(shapes, args.iters)
    rows += gemm_rows(args.iters)
    rows += blackwell_rows(args.iters)

    print()
    print("| kernel | shape | check | ms | GB/s | TFLOP/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        numbers = f"{fmt(r.ms, '.3f')} | {fmt(r.gb_per_s, '.0f')} | {fmt(r.tflops, '.1f')}"
        print(f"| {r.kernel} | {r.shape} | {r.status} | {numbers} |")
    failed = [r for r in rows if r.status.startswith("FAIL")]
    elapsed = time.perf_counter() - began
    print(f"\n{len(rows) - len(failed)} ok or skipped, {len(failed)} failed, {elapsed:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
