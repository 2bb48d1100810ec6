"""KV tier 2 on SmolLM2-135M: what a restored prefix costs in quality per codec, how many blocks a GiB holds, and
how long a restore takes next to recomputing the same prefix — each configuration side by side in one run.

    python -m bench.kv_tier_bench [--prefix 512] [--cont 64] [--windows 4] [--trials 5] [--dtype bfloat16]

Writes a markdown report to stdout and bench/results/kv_tier[.<dtype>].md. This benchmark never asserts.

- Text: /usr/share/common-licenses/GPL-3 (as bench/nvfp4_quality_bench.py), N windows of prefix + continuation
  tokens. One engine per configuration, each with a primary pool of 2 requests' worth of blocks:
  recompute   tier off; the prefix was computed, then pushed out of the pool by a filler prompt: recomputed
  pool hit    tier off; the prefix still in the pool (today's prefix-cache hit, the path reference)
  bf16|fp8|nvfp4  tier 2 on with that codec; the prefix computed, pushed out to tier 2 by the filler, restored
  disk        tier 2 off, the local-disk tier on (bf16, lossless): pushed out of the pool to files in a fresh
              directory (--disk-dir, default the system's temporary directory), read back and restored. In the
              time table twice: `disk` as the engine leaves it (files written a moment ago are in the page cache),
              and `disk, cold` with every block file flushed and dropped from the page cache first (fsync +
              posix_fadvise DONTNEED), so its read comes from the device
- Quality, per window: two requests on the prefix at once — one teacher-forced over the text's continuation
  (top-1 = the argmax at each forced position; NLL of the forced tokens -> perplexity), one greedy for `cont`
  tokens (EOS ignored). Agreement is against `recompute`: top-1 share of positions; greedy prefix (first
  difference / cont) and position-wise share. Perplexity ratio = ppl / ppl(recompute).
- Capacity: host bytes of one block per codec (what --kv-tier2-bytes counts), blocks and tokens per GiB.
- Time, A/B interleaved over trials (configuration order rotated each trial): after the prime + filler, the
  wall time to the first token of a request on the prefix (TTFT: recompute vs restore + the last partial block,
  including the offload of the blocks that request evicts), the tier's own restore seconds (decode + write; for
  the disk tier also the file reads and checksums), and the filler's step time (what offloading evicted blocks
  adds to the request that evicts them: for the disk tier, encoding and writing the files).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from services.engine.engine import EngineConfig, LLMEngine
from services.engine.kv_tier import HostKvTier
from services.engine.loader import LoadedModel, load_gguf
from services.engine.model_files import smollm2_gguf_path
from services.engine.nvfp4.calibration import EVALUATION_TEXT
from services.engine.sampling import SamplingParams

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BS = 16
CONFIGS = ("recompute", "pool hit", "bf16", "fp8", "nvfp4", "disk")
TIMED = ("recompute", "bf16", "fp8", "nvfp4", "disk", "disk, cold")


def build(model: LoadedModel, config: str, dtype: str, pool: int, disk_dir: str = "") -> LLMEngine:
    tier: dict[str, Any] = {}
    if config in ("bf16", "fp8", "nvfp4"):
        tier = {"kv_tier2_bytes": 256 << 20, "kv_tier2_codec": config}
    elif config == "disk":
        tier = {"kv_disk_path": disk_dir, "kv_disk_bytes": 256 << 20, "kv_tier2_codec": "bf16"}
    cfg = EngineConfig(dtype=dtype, block_size=BS, num_kv_blocks=pool, max_num_batched_tokens=2048, **tier)
    return LLMEngine(model, cfg)


def run_all(e: LLMEngine, reqs: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    for rid, (prompt, p) in reqs.items():
        e.add_request(rid, prompt, p)
    out: dict[str, list] = {rid: [] for rid in reqs}
    while e.has_unfinished():
        for o in e.step():
            out[o.request_id] += o.logprobs if o.logprobs else o.new_token_ids
    return out


_fillers = 0


def prepare(e: LLMEngine, config: str, prefix: list[int], filler: list[int]) -> float:
    """Prefix computed, then (except for `pool hit`) pushed out of the pool; returns the filler's wall time.
    Each filler starts with another token, so no filler is ever a cache hit itself."""
    global _fillers
    e.generate([prefix], SamplingParams(max_tokens=1, temperature=0))
    if config == "pool hit":
        return 0.0
    _fillers += 1
    t0 = time.perf_counter()
    e.generate([[_fillers % 1000 + 1000, *filler[1:]]], SamplingParams(max_tokens=1, temperature=0))
    return time.perf_counter() - t0


def quality(
    engines: dict[str, LLMEngine], windows: list[tuple[list[int], list[int]]], filler: list[int], cont: int
) -> dict[str, dict[str, float]]:
    res: dict[str, dict[str, list]] = {c: {"top1": [], "nll": [], "greedy": []} for c in CONFIGS}
    for w, (prefix, forced) in enumerate(windows):
        for c in CONFIGS:
            e = engines[c]
            prepare(e, c, prefix, filler)
            out = run_all(
                e,
                {
                    f"forced-{w}": (prefix, SamplingParams(max_tokens=len(forced), temperature=0, ignore_eos=True,
                                                           logprobs=1, forced_token_ids=tuple(forced))),
                    f"greedy-{w}": (prefix, SamplingParams(max_tokens=cont, temperature=0, ignore_eos=True)),
                },
            )  # fmt: skip
            sampled = out[f"forced-{w}"]
            res[c]["top1"].append([s.top_logprobs[0][0] for s in sampled])
            res[c]["nll"].append([-s.logprob for s in sampled])
            res[c]["greedy"].append(out[f"greedy-{w}"])
            if c in ("bf16", "fp8", "nvfp4", "disk"):
                tier = engines[c].disk if c == "disk" else engines[c].tier2
                assert tier is not None and tier.hits > 0, "the prefix was not restored"
    table: dict[str, dict[str, float]] = {}
    ref = res["recompute"]
    ref_ppl = math.exp(statistics.fmean(x for row in ref["nll"] for x in row))
    for c in CONFIGS:
        r = res[c]
        pairs = [
            (a, b) for ra, rb in zip(r["top1"], ref["top1"], strict=True) for a, b in zip(ra, rb, strict=True)
        ]
        gp, gs = [], []
        for ga, gb in zip(r["greedy"], ref["greedy"], strict=True):
            first = next((i for i, (a, b) in enumerate(zip(ga, gb, strict=True)) if a != b), len(gb))
            gp.append(first / len(gb))
            gs.append(sum(a == b for a, b in zip(ga, gb, strict=True)) / len(gb))
        ppl = math.exp(statistics.fmean(x for row in r["nll"] for x in row))
        table[c] = {
            "top1": sum(a == b for a, b in pairs) / len(pairs),
            "greedy_prefix": statistics.fmean(gp),
            "greedy_pos": statistics.fmean(gs),
            "ppl": ppl,
            "ppl_ratio": ppl / ref_ppl,
        }
    return table


def drop_page_cache(directory: Path) -> None:
    """Write every block file out and drop its pages, so the next read of it comes from the device."""
    for p in directory.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timing(
    engines: dict[str, LLMEngine], prefix: list[int], filler: list[int], trials: int
) -> dict[str, dict[str, float]]:
    configs = TIMED
    ttft: dict[str, list[float]] = {c: [] for c in configs}
    restore: dict[str, list[float]] = {c: [] for c in configs}
    fill: dict[str, list[float]] = {c: [] for c in configs}
    for t in range(trials):
        order = configs[t % len(configs) :] + configs[: t % len(configs)]
        for c in order:
            e = engines[c.removesuffix(", cold")]
            fill[c].append(prepare(e, c, prefix, filler))
            if c == "disk, cold":
                assert e.disk is not None
                drop_page_cache(e.disk.blocks_dir)
            tier = e.disk if e.disk is not None else e.tier2
            before = tier.restore_s if tier is not None else 0.0
            t0 = time.perf_counter()
            e.generate([prefix], SamplingParams(max_tokens=1, temperature=0))
            ttft[c].append(time.perf_counter() - t0)
            if tier is not None:
                restore[c].append(tier.restore_s - before)
    out = {}
    base = statistics.median(ttft["recompute"])
    for c in configs:
        med = statistics.median(ttft[c])
        out[c] = {
            "ttft_s": med,
            "ttft_ratio": med / base,
            "restore_s": statistics.median(restore[c]) if restore[c] else float("nan"),
            "filler_s": statistics.median(fill[c]),
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefix", type=int, default=512, help="prefix tokens (restored or recomputed)")
    ap.add_argument("--cont", type=int, default=64, help="continuation tokens (teacher-forced and greedy)")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument(
        "--disk-dir", default="", help="where the disk tier's directory goes (default: a temporary one)"
    )
    args = ap.parse_args()
    disk_dir = tempfile.mkdtemp(prefix="kv-disk-bench-", dir=args.disk_dir or None)

    model = load_gguf(smollm2_gguf_path())
    probe = build(model, "recompute", args.dtype, 4)
    assert probe.tokenizer is not None
    text = probe.tokenizer.encode(EVALUATION_TEXT.read_text())  # type: ignore[attr-defined]
    span = args.prefix + args.cont
    pool = 2 * -(-(span + 1) // BS) + 2
    filler = text[-(pool * BS - 1) :]  # needs the whole pool: everything cached before it is pushed out
    windows = [(text[w * span : w * span + args.prefix], text[w * span + args.prefix : (w + 1) * span])
               for w in range(args.windows)]  # fmt: skip
    assert args.windows * span + len(filler) <= len(text), "the text is too short for these windows"
    engines = {c: build(model, c, args.dtype, pool, disk_dir) for c in CONFIGS}
    fs = (
        subprocess.run(["df", "-T", disk_dir], capture_output=True, text=True).stdout.splitlines()[-1].split()
    )

    mc = model.config
    shape = (mc.num_layers, 2, mc.num_kv_heads, BS, mc.head_dim)
    kv_dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    sizes = {c: HostKvTier.encoded_block_bytes(c, shape, kv_dtype) for c in ("bf16", "fp8", "nvfp4")}

    q = quality(engines, windows, filler, args.cont)
    t = timing(engines, windows[0][0], filler, args.trials)

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    lines = [
        f"# KV tier 2 on SmolLM2-135M ({args.dtype})",
        "",
        f"`python -m bench.kv_tier_bench --prefix {args.prefix} --cont {args.cont} --windows {args.windows} "
        f"--trials {args.trials} --dtype {args.dtype}` at commit {commit}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} CPU threads, {platform.machine()}, {os.cpu_count()} CPUs; disk tier on "
        f"{fs[0]} ({fs[1]}).",
        "",
        f"## Quality: {args.windows} windows of {args.prefix} prefix + {args.cont} continuation tokens, vs recompute",
        "",
        "| prefix served by | top-1 agreement (teacher-forced) | greedy prefix agreement | greedy position-wise "
        "| perplexity | ppl ratio |",
        "|---|---|---|---|---|---|",
    ]
    for c in CONFIGS:
        r = q[c]
        lines.append(
            f"| {c} | {r['top1']:.4f} | {r['greedy_prefix']:.3f} | {r['greedy_pos']:.3f} | {r['ppl']:.3f} "
            f"| {r['ppl_ratio']:.4f} |"
        )
    lines += ["", "## Capacity (bytes of one block as tier 2 counts them)", ""]
    lines += ["| codec | bytes/block | blocks per GiB | tokens per GiB | vs bf16 |", "|---|---|---|---|---|"]
    for c, size in sizes.items():
        per_gib = (1 << 30) // size
        lines.append(f"| {c} | {size} | {per_gib} | {per_gib * BS} | {sizes['bf16'] / size:.2f}x |")
    lines += [
        "",
        f"## Time: a {args.prefix}-token prefix, median of {args.trials} interleaved trials",
        "",
        "| prefix served by | TTFT (s) | TTFT / recompute | restore itself (s) | filler step (s, offload "
        "included) |",
        "|---|---|---|---|---|",
    ]
    for c, r in t.items():
        restore = "—" if math.isnan(r["restore_s"]) else f"{r['restore_s']:.4f}"
        lines.append(f"| {c} | {r['ttft_s']:.4f} | {r['ttft_ratio']:.3f} | {restore} | {r['filler_s']:.4f} |")
    shutil.rmtree(disk_dir, ignore_errors=True)
    report = "\n".join(lines) + "\n"
    print(report)
    RESULTS_DIR.mkdir(exist_ok=True)
    suffix = "" if args.dtype == "bfloat16" else f".{args.dtype}"
    (RESULTS_DIR / f"kv_tier{suffix}.md").write_text(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
