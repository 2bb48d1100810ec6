"""Router benchmark: decision latency and rate with 64 workers and 1 M indexed blocks, on one core, every
policy side by side; and the prefix index's memory per million blocks.

    python -m bench.router_bench [--quick]

Writes a markdown report to stdout and to bench/results/router.md:

1. The cluster: 32 prefill + 32 decode workers over 2 zones × 4 racks × 4 nodes, the index holding 1 M
   (worker, block) entries: 3,900 shared "documents" of 64 blocks (16-token blocks), each cached on 4 workers.
2. Per policy: p50 / p99 decision latency and decisions/s for `RouterState.route` on 2,048-token prompts (a
   document prefix of 16–64 blocks + a unique suffix) — the whole in-process decision: the index walk, the
   pending-reservation walk, the policy, the reservation. The prompt's block hashes are computed ahead and
   timed on their own (the engine's hash function, the same for every policy). Each worker sends a load
   report every 64 decisions (as the live router sees them), which also clears reservations. The process is
   pinned to one core. Wall-clock and CPU-time (this thread's) percentiles both: on a shared machine the wall
   p99 measures the OS scheduler's preemptions as much as the router.
   Ratios are against the ttft policy in the same run (the peers: round-robin, least-loaded,
   cache-overlap, Dynamo's KV cost, sgl-router's cache-aware rule, all implemented in
   services/router/policy.py).
3. Index memory (tracemalloc) per million entries, and the time one worker's removal takes.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
import tracemalloc
from pathlib import Path

from services.engine.block_hash import block_hashes
from services.router.policy import POLICIES, RouteQuery, WorkerState, make_policy
from services.router.prefix_index import PrefixIndex
from services.router.state import RouterState

RESULTS = Path(__file__).resolve().parent / "results" / "router.md"
BLOCK = 16
DOC_BLOCKS = 64
COPIES = 4
PROMPT_TOKENS = 2048


def topology(i: int) -> dict[str, str]:
    return {"zone": f"z{i % 2}", "rack": f"r{i % 8}", "node": f"n{i % 16}"}


def workers(n_prefill: int, n_decode: int) -> list[WorkerState]:
    out = []
    for role, n in (("prefill", n_prefill), ("decode", n_decode)):
        for i in range(n):
            out.append(WorkerState(f"{role}-{i:02d}", role, epoch=1, capacity_blocks=200_000, **topology(i)))
    return out


def documents(n_docs: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(1, 49000) for _ in range(DOC_BLOCKS * BLOCK)] for _ in range(n_docs)]


def fill(
    index_or_state: PrefixIndex | RouterState, docs: list[list[int]], ids: list[str], rng: random.Random
) -> None:
    for doc in docs:
        hashes = block_hashes(doc, BLOCK)
        for worker_id in rng.sample(ids, COPIES):
            if isinstance(index_or_state, RouterState):
                index_or_state.on_stored(worker_id, hashes, computed=False)
            else:
                index_or_state.stored(worker_id, hashes)


def queries(docs: list[list[int]], n: int, rng: random.Random) -> list[RouteQuery]:
    out = []
    for i in range(n):
        doc = rng.choice(docs)
        keep = rng.randrange(16, DOC_BLOCKS + 1) * BLOCK
        suffix = [rng.randrange(1, 49000) for _ in range(PROMPT_TOKENS - keep)]
        tokens = doc[:keep] + suffix
        # hashed ahead, as the decision's input: hashing is measured on its own (it is the engine's function)
        out.append(
            RouteQuery(
                f"bench-{i}", num_tokens=len(tokens), block_hashes={BLOCK: block_hashes(tokens, BLOCK)}
            )
        )
    return out


def hashing_ms(docs: list[list[int]], n: int) -> tuple[float, float]:
    """p50 / p99 ms of block_hashes over one 2,048-token prompt (what Route adds to the decision)."""
    times = []
    for i in range(n):
        tokens = (docs[i % len(docs)] * 2)[:PROMPT_TOKENS]
        t0 = time.perf_counter()
        block_hashes(tokens, BLOCK)
        times.append(time.perf_counter() - t0)
    times.sort()
    return statistics.median(times) * 1e3, times[int(len(times) * 0.99) - 1] * 1e3


def run_policy(name: str, docs: list[list[int]], n: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    state = RouterState(make_policy(name, "auto"))
    ws = workers(32, 32)
    for w in ws:
        state.add_worker(w)
    fill(state, docs, [w.worker_id for w in ws], rng)
    qs = queries(docs, n, rng)
    times, cpu_times = [], []
    now = 0.0
    for i, q in enumerate(qs):
        now += 0.001
        t0, c0 = time.perf_counter(), time.thread_time()
        state.route(q, now)
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.thread_time() - c0)
        if i % 64 == 63:  # every worker reports: load reports arrive while routing
            for w in ws:
                state.on_load(
                    w.worker_id, now, queued_prefill_tokens=rng.randrange(0, 8000), running=rng.randrange(8)
                )
    times.sort()
    cpu_times.sort()
    return {
        "entries": len(state.index),
        "cpu_p50_ms": statistics.median(cpu_times) * 1e3,
        "cpu_p99_ms": cpu_times[int(len(cpu_times) * 0.99) - 1] * 1e3,
        "p50_ms": statistics.median(times) * 1e3,
        "p99_ms": times[int(len(times) * 0.99) - 1] * 1e3,
        "per_s": len(times) / sum(times),
    }


def index_memory(docs: list[list[int]], seed: int) -> tuple[int, float, int, float]:
    """(entries, bytes per million entries, unique blocks, seconds to remove one worker)."""
    rng = random.Random(seed)
    ids = [w.worker_id for w in workers(32, 32)]
    hashed = [block_hashes(doc, BLOCK) for doc in docs]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex()
    for hashes in hashed:
        for worker_id in rng.sample(ids, COPIES):
            index.stored(worker_id, hashes)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    unique = len(index._owners)
    t0 = time.perf_counter()
    index.remove_worker(ids[0])
    return (
        len(index) + index.blocks_of(ids[0]),
        used / max(1, len(index)) * 1e6,
        unique,
        time.perf_counter() - t0,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="100 k entries and 500 decisions (a smoke run)")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    n_docs = 390 if args.quick else 3900  # × 64 blocks × 4 copies ≈ 1 M entries
    n_decisions = 500 if args.quick else 5000
    docs = documents(n_docs, random.Random(1))

    rows = {name: run_policy(name, docs, n_decisions, seed=2) for name in POLICIES}
    entries, bytes_per_m, unique, remove_s = index_memory(docs, seed=2)
    hash_p50, hash_p99 = hashing_ms(docs, 500)

    ttft = rows["ttft"]
    lines = [
        "# Router decision benchmark",
        "",
        f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, one core; "
        f"32 prefill + 32 decode workers, {ttft['entries']:,.0f} indexed (worker, block) entries, "
        f"{n_decisions:,} decisions of {PROMPT_TOKENS}-token prompts per policy, mode auto.",
        "",
        "| policy | p50 ms | p99 ms | CPU p50 ms | CPU p99 ms | decisions/s | p50 vs ttft |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        ratio = r["p50_ms"] / ttft["p50_ms"]
        lines.append(
            f"| {name} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['cpu_p50_ms']:.3f} | {r['cpu_p99_ms']:.3f} "
            f"| {r['per_s']:,.0f} | {ratio:.2f}× |"
        )
    lines += [
        "",
        f"Target p99 < 1 ms (ttft): wall {ttft['p99_ms']:.3f} ms "
        f"({'met' if ttft['p99_ms'] < 1.0 else 'NOT met'}), CPU {ttft['cpu_p99_ms']:.3f} ms "
        f"({'met' if ttft['cpu_p99_ms'] < 1.0 else 'NOT met'}).",
        "",
        f"Hashing the prompt (services/engine/block_hash.py, {PROMPT_TOKENS} tokens = {PROMPT_TOKENS // BLOCK} "
        f"blocks), which a Route call adds when it gets token ids: p50 {hash_p50:.3f} ms, p99 {hash_p99:.3f} ms.",
        "",
        f"Prefix index memory: {bytes_per_m / 2**20:.0f} MiB per million (worker, block) entries "
        f"({entries:,} entries over {unique:,} distinct blocks, {COPIES} workers per block); "
        f"removing one worker's {entries // 64:,}-ish entries took {remove_s * 1e3:.0f} ms.",
    ]
    text = "\n".join(lines)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
