"""GPU acceptance check (`make gpu-check`): kernels, engine vs transformers, throughput, two-process KV transfer.

    python scripts/gpu_check.py [--device auto|cuda|cuda:N|cpu] [--smoke] [--budget-s S] [--steps 1,2,3,4]

Runs in one call of at most 8 minutes on an H100/H200 with no network: every model is built on the device from
seeded random weights in the Llama layout (the SmolLM2-135M shape and the Llama-3.1-8B shape), never downloaded.

1. NVFP4 kernels: quantizers bit-exact against the torch recipe, W4A16 GEMM against x @ dequantize(W).T.
2. The engine against Hugging Face transformers' LlamaForCausalLM holding the same weights. fp32 with TF32 off:
   greedy tokens identical over 32 steps for 8 prompts of mixed lengths, all admitted at once (batched) and
   arriving one every other step (continuous). bf16 and NVFP4: top-1 agreement and max logit difference against
   the fp32 reference, teacher-forced over the same sequences.
3. Throughput side by side: decode tok/s at batch 1/16/64 and prefill tok/s of one 2,048-token prompt, bf16 and
   NVFP4, against transformers `generate` with a static cache on the same GPU and against the bound (bytes of
   weights read per step / device-to-device copy bandwidth measured in this run). Then bf16 prefill of a step of
   64 fresh 32-token prompts, its attention in one varlen launch per layer vs one SDPA call per prompt, A/B/A/B.
4. Two worker processes on the one GPU, prefill -> KV -> decode: tokens equal the aggregated run; transfer GB/s
   against an in-run device memcpy, over CUDA IPC handles (services/kvtransfer/cuda_ipc.py) and over the staged
   host path (export to host bytes, shared memory, import).

Correctness failures (steps 1, 2, 4) exit 1, and so does a step that fails (an error; in step 3 a CUDA graph capture
that failed); throughput is reported, never asserted. A step that fails is reported and later steps still run; a
step that does not fit the remaining --budget-s is skipped with a line saying so. The tables go to $OUT when it is
set, else to bench/results/ (gpu_check.md and gpu_check.json).

`--device cpu --smoke` runs every step's logic on the CPU with tiny shapes and a few steps (tests/
scripts/test_gpu_check_smoke.py runs it in `make test`); without CUDA and without --device cpu it says so and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import faulthandler
import functools
import gc
import importlib.util
import inspect
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: the repository's services/ must be importable
    sys.path.insert(0, str(REPO))


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
    from services.engine.nvfp4.linear import NVFP4Linear
    from services.engine.nvfp4.recipe import dequantize, global_scale_for_amax, quantize

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
            # a W4A4 checkpoint's static activation scale (here: half the amax, so the largest values clip)
            g = global_scale_for_amax(x.float().abs().max() / 2)
            ref_static = dequantize(quantize(x, global_scale=g)) @ dequantize(w_q).T
            out_static = w4a4_matmul(x, w, g).float()
            rel = max(rel, float(torch.linalg.norm(out_static - ref_static) / torch.linalg.norm(ref_static)))
            # and through the engine's layer, which must hand its scale to the GEMM
            out_layer = NVFP4Linear(w_q, w4a4=True, input_scale=g)(x).float()
            rel = max(rel, float(torch.linalg.norm(out_layer - ref_static) / torch.linalg.norm(ref_static)))
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


# --------------------------------------------------------------------------------------------- the run


@dataclass
class StepResult:
    step: str
    status: str = "ok"  # ok | FAIL | skipped
    lines: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)

    def say(self, line: str) -> None:
        self.lines.append(line)
        print(f"  {line}", flush=True)

    def fail(self, line: str) -> None:
        self.status = "FAIL"
        self.say(f"FAIL: {line}")


class Budget:
    """Wall-clock budget of the whole run: a section that needs more than what is left is skipped, not started."""

    def __init__(self, seconds: float):
        self.began = time.perf_counter()
        self.seconds = seconds

    @property
    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.began)

    def allows(self, need_s: float) -> bool:
        return self.left >= need_s


@dataclass(frozen=True)
class Plan:
    """Sizes of every step: the real ones on a GPU, tiny ones for --smoke (the same logic, seconds on a CPU)."""

    smoke: bool
    device: torch.device

    @property
    def prompt_lens(self) -> tuple[int, ...]:  # step 2: 8 prompts of mixed lengths
        return (3, 9, 17, 5, 30, 12, 40, 7) if self.smoke else (5, 17, 33, 64, 100, 128, 250, 511)

    @property
    def greedy_steps(self) -> int:
        return 4 if self.smoke else 32

    @property
    def decode_batches(self) -> tuple[int, ...]:
        return (1, 4, 8) if self.smoke else (1, 16, 64)

    @property
    def decode_prompt_len(self) -> int:
        return 16 if self.smoke else 128

    @property
    def decode_steps(self) -> int:
        return 3 if self.smoke else 32

    @property
    def kv_blocks(
        self,
    ) -> int:  # every engine of steps 2 and 3: room for the largest decode batch, or 2 prefills
        decode = max(self.decode_batches) * -(-(self.decode_prompt_len + self.decode_steps + 24) // 16)
        return max(decode, 2 * -(-self.prefill_len // 16), 64) + 16

    @property
    def prefill_len(self) -> int:
        return 64 if self.smoke else 2048

    @property
    def disagg_prompt_lens(
        self,
    ) -> tuple[int, ...]:  # step 4: one long prompt so the transfer is big enough to time
        return (60, 3, 9, 17, 5, 30, 12, 7) if self.smoke else (4000, 5, 17, 64, 100, 250, 33, 1024)

    @property
    def disagg_max_tokens(self) -> int:
        return 4 if self.smoke else 16


# ------------------------------------------------------------------------------------------- the models

# The two shapes docs/gpu.md names. max_context is cut to 8192 for the 8B shape (its rope tables and any per-context
# buffer scale with it; nothing here goes past 4,096 tokens); its llama3 rope scaling is kept.
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536,
        vocab_size=49152, rope_theta=100000.0, tie_embeddings=True, rope_scaling=None,
    ),
    "llama3.1-8b": dict(
        num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336,
        vocab_size=128256, rope_theta=500000.0, tie_embeddings=False, rope_scaling=(8.0, 1.0, 4.0, 8192),
    ),
}  # fmt: skip
# The 8B widths (GQA 32/8, head_dim 128, 14336 FFN, 128256 vocab) with 4 layers: the fp32 token check at those
# widths without an fp32 copy of all 8B weights (32 GB, and minutes of hashing and copying on the host).
SHAPES["llama3.1-8b-4l"] = SHAPES["llama3.1-8b"] | {"num_layers": 4}
# --smoke: the same structure (tied or not, GQA ratio, rope scaling) at toy sizes.
SMOKE_SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": SHAPES["smollm2-135m"]
    | dict(num_layers=2, hidden_size=96, num_heads=3, num_kv_heads=1, head_dim=32, intermediate_size=192,
           vocab_size=320),
    "llama3.1-8b": SHAPES["llama3.1-8b"]
    | dict(num_layers=2, hidden_size=128, num_heads=8, num_kv_heads=2, head_dim=16, intermediate_size=256,
           vocab_size=384, rope_scaling=(8.0, 1.0, 4.0, 256)),
}  # fmt: skip
SMOKE_SHAPES["llama3.1-8b-4l"] = SMOKE_SHAPES["llama3.1-8b"] | {"num_layers": 3}
LOGIT_STD = 8.0  # LM-head scale: peaked next-token distributions, so a greedy near-tie is rare in fp32 noise


def model_config(shape: str, smoke: bool):  # -> ModelConfig
    from services.engine.config import ModelConfig, RopeScaling

    s = dict((SMOKE_SHAPES if smoke else SHAPES)[shape])
    rs = s.pop("rope_scaling")
    return ModelConfig(
        architecture="llama",
        rms_norm_eps=1e-5,
        max_context=512 if smoke else 8192,
        rope_scaling=None if rs is None else RopeScaling(*rs),
        bos_token_id=None,
        eos_token_id=None,  # random weights: no token means "stop", every run is max_tokens long
        name=f"random-{shape}",
        **s,
    )


def build_weights(cfg, device: torch.device, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random weights under the engine's canonical names, generated on the device in `dtype` (no host
    copy, no fp32 intermediate: the 8B shape in bf16 is 16 GB built in well under a second on an H200)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def r(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(shape, generator=g, device=device, dtype=dtype).mul_(std)

    def norm(n: int) -> torch.Tensor:
        return r(n, std=0.05).add_(1.0)

    h, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    head_std = LOGIT_STD / h**0.5  # the final norm leaves unit-RMS hidden states: logits have std ~LOGIT_STD
    w = {"embed_tokens": r(cfg.vocab_size, h, std=head_std if cfg.tie_embeddings else 1.0), "norm": norm(h)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}"
        w |= {
            f"{p}.q_proj": r(q, h, std=h**-0.5),
            f"{p}.k_proj": r(kv, h, std=h**-0.5),
            f"{p}.v_proj": r(kv, h, std=h**-0.5),
            f"{p}.o_proj": r(h, q, std=q**-0.5),
            f"{p}.gate_proj": r(f, h, std=h**-0.5),
            f"{p}.up_proj": r(f, h, std=h**-0.5),
            f"{p}.down_proj": r(h, f, std=f**-0.5),
            f"{p}.input_layernorm": norm(h),
            f"{p}.post_attention_layernorm": norm(h),
        }
    if not cfg.tie_embeddings:
        w["lm_head"] = r(cfg.vocab_size, h, std=head_std)
    return w


def loaded_model(cfg, weights: dict[str, torch.Tensor]):  # -> LoadedModel
    from services.engine.loader import LoadedModel

    return LoadedModel(config=cfg, weights=weights, source=cfg.name, source_format="memory")


_HF_NAMES = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
    "input_layernorm": "input_layernorm",
    "post_attention_layernorm": "post_attention_layernorm",
}


def hf_state_dict(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The same tensors under transformers' names; shared, not copied, when already in `dtype`."""
    out = {}
    for name, t in weights.items():
        if name in ("embed_tokens", "norm"):
            key = f"model.{name}.weight"
        elif name == "lm_head":
            key = "lm_head.weight"
        else:
            _, i, part = name.split(".", 2)
            key = f"model.layers.{i}.{_HF_NAMES[part]}.weight"
        out[key] = t.to(dtype)
    return out


