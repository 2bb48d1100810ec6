"""Typed configuration of the engine: what the model is (ModelConfig) and how it is served (EngineConfig).

Both are plain dataclasses with defaults that work on a laptop; the CLI and the Helm values use the same names.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = ("llama",)  # Llama 2/3, SmolLM and Qwen2-style layouts map onto this
SUPPORTED_DTYPES = ("float32", "bfloat16")  # torch's own names: `torch_dtype` maps them
SUPPORTED_QUANT = ("none", "nvfp4")
ATTENTION_BACKENDS = ("auto", "torch", "triton")  # auto: Triton paged attention on CUDA, torch ops elsewhere
# the data-free NVFP4 methods, quantized at load (services/engine/nvfp4/methods.py); gptq is offline only
NVFP4_LOAD_METHODS = ("rtn", "four_over_six", "mse")
NVFP4_METHODS = (*NVFP4_LOAD_METHODS, "gptq")  # all of them: `rackserve quantize --method`
# how NVFP4 weights are multiplied (nvfp4/blackwell.py: choose_gemm): auto = W4A4 where the GPU has FP4 tensor cores
# and the checkpoint does not declare 16-bit activations; w4a16 = activations never quantized; w4a4 = always
# (emulated on a CPU, refused on a GPU without FP4 tensor cores)
NVFP4_GEMMS = ("auto", "w4a16", "w4a4")
# what an NVFP4 checkpoint's weights were quantized for (`rackserve quantize --activations`): 16-bit inputs
# (W4A16), or NVFP4 inputs under static activation scales written with them (W4A4)
NVFP4_ACTIVATIONS = ("16bit", "nvfp4")
TIER2_CODECS = ("bf16", "fp8", "nvfp4")  # how KV tier 2 keeps a block (engine/kv_tier.py)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype an engine dtype name (one of SUPPORTED_DTYPES) stands for."""
    import torch  # here: the router and the launcher read this module without loading torch

    if name not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {name!r}")
    dtype: torch.dtype = getattr(torch, name)
    return dtype


class ModelLoadError(ValueError):
    """A model could not be loaded; the message names the file and what is wrong with it."""


_DEVICE_SPEC = re.compile(r"^(auto|cpu|cuda)(?::(\d+))?$")


