"""The prefill worker's event loop while a request's KV is published: how long it stops serving anything else.

    python -m bench.kv_publish_bench [--reps 5] [--tokens 2048,8192,32768] [--compress none,fp8]

A prefill worker publishes every disaggregated request's KV on its KvSource (services/kvtransfer/source.py): the
optional wire encoding (`--kv-compress`), the copy into a shm segment, the checksum and the NIXL registration.
Until 2026-12-06 all of it ran on the worker's asyncio loop, which also answers the worker's gRPC calls (other
requests' Prefill replies, ExportPrefix, health) and serves KV pulls over TCP: every other request on the worker
waited that long. Now `KvSource.publish` does that work on a publishing thread. Both ways in the same run, A/B/A/B,
median of `reps`, on one source with the default backends (tcp, shm, and NIXL where it loads):

- before: the wire encoding as it was (its copies by `bytearray(...)`, `tobytes()` and `bytes.join`, which hold
  the GIL) and the rest of the preparation (`KvSource._prepare`), all called on the loop, as publish did;
- now: `await KvSource.publish(...)` (the codec's copies by torch, services/engine/host_bytes.py).

For each: the publish's own time, and the loop's longest stall while it ran (a task that asks to wake every
millisecond records the longest gap between its wake-ups; ~1 ms means the loop never stopped). With an encoding,
the same for the decode worker's side: decoding the pulled payload, before on its loop (where every stream on
the worker waits), now `asyncio.to_thread(codec.decode, ...)` as `KvSink.pull` does. KV of the
SmolLM2-135M cache shape in bfloat16 (30 layers x 2 x 3 KV heads x 64 x 2 bytes = 23,040 bytes per token).
Writes a markdown table to stdout and bench/results/kv_publish.md. Benchmarks never run in tests.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import time
from collections.abc import Awaitable
from pathlib import Path

import numpy as np
import torch

from services.engine.kv_codec import fp8_decode, fp8_encode
from services.engine.nvfp4 import kv as nvkv
from services.kvtransfer import KvSource, TransferConfig, codec

RESULTS = Path(__file__).resolve().parent / "results" / "kv_publish.md"
BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 2  # SmolLM2-135M's KV in bf16
TICK_S = 0.001


async def _longest_gap(stop: asyncio.Event) -> float:
    loop = asyncio.get_running_loop()
    last = loop.time()
    worst = 0.0
    while not stop.is_set():
        await asyncio.sleep(TICK_S)
        now = loop.time()
        worst, last = max(worst, now - last), now
    return worst


def encode_before(payload: bytes, method: str) -> bytes:
    """codec.encode until 2026-12-06 (bf16 KV, head_dim 64)."""
    kv = torch.frombuffer(bytearray(payload), dtype=torch.bfloat16).view(-1, 64)
    if method == "fp8":
        scale, q = fp8_encode(kv)
        head = codec._FP8.pack(b"F8KV", 1, codec._CODES["bf16"], 0, kv.shape[0], 64)
        return b"".join((head, scale.numpy().tobytes(), q.view(torch.uint8).numpy().tobytes()))
    q = nvkv.quantize(kv)
    head = nvkv._HEADER.pack(nvkv.MAGIC, nvkv.VERSION, 1, 2) + np.array(kv.shape, "<i8").tobytes()
    g = np.array([float(q.global_scale)], "<f4").tobytes()
    return b"".join((head, g, q.scales.numpy().tobytes(), q.packed.numpy().tobytes()))


def decode_before(wire: memoryview, method: str) -> bytearray:
    """codec.decode until 2026-12-06: the payload copied into a bytearray, the result copied out of torch."""
    if method == "fp8":
        rows = (len(wire) - codec._FP8.size) // 68
        raw = torch.frombuffer(bytearray(wire[codec._FP8.size :]), dtype=torch.uint8)
        t = fp8_decode(
            raw[: rows * 4].view(torch.float32),
            raw[rows * 4 :].view(torch.float8_e4m3fn).view(rows, 64),
            torch.bfloat16,
        )
    else:
        t = nvkv.dequantize_kv_from_wire(bytearray(wire))
    return bytearray(t.contiguous().view(torch.uint8).numpy())


async def _publish_before(source: KvSource, key: str, payload: bytes, compress: str | None) -> None:
    # publish until 2026-12-06: the same work, on the loop
    if compress is not None:
        payload = encode_before(payload, compress)
    pub, _ = source._prepare(key, payload, None, "bf16", 64, None)
    source._pubs[key] = pub


async def _publish_now(source: KvSource, key: str, payload: bytes, compress: str | None) -> None:
    await source.publish(key, payload, 60.0, compress=compress, kv_dtype="bf16", head_dim=64)


async def _decode_before(wire: memoryview, method: str) -> None:
    decode_before(wire, method)


async def _decode_now(wire: memoryview, method: str) -> None:
    await asyncio.to_thread(codec.decode, wire, method)


async def watched(work: Awaitable[None]) -> tuple[float, float]:
    """(seconds the work took, the loop's longest stall in seconds while it ran)."""
    stop = asyncio.Event()
    ticker = asyncio.create_task(_longest_gap(stop))
    await asyncio.sleep(0.01)  # the ticker is running
    t0 = time.perf_counter()
    await work
    took = time.perf_counter() - t0
    stop.set()
    return took, await ticker


async def one(
    source: KvSource, how: str, key: str, payload: bytes, compress: str | None
) -> tuple[float, float]:
    """(publish seconds, the loop's longest stall in seconds) for one publish."""
    publish = _publish_before if how == "before" else _publish_now
    got = await watched(publish(source, key, payload, compress))
    source.retract(key)
    return got


async def run(tokens: list[int], compress: list[str | None], reps: int) -> list[dict[str, object]]:
    source = await KvSource.start(TransferConfig(host="127.0.0.1", port=0))
    rows = []
    try:
        for n in tokens:
            # bf16-like values: random bytes would be NaNs and infinities to the fp8 encoder
            values = np.random.default_rng(n).standard_normal(n * BYTES_PER_TOKEN // 2, dtype=np.float32)
            payload = (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
            for c in compress:
                times: dict[str, list[tuple[float, float]]] = {
                    "before": [],
                    "now": [],
                    "decode_before": [],
                    "decode_now": [],
                }
                await one(source, "now", "warm", payload, c)  # codec kernels, first segment
                for r in range(reps):
                    for how in ("before", "now"):
                        times[how].append(await one(source, how, f"{how}-{n}-{c}-{r}", payload, c))
                if c is not None:
                    wire = codec.encode(payload, c, "bf16", 64)
                    for _ in range(reps):
                        times["decode_before"].append(await watched(_decode_before(wire, c)))
                        times["decode_now"].append(await watched(_decode_now(wire, c)))
                row: dict[str, object] = {"tokens": n, "mib": len(payload) / 2**20, "compress": c or "none"}
                for how, got in times.items():
                    if got:
                        row[f"{how}_s"] = statistics.median(t for t, _ in got)
                        row[f"{how}_gap_s"] = statistics.median(g for _, g in got)
                rows.append(row)
                print(_line(row), flush=True)
    finally:
        await source.close()
    return rows


def _line(r: dict[str, object]) -> str:
    def ms(k: str) -> str:
        v = r.get(k)
        if v is None:
            return "-"
        assert isinstance(v, float)
        return f"{v * 1e3:,.0f} ms" if v >= 0.01 else f"{v * 1e3:.1f} ms"

    return (
        f"| {r['tokens']:,} | {r['mib']:.0f} MiB | {r['compress']} | {ms('before_s')} / {ms('before_gap_s')} "
        f"| {ms('now_s')} / {ms('now_gap_s')} | {ms('decode_before_s')} / {ms('decode_before_gap_s')} "
        f"| {ms('decode_now_s')} / {ms('decode_now_gap_s')} |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", default="2048,8192,32768")
    ap.add_argument("--compress", default="none,fp8", help="comma list of none|fp8|nvfp4")
    a = ap.parse_args(argv)
    tokens = [int(t) for t in a.tokens.split(",")]
    compress = [None if c == "none" else c for c in a.compress.split(",")]
    head = [
        f"KV publication on the prefill worker's loop ({platform.machine()}, {os.cpu_count()} CPUs), median of "
        f"{a.reps}, A/B/A/B in one run: `python -m bench.kv_publish_bench --reps {a.reps}`",
        "",
        "| prompt tokens | KV | wire encoding | publish before: took / loop's longest stall | publish now "
        "| decode on pull, before | decode now |",
        "|---|---|---|---|---|---|---|",
    ]
    print("\n".join(head), flush=True)
    rows = asyncio.run(run(tokens, compress, a.reps))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text("\n".join([*head, *(_line(r) for r in rows)]) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
