"""Restoring a prefix from KV tier 2 beside the step vs before it, on SmolLM2-135M: what the sequences already
decoding see while a long prefix comes back, and what the restoring request's TTFT pays — A/B in one run.

    python -m bench.kv_restore_overlap_bench [--prefix 1024] [--decoders 8] [--trials 3] [--codec fp8] [--dtype D]

Writes a markdown report to stdout and bench/results/kv_restore_overlap.md (`_float32.md` for that dtype).
This benchmark never asserts.

One engine per mode (`--kv-async-restore` on: the restore is written on the restore thread while the step runs
the others, and the request runs from the next step; off: it is written before the step), both with the worker's
default of one torch thread, a `dtype` cache (bf16 by default), a tier 2 in `codec`. Each trial, per mode (order
alternated): a fresh prefix is computed and pushed out to tier 2 by a filler prompt; `decoders` short prompts are
started and stepped until each has its first token; then the request on the prefix arrives (prefix + 16 new
tokens, one output token) and the engine steps until it has its first token. Reported, median over trials:
  gap max    the longest step the decoding sequences waited through in that window (their worst inter-token gap)
  gap mean   their mean inter-token gap in the window
  TTFT       the restoring request's time from arrival to its first token
  restore    the tier's own restore seconds (decode + write)
  alone      one step of the decoders with nothing arriving (the floor for a gap)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from services.engine.engine import EngineConfig, LLMEngine
from services.engine.loader import LoadedModel, load_gguf
from services.engine.model_files import smollm2_gguf_path
from services.engine.nvfp4.calibration import EVALUATION_TEXT
from services.engine.sampling import SamplingParams

BS = 16
MODES = ("async", "sync")


def build(model: LoadedModel, mode: str, codec: str, pool: int, dtype: str) -> LLMEngine:
    cfg = EngineConfig(
        dtype=dtype, block_size=BS, num_kv_blocks=pool, max_num_batched_tokens=4096, num_threads=1,
        kv_tier2_bytes=1 << 30, kv_tier2_codec=codec, kv_async_restore=mode == "async",
    )  # fmt: skip
    return LLMEngine(model, cfg)


def trial(
    e: LLMEngine, prefix: list[int], filler: list[int], decoders: list[list[int]], tail: list[int]
) -> dict:
    one = SamplingParams(max_tokens=1, temperature=0)
    e.generate([prefix], one)
    e.generate([filler], one)  # the whole pool: the prefix goes to tier 2
    assert e.tier2 is not None
    restore_s0 = e.tier2.restore_s
    long = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
    ids = [f"d{i}-{time.monotonic_ns()}" for i in range(len(decoders))]
    for rid, p in zip(ids, decoders, strict=True):
        e.add_request(rid, p, long)
    started: set[str] = set()
    while len(started) < len(ids):
        started |= {o.request_id for o in e.step()}
    t0 = time.perf_counter()
    e.step()
    alone = time.perf_counter() - t0
    rid = f"r-{time.monotonic_ns()}"
    arrived = time.perf_counter()
    e.add_request(rid, prefix + tail, one)
    gaps: list[float] = []
    first = 0.0
    while not first:
        t0 = time.perf_counter()
        outs = e.step()
        now = time.perf_counter()
        gaps.append(now - t0)
        if any(o.request_id == rid for o in outs):
            first = now - arrived
    for d in ids:
        e.abort(d)
    return {
        "gap max": max(gaps), "gap mean": statistics.fmean(gaps), "TTFT": first,
        "restore": e.tier2.restore_s - restore_s0, "alone": alone,
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefix", type=int, default=1024, help="tokens of the prefix restored from tier 2")
    ap.add_argument("--decoders", type=int, default=8, help="sequences decoding when it arrives")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--codec", default="fp8", choices=("bf16", "fp8", "nvfp4"))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = ap.parse_args()

    model = load_gguf(smollm2_gguf_path())
    probe = build(model, "sync", args.codec, 4, args.dtype)
    assert probe.tokenizer is not None
    text = probe.tokenizer.encode(EVALUATION_TEXT.read_text())  # type: ignore[attr-defined]
    pool = -(-(args.prefix + 16 + 1) // BS) + args.decoders * 4 + 4  # the request + every decoder's blocks
    filler = text[-(pool * BS - 1) :]
    # a distinct first line per trial: every prefix has a hash chain of its own from block 0
    prefixes = [
        (probe.tokenizer.encode(f"Copy {t}.\n") + text)[: args.prefix] for t in range(2 * args.trials)
    ]  # type: ignore[attr-defined]
    assert args.prefix + len(filler) <= len(text), "the text is too short for this prefix"
    decoders = [text[i * 7 : i * 7 + 24] for i in range(args.decoders)]
    tail = text[-(pool * BS) - 16 : -(pool * BS)]
    engines = {m: build(model, m, args.codec, pool, args.dtype) for m in MODES}
    for m in MODES:  # warm-up
        trial(engines[m], prefixes[0][: 4 * BS], filler, decoders, tail)

    rows: dict[str, list[dict]] = {m: [] for m in MODES}
    k = 0
    for t in range(args.trials):
        for m in MODES if t % 2 == 0 else MODES[::-1]:
            rows[m].append(trial(engines[m], prefixes[k], filler, decoders, tail))
            k += 1
    med = {m: {c: statistics.median(r[c] for r in rows[m]) for c in rows[m][0]} for m in MODES}

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    cols = ("gap max", "gap mean", "TTFT", "restore", "alone")
    lines = [
        f"# Tier-2 restore beside the step vs before it (SmolLM2-135M, {args.dtype} cache)",
        "",
        f"`python -m bench.kv_restore_overlap_bench --prefix {args.prefix} --decoders {args.decoders} "
        f"--trials {args.trials} --codec {args.codec} --dtype {args.dtype}` at commit {commit}; "
        f"torch {torch.__version__}, one torch thread per engine, {platform.machine()}, {os.cpu_count()} CPUs. "
        f"Median of {args.trials} trials, modes alternated; milliseconds.",
        "",
        "| restore | " + " | ".join(cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for m in MODES:
        label = "beside the step (async)" if m == "async" else "before the step (sync)"
        lines.append(f"| {label} | " + " | ".join(f"{med[m][c] * 1e3:.1f}" for c in cols) + " |")
    lines.append(
        "| **async / sync** | " + " | ".join(f"{med['async'][c] / med['sync'][c]:.2f}x" for c in cols) + " |"
    )
    report = "\n".join(lines) + "\n"
    print(report)
    name = "kv_restore_overlap" + ("" if args.dtype == "bfloat16" else f"_{args.dtype}")
    out = Path(__file__).parent / "results" / f"{name}.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
