"""What a decode worker keeps of the KV it pulled while the streams it came for decode: before and now.

    python -m bench.kv_pull_resident_bench [--before 9bb7928] [--rounds 2] [--streams 4] [--tokens 2048]

One etcd, one prefill worker (this tree) and, per arm, one decode worker started from that arm's tree — `before`:
the checkout given by --before (before 2026-12-06 a decode worker's stream held its pulled payload until the
stream ended; a commit is checked out into a temporary git worktree with this checkout's generated gRPC stubs,
and removed after), `now`: this checkout — all SmolLM2-135M in bf16 with one torch thread. Per round and arm, A/B/A/B
after one unmeasured warm-up round per arm: the arm's decode worker's resident memory (VmRSS) is read, N streams
open together, each with a fresh KvHandle of its own `--tokens`-token prompt (the same prompts every round: after
the first they are prefix hits on the prefill worker, and the whole KV still crosses over TCP), and once every
stream has its first token (its KV is imported) VmRSS is read again; then the streams are cancelled. Reported: the
KV bytes pulled and the growth of the decode worker's resident memory while the streams decode, median over rounds.
Writes bench/results/kv_pull_resident.md. Benchmarks never run in tests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator

import grpc
import numpy as np

from bench.report import publish
from services.rpc import pb, pb_grpc
from tests.support.cluster import LocalCluster, Proc, greedy, local_cluster, run, start_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = ("before", "now")
MiB = 1 << 20


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def one_round(c: LocalCluster, arm: str, prompts: list[list[int]], tag: str) -> tuple[int, int]:
    """Open the streams on the arm's decode worker; (KV bytes pulled, RSS growth once all have a token)."""
    pid = c.procs[f"decode-{arm}"].popen.pid
    async with (
        grpc.aio.insecure_channel(c.endpoints["prefill-a"]) as pch,
        grpc.aio.insecure_channel(c.endpoints[f"decode-{arm}"]) as dch,
    ):
        prefill, decode = pb_grpc.PrefillWorkerStub(pch), pb_grpc.DecodeWorkerStub(dch)
        handles = []
        for i, prompt in enumerate(prompts):  # one at a time: the prefill worker's pool holds them all
            rid = f"{tag}-{i}"
            r = await prefill.Prefill(
                pb.PrefillRequest(request_id=rid, token_ids=prompt, params=greedy(8)), timeout=600
            )
            handles.append((rid, prompt, r))
        await asyncio.sleep(0.5)
        rss0 = rss_bytes(pid)
        calls = [
            decode.Decode(
                pb.DecodeRequest(
                    request_id=rid,
                    prompt_token_ids=prompt,
                    emitted_token_ids=[r.first_token.token_id],
                    params=greedy(512, ignore_eos=True),
                    kv=r.kv,
                ),
                timeout=600,
            )
            for rid, prompt, r in handles
        ]
        pulled = 0
        for call in calls:
            chunk = await call.read()
            while not chunk.tokens:
                chunk = await call.read()
            pulled += chunk.transfer_bytes
        await asyncio.sleep(0.5)  # the last write's buffers settle
        grown = rss_bytes(pid) - rss0
        for call in calls:
            call.cancel()
        for rid, _, _ in handles:  # let the prefill worker free its copies now, not at the TTL
            await prefill.Release(pb.ReleaseRequest(request_id=rid), timeout=10)
    await asyncio.sleep(1.0)
    return pulled, grown


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument(
        "--before", default="9bb7928", help="the code to compare with: a commit, or a checkout's path"
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--tokens", type=int, default=2048, help="prompt tokens per stream")
    p.add_argument("--seed", type=int, default=7)
    a = p.parse_args()
    log_dir = tempfile.mkdtemp(prefix="kv-pull-resident-")
    with before_tree(a.before, log_dir) as before:
        measure(a, {"before": before, "now": ROOT}, log_dir)


@contextlib.contextmanager
def before_tree(before: str, scratch: str) -> Iterator[str]:
    """The checkout at `before` (a path), or a temporary worktree of that commit with this one's gRPC stubs."""
    if os.path.isdir(before):
        yield os.path.abspath(before)
        return
    tree = os.path.join(scratch, "before")
    subprocess.run(
        ["git", "worktree", "add", "--detach", tree, before], cwd=ROOT, check=True, capture_output=True
    )
    try:
        stubs = os.path.join("services", "rpc", "rackserve")  # generated (gitignored), the same proto
        shutil.copytree(os.path.join(ROOT, stubs), os.path.join(tree, stubs), dirs_exist_ok=True)
        yield tree
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=ROOT, capture_output=True)


def measure(a: argparse.Namespace, trees: dict[str, str], log_dir: str) -> None:
    rng = np.random.default_rng(a.seed)
    prompts = [rng.integers(100, 40_000, a.tokens).tolist() for _ in range(a.streams)]
    kv_bytes = a.streams * (a.tokens + 64) * 30 * 2 * 3 * 64 * 2  # bf16 SmolLM2 KV of every stream, and room
    flags = ["--dtype", "bfloat16", "--threads", "1"]

    pool = ["--kv-cache-bytes", str(2 * kv_bytes)]

    def start(etcd_url: str) -> list[Proc]:
        prefill = [
            "services.prefill.server",
            "prefill-a",
            etcd_url,
            log_dir,
            *flags,
            *pool,
            "--kv-ttl-s",
            "120",
        ]
        procs = [start_process(*prefill)]
        for arm in ARMS:
            decode = ["services.decode.server", f"decode-{arm}", etcd_url, log_dir, *flags, *pool]
            procs.append(start_process(*decode, "--kv-backend-preference", "tcp", tree=trees[arm]))
        return procs

    grown: dict[str, list[int]] = {arm: [] for arm in ARMS}
    pulled = 0
    t0 = time.monotonic()
    with local_cluster(log_dir, start, {"prefill": 1, "decode": 2}) as c:
        for arm in ARMS:
            run(lambda arm=arm: one_round(c, arm, prompts, f"warm-{arm}"), 1800)
        for i in range(a.rounds):
            for arm in ARMS:
                pulled, g = run(lambda arm=arm, i=i: one_round(c, arm, prompts, f"r{i}-{arm}"), 1800)
                grown[arm].append(g)
                print(
                    f"round {i} {arm}: pulled {pulled / MiB:.0f} MiB, decode RSS +{g / MiB:.0f} MiB",
                    flush=True,
                )
    wall = time.monotonic() - t0
    before_commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=trees["before"], capture_output=True, text=True
    ).stdout.strip()
    lines = [
        f"| streams × prompt tokens | KV pulled | decode worker's RSS growth, before ({before_commit}) | now |",
        "|---|---|---|---|",
        f"| {a.streams} × {a.tokens:,} | {pulled / MiB:.0f} MiB | "
        f"{statistics.median(grown['before']) / MiB:.0f} MiB | {statistics.median(grown['now']) / MiB:.0f} MiB |",
        "",
        "Per round (MiB, before / now): "
        + ", ".join(
            f"{b / MiB:.0f} / {n / MiB:.0f}" for b, n in zip(grown["before"], grown["now"], strict=True)
        ),
        f"{platform.node()}, {os.cpu_count()} cores, {a.rounds} rounds A/B/A/B after a warm-up, {wall:.0f} s.",
    ]
    publish(lines, "kv_pull_resident.md")


if __name__ == "__main__":
    main()
