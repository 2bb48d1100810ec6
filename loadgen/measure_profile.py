"""Measure the simulator's CPU profile on this machine's real cluster (`rackserve up`, SmolLM2-135M).

  python -m loadgen.measure_profile [--out loadgen/profiles/cpu_smollm2.json]

One cluster, router in `auto` mode: prompts shorter than the threshold are prefilled by the decode worker
(aggregated), longer ones by the prefill worker and shipped. Through the HTTP API only:
  prefill   TTFT of single requests at several prompt lengths (agg) → overhead + tokens/s (least squares)
  decode    median inter-token gap at batch 1..16 with short prompts, and at batch 8 with long ones
            → base + per-sequence + per-context-token step time
  transfer  first gap after the first token of a disaggregated request (prefill → decode hand-off) minus a
            normal decode gap, over the prompt's KV bytes → GB/s (one host: every link class gets this value)
Both workers share this machine's cores with anything else running, so the profile records when it was taken and
the load average then; measure on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

import numpy as np

from loadgen.client import LoadGenerator, RunConfig
from loadgen.local import rackserve_up
from loadgen.sim.profile import PROFILE_DIR
from loadgen.workload import Lengths, synthetic
from services.router.cost_model import SAME_NODE, SAME_RACK, SAME_ZONE

MODEL = "SmolLM2-135M-Instruct"
# SmolLM2-135M: 30 layers, 3 KV heads of 64; bf16 K and V → 30*3*64*2*2 bytes per token
KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 2
KV_CACHE_BYTES = 256 << 20  # `rackserve up`'s default per worker
BLOCK_SIZE = 16
DISAGG_MIN = 900


def _run(url: str, specs, concurrency: int):  # noqa: ANN001, ANN202
    cfg = RunConfig(url=url, model=MODEL, concurrency=concurrency, progress=False, fetch_timeline=False)
    results, _ = asyncio.run(LoadGenerator(cfg).run(specs))
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"measurement requests failed: {bad[:3]}")
    return results


def measure(url: str, seed: int) -> dict:
    out: dict = {"prefill_points": [], "decode_points": [], "transfer_points": []}
    _run(url, synthetic(2, Lengths(64, 64), Lengths(4, 4), seed + 99), 1)  # warm up
    # prefill: one request at a time, unique prompts (no cache hits), 2 output tokens
    for n in (32, 128, 256, 512, 768):
        rs = _run(url, synthetic(3, Lengths(n, n), Lengths(2, 2), seed + n), 1)
        out["prefill_points"].append([n, statistics.median(r.ttft_s for r in rs)])
    xs = np.array([p[0] for p in out["prefill_points"]], float)
    ys = np.array([p[1] for p in out["prefill_points"]], float)
    slope, intercept = np.polyfit(xs, ys, 1)
    # decode: b concurrent requests, 24 tokens each; the median gap is one step at batch ~b
    for b in (1, 2, 4, 8, 16):
        rs = _run(url, synthetic(b, Lengths(32, 32), Lengths(24, 24), seed + 1000 + b), b)
        out["decode_points"].append([b, 32, statistics.median(g for r in rs for g in r.itl_s)])
    bs = np.array([p[0] for p in out["decode_points"]], float)
    gaps = np.array([p[2] for p in out["decode_points"]], float)
    per_seq, base = np.polyfit(bs, gaps, 1)
    rs = _run(url, synthetic(8, Lengths(768, 768), Lengths(24, 24), seed + 2000), 8)
    long_gap = statistics.median(g for r in rs for g in r.itl_s)
    out["decode_points"].append([8, 768, long_gap])
    short_gap8 = base + 8 * per_seq
    per_ctx = max(0.0, (long_gap - short_gap8) / (8 * (768 - 32)))
    # transfer: long prompts go to the prefill worker; the first gap holds the hand-off
    n = 1536
    rs = _run(url, synthetic(3, Lengths(n, n), Lengths(6, 6), seed + 3000), 1)
    handoff = statistics.median(r.itl_s[0] for r in rs)
    steady = statistics.median(g for r in rs for g in r.itl_s[1:])
    transfer_s = max(1e-4, handoff - steady)
    gbps = n * KV_BYTES_PER_TOKEN / transfer_s / 1e9
    out["transfer_points"].append([n, handoff, steady])
    out["fit"] = {
        "prefill_tokens_per_s": 1.0 / slope if slope > 0 else float("inf"),
        "prefill_overhead_s": max(0.0, intercept),
        "decode_base_s": max(0.0, base),
        "decode_per_seq_s": max(0.0, per_seq),
        "decode_per_ctx_token_s": per_ctx,
        "transfer_gbps": gbps,
        "transfer_handoff_s": handoff,
    }
    return out


def profile_from(m: dict, when: str) -> dict:
    f = m["fit"]
    link = {"gbps": round(f["transfer_gbps"], 4), "latency_s": 0.0}
    return {
        "name": "cpu_smollm2",
        "source": (
            f"measured on this machine's real cluster ({when}; `rackserve up`, 1 prefill + 1 decode worker, "
            f"bf16, 1 torch thread each) by loadgen/measure_profile.py; load average {os.getloadavg()[0]:.1f} "
            "when it finished"
        ),
        "model": "SmolLM2-135M-Instruct (30 layers, 3 KV heads x 64, bf16 KV 22.5 KiB/token)",
        "block_size": BLOCK_SIZE,
        "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
        "kv_capacity_blocks": KV_CACHE_BYTES // (KV_BYTES_PER_TOKEN * BLOCK_SIZE),
        "prefill_tokens_per_s": round(f["prefill_tokens_per_s"], 1),
        "prefill_overhead_s": round(f["prefill_overhead_s"], 5),
        "attn_s_per_token_pair": 0.0,
        "max_prefill_chunk_tokens": 512,
        "decode_base_s": round(f["decode_base_s"], 5),
        "decode_per_seq_s": round(f["decode_per_seq_s"], 6),
        "decode_per_ctx_token_s": f["decode_per_ctx_token_s"],
        "max_batch": 64,
        "links": {SAME_NODE: link, SAME_RACK: link, SAME_ZONE: link},
        "workers_per_node": 64,
        "nodes_per_rack": 1,
        "notes": "one host: all link classes carry the measured same-host hand-off rate (KV bytes over the "
        "extra first-gap time of a disaggregated request, which includes the RPC hop, not only the copy)",
        "_measurements": m,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=f"{PROFILE_DIR}/cpu_smollm2.json")
    p.add_argument("--seed", type=int, default=11)
    a = p.parse_args()
    flags = (
        "--prefill",
        "1",
        "--decode",
        "1",
        "--mode",
        "auto",
        "--disagg-min-prompt-tokens",
        str(DISAGG_MIN),
    )
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with rackserve_up(*flags) as url:
        m = measure(url, a.seed)
    prof = profile_from(m, when)
    with open(a.out, "w") as f:
        json.dump(prof, f, indent=1)
    print(json.dumps(m["fit"], indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
