"""A routed request counts on its worker until the worker's load reports count it — heartbeats included.

A real etcd, a real router in `--mode disagg`, two real prefill workers and a decode worker. A long prompt runs in
one engine step of seconds on a CPU; meanwhile its worker repeats its last (idle) load snapshot every second as a
heartbeat. Until 2026-12-07 that heartbeat cleared the router's reservation of the prompt, so for the rest of the
step the router saw the worker as idle and sent about half of the next requests to it, behind the long prompt,
with an idle prefill worker beside it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import pytest

from services.rpc import pb, pb_grpc
from tests.support.cluster import (
    RPC_TIMEOUT_S,
    LocalCluster,
    Proc,
    greedy,
    local_cluster,
    run,
    start_process,
)
from tests.support.markers import starts_processes

LONG = [(i * 37) % 4000 + 10 for i in range(2000)]
# the whole prompt in one step, with room for its KV
PREFILL_FLAGS = ["--dtype", "float32", "--kv-cache-bytes", str(160 << 20), "--threads", "1",
                 "--max-num-batched-tokens", "2048"]  # fmt: skip
# a decode worker whose context holds the long prompt too: the router chooses no worker that cannot
DECODE_FLAGS = ["--dtype", "float32", "--kv-cache-bytes", str(160 << 20), "--threads", "1"]
PROBE_S = 2.5  # longer than a heartbeat's period (1 s), shorter than the long prompt's step on a CPU


@pytest.fixture(scope="module")
@starts_processes
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    log_dir = str(tmp_path_factory.mktemp("router-reservations"))

    def start(etcd_url: str) -> list[Proc]:
        return [
            start_process("services.prefill.server", "prefill-a", etcd_url, log_dir, *PREFILL_FLAGS),
            start_process("services.prefill.server", "prefill-b", etcd_url, log_dir, *PREFILL_FLAGS),
            start_process("services.decode.server", "decode-a", etcd_url, log_dir, *DECODE_FLAGS),
            start_process("services.router.server", "router", etcd_url, log_dir, "--mode", "disagg"),
        ]

    with local_cluster(log_dir, start, {"prefill": 2, "decode": 1, "router": 1}) as c:
        yield c


def test_requests_routed_while_a_long_prompt_runs_go_to_the_idle_worker(cluster: LocalCluster) -> None:
    async def body() -> tuple[str, float, list[tuple[float, pb.RoutePlan]]]:
        async with grpc.aio.insecure_channel(cluster.endpoints["router"]) as channel:
            router = pb_grpc.RouterStub(channel)
            plan = await router.Route(pb.RouteRequest(request_id="long", token_ids=LONG, need_prefill=True),
                                      timeout=5.0)  # fmt: skip
            busy = plan.prefill.worker_id
            async with grpc.aio.insecure_channel(cluster.endpoints[busy]) as worker:
                t0 = time.monotonic()
                prefill = asyncio.ensure_future(
                    pb_grpc.PrefillWorkerStub(worker).Prefill(
                        pb.PrefillRequest(request_id="long", token_ids=LONG, params=greedy(1)),
                        timeout=RPC_TIMEOUT_S * 4,
                    )
                )
                probes = []
                while time.monotonic() - t0 < PROBE_S and not prefill.done():
                    request = pb.RouteRequest(
                        request_id=f"probe-{len(probes)}", token_ids=[5], need_prefill=True
                    )
                    probes.append((time.monotonic() - t0, await router.Route(request, timeout=5.0)))
                    await asyncio.sleep(0.1)
                await prefill
                return busy, time.monotonic() - t0, probes

    busy, took_s, probes = run(body, 300)
    # the probes while the long prompt was surely still running (its end reaches the router a moment early)
    during = [plan for at, plan in probes if at < took_s - 0.3]
    assert len(during) >= 5, (took_s, len(probes))
    for plan in during:
        assert plan.prefill.worker_id != busy, (busy, plan)
        assert plan.runner_up_prefill.worker_id == busy and plan.runner_up_terms["queue_s"] > 0, plan
