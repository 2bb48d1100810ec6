"""KV tier 2 on a real `rackserve up` cluster: multi-turn chat whose sessions do not fit the worker's pool.

    python -m bench.kv_tier_cluster_bench [--rounds 2] [--sessions 8] [--turns 4] [--kv-cache-bytes 36864000]

Each round starts a fresh `rackserve up` (one decode worker in --mode agg, SmolLM2-135M in bf16, a primary KV
pool of --kv-cache-bytes) twice: tier 2 off, then tier 2 on (--kv-tier2-bytes, bf16 codec), A/B/A/B … so both
see the same machine load over the run. The workload is loadgen's `text` sessions: every session opens with the
same system prompt and each turn repeats the conversation so far, sessions interleaved turn by turn (a closed
loop of --concurrency), so by the time a session comes back its earlier turns have been pushed out of the pool by
the other sessions. Measured at the client (loadgen): TTFT p50/p90 and the prefix hit rate from the frontend's
`usage.prompt_tokens_details.cached_tokens` (a pool hit and a tier-2 restore both count as cached). Reported
per round and as on/off ratios of the pooled samples. Writes bench/results/kv_tier_cluster.md.
Benchmarks never run in tests.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import time

from loadgen import report as rep
from loadgen.client import LoadGenerator, RunConfig
from loadgen.local import rackserve_up
from loadgen.workload import Lengths, RequestSpec, text_sessions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results", "kv_tier_cluster.md")
MODEL = "SmolLM2-135M-Instruct"


def workload(a: argparse.Namespace) -> list[RequestSpec]:
    return text_sessions(
        a.sessions,
        a.turns,
        Lengths.parse(f"uniform:{a.user_tokens // 2}:{a.user_tokens}"),
        Lengths.parse(f"fixed:{a.output_tokens}"),
        seed=a.seed,
        system_prompt_tokens=a.system_prompt_tokens,
    )


def one_round(a: argparse.Namespace, specs: list[RequestSpec], tier2: bool, log_path: str) -> dict:
    flags = [
        "--prefill",
        "0",
        "--decode",
        "1",
        "--mode",
        "agg",
        "--dtype",
        a.dtype,
        "--kv-cache-bytes",
        str(a.kv_cache_bytes),
    ]
    if tier2:
        flags += ["--kv-tier2-bytes", str(a.kv_tier2_bytes), "--kv-tier2-codec", "bf16"]
    with rackserve_up(*flags, log_path=log_path) as url:
        run = RunConfig(
            url=url, model=MODEL, mode="closed", concurrency=a.concurrency, request_timeout_s=600.0
        )
        results, _ = asyncio.run(LoadGenerator(run).run(specs))
    ok = [r for r in results if r.ok]
    if len(ok) != len(results):
        bad = [r for r in results if not r.ok]
        raise RuntimeError(f"{len(bad)} requests failed, e.g. {bad[0].status} {bad[0].error}")
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    later = [r.ttft_s for r in ok if r.ttft_s is not None and not r.request_id.endswith("-0")]
    cached = sum(r.cached_tokens or 0 for r in ok)
    prompt = sum(r.input_tokens for r in ok)
    return {
        "tier2": tier2,
        "n": len(ok),
        "ttft": ttfts,
        "ttft_later": later,
        "cached": cached,
        "prompt": prompt,
        "flags": flags,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2, help="A/B pairs (tier off, tier on)")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-prompt-tokens", type=int, default=200)
    p.add_argument("--user-tokens", type=int, default=120, help="a user turn: uniform between half and this")
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument(
        "--kv-cache-bytes", type=int, default=100 * 368_640, help="primary pool (100 bf16 blocks of SmolLM2)"
    )
    p.add_argument("--kv-tier2-bytes", type=int, default=512 << 20)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", default=RESULTS)
    a = p.parse_args()
    specs = workload(a)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    logs = os.path.join(os.path.dirname(a.out), "kv_tier_cluster_logs")
    os.makedirs(logs, exist_ok=True)
    rounds: list[dict] = []
    t0 = time.monotonic()
    for i in range(a.rounds):
        for tier2 in (False, True):
            name = f"r{i}_{'on' if tier2 else 'off'}"
            r = one_round(a, specs, tier2, os.path.join(logs, f"{name}.log"))
            rounds.append(r)
            print(
                f"{name}: TTFT p50 {rep.percentile(r['ttft'], 50) * 1000:.0f} ms p90 "
                f"{rep.percentile(r['ttft'], 90) * 1000:.0f} ms, hit rate {r['cached'] / r['prompt']:.1%}",
                flush=True,
            )
    wall = time.monotonic() - t0
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    lines = [
        "| round | tier 2 | requests | TTFT p50 (ms) | TTFT p90 (ms) | later turns TTFT p50 (ms) | prefix hit rate |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rounds):
        lines.append(
            f"| {i // 2} | {'on' if r['tier2'] else 'off'} | {r['n']} | {rep.percentile(r['ttft'], 50) * 1000:.0f} | "
            f"{rep.percentile(r['ttft'], 90) * 1000:.0f} | {rep.percentile(r['ttft_later'], 50) * 1000:.0f} | "
            f"{r['cached'] / r['prompt']:.1%} |"
        )

    def pooled(tier2: bool, key: str) -> list[float]:
        return [x for r in rounds if r["tier2"] == tier2 for x in r[key]]

    def hit(tier2: bool) -> float:
        rs = [r for r in rounds if r["tier2"] == tier2]
        return sum(r["cached"] for r in rs) / sum(r["prompt"] for r in rs)

    ratio = {
        q: rep.percentile(pooled(True, "ttft"), q) / rep.percentile(pooled(False, "ttft"), q)
        for q in (50, 90)
    }
    later = rep.percentile(pooled(True, "ttft_later"), 50) / rep.percentile(pooled(False, "ttft_later"), 50)
    lines += [
        "",
        "| pooled over rounds | TTFT p50 on/off | TTFT p90 on/off | later turns TTFT p50 on/off | "
        "prefix hit rate off → on |",
        "|---|---|---|---|---|",
        f"| {a.rounds} × (off, on) | **{ratio[50]:.2f}** | **{ratio[90]:.2f}** | **{later:.2f}** | "
        f"{hit(False):.1%} → {hit(True):.1%} |",
    ]
    cmd = "python -m bench.kv_tier_cluster_bench " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k != "out"
    )
    header = [
        "# KV tier 2 on a real cluster",
        "",
        f"`{cmd}` at commit `{commit}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, wall {wall:.0f} s.",
        f"Cluster flags: `rackserve up {' '.join(rounds[0]['flags'])}` (+ `--kv-tier2-bytes "
        f"{a.kv_tier2_bytes} --kv-tier2-codec bf16` when on). Workload: {len(specs)} chat requests, "
        f"{a.sessions} sessions × {a.turns} turns, closed loop of {a.concurrency}.",
        "",
    ]
    text = "\n".join(header + lines) + "\n"
    with open(a.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
