"""KV staging on the engine thread: what a disaggregated request's KV costs the prefill worker to export and the
decode worker to import, around the transfer itself.

    python -m bench.kv_stage_bench [--reps 5] [--tokens 2048,8192,32768]

The SmolLM2-135M cache shape (30 layers, 3 KV heads, head dim 64, 16-token blocks) in bfloat16, blocks scattered
over a pool twice the prompt's size. Export: copy the prompt's blocks out of the pool (`read_blocks`) and stage
them as host bytes for the byte transports. Shm segment: the producer's publication of those bytes in
/dev/shm (what a same-node pull reads; on the prefill worker's event loop until 2026-12-06, now on its
publishing thread, `bench/kv_publish_bench.py`). Import: the pulled bytes (a
writable buffer, as a pull lands in) written into the decode pool's blocks. Each measured two ways in the same
run, A/B/A/B, median of `reps`:

- before: as it was until 2026-12-06 — `read_blocks` selected on the cache's layout and then made the result
  contiguous (two copies), `.cpu().view(uint8).numpy().tobytes()` staged it (a third), and the import copied the
  pulled bytes into a `bytearray` before `torch.frombuffer` (another);
  The segment was filled through a fresh mapping (a page fault per 4 KiB).
- now: `read_blocks` gathers from the block-major view (one copy), `engine.staged_bytes` is a view onto it, the
  segment is filled by write(2) (`kvtransfer.shm.Segment`, where tmpfs gives huge pages without being asked
  or not at all), and `torch.frombuffer` reads the pulled buffer in place.

Both run on the engine's thread in a worker, so every millisecond here is one no other request on that worker
steps in. Writes a markdown table to stdout and bench/results/kv_stage.md. Benchmarks never run in tests.
"""

from __future__ import annotations

import argparse
import mmap
import os
import platform
import statistics
import uuid
from pathlib import Path

import torch

from bench.kv_cache_fixture import BLOCK, HEAD_DIM, KV_HEADS, LAYERS, smollm2_cache, timed
from bench.report import publish
from services.engine.engine import staged_bytes
from services.engine.model import PagedKvCache
from services.kvtransfer import shm

RESULTS = Path(__file__).resolve().parent / "results" / "kv_stage.md"


def export_before(kv: PagedKvCache, ids: torch.Tensor) -> bytes:
    blocks = (
        kv.data.index_select(3, ids).permute(3, 0, 1, 2, 4, 5).contiguous()
    )  # read_blocks until 2026-12-06
    return blocks.cpu().view(torch.uint8).numpy().tobytes()


def export_now(kv: PagedKvCache, ids: torch.Tensor) -> memoryview:
    return staged_bytes(kv.read_blocks(ids))


def _write(kv: PagedKvCache, ids: torch.Tensor, buf: bytearray | memoryview) -> None:
    shape = (len(ids), LAYERS, 2, KV_HEADS, BLOCK, HEAD_DIM)
    kv.write_blocks(ids, torch.frombuffer(buf, dtype=torch.uint8).view(kv.dtype).view(shape))


def import_before(kv: PagedKvCache, ids: torch.Tensor, data: memoryview) -> None:
    _write(kv, ids, bytearray(data))


def import_now(kv: PagedKvCache, ids: torch.Tensor, data: memoryview) -> None:
    _write(kv, ids, data)


def segment_before(payload: memoryview) -> None:
    """The shm segment as it was written until 2026-12-06: through a fresh mapping, a page fault per 4 KiB."""
    path = f"/dev/shm/{shm.PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, len(payload))
    m = mmap.mmap(fd, len(payload))
    os.close(fd)
    m[:] = payload
    m.close()
    os.unlink(path)


def segment_now(payload: memoryview) -> None:
    seg = shm.Segment("/dev/shm", f"{shm.PREFIX}{os.getpid()}-{uuid.uuid4().hex}", payload)
    seg.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", default="2048,8192,32768")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)  # a worker's engine runs one torch thread per core it was given; one here
    rows = []
    gen = torch.Generator().manual_seed(0)
    for tokens in (int(t) for t in a.tokens.split(",")):
        n = tokens // BLOCK
        src, dst = smollm2_cache(2 * n, gen), smollm2_cache(2 * n)
        ids = torch.randperm(2 * n, generator=gen)[:n]  # scattered, as a pool's blocks are
        into = torch.randperm(2 * n, generator=gen)[:n]
        pulled = memoryview(bytearray(export_before(src, ids)))  # what a pull hands the decode worker
        assert bytes(export_now(src, ids)) == bytes(pulled)
        keys = ("exp_before", "exp_now", "seg_before", "seg_now", "imp_before", "imp_now")
        times: dict[str, list[float]] = {k: [] for k in keys}
        for _ in range(a.reps):  # A/B/A/B: both see the same machine load
            times["exp_before"].append(timed(export_before, src, ids))
            times["exp_now"].append(timed(export_now, src, ids))
            times["seg_before"].append(timed(segment_before, pulled))
            times["seg_now"].append(timed(segment_now, pulled))
            times["imp_before"].append(timed(import_before, dst, into, pulled))
            times["imp_now"].append(timed(import_now, dst, into, pulled))
        assert torch.equal(dst.read_blocks(into), src.read_blocks(ids))  # the import put the bytes in place
        med = {k: statistics.median(v) * 1000 for k, v in times.items()}
        rows.append((tokens, len(pulled) / 2**20, med))
    lines = [
        f"KV staging on the engine thread, SmolLM2-135M cache shape, bfloat16, one torch thread, median of {a.reps} "
        f"A/B/A/B rounds ({platform.machine()}, {torch.__version__}):",
        "",
        "| prompt tokens | KV MiB | export before ms | now | ratio | shm segment before ms | now | ratio | "
        "import before ms | now | ratio | all three, ms saved |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for tokens, mib, m in rows:
        saved = sum(m[f"{k}_before"] - m[f"{k}_now"] for k in ("exp", "seg", "imp"))
        cells = [f"{tokens:,}", f"{mib:.0f}"]
        for k in ("exp", "seg", "imp"):
            before, now = m[f"{k}_before"], m[f"{k}_now"]
            cells += [f"{before:.1f}", f"{now:.1f}", f"x{now / before:.2f}"]
        lines.append("| " + " | ".join([*cells, f"{saved:.1f}"]) + " |")
    publish(lines, RESULTS.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
