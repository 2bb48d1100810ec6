"""Compile every Triton kernel configuration a GPU worker launches, for Hopper and Blackwell, without a GPU.

    .venv/bin/python scripts/triton_compile_check.py                 # sm_90 and sm_100, every case (~1-2 min)
    .venv/bin/python scripts/triton_compile_check.py --arch 90 --out bench/results

Triton's CPU interpreter (`TRITON_INTERPRET=1`, how `make test` checks the kernels' numbers) never lowers a
kernel: it runs the Python body with numpy. What fails only on the GPU — a lowering the backend rejects, a tile
whose shared memory exceeds the SM's, a register budget that spills — stays hidden until a GPU runs it. This runs
Triton's real compiler (Triton IR -> TTGIR -> LLVM IR -> PTX -> cubin with the ptxas Triton ships) for a named GPU
target, through the engine's own launch wrappers with CPU tensors of the shapes the engine passes: each launch is
compiled and not run (`compile_only`). Per compiled kernel it reports Triton's shared memory, and the registers,
and stack (spilled registers) ptxas gave each thread (from `cuobjdump --dump-resource-usage` of the cubin).

Fails (exit 1) when a kernel does not compile or needs more shared memory than the target's per-block limit.
Spills (a stack) are reported, not failed: they cost speed, not correctness. The cases are the shapes `make gpu-check`
builds (docs/gpu.md): SmolLM2-135M (9 heads, 3 KV heads, head_dim 64) and Llama-3.1-8B (32 / 8, head_dim 128),
16-token blocks, bf16 and fp32 (the correctness step's dtype), decode batches 1 / 16 / 64 at short and long
contexts (single pass and split-K), prefill chunks of 8 and 2,048 tokens and a step of 64 32-token prompts in one
varlen launch, and on Hopper the NVFP4 W4A16 GEMM at
decode and prefill batch sizes over the 8B's projections; NVFP4 activation quantization on both (Blackwell's FP4
GEMM is torch's `_scaled_mm`, not Triton).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.pop("TRITON_INTERPRET", None)  # the real compiler, not the interpreter

import torch  # noqa: E402

# per-block shared memory a kernel may opt into (CUDA programming guide, by compute capability)
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024, 120: 99 * 1024}
ARCH_NAME = {
    80: "sm_80 (A100)", 86: "sm_86 (A10, RTX 30)", 89: "sm_89 (L40S, RTX 40)", 90: "sm_90 (Hopper)",
    100: "sm_100 (Blackwell)", 120: "sm_120 (RTX 50)",
}  # fmt: skip
MODELS = {  # name: (heads, kv heads, head_dim)
    "smollm2-135m": (9, 3, 64),
    "llama3.1-8b": (32, 8, 128),
}
BLOCK = 16  # the engine's default tokens per KV block
GEMMS_8B = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))  # (N, K): qkv, o, gate+up, down


@dataclass
class Compiled:
    case: str
    kernel: str
    constants: str
    shared: int
    registers: int | None = None
    stack_bytes: int | None = None
    error: str | None = None
    warps: int | None = None


@dataclass
class Report:
    arch: int
    rows: list[Compiled] = field(default_factory=list)

    def failures(self) -> list[str]:
        out = []
        for r in self.rows:
            if r.error:
                out.append(f"sm_{self.arch} {r.case} {r.kernel}: {r.error}")
            elif r.shared > SHARED_LIMIT[self.arch]:
                out.append(
                    f"sm_{self.arch} {r.case} {r.kernel}: {r.shared} B of shared memory, over the "
                    f"{SHARED_LIMIT[self.arch]} B a block may use"
                )
        return out


def _cuobjdump() -> str | None:
    import triton.backends.nvidia as nvidia

    path = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    return str(path) if path.exists() else None


_USAGE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def resource_usage(cubin: bytes) -> tuple[int, int, int] | None:
    """(registers per thread, stack bytes per thread, static shared bytes) of a cubin's kernel, as cuobjdump
    reads them. A stack of more than a few bytes is registers spilled to local memory."""
    tool = _cuobjdump()
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        done = subprocess.run(
            [tool, "--dump-resource-usage", f.name], capture_output=True, text=True, timeout=60
        )
    m = _USAGE.search(done.stdout)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


@contextlib.contextmanager
def compile_only(arch: int, case: Callable[[], str]) -> Iterator[list[Compiled]]:
    """Inside: every Triton launch compiles its kernel for compute capability `arch` and returns without running
    it (Triton's own warm-up path), and is recorded. No GPU and no CUDA driver needed: the target is given, not
    asked of a device. The device number is the arch, so kernels compiled for one target are never handed to
    another from Triton's per-device cache."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class TargetOnly:
        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", arch, 32)

        def get_current_device(self) -> int:
            return arch

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cpu")

    compiled: list[Compiled] = []
    real_run = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):  # type: ignore[no-untyped-def]
        name = getattr(self, "__name__", str(self))
        try:
            kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as e:  # a lowering or ptxas failure: recorded, the other cases still compile
            compiled.append(Compiled(case(), name, "", 0, error=f"{type(e).__name__}: {str(e)[:400]}"))
            return None
        consts = {k: v for k, v in kwargs.items() if k.isupper()}
        row = Compiled(
            case(), name, ", ".join(f"{k}={v}" for k, v in sorted(consts.items())), int(kernel.metadata.shared),
            warps=int(kernel.metadata.num_warps),
        )  # fmt: skip
        usage = resource_usage(kernel.asm["cubin"])
        if usage is not None:
            row.registers, row.stack_bytes, static_shared = usage
            row.shared += static_shared  # Triton's dynamic shared memory plus the kernel's static
        compiled.append(row)
        return kernel

    previous = getattr(driver, "_active", None)
    driver.set_active(TargetOnly())  # type: ignore[arg-type]
    JITFunction.run = run  # type: ignore[method-assign]
    try:
        yield compiled
    finally:
        JITFunction.run = real_run  # type: ignore[method-assign]
        driver._active = previous  # reset_active() would look for a real GPU driver