def hf_model(cfg, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device):
    """transformers' LlamaForCausalLM holding the same weights: built on the meta device, then the tensors are
    assigned (no random init of 8B parameters, no second copy when the dtype already matches)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rs = cfg.rope_scaling
    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_context,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        rope_scaling=None
        if rs is None
        else {
            "rope_type": "llama3",
            "factor": rs.factor,
            "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
        },
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    hf_cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_cfg)
    state = hf_state_dict(weights, dtype)
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    # rotary inv_freq is a non-persistent buffer: not in any state dict, so it is rebuilt on the device
    model.model.rotary_emb = LlamaRotaryEmbedding(config=hf_cfg).to(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:
        raise RuntimeError(f"transformers model has tensors left on the meta device: {left[:3]}")
    return model.eval()


# ------------------------------------------------------------------------------------------- the engine


NOTES: list[str] = []  # run-wide remarks that belong in the report's header


def free_device_memory(dev: torch.device) -> None:
    """Between models and steps: collect reference cycles (a transformers model can sit in one until collected,
    with 32 GB of an 8B fp32 reference) and empty the allocator's cache. A CUDA error raised here (a sticky one,
    left by a kernel that failed) is noted, never fatal: later steps fail on their own, and the report is kept."""
    gc.collect()
    if dev.type != "cuda":
        return
    try:
        torch.cuda.empty_cache()
    except Exception as exc:  # noqa: BLE001
        note(f"emptying the CUDA cache failed ({type(exc).__name__}: {exc}); the device may be unusable now")


def note(line: str) -> None:
    if line not in NOTES:
        NOTES.append(line)
        print(f"gpu_check: {line}", flush=True)


_HASHES_DEVICE: dict[str, bool] = {}


def fingerprint_takes_device_tensors(device: torch.device) -> bool:
    """Whether the engine's model fingerprint can hash weights that live on `device` (a loader that reads
    files hands it host tensors; this check hands it device ones)."""
    from services.engine.loader import model_fingerprint

    if device.type not in _HASHES_DEVICE:
        try:
            model_fingerprint(model_config("smollm2-135m", True), {"probe": torch.zeros(2, device=device)})
            _HASHES_DEVICE[device.type] = True
        except (TypeError, RuntimeError):
            _HASHES_DEVICE[device.type] = False
    return _HASHES_DEVICE[device.type]


def make_engine(cfg, weights, device: torch.device, dtype: str, quant: str, num_kv_blocks: int, plan: Plan):
    """An LLMEngine on `device`. Uses EngineConfig.device where the engine has it; an engine without device
    support can only run the CPU smoke path, and says so for CUDA."""
    from services.engine.engine import EngineConfig, LLMEngine

    fields = EngineConfig.__dataclass_fields__
    kw: dict[str, Any] = dict(
        dtype=dtype,
        quant=quant,
        num_kv_blocks=num_kv_blocks,
        max_num_seqs=64,
        max_num_batched_tokens=max(plan.prefill_len, 512),
        enable_prefix_caching=False,  # throughput runs reuse no prefixes; imported KV must not be bypassed
        cpu_kernels=plan.device.type != "cpu",  # the smoke path: plain torch ops, no C++ build in a test
    )
    if "device" in fields:
        kw["device"] = str(device)
    elif device.type != "cpu":
        raise RuntimeError("this engine has no EngineConfig.device: it cannot run on CUDA yet")
    if device.type != "cpu" and not fingerprint_takes_device_tensors(device):
        note(
            "the engine's model_fingerprint cannot hash device tensors: engines get host copies of the weights "
            "(slower to build, the same numbers)"
        )
        weights = {k: v.cpu() for k, v in weights.items()}
    return LLMEngine(loaded_model(cfg, weights), EngineConfig(**kw))


class Models:
    """Weights and engines shared by steps 2 and 3: the 8B-shape engines take the longest to build (weights
    fused and quantized, the fingerprint hashed), so each is built once for both steps."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.weights: dict[tuple[str, torch.dtype], tuple[Any, dict[str, torch.Tensor]]] = {}
        self.engines: dict[tuple[str, torch.dtype, str, str], Any] = {}

    def weights_for(self, shape: str, dtype: torch.dtype) -> tuple[Any, dict[str, torch.Tensor]]:
        if (shape, dtype) not in self.weights:
            cfg = model_config(shape, self.plan.smoke)
            self.weights[(shape, dtype)] = (cfg, build_weights(cfg, self.plan.device, dtype))
        return self.weights[(shape, dtype)]

    def engine(self, shape: str, wdtype: torch.dtype, dtype: str, quant: str, keep: bool):
        key = (shape, wdtype, dtype, quant)
        if key in self.engines:
            return self.engines[key]
        cfg, weights = self.weights_for(shape, wdtype)
        engine = make_engine(cfg, weights, self.plan.device, dtype, quant, self.plan.kv_blocks, self.plan)
        if keep:
            self.engines[key] = engine
        return engine

    def drop(self, shape: str) -> None:
        for key in [k for k in self.engines if k[0] == shape]:
            del self.engines[key]
        for key in [k for k in self.weights if k[0] == shape]:
            del self.weights[key]
        free_device_memory(self.plan.device)


