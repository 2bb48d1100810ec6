"""KV tier 2 in a real decode worker process (agg: it prefills locally): a prompt whose blocks were pushed out of
the worker's tiny primary pool is restored from tier 2 — the same tokens as its first, cold run — and the worker
says so where an operator and the router look: its /metrics (tier-2 hits, restore seconds) and its Subscribe
stream (OFFLOADED, then RESTORED, for the prompt's block hashes), and a real router process's prefix index
follows both tiers. A bad tier flag stops the worker at start."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.engine.block_hash import block_hashes
from services.engine.model_files import smollm2_gguf_path
from services.engine.tokenizer import Tokenizer
from services.rpc import pb, pb_grpc
from tests.engine.test_kv_tier import BS, POOL, TEXT_A, TEXT_B
from tests.support.cluster import (
    LocalCluster,
    Proc,
    decode,
    greedy,
    local_cluster,
    run,
    start_process,
    token_ids,
)

BLOCK_BYTES = 30 * 2 * 3 * BS * 64 * 2  # SmolLM2-135M, bf16: layers x (K, V) x kv heads x tokens x head_dim
FLAGS = ["--dtype", "bfloat16", "--threads", "1", "--kv-cache-bytes", str(POOL * BLOCK_BYTES)]
FLAGS += ["--kv-tier2-bytes", str(64 << 20), "--kv-tier2-codec", "bf16"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    log_dir = str(tmp_path_factory.mktemp("kv_tier_worker"))

    def start(etcd_url: str) -> list[Proc]:
        return [
            start_process("services.decode.server", "decode-t", etcd_url, log_dir, *FLAGS),
            start_process("services.router.server", "router-t", etcd_url, log_dir, "--metrics-port", "0"),
        ]

    with local_cluster(log_dir, start, {"decode": 1, "router": 1}) as c:
        yield c


def metric(endpoint: str, name: str, **labels: str) -> float:
    text = httpx.get(f"http://{endpoint}/metrics", timeout=10).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def router_sees(
    cluster: LocalCluster,
    prompt: list[int],
    cached: int,
    indexed: int,
    tier2: int = 0,
    timeout_s: float = 15.0,
) -> None:
    """Until the router's plan for `prompt` counts `cached` tokens in the worker's pool and `tier2` to restore
    from its tier 2, and its index holds `indexed` (worker, block) entries over both tiers."""
    router = cluster.endpoints["router-t"]
    metrics_ep = cluster.infos["router-t"].metrics_endpoint

    async def route() -> pb.RoutePlan:
        async with grpc.aio.insecure_channel(router) as channel:
            req = pb.RouteRequest(request_id="probe", token_ids=prompt, need_prefill=True)
            return await pb_grpc.RouterStub(channel).Route(req, timeout=5.0)

    deadline = time.monotonic() + timeout_s
    while True:
        terms = run(route).score_terms
        got = (
            terms["cached_tokens"],
            terms["tier2_tokens"],
            metric(metrics_ep, "rackserve_router_indexed_blocks"),
        )
        if got == (cached, tier2, indexed):
            return
        assert time.monotonic() < deadline, (
            f"router: (cached tokens, tier-2 tokens, indexed entries) = {got}, want {(cached, tier2, indexed)}"
        )
        time.sleep(0.2)


async def kv_events(endpoint: str, want: int, timeout_s: float = 20.0) -> list[pb.KvBlockEvent]:
    """The KV events of a fresh Subscribe stream (with its snapshot) until `want` RESTORED hashes arrived."""
    out: list[pb.KvBlockEvent] = []
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = pb_grpc.DecodeWorkerStub(channel)
        stream = stub.Subscribe(pb.SubscribeRequest(subscriber_id="t", snapshot=True), timeout=timeout_s)
        async for ev in stream:
            if ev.HasField("kv"):
                out.append(ev.kv)
            if sum(len(k.block_hashes) for k in out if k.kind == pb.KvBlockEvent.RESTORED) >= want:
                stream.cancel()
                break
    return out


def test_a_worker_restores_an_evicted_prefix_from_tier_2_with_the_cold_runs_tokens(
    cluster: LocalCluster,
) -> None:
    tok = Tokenizer.from_gguf(smollm2_gguf_path())
    a, b = tok.encode(TEXT_A), tok.encode(TEXT_B)
    ep = cluster.endpoints["decode-t"]
    metrics_ep = cluster.infos["decode-t"].metrics_endpoint
    hashes = block_hashes(a[: len(a) - 1], BS)

    def ask(rid: str, prompt: list[int]) -> list[pb.DecodeChunk]:
        req = pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt, params=greedy(16, ignore_eos=True))
        return run(lambda: decode(ep, req), 120)

    full_a, full_b = (
        (len(a) + 15) // BS,
        (len(b) + 15) // BS,
    )  # full blocks each computed (prompt + 15 tokens)
    first = ask("a-cold", a)
    assert first[0].cached_tokens == 0
    router_sees(cluster, a, cached=len(a) // BS * BS, indexed=full_a)
    ask("b", b)  # needs the whole pool: A's blocks leave it, for tier 2
    # B in the pool, A in tier 2: the router's plan restores A's prefix instead of recomputing it
    router_sees(cluster, a, cached=0, tier2=len(a) // BS * BS, indexed=full_b + full_a)

    async def again() -> tuple[list[pb.DecodeChunk], list[pb.KvBlockEvent]]:
        watch = asyncio.create_task(kv_events(ep, len(hashes)))
        await asyncio.sleep(0.5)  # the subscription (and its snapshot of tier 2) is open before A comes back
        req = pb.DecodeRequest(request_id="a-again", prompt_token_ids=a, params=greedy(16, ignore_eos=True))
        chunks = await decode(ep, req)
        return chunks, await watch

    chunks, events = run(again, 120)
    assert token_ids(chunks) == token_ids(first)
    assert chunks[0].cached_tokens == len(hashes) * BS
    snapshot_tier2 = [h for k in events if k.kind == pb.KvBlockEvent.OFFLOADED for h in k.block_hashes]
    assert set(hashes) <= set(snapshot_tier2)  # the snapshot listed A's blocks in tier 2 ...
    restored = [h for k in events if k.kind == pb.KvBlockEvent.RESTORED for h in k.block_hashes]
    assert restored == hashes  # ... and then reported them back in the pool
    assert metric(metrics_ep, "rackserve_kv_tier_hits_total", tier="host") == len(hashes)
    assert metric(metrics_ep, "rackserve_kv_tier_restore_seconds_count", tier="host") == 1
    assert metric(metrics_ep, "rackserve_kv_tier_capacity_bytes", tier="host") == 64 << 20
    assert metric(metrics_ep, "rackserve_kv_tier_capacity_bytes", tier="primary") == POOL * BLOCK_BYTES
    # the engine's memory by part: the same KV cache, and the weights: 134.5M bf16 parameters (269 MB), and where
    # oneDNN packs the projections the LM head packed apart from the tied embedding (28.3M more: 326 MB). Before,
    # oneDNN's packed weights went uncounted (57 MB, the embedding alone). No GPU plan on a CPU worker.
    assert metric(metrics_ep, "rackserve_engine_memory_bytes", part="kv_cache") == POOL * BLOCK_BYTES
    assert 268e6 < metric(metrics_ep, "rackserve_engine_memory_bytes", part="weights") < 327e6
    text = httpx.get(f"http://{metrics_ep}/metrics", timeout=10).text
    parts = {s.labels["part"] for f in text_string_to_metric_families(text) for s in f.samples
             if s.name == "rackserve_engine_memory_bytes"}  # fmt: skip
    assert parts == {"weights", "kv_cache"}
    # A is back in the pool (its restored blocks and its recomputed last one, whose tier-2 copy was dropped), B in
    # tier 2: the router's index says the same
    router_sees(cluster, a, cached=len(a) // BS * BS, indexed=full_a + full_b)


@pytest.mark.parametrize(
    ("flags", "complaint"),
    [
        (["--kv-tier2-codec", "int4"], "invalid choice: 'int4'"),
        (["--kv-tier2-bytes", "-5"], "must be at least 0"),
        (["--kv-tier2-bytes", "1000", "--kv-tier2-codec", "nvfp4"], "cannot hold one KV block"),
        (["--kv-tier2-bytes", str(1 << 20), "--no-prefix-caching"], "needs the prefix cache"),
    ],
)
def test_a_bad_tier_flag_stops_the_worker_naming_it(flags: list[str], complaint: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "services.decode.server",
        "--etcd",
        "http://127.0.0.1:1",
        "--port",
        "0",
        *flags,
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert complaint in p.stdout + p.stderr