def _attention_cases(dtypes: tuple[torch.dtype, ...]) -> Iterator[tuple[str, Callable[[], object]]]:
    from services.engine import triton_attention as ta
    from services.engine.varlen import PrefillChunk, plan_prefill

    for model, (heads, kv_heads, head_dim) in MODELS.items():
        for dtype in dtypes:
            dt = str(dtype).removeprefix("torch.")
            num_blocks = 4200 // BLOCK + 8
            k = torch.zeros(kv_heads * num_blocks, BLOCK, head_dim, dtype=dtype)
            v = torch.zeros_like(k)
            for batch in (1, 16, 64):
                for context in (128, 4096):
                    width = -(-context // BLOCK)
                    tables = torch.zeros(batch, width, dtype=torch.int32)
                    lens = torch.full((batch,), context, dtype=torch.int32)
                    q = torch.zeros(batch, heads, head_dim, dtype=dtype)
                    splits = ta.choose_num_splits(batch, kv_heads, width * BLOCK)

                    def decode(q=q, k=k, v=v, tables=tables, lens=lens, kv_heads=kv_heads) -> object:
                        return ta.paged_decode_attention(q, k, v, tables, lens, kv_heads, 0.125)

                    yield f"{model} {dt} decode batch {batch} context {context} ({splits} splits)", decode
            for n in (8, 2048):
                q = torch.zeros(n, heads, head_dim, dtype=dtype)
                table = torch.zeros(-(-(n + 64) // BLOCK), dtype=torch.int32)

                def prefill(q=q, k=k, v=v, table=table, kv_heads=kv_heads) -> object:
                    return ta.paged_prefill_attention(q, k, v, table, 64, 0.125, kv_heads)

                yield f"{model} {dt} prefill {n} tokens after 64 cached", prefill
            # a step of 64 short prompts: one varlen launch over all their chunks
            plan = plan_prefill(
                [PrefillChunk(32 * i, 32, 0, [2 * i, 2 * i + 1]) for i in range(64)],
                dtype,
                BLOCK,
                torch.device("cpu"),
            )
            q = torch.zeros(64 * 32, heads, head_dim, dtype=dtype)

            def varlen(q=q, k=k, v=v, plan=plan, kv_heads=kv_heads) -> object:
                return ta.paged_prefill_varlen(q, k, v, plan, 0.125, kv_heads, torch.empty_like(q))

            yield f"{model} {dt} prefill 64 prompts of 32 tokens in one launch", varlen


def _nvfp4_cases(arch: int, dtypes: tuple[torch.dtype, ...]) -> Iterator[tuple[str, Callable[[], object]]]:
    from services.engine.nvfp4 import triton_kernels as tk
    from services.engine.nvfp4.recipe import NVFP4Tensor, padded_size

    for dtype in dtypes:
        dt = str(dtype).removeprefix("torch.")
        for m in (1, 64, 2048):
            x = torch.zeros(m, 4096, dtype=dtype)

            def quantize(x=x) -> object:
                return tk.quantize_triton(x)

            yield f"quantize {dt} [{m}, 4096]", quantize
        if arch >= 100:
            continue  # compute capability 10+: the FP4 GEMM is torch._scaled_mm
        for n, k in GEMMS_8B:
            kp = padded_size(k)
            w = NVFP4Tensor(
                packed=torch.zeros(n, kp // 2, dtype=torch.uint8),
                scales=torch.zeros(n, kp // 16, dtype=torch.uint8),
                global_scale=torch.ones(()),
                shape=(n, k),
            )
            for m in (1, 32, 2048):
                x = torch.zeros(m, k, dtype=dtype)

                def gemm(x=x, w=w) -> object:
                    return tk.w4a16_matmul(x, w)

                yield f"w4a16 {dt} [{m}, {k}] x [{n}, {k}]^T", gemm


def check(
    arch: int, dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32), only: str = ""
) -> Report:
    """Compile every case (those whose name contains `only`, when given) for compute capability `arch`."""
    report = Report(arch)
    current = {"case": ""}
    with compile_only(arch, lambda: current["case"]) as compiled:
        for case, launch in (*_attention_cases(dtypes), *_nvfp4_cases(arch, dtypes)):
            if only not in case:
                continue
            current["case"] = case
            try:
                launch()
            except Exception as e:  # the wrapper itself refused the shapes: a failure of the case
                compiled.append(Compiled(case, "(wrapper)", "", 0, error=f"{type(e).__name__}: {e}"))
    report.rows = compiled
    return report


def table(report: Report) -> str:
    lines = [
        f"**{ARCH_NAME.get(report.arch, f'sm_{report.arch}')}**: {len(report.rows)} launches compiled, "
        f"shared memory limit {SHARED_LIMIT[report.arch]} B per block\n",
        "| case | kernel | warps | shared B | registers | stack B (spills) | result |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report.rows:
        result = r.error or ("over the shared limit" if r.shared > SHARED_LIMIT[report.arch] else "ok")
        lines.append(
            f"| {r.case} | {r.kernel} | {r.warps or '-'} | {r.shared} | "
            f"{'-' if r.registers is None else r.registers} | {'-' if r.stack_bytes is None else r.stack_bytes} | "
            f"{result} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--arch",
        default="90,100",
        help=f"compute capabilities to compile for, comma-separated, of {','.join(map(str, SHARED_LIMIT))}",
    )
    ap.add_argument("--only", default="", help="only the cases whose name contains this")
    ap.add_argument(
        "--out", default="", help="directory for triton_compile.md and .json (default: print only)"
    )
    a = ap.parse_args(argv)
    import triton

    t0 = time.time()
    archs = [int(x) for x in a.arch.split(",")]
    if unknown := [x for x in archs if x not in SHARED_LIMIT]:
        ap.error(f"--arch {unknown}: known are {sorted(SHARED_LIMIT)}")
    reports = [check(arch, only=a.only) for arch in archs]
    head = (
        f"Triton {triton.__version__}, torch {torch.__version__}; compiled in {time.time() - t0:.0f} s "
        f"(`scripts/triton_compile_check.py --arch {a.arch}`)\n"
    )
    text = head + "\n" + "\n\n".join(table(r) for r in reports)
    print(text)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        Path(a.out, "triton_compile.md").write_text(text + "\n")
    failures = [f for r in reports for f in r.failures()]
    if a.out:
        doc = {
            "triton": triton.__version__,
            "torch": torch.__version__,
            "shared_limit": {str(r.arch): SHARED_LIMIT[r.arch] for r in reports},
            "targets": {str(r.arch): [dataclasses.asdict(row) for row in r.rows] for r in reports},
            "failures": failures,
        }
        Path(a.out, "triton_compile.json").write_text(json.dumps(doc, indent=1) + "\n")
    for f in failures:
        print("FAIL", f, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