def engine_device(engine) -> torch.device:
    return getattr(engine, "device", None) or engine.kv.data.device


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def engine_logits(engine, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of the engine's own model over one prefill of `ids`, in its KV cache.

    Only while the engine holds no request: the sequence is written to blocks 0.. of the cache, which are all
    free then (prefix caching is off in these engines, so no freed block is still promised to a prefix)."""
    from services.engine.model import AttnMetadata, PrefillSegment

    if engine.has_unfinished() or engine.requests:
        raise RuntimeError("engine_logits needs an idle engine")
    dev = engine.kv.data.device
    n = len(ids)
    usable = getattr(engine.kv, "usable_blocks", engine.kv.num_blocks)  # not the CUDA-graph scratch block
    if -(-n // engine.kv.block_size) > usable:
        raise RuntimeError(f"{n} tokens do not fit the engine's {usable} KV blocks")
    meta = AttnMetadata(slot_mapping=torch.arange(n, device=dev), prefills=[PrefillSegment(0, n)])
    hidden = engine.model(torch.tensor(ids, device=dev), torch.arange(n, device=dev), meta, engine.kv)
    return engine.model.logits(hidden).float()


def run_continuous(engine, prompts: list[list[int]], params) -> list[list[int]]:
    """Continuous batching: one prompt arrives every other step while the earlier ones decode."""
    pending = list(enumerate(prompts))
    out: dict[str, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % 2 == 0:
            i, p = pending.pop(0)
            out[f"cont-{i}"] = []
            engine.add_request(f"cont-{i}", p, params)
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        step += 1
    return [out[f"cont-{i}"] for i in range(len(prompts))]


# ------------------------------------------------------------------------------- step 2: vs transformers


@torch.no_grad()
def hf_greedy(
    model, prompt: list[int], n: int, device: torch.device
) -> tuple[list[int], torch.Tensor, list[float]]:
    """transformers' greedy continuation of one prompt (batch 1, its own KV cache, no padding), the logits of
    every position of prompt + continuation[:-1] (each predicts the next token), and the top-2 margin of each
    greedy pick (how close to a tie it was)."""
    from transformers import DynamicCache

    # one cache object, filled in place; its keyword is `cache` from transformers 5.2x, `past_key_values` before
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    kv = {name: DynamicCache()}
    out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True, **kv)
    rows = [out.logits[0].float()]
    tokens: list[int] = []
    margins: list[float] = []
    last = rows[0][-1]
    for step in range(n):
        top = last.topk(2)
        tokens.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        if step == n - 1:
            break
        out = model(input_ids=top.indices[:1].view(1, 1), use_cache=True, **kv)
        last = out.logits[0, -1].float()
        rows.append(last[None])
    return tokens, torch.cat(rows), margins


def first_divergence(got: list[int], want: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def compare_shape(
    res: StepResult,
    plan: Plan,
    budget: Budget,
    models: Models,
    shape: str,
    modes: list[tuple[str, str]],
    weight_dtype: torch.dtype,
) -> None:
    """One model shape: the transformers fp32 reference, then each (dtype, quant) engine against it."""
    from services.engine.sampling import SamplingParams

    dev = plan.device
    t0 = time.perf_counter()
    cfg, weights = models.weights_for(shape, weight_dtype)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in plan.prompt_lens]
    n = plan.greedy_steps
    hf = hf_model(cfg, weights, torch.float32, dev)
    ref = [hf_greedy(hf, p, n, dev) for p in prompts]
    del hf
    free_device_memory(dev)
    res.say(
        f"{shape} ({cfg.num_layers} layers, weights {str(weight_dtype).removeprefix('torch.')}): "
        f"transformers fp32 reference, {len(prompts)} prompts x {n} greedy steps "
        f"({time.perf_counter() - t0:.1f} s); smallest top-2 margin {min(min(r[2]) for r in ref):.2e}"
    )
    for dtype, quant in modes:
        label = f"{shape} {dtype}{'' if quant == 'none' else ' ' + quant}"
        if not plan.smoke and not budget.allows(25):
            res.say(f"{label}: skipped, {budget.left:.0f} s of the budget left")
            continue
        t0 = time.perf_counter()
        try:
            engine = models.engine(shape, weight_dtype, dtype, quant, keep=shape == THROUGHPUT_SHAPE)
            agree = total = 0
            max_diff = 0.0
            for p, (toks, logits, _) in zip(prompts, ref, strict=True):
                ours = engine_logits(engine, p + toks[:-1])
                agree += int((ours.argmax(-1) == logits.argmax(-1)).sum())
                total += logits.shape[0]
                max_diff = max(max_diff, float((ours - logits).abs().max()))
            stats = {"top1_agreement": agree / total, "max_logit_diff": max_diff, "positions": total}
            line = (
                f"{label}: top-1 agreement {agree / total:.4f} over {total} positions, "
                f"max |logit diff| {max_diff:.3g}"
            )
            if dtype == "float32" and quant == "none":
                params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                want = [r[0] for r in ref]
                for how, got in (
                    ("batched", engine.generate(prompts, params)),
                    ("continuous", run_continuous(engine, prompts, params)),
                ):
                    bad = [i for i in range(len(prompts)) if got[i] != want[i]]
                    stats[f"{how}_identical"] = len(prompts) - len(bad)
                    if bad:
                        i = bad[0]
                        j = first_divergence(got[i], want[i]) or 0  # bad: they differ somewhere
                        margin = ref[i][2][j] if j < len(ref[i][2]) else float("nan")
                        res.fail(
                            f"{label} {how}: greedy tokens differ from transformers for {len(bad)} of "
                            f"{len(prompts)} prompts; prompt {i} (len {len(prompts[i])}) first at step {j} "
                            f"(ours {got[i][j : j + 3]}, transformers {want[i][j : j + 3]}; transformers' top-2 "
                            f"margin there {margin:.2e}, max |logit diff| {max_diff:.2e})"
                        )
                line += (
                    f"; greedy tokens identical to transformers for {stats['batched_identical']}/{len(prompts)} "
                    f"batched and {stats['continuous_identical']}/{len(prompts)} continuous"
                )
            res.say(f"{line} ({time.perf_counter() - t0:.1f} s)")
            res.data[label] = stats
            del engine
        except Exception as exc:  # noqa: BLE001 - report each mode, then the next
            traceback.print_exc()
            res.fail(f"{label}: {type(exc).__name__}: {exc}")
        free_device_memory(dev)


def step_correctness(res: StepResult, plan: Plan, budget: Budget, models: Models) -> None:
    all_modes = [("float32", "none"), ("bfloat16", "none"), ("bfloat16", "nvfp4")]
    # fp32 token identity on the small shape and on the 8B widths (4 layers); bf16 and NVFP4 also on the full
    # 32-layer 8B shape, whose weights are built in bf16 (the dtype it is served in).
    runs = [
        ("smollm2-135m", all_modes, torch.float32, 30),
        ("llama3.1-8b-4l", all_modes, torch.float32, 40),
        ("llama3.1-8b", all_modes[1:], torch.bfloat16, 90),
    ]
    if plan.smoke:  # at toy sizes the 4-layer run adds nothing the other two do not already cover
        runs = [r for r in runs if r[0] != "llama3.1-8b-4l"]
    for shape, modes, wdtype, need_s in runs:
        if not budget.allows(0 if plan.smoke else need_s):
            res.say(f"{shape}: skipped, {budget.left:.0f} s of the budget left and it needs ~{need_s} s")
            continue
        try:
            compare_shape(res, plan, budget, models, shape, modes, wdtype)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            res.fail(f"{shape}: {type(exc).__name__}: {exc}")
        if shape != THROUGHPUT_SHAPE:  # only the throughput shape's weights and engines are kept for step 3
            models.drop(shape)
        free_device_memory(plan.device)


# --------------------------------------------------------------------------------------- step 3: speed


def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting the bytes read and the bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * reps / (time.perf_counter() - t0)


def decode_weight_bytes(model: torch.nn.Module, tied: bool) -> int:
    """Bytes of weights one decode step reads: every projection and norm, and the LM head. The embedding table is
    only gathered from (one row per token), so it counts only when it is also the (tied) LM head."""
    seen: set[int] = set()
    total = 0
    for mname, mod in model.named_modules():
        tensors = [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]
        extra = getattr(mod, "packed", None)  # the CPU oneDNN-packed bf16 weight is a plain attribute
        if isinstance(extra, torch.Tensor) and all(n != "packed" for n, _ in tensors):
            tensors.append(("packed", extra))
        for name, t in tensors:
            full = f"{mname}.{name}" if mname else name
            if t is None or full.startswith("rope_") or (not tied and full.startswith("embed.")):
                continue
            try:
                key, nbytes = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
            except (NotImplementedError, RuntimeError):  # opaque (oneDNN-packed) tensors have no storage
                key, nbytes = id(t), t.numel() * t.element_size()
            if key not in seen:
                seen.add(key)
                total += nbytes
    return total


def engine_decode_tps(engine, batch: int, prompt_len: int, steps: int, vocab: int, seed: int) -> float:
    from services.engine.sampling import SamplingParams

    dev = engine_device(engine)
    g = torch.Generator().manual_seed(seed)
    warm = 3
    # room for the tokens the first-admitted prompts decode while the last ones are still prefilling
    params = SamplingParams(max_tokens=warm + steps + 16, temperature=0, ignore_eos=True)
    ids = [f"dec-{seed}-{i}" for i in range(batch)]
    try:
        for rid in ids:
            engine.add_request(rid, torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), params)
        started: set[str] = set()
        while len(started) < batch:  # every prompt prefilled: from here on each step is a pure decode step
            started |= {o.request_id for o in engine.step()}
        for _ in range(warm):  # CUDA graph capture and autotuning for this batch size happen here
            engine.step()
        sync(dev)
        t0 = time.perf_counter()
        made = sum(len(o.new_token_ids) for _ in range(steps) for o in engine.step())
        sync(dev)
        dt = time.perf_counter() - t0
    finally:  # the next case starts from an empty engine, also after a failure
        for rid in ids:
            engine.abort(rid)
    return made / dt


def engine_prefill_tps(engine, length: int, vocab: int, seed: int) -> float:
    from services.engine.sampling import SamplingParams

    dev = engine_device(engine)
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    dt = 0.0
    for _ in range(2):  # the first is the warm-up; distinct prompts (and no prefix caching) so both compute
        prompt = torch.randint(0, vocab, (length,), generator=g).tolist()
        sync(dev)
        t0 = time.perf_counter()
        engine.generate([prompt], params)
        sync(dev)
        dt = time.perf_counter() - t0
    return length / dt


def compiled_variants() -> dict[str, int]:
    """Compiled variants of each Triton kernel a worker launches, from Triton's per-device kernel caches: what a
    step compiled (seconds, inside the step) shows as growth between two calls."""
    from services.engine import triton_attention as ta
    from services.engine.nvfp4 import triton_kernels as tk

    out = {}
    for fn in (ta._prefill_kernel, ta._decode_kernel, ta._reduce_splits_kernel, tk._w4a16_kernel):
        try:
            out[fn.fn.__name__] = sum(len(c[0]) for c in fn.device_caches.values())
        except (AttributeError, TypeError, IndexError):  # another Triton's cache layout: nothing to report
            pass
    return out


def varlen_prefill_ab(engine, prompts: int, length: int, vocab: int, rounds: int = 2) -> dict[str, float]:
    """Prefill tok/s of a step of `prompts` fresh `length`-token prompts with their attention in one varlen launch
    per layer (the engine's way) and with one SDPA call per prompt per layer (how it ran before), A/B/A/B on the
    same engine; every round's prompts are new (no prefix hits). The first pair warms both up."""
    import services.engine.engine as engine_module
    from services.engine.sampling import SamplingParams

    dev = engine_device(engine)
    g = torch.Generator().manual_seed(prompts * length)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    default = engine_module.SDPA_FRESH_MIN_TOKENS
    best = {"varlen": 0.0, "per_prompt": 0.0}
    try:
        for _ in range(rounds + 1):
            for mode, threshold in (("varlen", default), ("per_prompt", 1)):
                engine_module.SDPA_FRESH_MIN_TOKENS = threshold
                batch = [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(prompts)]
                sync(dev)
                t0 = time.perf_counter()
                engine.generate(batch, params)
                sync(dev)
                best[mode] = max(best[mode], prompts * length / (time.perf_counter() - t0))
    finally:
        engine_module.SDPA_FRESH_MIN_TOKENS = default
    return best


@torch.no_grad()
def hf_decode_tps(
    model, batch: int, prompt_len: int, steps: int, vocab: int, device: torch.device
) -> float | None:
    """transformers `generate` with a static cache: per-step time from two runs that differ only in length, so
    the prefill and the cache set-up cancel. Eager: on CUDA a static cache makes `generate` torch.compile the
    model (inductor, reduce-overhead) for each new cache length and batch, minutes of compiling for the 8B
    shape that this check's one call cannot spend, so compiling is turned off where transformers has the
    switch; the engine runs eager kernels too, with CUDA graphs. A transformers without the switch gets its
    default (dynamic) cache on CUDA instead, which it never compiles, and the report says so."""
    from transformers import GenerationConfig

    cache: dict[str, Any] = {"cache_implementation": "static"}
    if hasattr(GenerationConfig(), "disable_compile"):
        cache["disable_compile"] = True
    elif device.type == "cuda":
        note(
            "this transformers cannot turn off compiling a static cache: its decode baseline uses its dynamic cache"
        )
        cache = {}
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (batch, prompt_len), generator=g).to(device)
    mask = torch.ones_like(ids)

    def run(new: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            **cache,
        )
        sync(device)
        return time.perf_counter() - t0

    run(2)  # warm-up
    short, long = run(2), run(2 + steps)
    if long <= short:  # noise larger than the work (tiny smoke models on a busy CPU): no figure
        return None
    return batch * steps / (long - short)


@torch.no_grad()
def hf_prefill_tps(model, length: int, vocab: int, device: torch.device) -> float:
    g = torch.Generator().manual_seed(6)
    dt = 0.0
    for _ in range(2):
        ids = torch.randint(0, vocab, (1, length), generator=g).to(device)
        sync(device)
        t0 = time.perf_counter()
        try:
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
        except TypeError:  # transformers before logits_to_keep
            model(input_ids=ids, use_cache=False)
        sync(device)
        dt = time.perf_counter() - t0
    return length / dt


THROUGHPUT_SHAPE = "llama3.1-8b"


def step_throughput(res: StepResult, plan: Plan, budget: Budget, models: Models) -> None:
    try:
        throughput(res, plan, budget, models)
    finally:
        models.drop(THROUGHPUT_SHAPE)


def throughput(res: StepResult, plan: Plan, budget: Budget, models: Models) -> None:
    dev = plan.device
    shape = THROUGHPUT_SHAPE
    bw = copy_bandwidth(dev, (8 << 20) if plan.smoke else (1 << 30))
    res.say(f"device-to-device copy bandwidth: {bw / 1e9:.0f} GB/s (read + write)")
    res.data["copy_bandwidth_gb_s"] = bw / 1e9
    cfg, weights = models.weights_for(shape, torch.bfloat16)
    P, S = plan.decode_prompt_len, plan.decode_steps
    try:  # transformers failing is no failure of ours: the engine's rows are measured, its column says "-"
        hf = hf_model(cfg, weights, torch.bfloat16, dev)  # shares the bf16 tensors: no second copy
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        hf = None
        res.say(f"transformers model: {type(exc).__name__}: {exc}; no baseline")
    rows: list[dict[str, Any]] = []
    hf_cache: dict[str, float | None] = {}
    for quant in ("none", "nvfp4"):
        fmt_name = "bf16" if quant == "none" else "nvfp4"
        if not budget.allows(0 if plan.smoke else 45):
            res.say(f"{fmt_name}: skipped, {budget.left:.0f} s of the budget left")
            continue
        t0 = time.perf_counter()
        reused = (shape, torch.bfloat16, "bfloat16", quant) in models.engines
        engine = models.engine(shape, torch.bfloat16, "bfloat16", quant, keep=False)
        wbytes = decode_weight_bytes(engine.model, cfg.tie_embeddings)
        res.say(
            f"{shape} {fmt_name}: engine "
            f"{'from step 2' if reused else f'built in {time.perf_counter() - t0:.1f} s'}, "
            f"{wbytes / 1e9:.2f} GB of weights read per step"
        )
        if getattr(engine, "graphs_error", ""):  # the engine serves eagerly; a GPU worker must run graphs
            res.fail(
                f"{fmt_name}: CUDA graphs not captured ({engine.graphs_error}); its decode rows are eager"
            )
        variants = compiled_variants()  # after the engine's start-up: its warm-up and graph capture
        cases = [("decode", b) for b in plan.decode_batches] + [("prefill", plan.prefill_len)]
        for phase, n in cases:
            if not budget.allows(0 if plan.smoke else 15):
                res.say(f"{fmt_name} {phase} {n}: skipped, {budget.left:.0f} s of the budget left")
                continue
            key = f"{phase}-{n}"
            try:  # the engine failing a case is a failure of the step; the next case still runs
                if phase == "decode":
                    ours = engine_decode_tps(engine, n, P, S, cfg.vocab_size, seed=n)
                else:
                    ours = engine_prefill_tps(engine, n, cfg.vocab_size, seed=n)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                res.fail(f"engine {fmt_name} {phase} {n}: {type(exc).__name__}: {exc}")
                continue
            if hf is None:
                hf_cache[key] = None
            elif key not in hf_cache:
                try:  # transformers failing is no failure of ours: its column says "-"
                    if phase == "decode":
                        hf_cache[key] = hf_decode_tps(hf, n, P, S, cfg.vocab_size, dev)
                    else:
                        hf_cache[key] = hf_prefill_tps(hf, n, cfg.vocab_size, dev)
                except Exception as exc:  # noqa: BLE001
                    traceback.print_exc()
                    hf_cache[key] = None
                    res.say(f"transformers {phase} {n}: {type(exc).__name__}: {exc}")
            # prefill is compute-bound: the weight-streaming bound says nothing about it
            bound = n * bw / wbytes if phase == "decode" else None
            row = dict(
                model=shape, format=fmt_name, phase=phase, n=n, engine_tok_s=ours,
                transformers_tok_s=hf_cache[key], bound_tok_s=bound, weight_bytes=wbytes,
            )  # fmt: skip
            rows.append(row)
            res.say(
                f"{fmt_name} {phase} {'batch' if phase == 'decode' else 'tokens'} {n}: engine {ours:.1f} tok/s, "
                f"transformers bf16 {fmt(hf_cache[key], '.1f')} tok/s, bound {fmt(bound, '.0f')} tok/s"
            )
        if (
            quant == "none"
            and engine.attention_backend == "triton"
            and budget.allows(0 if plan.smoke else 20)
        ):
            try:
                n_prompts, length = (8, 8) if plan.smoke else (64, 32)
                ab = varlen_prefill_ab(engine, n_prompts, length, cfg.vocab_size)
                res.data["varlen_prefill"] = dict(prompts=n_prompts, tokens=length, **ab)
                res.say(
                    f"bf16 prefill of {n_prompts} prompts of {length} tokens in one step: varlen launch "
                    f"{ab['varlen']:.0f} tok/s, one SDPA call per prompt {ab['per_prompt']:.0f} tok/s "
                    f"({ab['varlen'] / ab['per_prompt']:.2f}x)"
                )
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                res.fail(f"engine bf16 varlen prefill: {type(exc).__name__}: {exc}")
        grown = {k: v - variants.get(k, 0) for k, v in compiled_variants().items() if v > variants.get(k, 0)}
        res.data.setdefault("compiled_while_serving", {})[fmt_name] = grown
        res.say(f"{fmt_name}: Triton kernels compiled after start-up, while serving: {grown or 'none'}")
        models.engines.pop((shape, torch.bfloat16, "bfloat16", quant), None)
        del engine
        free_device_memory(dev)
    res.data["rows"] = rows
    res.data["table"] = throughput_table(rows)
    print("\n" + res.data["table"] + "\n", flush=True)
    res.data["targets"] = targets(rows)
    for line in res.data["targets"]:
        res.say(line)


def throughput_table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| model | format | phase | batch / tokens | engine tok/s | transformers bf16 tok/s | engine / transformers "
        "| bound tok/s | engine / bound |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        vs_hf = r["engine_tok_s"] / r["transformers_tok_s"] if r["transformers_tok_s"] else None
        vs_bound = r["engine_tok_s"] / r["bound_tok_s"] if r["bound_tok_s"] else None
        out.append(
            f"| {r['model']} | {r['format']} | {r['phase']} | {r['n']} | {r['engine_tok_s']:.1f} "
            f"| {fmt(r['transformers_tok_s'], '.1f')} | {fmt(vs_hf, '.2f')}x | {fmt(r['bound_tok_s'], '.0f')} "
            f"| {'-' if vs_bound is None else format(vs_bound, '.0%')} |"
        )
    return "\n".join(out)


def targets(rows: list[dict[str, Any]]) -> list[str]:
    """docs/gpu.md's targets, reported (never asserted: random weights, one run)."""
    by = {(r["format"], r["phase"], r["n"]): r for r in rows}
    out = []
    b1, n1 = by.get(("bf16", "decode", 1)), by.get(("nvfp4", "decode", 1))
    if b1 and b1["bound_tok_s"]:
        x = b1["engine_tok_s"] / b1["bound_tok_s"]
        out.append(
            f"target bf16 batch-1 decode >= 70% of the bound: {x:.0%} ({'met' if x >= 0.7 else 'not met'})"
        )
    if b1 and n1:
        x = n1["engine_tok_s"] / b1["engine_tok_s"]
        out.append(f"target NVFP4 batch-1 decode >= 2x bf16: {x:.2f}x ({'met' if x >= 2 else 'not met'})")
    b64 = by.get(("bf16", "decode", 64))
    if b64 and b64["transformers_tok_s"]:
        x = b64["engine_tok_s"] / b64["transformers_tok_s"]
        out.append(f"target batch-64 decode >= 5x transformers: {x:.2f}x ({'met' if x >= 5 else 'not met'})")
    return out


# ------------------------------------------------------------------ step 4: two workers, KV between them


def worker_engine(spec: dict[str, Any]):
    dev = torch.device(spec["device"])
    plan = Plan(spec["smoke"], dev)
    cfg = model_config(spec["shape"], spec["smoke"])
    # the same seed on the same device gives both processes bit-identical weights, hence one fingerprint
    weights = build_weights(cfg, dev, getattr(torch, spec["dtype"]))
    return make_engine(cfg, weights, dev, spec["dtype"], "none", spec["num_kv_blocks"], plan)


def export_blocks(engine, request_id: str) -> tuple[torch.Tensor, list[int]]:
    """The request's computed KV blocks as one device tensor [n, layers, 2, kv_heads, block_size, head_dim]."""
    req = engine.requests[request_id]
    n = req.num_computed_tokens
    if hasattr(engine, "export_kv_blocks"):
        return engine.export_kv_blocks(request_id), req.all_ids[:n]
    nb = -(-n // engine.kv.block_size)
    ids = torch.tensor(req.block_ids[:nb], device=engine.kv.data.device)
    return engine.kv.read_blocks(ids), req.all_ids[:n]


def import_blocks(
    engine, rid: str, prompt, params, first: int, blocks: torch.Tensor, token_ids, layout
) -> str:
    """Queue a decode of `prompt` after its first token with the KV in `blocks` (a device tensor): straight from
    device memory where the engine imports device blocks (a KvExport holding a tensor); an engine that only
    imports host bytes gets them, and the report says so."""
    from services.engine.engine import KvExport, KvLayout

    if "kv_blocks" in inspect.signature(engine.add_request).parameters:
        engine.add_request(rid, prompt, params, output_ids=[first], kv_blocks=blocks, kv_token_ids=token_ids)
        return "device"
    if "device_blocks" in getattr(KvExport, "__dataclass_fields__", {}):  # KvExport.data may be device blocks
        kv = KvExport(KvLayout(**layout), token_ids, blocks)  # type: ignore[arg-type]
        engine.add_request(rid, prompt, params, output_ids=[first], kv=kv)
        return "device"
    data = blocks.contiguous().cpu().view(torch.uint8).numpy().tobytes()
    engine.add_request(
        rid, prompt, params, output_ids=[first], kv=KvExport(KvLayout(**layout), token_ids, data)
    )
    return "host (engine has no add_request(kv_blocks=...) yet)"


def export_off_thread(engine, rid: str, keep_device: bool) -> tuple[Any, memoryview, torch.Tensor | None]:
    """As a prefill worker exports: pin the request's blocks, copy them off the engine thread (on a GPU on a
    stream of its own, to the host 64 MiB at a time, keeping the device copy if asked), unpin. The job, the host
    bytes and the device copy (or None)."""
    pin = f"{rid}\x00copy"
    job = engine.begin_export(pin, rid)
    try:
        with ThreadPoolExecutor(1) as copier:
            data, device_copy = copier.submit(job.copy_out, keep_device).result()
    finally:
        engine.release_kv(pin)
    return job, data, device_copy


def import_then_finish(engine, rid: str, add: Callable[[], Any]) -> tuple[float, list[int], Any]:
    """Queue an import with `add` and run the request to its end: (the import's time, the tokens, what `add`
    returned). The engine writes imported KV in the step that admits the request, so the import is that step's
    time less the next step's (the same request decoding, without a write)."""
    dev = engine.device
    sync(dev)
    t0 = time.perf_counter()
    added = add()
    out = [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
    sync(dev)
    t1 = time.perf_counter()
    out += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
    sync(dev)
    return max((t1 - t0) - (time.perf_counter() - t1), 0.0), out + finish(engine, rid), added


def greedy_with_margins(
    engine, rid: str, prompt: list[int], params, output_ids=()
) -> tuple[list[int], list[float]]:
    """A greedy run with each token's margin: its logprob less the runner-up's (a near-tie is a small margin)."""
    engine.add_request(rid, prompt, dataclasses.replace(params, logprobs=2), output_ids=list(output_ids))
    tokens: list[int] = []
    margins: list[float] = []
    while rid in engine.requests and not engine.requests[rid].finished:
        for o in engine.step():
            if o.request_id == rid:
                tokens += o.new_token_ids
                margins += [s.top_logprobs[0][1] - s.top_logprobs[1][1] for s in o.logprobs]
    return tokens, margins


NEAR_TIE = 0.05  # nats: two tokens this close can swap in bf16 when the batch around a sequence changes


def agree(got: list[int], want: list[int], margins: list[float]) -> tuple[bool, str]:
    """Greedy tokens equal, or first different where the reference's top two were a near-tie (bf16 kernels at
    another batch size may round the other way there: not a fault of the KV): (ok, what happened)."""
    d = next((k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    if d is None:
        return len(got) == len(want), "equal" if len(got) == len(want) else "of another length"
    if d < len(margins) and margins[d] < NEAR_TIE:
        return True, f"equal up to token {d}, a near-tie (margin {margins[d]:.3f})"
    return False, f"DIFFERENT from token {d} (margin {margins[d] if d < len(margins) else float('nan'):.3f})"


def finish(engine, rid: str) -> list[int]:
    out: list[int] = []
    while rid in engine.requests and not engine.requests[rid].finished:
        for o in engine.step():
            if o.request_id == rid:
                out += o.new_token_ids
    return out


def best_copy_s(dst: torch.Tensor, src: torch.Tensor, reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        sync(dst.device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(dst.device)
        best = min(best, time.perf_counter() - t0)
    return best


def attach_shm(name: str):
    """Open the prefill worker's segment without adopting it: before Python 3.13 attaching registers it with
    this process's resource tracker, which would unlink it (and warn) when this process exits."""
    from multiprocessing import resource_tracker, shared_memory

    try:
        return shared_memory.SharedMemory(name=name, track=False)  # type: ignore[call-arg]
    except TypeError:
        shm = shared_memory.SharedMemory(name=name)
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        return shm


def gb(x: float) -> str:
    """Three significant digits: the smoke run moves kilobytes, the GPU run hundreds of megabytes."""
    return format(x / 1e9, ".3g")


class TransferLoop:
    """The transfer engine's own objects in a step-4 worker (KvSource in the prefill process, KvSink in the
    decode process), on an asyncio loop of their own thread, as a worker's server runs them."""

    def __init__(self, dev: torch.device) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="transfer-loop", daemon=True).start()
        # on a GPU: cuda_ipc for the device copy, TCP for the host bytes (shm is left out: a container's 64 MB
        # /dev/shm would not hold the larger prompts); on a CPU: TCP
        self.backends = ("tcp", "cuda_ipc") if dev.type == "cuda" else ("tcp",)
        self.source: Any = None
        self.sink: Any = None

    def run(self, coro: Any, timeout: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def open_source(self) -> Any:
        from services.kvtransfer import KvSource, TransferConfig

        if self.source is None:
            self.source = self.run(KvSource.start(TransferConfig(backends=self.backends)))
        return self.source

    def open_sink(self) -> Any:
        from services.kvtransfer import KvSink, TransferConfig

        if self.sink is None:
            self.sink = self.run(KvSink.start(TransferConfig(backends=self.backends)))
        return self.sink

    def retract(self, key: str) -> None:
        async def retract() -> None:
            self.source.retract(key)

        self.run(retract())

    def close(self) -> None:
        for end in (self.sink, self.source):
            if end is not None:
                self.run(end.close(), 60.0)
        self.loop.call_soon_threadsafe(self.loop.stop)


def worker_main(role: str, spec: dict[str, Any]) -> int:
    """A prefill or decode worker of step 4: JSON requests on stdin, `@@`-prefixed JSON replies on stdout."""
    from multiprocessing import shared_memory

    from services.engine.engine import KvExport, KvLayout
    from services.engine.sampling import SamplingParams

    def reply(obj: dict[str, Any]) -> None:
        sys.stdout.write("@@" + json.dumps(obj) + "\n")
        sys.stdout.flush()

    engine = worker_engine(spec)
    dev = engine_device(engine)
    reply({"ready": role, "pid": os.getpid(), "device": str(dev)})
    held: dict[str, Any] = {}
    transfer = TransferLoop(dev)
    for line in sys.stdin:
        msg = json.loads(line)
        op = msg["op"]
        try:
            if op == "quit":
                break
            if op == "prefill":
                # prefill worker: compute the prompt's KV and the first token, hold the KV and offer it
                rid, prompt = msg["rid"], msg["prompt"]
                params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
                engine.add_request(rid, prompt, params, hold_kv=True)
                first = finish(engine, rid)[0]
                r: dict[str, Any] = {"first": first, "layout": asdict(engine.kv_layout)}
                if msg["mode"] == "ipc":
                    from services.kvtransfer.cuda_ipc import describe

                    blocks, token_ids = export_blocks(engine, rid)
                    sync(dev)
                    held[rid] = blocks  # alive until the decode worker has copied out of it
                    r |= {"desc": describe(blocks), "token_ids": token_ids}
                elif msg["mode"] == "source":
                    # as a prefill worker hands KV over: pin, copy off the engine thread (on a GPU keeping the
                    # device copy for cuda_ipc readers), unpin, publish on the worker's KvSource
                    source = transfer.open_source()
                    t0 = time.perf_counter()
                    job, data, device_copy = export_off_thread(engine, rid, keep_device=dev.type == "cuda")
                    ticket = transfer.run(source.publish(rid, data, 120.0, device_payload=device_copy))
                    r |= {"export_s": time.perf_counter() - t0, "ticket": ticket.to_json()}
                    r |= {"token_ids": job.token_ids, "device_copy": device_copy is not None}
                    held[rid] = "source"
                else:
                    t0 = time.perf_counter()
                    job, data, _ = export_off_thread(engine, rid, keep_device=False)
                    shm = shared_memory.SharedMemory(create=True, size=len(data))
                    shm.buf[: len(data)] = data
                    r |= {"export_s": time.perf_counter() - t0, "shm": shm.name, "nbytes": len(data)}
                    r["token_ids"] = job.token_ids
                    held[rid] = shm
                reply(r)
            elif op == "release":
                h = held.pop(msg["rid"], None)
                if h == "source":
                    transfer.retract(msg["rid"])
                if isinstance(h, shared_memory.SharedMemory):
                    h.close()
                    h.unlink()
                engine.release_kv(msg["rid"])
                reply({"released": msg["rid"]})
            elif op == "aggregated":
                # decode worker: the same prompt prefilled and decoded here, the reference
                params = SamplingParams(max_tokens=msg["max_tokens"], temperature=0, ignore_eos=True)
                reply({"tokens": engine.generate([msg["prompt"]], params)[0]})
            elif op == "decode":
                # decode worker: take the offered KV (IPC handle or shared memory), decode after the first token
                rid, prompt, first = msg["rid"], msg["prompt"], msg["first"]
                params = SamplingParams(max_tokens=msg["max_tokens"], temperature=0, ignore_eos=True)
                r = {}
                if msg["mode"] == "ipc":
                    from services.kvtransfer.cuda_ipc import open_described

                    t0 = time.perf_counter()
                    remote = open_described(msg["desc"])
                    r["open_s"] = time.perf_counter() - t0
                    local = torch.empty_like(remote, memory_format=torch.contiguous_format)
                    r["copy_s"] = best_copy_s(local, remote)  # peer's device memory -> ours
                    r["nbytes"] = remote.numel() * remote.element_size()
                    r["memcpy_s"] = best_copy_s(torch.empty_like(local), local)  # the same bytes within ours
                    del remote  # unmaps the peer's allocation
                    add = functools.partial(
                        import_blocks,
                        engine,
                        rid,
                        prompt,
                        params,
                        first,
                        local,
                        msg["token_ids"],
                        msg["layout"],
                    )
                elif msg["mode"] == "staged":
                    t0 = time.perf_counter()
                    shm = attach_shm(msg["shm"])
                    data = bytes(shm.buf[: msg["nbytes"]])
                    shm.close()
                    kv = KvExport(KvLayout(**msg["layout"]), msg["token_ids"], data)
                    r["shm_s"] = time.perf_counter() - t0  # attach and copy out of the segment
                    # host -> device, 64 MiB at a time, in the step that admits it
                    add = functools.partial(
                        engine.add_request, rid, prompt, params, output_ids=[first], kv=kv
                    )
                    r["nbytes"] = len(data)
                    staged = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
                    r["memcpy_s"] = best_copy_s(torch.empty_like(staged), staged)
                    r["import"] = "host"
                elif msg["mode"] == "source":
                    # as a decode worker takes it: its KvSink pulls the ticket (cuda_ipc: GPU to GPU, onto this
                    # process's GPU), and the engine imports what arrived
                    from services.kvtransfer import TransferTicket

                    sink = transfer.open_sink()
                    ticket = TransferTicket.from_json(msg["ticket"])
                    backend = "cuda_ipc" if dev.type == "cuda" else "tcp"
                    pulled = transfer.run(sink.pull(ticket, 60.0, backend=backend, device=str(dev)))
                    r |= {"copy_s": pulled.seconds, "nbytes": pulled.bytes}
                    r["import"] = pulled.backend + (
                        " device-direct" if pulled.device_direct else " host bytes"
                    )
                    on_dev = (
                        pulled.data
                        if isinstance(pulled.data, torch.Tensor)
                        else torch.frombuffer(bytearray(pulled.data), dtype=torch.uint8).to(dev)
                    )
                    # the same bytes within ours
                    r["memcpy_s"] = best_copy_s(torch.empty_like(on_dev), on_dev)
                    del on_dev
                    kv = KvExport(KvLayout(**msg["layout"]), msg["token_ids"], pulled.data)
                    del pulled
                    add = functools.partial(
                        engine.add_request, rid, prompt, params, output_ids=[first], kv=kv
                    )
                r["import_s"], tokens, how = import_then_finish(engine, rid, add)
                if msg["mode"] == "ipc":
                    r["import"] = how
                r["tokens"] = [first] + tokens
                reply(r)
            elif op == "decode_beside":
                # decode worker: the staged KV arrives while another sequence decodes, so the engine writes it
                # beside that sequence's step (the restore thread; its own stream on a GPU): both must give the
                # tokens they give alone
                rid, prompt, first = msg["rid"], msg["prompt"], msg["first"]
                params = SamplingParams(max_tokens=msg["max_tokens"], temperature=0, ignore_eos=True)
                other = msg["companion"]
                solo, solo_margins = greedy_with_margins(engine, "companion-solo", other, params)
                ref, ref_margins = greedy_with_margins(
                    engine, f"{rid}-ref", prompt, params, output_ids=[first]
                )
                engine.add_request("companion", other, params)
                outs: dict[str, list[int]] = {"companion": [], rid: [first]}
                for o in engine.step():  # its prefill: it is decoding when the KV comes
                    outs[o.request_id] += o.new_token_ids
                shm = attach_shm(msg["shm"])
                data = bytes(shm.buf[: msg["nbytes"]])
                shm.close()
                kv = KvExport(KvLayout(**msg["layout"]), msg["token_ids"], data)
                engine.add_request(rid, prompt, params, output_ids=[first], kv=kv)
                beside = None
                while engine.has_unfinished():
                    for o in engine.step():
                        outs[o.request_id] += o.new_token_ids
                    if beside is None:
                        beside = rid in engine.scheduler.restoring
                reply({
                    "tokens": outs[rid], "companion": outs["companion"], "solo": solo, "beside": beside,
                    "ref": [first, *ref], "ref_margins": [float("inf"), *ref_margins], "solo_margins": solo_margins,
                })  # fmt: skip
            else:
                reply({"error": f"unknown op {op!r}"})
        except Exception as exc:  # noqa: BLE001 - the parent reports it and goes on
            traceback.print_exc()
            reply({"error": f"{type(exc).__name__}: {exc}"})
    transfer.close()
    return 0


WORKERS: list[Worker] = []  # every step-4 worker started: the watchdog kills what is still running


class Worker:
    """One worker process of step 4, spoken to over its stdin/stdout with a deadline on every reply."""

    def __init__(self, role: str, spec: dict[str, Any]):
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            role,
            "--worker-spec",
            json.dumps(spec),
        ]
        self.role = role
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
        WORKERS.append(self)
        self.replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@"):
                self.replies.put(json.loads(line[2:]))
            else:  # anything else a library printed: shown, marked with the worker's role
                sys.stdout.write(f"[{self.role}] {line}")
        self.replies.put(None)  # the process ended

    def get(self, timeout: float) -> dict[str, Any]:
        try:
            r = self.replies.get(timeout=max(timeout, 1.0))
        except queue.Empty:
            raise TimeoutError(f"{self.role} worker gave no reply within {timeout:.0f} s") from None
        if r is None:
            raise RuntimeError(f"{self.role} worker exited (status {self.proc.wait()})")
        if "error" in r:
            raise RuntimeError(f"{self.role} worker: {r['error']}")
        return r

    def call(self, timeout: float, **msg: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self.get(timeout)

    def close(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.close()
            self.proc.wait(timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def import_beside(
    res: StepResult, prefill: Worker, decode: Worker, p: list[int], m: int, other: list[int]
) -> None:
    """The staged import once more, while another sequence decodes on the decode worker: written beside its step
    (the restore thread; on a GPU its own stream after the steps before it). Both sequences must give their
    tokens alone — in bf16, up to a near-tie where the other sequence in the batch makes the kernels round the
    other way (`agree`)."""
    offer = prefill.call(120, op="prefill", rid="beside", prompt=p, mode="staged")
    try:
        got = decode.call(
            120, op="decode_beside", rid="beside", prompt=p, max_tokens=m, companion=other, **offer
        )
    finally:
        release(prefill, "beside")
    ok_imported, imported = agree(got["tokens"], got["ref"], got["ref_margins"])
    ok_other, other_seq = agree(got["companion"], got["solo"], got["solo_margins"])
    res.say(
        f"staged import beside a decoding sequence: written beside its step: {got['beside']}; the imported "
        f"sequence {imported}, the other {other_seq}, to their runs alone"
    )
    res.data["import_beside"] = dict(beside=got["beside"], imported=imported, other=other_seq)
    if not (ok_imported and ok_other):
        res.fail(
            f"import beside a decoding sequence: imported {got['tokens']} (alone {got['ref']}), the other "
            f"sequence {got['companion']} (alone {got['solo']})"
        )
    elif not got["beside"]:
        res.fail("import beside a decoding sequence: the KV was written before the step, not beside it")


def release(prefill: Worker, rid: str) -> None:
    """Let the prefill worker free a request's blocks; a worker that cannot answer any more is past caring."""
    try:
        prefill.call(60, op="release", rid=rid)
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"gpu_check: release of {rid} on the prefill worker failed: {exc}", flush=True)


def shm_fits(res: StepResult, nbytes: int, i: int, tokens: int, where: str = "/dev/shm") -> bool:
    """Whether one staged KV of `nbytes` fits in `where` (POSIX shared memory). A container's /dev/shm is 64 MB
    unless it is given more, and writing past it kills the writer with SIGBUS: such a prompt is skipped, said."""
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return True  # no such mount to measure: shared_memory will say what is wrong
    if nbytes <= free * 0.9:
        return True
    res.say(
        f"staged: prompt {i} ({tokens} tokens, {nbytes / 1e6:.0f} MB of KV) skipped: {where} has "
        f"{free / 1e6:.0f} MB free (a container's default is 64 MB; give it more, e.g. --shm-size)"
    )
    return False


def check_staging(res: StepResult, dev: torch.device) -> None:
    """Device bytes to the host through the two pinned bounce buffers (engine.device_to_host), as an export with
    no device copy kept and every staged device copy go: four chunks, the last one short, byte for byte."""
    from services.engine.engine import STAGE_CHUNK_BYTES, device_to_host

    g = torch.Generator(device=dev).manual_seed(29)
    x = torch.randint(0, 256, (3 * STAGE_CHUNK_BYTES + 12345,), dtype=torch.uint8, device=dev, generator=g)
    t0 = time.perf_counter()
    host = device_to_host(x.split(STAGE_CHUNK_BYTES), x.numel(), dev, STAGE_CHUNK_BYTES)
    s = time.perf_counter() - t0
    ok = torch.equal(host, x.cpu())
    res.say(
        f"staging to the host in {STAGE_CHUNK_BYTES >> 20} MiB chunks: {x.numel() / 1e6:.0f} MB "
        f"{'equal' if ok else 'DIFFERENT'}, {x.numel() / s / 1e9:.3g} GB/s (first call, pinned buffers new)"
    )
    if not ok:
        res.fail("device_to_host: the host bytes differ from the device's")


def step_disagg(res: StepResult, plan: Plan, budget: Budget) -> None:
    dev = plan.device
    if dev.type == "cuda":
        check_staging(res, dev)
    spec = dict(
        shape="smollm2-135m",
        device=str(dev),
        smoke=plan.smoke,
        dtype="float32" if plan.smoke else "bfloat16",  # bf16 on the GPU, as served
        num_kv_blocks=-(-(max(plan.disagg_prompt_lens) + plan.disagg_max_tokens) // 16) * 2 + 16,
    )
    res.say(f"workers: {spec['shape']} {spec['dtype']} on {dev}, one prefill and one decode process")
    deadline = max(budget.left, 60.0)
    workers = [Worker("prefill", spec), Worker("decode", spec)]
    try:
        prefill, decode = workers
        for w in workers:
            w.get(timeout=min(deadline, 300.0))
        g = torch.Generator().manual_seed(23)
        vocab = model_config(spec["shape"], plan.smoke).vocab_size
        prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in plan.disagg_prompt_lens]
        m = plan.disagg_max_tokens
        want = [decode.call(120, op="aggregated", prompt=p, max_tokens=m)["tokens"] for p in prompts]
        modes = ["ipc", "source", "staged"] if dev.type == "cuda" else ["source", "staged"]
        if dev.type != "cuda":
            res.say(
                "CUDA IPC path: skipped, it needs CUDA (the transfer engine pulls over TCP; the staged host path "
                "runs)"
            )
        from services.engine.model import PagedKvCache

        block = PagedKvCache.bytes_per_block(
            model_config(spec["shape"], plan.smoke), 16, getattr(torch, spec["dtype"])
        )

        def one_mode(mode: str) -> None:
            same = tried = 0
            nbytes = copy_s = memcpy_s = 0.0
            imports: set[str] = set()
            biggest: dict[str, Any] = {}
            for i, p in enumerate(prompts):
                rid = f"{mode}-{i}"
                if mode == "staged" and not shm_fits(res, -(-len(p) // 16) * block, i, len(p)):
                    continue
                tried += 1
                offer = prefill.call(120, op="prefill", rid=rid, prompt=p, mode=mode)
                try:
                    got = decode.call(120, op="decode", rid=rid, prompt=p, max_tokens=m, mode=mode, **offer)
                finally:  # the prefill worker's blocks go back even when the decode side failed
                    release(prefill, rid)
                same += got["tokens"] == want[i]
                if got["tokens"] != want[i]:
                    res.fail(
                        f"{mode}: prompt {i} (len {len(p)}) decoded {got['tokens']} after the transfer, "
                        f"the aggregated run gave {want[i]}"
                    )
                moved = (
                    got["copy_s"]
                    if mode in ("ipc", "source")
                    else offer["export_s"] + got["shm_s"] + got["import_s"]
                )
                if mode == "source" and dev.type == "cuda" and got["import"] != "cuda_ipc device-direct":
                    res.fail(
                        f"source: prompt {i}: the KvSink pull went {got['import']}, not cuda_ipc GPU to GPU"
                    )
                nbytes += got["nbytes"]
                copy_s += moved
                memcpy_s += got["memcpy_s"]
                imports.add(got["import"])
                if got["nbytes"] >= biggest.get("nbytes", 0):
                    biggest = {"nbytes": got["nbytes"], "s": moved, "memcpy_s": got["memcpy_s"]}
                    biggest |= {k: got[k] for k in ("open_s", "import_s") if k in got}
            if not biggest:
                res.say(f"{mode}: no prompt fit, nothing transferred")
                return
            gbs = biggest["nbytes"] / biggest["s"] / 1e9
            ref = biggest["nbytes"] / biggest["memcpy_s"] / 1e9
            what = {
                "ipc": "peer device -> device copy",
                "source": "KvSource -> KvSink pull",
                "staged": "export to host + shm + import to device",
            }[mode]
            res.say(
                f"{mode}: tokens equal to the aggregated run for {same}/{tried} prompts; largest KV "
                f"{gb(biggest['nbytes'] * 1e3)} MB at {gbs:.3g} GB/s ({what}) vs device memcpy {ref:.3g} GB/s "
                f"= {gbs / ref:.0%}; all {tried}: {gb(nbytes * 1e3)} MB at {gb(nbytes / copy_s)} GB/s; "
                f"import: {', '.join(sorted(imports))}"
                + (f"; IPC open {biggest['open_s'] * 1e3:.1f} ms" if "open_s" in biggest else "")
            )
            res.data[mode] = dict(
                equal=same, prompts=tried, largest_bytes=biggest["nbytes"], largest_gb_s=gbs,
                memcpy_gb_s=ref, ratio=gbs / ref, total_bytes=nbytes, total_gb_s=nbytes / copy_s,
                import_path=sorted(imports),
            )  # fmt: skip
            if mode in ("ipc", "source") and dev.type == "cuda":
                res.say(
                    f"{mode}: target transfer >= 50% of device memcpy: {gbs / ref:.0%} "
                    f"({'met' if gbs >= ref / 2 else 'not met'})"
                )

        for mode in modes:
            try:  # a mode that fails is reported; the next mode still runs
                one_mode(mode)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                res.fail(f"{mode}: {type(exc).__name__}: {exc}")
        # the staged import once more, while another sequence decodes on the decode worker: written beside its
        # step (the restore thread, on a GPU its own stream after the steps before it)
        i = min(range(len(prompts)), key=lambda k: len(prompts[k]))
        p = prompts[i]
        if shm_fits(res, -(-len(p) // 16) * block, i, len(p)):
            try:
                import_beside(res, prefill, decode, p, m, torch.randint(0, vocab, (8,), generator=g).tolist())
            except Exception as exc:  # noqa: BLE001 - reported; the step's other results stand
                traceback.print_exc()
                res.fail(f"import beside a decoding sequence: {type(exc).__name__}: {exc}")
    finally:
        for w in workers:
            w.close()


# --------------------------------------------------------------------------------------------- main


def step_kernels(res: StepResult, plan: Plan, budget: Budget, iters: int) -> None:
    if plan.device.type != "cuda":
        res.status = "skipped"
        res.say("the NVFP4 kernel checks need CUDA")
        return
    from services.engine.nvfp4.recipe import quantize
    from services.engine.nvfp4.triton_kernels import quantize_triton

    # 64-128 MiB inputs: well past the 50 MB L2 of an H100/H200, small enough for a quick CPU reference.
    shapes = [((8192, 4096), torch.bfloat16), ((8192, 4096), torch.float32), ((1000, 1007), torch.float32)]
    rows: list[Row] = []
    with torch.cuda.device(plan.device):  # the checks allocate on "cuda": the device --device names
        rows += check_quantizer("triton quantize", quantize_triton, shapes, iters)
        rows += check_quantizer("torch recipe on GPU", quantize, shapes[:1], max(3, iters // 4))
        rows += cuda_quantize_rows(shapes, iters)
        rows += gemm_rows(iters)
        rows += blackwell_rows(iters)
    table = ["| kernel | shape | check | ms | GB/s | TFLOP/s |", "|---|---|---|---|---|---|"]
    for r in rows:
        numbers = f"{fmt(r.ms, '.3f')} | {fmt(r.gb_per_s, '.0f')} | {fmt(r.tflops, '.1f')}"
        table.append(f"| {r.kernel} | {r.shape} | {r.status} | {numbers} |")
    print("\n".join(table))
    res.data["table"] = "\n".join(table)
    res.data["rows"] = [asdict(r) for r in rows]
    failed = [r for r in rows if r.status.startswith("FAIL")]
    if failed:
        res.fail(f"{len(failed)} of {len(rows)} kernel checks failed: {', '.join(r.kernel for r in failed)}")
    else:
        res.say(f"{len(rows)} kernel checks ok or skipped")


def resolve_device(name: str) -> torch.device | None:
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else None
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"gpu_check: --device {name} asked for, but torch.cuda.is_available() is False")
    return dev


def out_dir() -> Path:
    return Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "bench" / "results"


def write_report(results: list[StepResult], header: dict[str, Any]) -> Path:
    d = out_dir()
    d.mkdir(parents=True, exist_ok=True)
    header = header | {"notes": NOTES}
    md = [f"# gpu_check {header['date']}", "", *(f"- {k}: {v}" for k, v in header.items()), ""]
    for r in results:
        md += [f"## {r.step}: {r.status}", "", *(f"- {line}" for line in r.lines), ""]
        if "table" in r.data:
            md += [r.data["table"], ""]
    (d / "gpu_check.md").write_text("\n".join(md))
    body = {"header": header, "steps": [asdict(r) for r in results]}
    (d / "gpu_check.json").write_text(json.dumps(body, indent=1, default=str))
    return d


def over_budget(results: list[StepResult], header: dict[str, Any]) -> None:
    print("\ngpu_check: over budget, stopping; where each thread was:", flush=True)
    faulthandler.dump_traceback(all_threads=True)
    if results and results[-1].status == "ok":
        results[-1].status = "FAIL"
        results[-1].lines.append("FAIL: did not finish within the budget (stopped by the watchdog)")
    for w in WORKERS:  # a busy worker would hold the GPU (and this call's output) until its own call ends
        if w.proc.poll() is None:
            w.proc.kill()
    try:
        d = write_report(list(results), header)
        print(f"gpu_check: partial report in {d}/gpu_check.md", flush=True)
    finally:
        os._exit(3)


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto (CUDA if available), cuda, cuda:N or cpu")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes and a few steps: the logic, not speed"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=400.0,
        help="wall-clock budget (s); a section that does not fit is skipped",
    )
    parser.add_argument("--steps", default="1,2,4,3", help="steps to run, in this order (default 1,2,4,3)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per kernel in step 1")
    parser.add_argument(
        "--grace-s", type=float, default=40.0, help="past the budget by this much, a hung step is stopped"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # step 4's child processes
    parser.add_argument("--worker-spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(args.worker_spec)
        if spec["smoke"]:
            torch.set_num_threads(1)  # two workers and the parent share the CPU: no oversubscription
        return worker_main(args.worker, spec)

    missing = [m for m in ("gguf", "xxhash", "transformers") if importlib.util.find_spec(m) is None]
    if missing:  # on a GPU machine without network these come from .whl/ (scripts/gpu_wheels.sh)
        print(f"gpu_check: missing Python packages {', '.join(missing)}; see docs/gpu.md")
    dev = resolve_device(args.device)
    if dev is None:
        print(
            "gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing to check. "
            "`--device cpu --smoke` runs the check's logic on the CPU."
        )
        return 0
    # fp32 means fp32: TF32 matmuls would round the inputs to 10 mantissa bits and break token identity
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    budget = Budget(args.budget_s)
    plan = Plan(args.smoke, dev)
    models = Models(plan)
    if args.smoke and dev.type == "cpu":
        torch.set_num_threads(1)  # toy shapes: threads only add synchronisation (and step 4 runs 3 processes)
    name = torch.cuda.get_device_properties(dev).name if dev.type == "cuda" else "cpu"
    header = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "device": name,
        "commit": git_commit(),
        "torch": torch.__version__,
        "smoke": args.smoke,
        "command": " ".join(["python", "scripts/gpu_check.py", *sys.argv[1:]]),
    }
    print(f"gpu_check: {name}, torch {torch.__version__}, budget {args.budget_s:.0f} s, smoke={args.smoke}")
    steps: dict[str, tuple[str, Callable[[StepResult], None], float]] = {
        "1": ("step 1: NVFP4 kernels", lambda r: step_kernels(r, plan, budget, args.iters), 60),
        "2": ("step 2: engine vs transformers", lambda r: step_correctness(r, plan, budget, models), 60),
        "3": ("step 3: throughput", lambda r: step_throughput(r, plan, budget, models), 90),
        "4": ("step 4: prefill -> KV -> decode, two processes", lambda r: step_disagg(r, plan, budget), 45),
    }
    results: list[StepResult] = []
    # A step can only be skipped before it starts; one that hangs (a kernel, a capture, a worker) is stopped
    # here: stacks dumped for the reader, the report written with what finished, exit status 3.
    watchdog = threading.Timer(args.budget_s + args.grace_s, over_budget, (results, header))
    watchdog.daemon = True
    watchdog.start()
    for key in [s.strip() for s in args.steps.split(",") if s.strip()]:
        title, fn, need = steps[key]
        res = StepResult(title)
        results.append(res)
        print(f"\n{title} ({budget.left:.0f} s of the budget left)", flush=True)
        if not args.smoke and not budget.allows(need):
            res.status = "skipped"
            res.say(f"skipped: {budget.left:.0f} s of the budget left, it needs ~{need:.0f} s")
            continue
        try:
            fn(res)
        except Exception as exc:  # noqa: BLE001 - a failed step is reported; the next one still runs
            traceback.print_exc()
            res.fail(f"{type(exc).__name__}: {exc}")
        free_device_memory(dev)
        write_report(
            results, header
        )  # after every step: a later crash (a segfault, a hang) keeps what finished
    watchdog.cancel()
    d = write_report(results, header)
    print("\n" + "\n".join(f"{r.step}: {r.status}" for r in results))
    failed = [r for r in results if r.status == "FAIL"]
    print(f"{len(failed)} step(s) failed, {budget.seconds - budget.left:.0f} s; report in {d}/gpu_check.md")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