def parse_device_spec(spec: str) -> tuple[str, int | None]:
    """A device flag as (kind, index): auto | cpu | cuda | cuda:N, any case. Here, not in device.py, so that
    `rackserve up` reads the flag without importing torch."""
    m = _DEVICE_SPEC.match(spec.strip().lower())
    if m is None or (m.group(2) is not None and m.group(1) != "cuda"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {spec!r}")
    return m.group(1), None if m.group(2) is None else int(m.group(2))


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (rope_type "llama3"); None on the model means plain RoPE."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_context: int
    tie_embeddings: bool
    attention_bias: bool = False
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    def canonical_json(self) -> str:
        """The config as it enters the model fingerprint: sorted keys, no display-only fields."""
        d = dataclasses.asdict(self)
        d.pop("name")
        return json.dumps(d, sort_keys=True, separators=(",", ":"))


@dataclass
class EngineConfig:
    """How one engine instance serves a model."""

    dtype: str = "bfloat16"
    quant: str = "none"  # none | nvfp4
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int = 0  # 0: size from kv_cache_bytes
    kv_cache_bytes: int = 0  # 0: 1 GiB on CPU; on CUDA what gpu_memory_utilization leaves (engine/device.py)
    max_num_seqs: int = 64  # admission limit: sequences in one batch
    # token budget of one step (chunked prefill); 0: by device (device.step_token_budget)
    max_num_batched_tokens: int = 0
    max_model_len: int = 0  # 0: the model's context length
    enable_prefix_caching: bool = True
    num_threads: int = 0  # 0: leave torch's default
    cpu_kernels: bool = (
        True  # fused CPU kernels (engine/cpu_ops.py) for bf16 where they build; False: torch ops
    )
    nvfp4_cache_dequantized: bool = False
    device: str = "auto"  # auto | cpu | cuda | cuda:N (engine/device.py); auto = CUDA when one is visible
    gpu_memory_utilization: float = 0.9  # share of the GPU's memory for weights + activations + KV blocks
    # GPU: kept out of the KV plan for KV copies in transit beside the cache: the device copies a prefill worker
    # keeps for device-direct readers (--kv-device-copy-bytes) and device-direct pulls not yet written into the
    # cache (--kv-device-pull-bytes); services/kvtransfer/budget.py
    kv_transit_bytes: int = 0
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps
    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS
    nvfp4_method: str = "rtn"  # how --quant nvfp4 picks scales and codes at load (nvfp4/methods.py)
    nvfp4_gemm: str = "auto"  # one of NVFP4_GEMMS: whether NVFP4 layers also quantize their activations
    # tier 2 of the KV cache (engine/kv_tier.py): host bytes for blocks evicted from the pool; 0 = off
    kv_tier2_bytes: int = 0
    kv_tier2_codec: str = "bf16"  # one of TIER2_CODECS: bf16 (lossless) | fp8 | nvfp4 (docs/kv-tiers.md)
    # the disk tier below it (engine/kv_disk.py): a directory of its own and the bytes its files may take; 0 = off.
    # Blocks are kept in kv_tier2_codec.
    kv_disk_path: str = ""
    kv_disk_bytes: int = 0
    # a request whose prefix comes back from a tier, or whose KV came from a prefill worker, while others run waits
    # a step while its blocks are written beside the step (a worker thread; a side stream on CUDA) instead of
    # stalling the batch: docs/kv-tiers.md
    kv_async_restore: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        if self.quant not in SUPPORTED_QUANT:
            raise ValueError(f"quant must be one of {SUPPORTED_QUANT}, got {self.quant!r}")
        if self.nvfp4_method not in NVFP4_LOAD_METHODS:
            hint = " (gptq needs calibration: `rackserve quantize --method gptq`)" * (
                self.nvfp4_method == "gptq"
            )
            raise ValueError(
                f"nvfp4_method must be one of {NVFP4_LOAD_METHODS}, got {self.nvfp4_method!r}{hint}"
            )
        if self.nvfp4_method != "rtn" and self.quant != "nvfp4":
            raise ValueError(
                f"nvfp4_method={self.nvfp4_method!r} needs quant='nvfp4', got quant={self.quant!r}"
            )
        if self.nvfp4_gemm not in NVFP4_GEMMS:
            raise ValueError(f"nvfp4_gemm must be one of {NVFP4_GEMMS}, got {self.nvfp4_gemm!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_transit_bytes < 0:
            raise ValueError(f"kv_transit_bytes must not be negative, got {self.kv_transit_bytes}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        parse_device_spec(self.device)  # a malformed spec fails here, before any weight is read
        if self.kv_tier2_codec not in TIER2_CODECS:
            raise ValueError(f"kv_tier2_codec must be one of {TIER2_CODECS}, got {self.kv_tier2_codec!r}")
        if self.kv_tier2_bytes < 0:
            raise ValueError(f"kv_tier2_bytes must be >= 0 (0 turns tier 2 off), got {self.kv_tier2_bytes}")
        if self.kv_tier2_bytes and not self.enable_prefix_caching:
            raise ValueError("kv_tier2_bytes needs the prefix cache: tier 2 keeps evicted cached blocks")
        if self.kv_disk_bytes < 0:
            raise ValueError(
                f"kv_disk_bytes must be >= 0 (0 turns the disk tier off), got {self.kv_disk_bytes}"
            )
        if self.kv_disk_bytes and not self.kv_disk_path:
            raise ValueError(
                "kv_disk_bytes needs kv_disk_path: the directory the disk tier keeps its blocks in"
            )
        if self.kv_disk_path and not self.kv_disk_bytes:
            raise ValueError("kv_disk_path needs kv_disk_bytes > 0: how many bytes the disk tier may take")
        if self.kv_disk_bytes and not self.enable_prefix_caching:
            raise ValueError(
                "kv_disk_bytes needs the prefix cache: the disk tier keeps evicted cached blocks"
            )
        # each would leave the scheduler nothing to run, and a request waiting for good
        for name in (
            "kv_cache_bytes",
            "num_kv_blocks",
            "num_threads",
            "max_model_len",
            "max_num_batched_tokens",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: the default), got {getattr(self, name)}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens and self.max_num_batched_tokens < self.block_size:
            raise ValueError("max_num_batched_tokens must be at least block_size (or 0: by device)")
