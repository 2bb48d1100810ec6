"""A prefill worker's KV export and the engine thread: how long another request's step waits for it.

    python -m bench.kv_export_bench [--reps 5] [--tokens 2048,8192,32768]

When a prompt's prefill ends, the worker copies its KV blocks out of the pool for the decode worker to pull. Until
2026-12-06 that copy ran on the engine's thread (`export_kv`: the gather, and on a GPU the device-to-host copy),
so the engine stepped no other request meanwhile. Now the engine thread only pins the blocks (`begin_export`)
and the copy (`ExportJob.copy_out`) runs on another thread while the engine steps on.

Measured: the SmolLM2-135M cache shape (30 layers, 3 KV heads, head dim 64, 16-token blocks) in bfloat16, blocks
scattered over a pool twice the prompt's size, one torch thread per thread (a worker given one core per thread).
The "step" is a fixed piece of engine-like work (a batch-64 decode step's matmuls at the 135M model's width,
~tens of ms on this VM). Each round, A/B/A/B: the step alone; before — the copy on the engine thread, then the
step; now — the pin, then the step while another thread copies. Reported: the time from the prompt's export
until the step has finished, median of `reps`. On a machine with a spare core the copy costs the step nothing;
on two busy cores they share them. Writes a markdown table to stdout and bench/results/kv_export.md.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from bench.kv_cache_fixture import BLOCK, LAYERS, smollm2_cache, timed
from bench.report import publish, wait_rows
from services.engine.engine import ExportJob, staged_bytes
from services.engine.kv_cache import BlockManager
from services.engine.model import PagedKvCache

RESULTS = Path(__file__).resolve().parent / "results" / "kv_export.md"
HIDDEN, FFN = 576, 1536


def make_step(gen: torch.Generator) -> Any:
    x = torch.randn(64, HIDDEN, generator=gen, dtype=torch.bfloat16)
    w_up = torch.randn(HIDDEN, 2 * FFN, generator=gen, dtype=torch.bfloat16)
    w_down = torch.randn(FFN, HIDDEN, generator=gen, dtype=torch.bfloat16)

    def step() -> None:
        h = x
        for _ in range(LAYERS):
            up = h @ w_up
            h = (up[:, :FFN] * up[:, FFN:]) @ w_down

    return step


def before(kv: PagedKvCache, ids: list[int], step: Any) -> float:
    t0 = time.perf_counter()
    staged_bytes(kv.read_blocks(torch.tensor(ids)))  # export_kv on the engine thread
    step()
    return time.perf_counter() - t0


def now(kv: PagedKvCache, blocks: BlockManager, ids: list[int], step: Any) -> float:
    t0 = time.perf_counter()
    blocks.acquire(ids)  # begin_export: the pin
    job = ExportJob(kv, None, list(ids), [])  # type: ignore[arg-type]  # copy_out reads no layout

    def copy() -> None:
        torch.set_num_threads(1)
        job.copy_out(keep_device=False)

    copier = threading.Thread(target=copy)
    copier.start()
    step()
    took = time.perf_counter() - t0
    copier.join()
    blocks.release(ids)
    return took


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", default="2048,8192,32768")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    step = make_step(gen)
    rows = []
    for tokens in (int(t) for t in a.tokens.split(",")):
        n = tokens // BLOCK
        kv = smollm2_cache(2 * n, gen)
        blocks = BlockManager(2 * n, BLOCK)
        ids = blocks.allocate(2 * n)
        perm = torch.randperm(2 * n, generator=gen)[:n].tolist()
        ids = [ids[i] for i in perm]  # scattered, as a pool's blocks are
        job = ExportJob(kv, None, ids, [])  # type: ignore[arg-type]
        assert bytes(job.copy_out(keep_device=False)[0]) == bytes(
            staged_bytes(kv.read_blocks(torch.tensor(ids)))
        )
        times: dict[str, list[float]] = {"alone": [], "before": [], "now": []}
        for _ in range(a.reps):  # A/B/A/B
            times["alone"].append(timed(step))
            times["before"].append(before(kv, ids, step))
            times["now"].append(now(kv, blocks, ids, step))
        med = {k: statistics.median(v) * 1000 for k, v in times.items()}
        rows.append((tokens, n * kv.block_bytes / 2**20, med))
    lines = [
        f"Another request's step after a prompt's KV export, SmolLM2-135M cache shape, bfloat16, median of {a.reps} "
        f"A/B/A/B rounds ({platform.machine()}, {torch.__version__}, {torch.get_num_threads()} torch thread):",
        "",
        "| prompt tokens | KV MiB | step alone ms | copy on the engine thread, then the step | pin, step beside "
        "the copy | ratio | the step's wait, before / now ms |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += wait_rows(rows, "now")
    publish(lines, RESULTS.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
