"""Prefix pulls between workers on a real `rackserve up` cluster: multi-turn chat over two prefill workers.

    python -m bench.peer_pull_cluster_bench [--rounds 2] [--arms off,on] [--sessions 8] [--turns 4]

Each round starts a fresh `rackserve up` (2 prefill + 1 decode workers, --mode disagg, SmolLM2-135M) per arm,
A/B/A/B … so every arm sees the same machine load over the run: `off` runs the router with `--no-peer-pull`
(every prefix not in the chosen prefill worker's own pool is recomputed), `on` with `--peer-pull` (the router may
plan a PrefixPull of the blocks another prefill worker holds). The workload is bench/kv_tier_cluster_bench.py's:
loadgen `text` sessions sharing a system prompt, each turn repeating the conversation so far, interleaved turn by
turn in a closed loop, so a session's next turn often lands on the other prefill worker than its last one.
Measured at the client (loadgen): TTFT p50/p90 and the prefix hit rate from the frontend's
`usage.prompt_tokens_details.cached_tokens` (a pull's tokens count as cached); pulled tokens per arm from the
frontend's `rackserve_pulled_prompt_tokens_total`. Reported per round and as on/off ratios of the pooled samples.
Writes bench/results/peer_pull_cluster.md. Benchmarks never run in tests.

A tree whose `rackserve up` has no `--peer-pull` flag (the router that plans pulls is not in it) can only run
`--arms off`, which then passes no peer-pull flag at all: that router never plans a pull.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.kv_tier_cluster_bench import MODEL, workload
from loadgen import report as rep
from loadgen.client import LoadGenerator, RunConfig
from loadgen.local import rackserve_up
from loadgen.workload import RequestSpec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results", "peer_pull_cluster.md")
ARMS = ("off", "on")


def up_knows_peer_pull() -> bool:
    """Whether this tree's `rackserve up` (its router) has the --peer-pull switch."""
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "up", "--help"], cwd=ROOT, capture_output=True, text=True
    ).stdout
    return "--peer-pull" in out


def pulled_tokens(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "rackserve_pulled_prompt_tokens_total"
    )


def one_round(a: argparse.Namespace, specs: list[RequestSpec], arm: str, flag: bool, log_path: str) -> dict:
    flags = ["--prefill", "2", "--decode", "1", "--mode", "disagg", "--dtype", a.dtype]
    flags += ["--kv-cache-bytes", str(a.kv_cache_bytes)]
    if flag:
        flags.append("--peer-pull" if arm == "on" else "--no-peer-pull")
    with rackserve_up(*flags, log_path=log_path) as url:
        run = RunConfig(
            url=url, model=MODEL, mode="closed", concurrency=a.concurrency, request_timeout_s=600.0
        )
        results, _ = asyncio.run(LoadGenerator(run).run(specs))
        pulled = pulled_tokens(url)
    ok = [r for r in results if r.ok]
    if len(ok) != len(results):
        bad = [r for r in results if not r.ok]
        raise RuntimeError(f"{len(bad)} requests failed, e.g. {bad[0].status} {bad[0].error}")
    return {
        "arm": arm,
        "n": len(ok),
        "ttft": [r.ttft_s for r in ok if r.ttft_s is not None],
        "cached": sum(r.cached_tokens or 0 for r in ok),
        "prompt": sum(r.input_tokens for r in ok),
        "pulled": pulled,
        "flags": flags,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--rounds", type=int, default=2, help="rounds of every arm, interleaved")
    p.add_argument("--arms", default="off,on", help="comma list of off,on")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-prompt-tokens", type=int, default=200)
    p.add_argument("--user-tokens", type=int, default=120, help="a user turn: uniform between half and this")
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument(
        "--kv-cache-bytes", type=int, default=200 * 368_640, help="pool per worker (200 bf16 SmolLM2 blocks)"
    )
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", default=RESULTS)
    a = p.parse_args()
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    if not arms or any(x not in ARMS for x in arms):
        p.error(f"--arms must be a comma list of {list(ARMS)}, got {a.arms!r}")
    flag = up_knows_peer_pull()
    if "on" in arms and not flag:
        p.error(
            "this tree's `rackserve up` has no --peer-pull (the router that plans prefix pulls is not in it): "
            "run --arms off, or merge that router first"
        )
    specs = workload(a)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    logs = os.path.join(os.path.dirname(a.out), "peer_pull_cluster_logs")
    os.makedirs(logs, exist_ok=True)
    rounds: list[dict] = []
    t0 = time.monotonic()
    for i in range(a.rounds):
        for arm in arms:
            name = f"r{i}_{arm}"
            r = one_round(a, specs, arm, flag, os.path.join(logs, f"{name}.log"))
            rounds.append(r)
            print(
                f"{name}: TTFT p50 {rep.percentile(r['ttft'], 50) * 1000:.0f} ms p90 "
                f"{rep.percentile(r['ttft'], 90) * 1000:.0f} ms, hit rate {r['cached'] / r['prompt']:.1%}, "
                f"pulled {r['pulled']:.0f} tokens",
                flush=True,
            )
    wall = time.monotonic() - t0
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    lines = [
        "| round | peer pull | requests | TTFT p50 (ms) | TTFT p90 (ms) | prefix hit rate | pulled tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rounds):
        lines.append(
            f"| {i // len(arms)} | {r['arm']} | {r['n']} | {rep.percentile(r['ttft'], 50) * 1000:.0f} | "
            f"{rep.percentile(r['ttft'], 90) * 1000:.0f} | {r['cached'] / r['prompt']:.1%} | {r['pulled']:.0f} |"
        )

    def of(arm: str) -> list[dict]:
        return [r for r in rounds if r["arm"] == arm]

    def pooled(arm: str) -> list[float]:
        return [x for r in of(arm) for x in r["ttft"]]

    def hit(arm: str) -> float:
        return sum(r["cached"] for r in of(arm)) / sum(r["prompt"] for r in of(arm))

    if set(arms) == set(ARMS):
        ratio = {q: rep.percentile(pooled("on"), q) / rep.percentile(pooled("off"), q) for q in (50, 90)}
        lines += [
            "",
            "| pooled over rounds | TTFT p50 on/off | TTFT p90 on/off | prefix hit rate off → on | pulled tokens on |",
            "|---|---|---|---|---|",
            f"| {a.rounds} × (off, on) | **{ratio[50]:.2f}** | **{ratio[90]:.2f}** | "
            f"{hit('off'):.1%} → {hit('on'):.1%} | {sum(r['pulled'] for r in of('on')):.0f} |",
        ]
    cmd = "python -m bench.peer_pull_cluster_bench " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k != "out"
    )
    header = [
        "# Prefix pulls between workers on a real cluster",
        "",
        f"`{cmd}` at commit `{commit}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, wall {wall:.0f} s.",
        f"Cluster flags: `rackserve up {' '.join(rounds[0]['flags'])}`"
        + (
            " (`--peer-pull` when on)."
            if flag
            else " (this tree's router has no --peer-pull: it plans no pull)."
        )
        + f" Workload: {len(specs)} chat requests, {a.sessions} sessions × {a.turns} turns, closed loop of "
        f"{a.concurrency}.",
        "",
    ]
    text = "\n".join(header + lines) + "\n"
    with open(a.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
