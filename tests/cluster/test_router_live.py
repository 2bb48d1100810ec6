"""The router against real processes: a real etcd, a real decode worker running the real model.

The prefix index is fed by the worker's own block events, the plan shows the prompt's blocks cached on the
worker that holds them, and when that worker dies its entries leave the index and, once its lease expires, it
leaves the plans. (One worker process keeps this test cheap; prefill workers feed the index the same way.)
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from services.rpc import pb, pb_grpc
from tests.support.cluster import (
    LEASE_TTL_S,
    RPC_TIMEOUT_S,
    WORKER_FLAGS,
    LocalCluster,
    Proc,
    greedy,
    local_cluster,
    run,
    start_process,
)
from tests.support.etcd import free_port

PROMPT = [(i * 37) % 4000 + 10 for i in range(200)]  # 12 full blocks of 16 tokens


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, metrics_port: int) -> Iterator[LocalCluster]:
    log_dir = str(tmp_path_factory.mktemp("router-live"))

    def start(etcd_url: str) -> list[Proc]:
        return [
            start_process("services.decode.server", "decode-a", etcd_url, log_dir, *WORKER_FLAGS),
            start_process(
                "services.router.server", "router-a", etcd_url, log_dir,
                "--metrics-port", str(metrics_port),
            ),
        ]  # fmt: skip

    with local_cluster(log_dir, start, {"decode": 1, "router": 1}) as c:
        yield c


def indexed_blocks(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5.0) as response:
        text = response.read().decode()
    line = next(ln for ln in text.splitlines() if ln.startswith("rackserve_router_indexed_blocks "))
    return float(line.split()[1])


def test_malformed_routes_get_invalid_argument_and_the_next_good_one_routes(cluster: LocalCluster) -> None:
    """Runs before the test below kills the worker. Each bad call gets a status naming what is wrong, not
    INTERNAL or UNKNOWN with a traceback in the router's log."""
    router = cluster.endpoints["router-a"]
    max_len = cluster.infos["decode-a"].max_model_len
    assert max_len > 0

    async def calls() -> list[tuple[grpc.StatusCode, str]]:
        got = []
        async with grpc.aio.insecure_channel(router) as channel:
            stub = pb_grpc.RouterStub(channel)
            bad = [
                pb.RouteRequest(request_id="neg", token_ids=PROMPT[:20] + [-1] + PROMPT[20:40]),
                pb.RouteRequest(request_id="long", token_ids=[5] * max_len),
                pb.RouteRequest(request_id="empty", need_prefill=True),
            ]
            for request in bad:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Route(request, timeout=5.0)
                got.append((e.value.code(), e.value.details() or ""))
            # bytes that are no RouteRequest (a string field that is not UTF-8)
            raw = channel.unary_unary("/rackserve.v1.Router/Route")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await raw(b"\x0a\x02\xff\xfe", timeout=5.0)
            got.append((e.value.code(), e.value.details() or ""))
            plan = await stub.Route(pb.RouteRequest(request_id="good", token_ids=PROMPT), timeout=5.0)
            assert plan.decode.worker_id == "decode-a"
        return got

    got = run(calls)
    assert [code for code, _ in got] == [grpc.StatusCode.INVALID_ARGUMENT] * 4, got
    assert "negative token id (-1)" in got[0][1]
    assert f"no shorter than any decode worker's context ({max_len} tokens)" in got[1][1]
    assert "no prompt to prefill" in got[2][1]
    assert "not a /rackserve.v1.Router/Route request" in got[3][1]


def test_cached_blocks_reach_the_plan_and_leave_the_index_when_the_worker_dies(
    cluster: LocalCluster, metrics_port: int
) -> None:
    router = cluster.endpoints["router-a"]
    route_request = pb.RouteRequest(request_id="live-1", token_ids=PROMPT, need_prefill=True)

    async def route() -> pb.RoutePlan:
        async with grpc.aio.insecure_channel(router) as channel:
            return await pb_grpc.RouterStub(channel).Route(route_request, timeout=5.0)

    async def warm_then_route() -> tuple[pb.RoutePlan, pb.RoutePlan]:
        cold = await route()
        assert cold.decode.worker_id == "decode-a" and cold.score_terms["cached_tokens"] == 0
        assert cold.reason_code == "only_candidate" and not cold.HasField("prefill")
        async with grpc.aio.insecure_channel(cluster.endpoints["decode-a"]) as worker:
            request = pb.DecodeRequest(request_id="warm", prompt_token_ids=PROMPT, params=greedy(2))
            [_ async for _ in pb_grpc.DecodeWorkerStub(worker).Decode(request, timeout=RPC_TIMEOUT_S)]
        deadline = time.monotonic() + 10.0
        while True:  # the worker's stored-block events reach the router's index
            plan = await route()
            if plan.score_terms["cached_tokens"] > 0 or time.monotonic() > deadline:
                return cold, plan
            await asyncio.sleep(0.1)

    cold, plan = run(warm_then_route)
    assert plan.decode.worker_id == "decode-a"
    assert plan.score_terms["cached_tokens"] == 192  # 12 blocks; the last 8 tokens are always computed
    assert plan.policy == "ttft" and plan.score_terms["prefill_s"] < cold.score_terms["prefill_s"]
    # the cache makes the estimate cheaper; the admission term is left out of the comparison: it moves with the
    # decode worker's load at that instant (this router's own reservations from the polling above, a step time
    # measured meanwhile), which has nothing to do with the cache
    assert 0 < plan.estimated_ttft_s
    warm_s = plan.estimated_ttft_s - plan.score_terms["admission_s"]
    assert warm_s < cold.estimated_ttft_s - cold.score_terms["admission_s"]
    assert indexed_blocks(metrics_port) >= 12

    cluster.procs["decode-a"].popen.kill()
    t0 = time.monotonic()
    while indexed_blocks(metrics_port) > 0:
        assert time.monotonic() - t0 < LEASE_TTL_S + 10, "the dead worker's blocks stayed in the index"
        time.sleep(0.2)

    async def route_until_unavailable() -> grpc.aio.AioRpcError:
        while True:
            try:
                await route()
            except grpc.aio.AioRpcError as e:
                return e
            await asyncio.sleep(0.2)

    error = run(route_until_unavailable, LEASE_TTL_S + 10)
    assert error.code() is grpc.StatusCode.UNAVAILABLE and error.details() == "no decode workers"
