"""What the KV staging and export benchmarks build on: SmolLM2-135M's KV cache shape (30 layers, 3 KV heads,
head dim 64, 16-token blocks), a bfloat16 cache of it, and a timer."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import SimpleNamespace

import torch

from services.engine.model import PagedKvCache

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16


def smollm2_cache(num_blocks: int, gen: torch.Generator | None = None) -> PagedKvCache:
    """A bfloat16 cache of num_blocks blocks of that shape; filled with random values from `gen` if given."""
    cfg = SimpleNamespace(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)  # what the cache reads
    kv = PagedKvCache(cfg, num_blocks, BLOCK, torch.bfloat16)  # type: ignore[arg-type]
    if gen is not None:
        kv.data.copy_(torch.randn(kv.data.shape, generator=gen, dtype=torch.float32))
    return kv


def timed(fn: Callable[..., object], *args: object) -> float:
    """Seconds one call of fn(*args) takes."""
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0
