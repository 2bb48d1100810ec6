"""A worker that stops talking stops getting requests, long before its etcd lease says it is gone.

A real etcd, a real router and a real decode worker whose lease outlives the test (60 s): a frozen process
(SIGSTOP: a paused container, a node under swap) or a wedged one keeps its registration until the lease runs out,
and until this fix the router sent it every request meanwhile. The worker reports its load every second; the router
takes `--silent-after-s` (3 s) of silence for a worker it must not route to, and routes to it again once it speaks.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator

import grpc
import pytest

from services.discovery import WorkerDirectory
from services.rpc import pb, pb_grpc
from tests.support.cluster import WORKER_FLAGS, LocalCluster, Proc, greedy, local_cluster, run, start_process
from tests.support.markers import starts_processes

LONG_LEASE_S = 60.0
PROMPT = [(i * 37) % 4000 + 10 for i in range(40)]


@pytest.fixture(scope="module")
@starts_processes
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    log_dir = str(tmp_path_factory.mktemp("router-silence"))

    def start(etcd_url: str) -> list[Proc]:
        return [
            start_process("services.decode.server", "decode-s", etcd_url, log_dir, *WORKER_FLAGS,
                          "--lease-ttl-s", str(LONG_LEASE_S)),
            start_process("services.router.server", "router-s", etcd_url, log_dir, "--silent-after-s", "3"),
        ]  # fmt: skip

    with local_cluster(log_dir, start, {"decode": 1, "router": 1}) as c:
        yield c


async def route(endpoint: str, request_id: str) -> pb.RoutePlan | grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        try:
            return await pb_grpc.RouterStub(channel).Route(
                pb.RouteRequest(request_id=request_id), timeout=5.0
            )
        except grpc.aio.AioRpcError as e:
            return e


async def until(endpoint: str, want_worker: bool, within_s: float) -> float:
    """Seconds until a Route gets the worker (want_worker) or UNAVAILABLE (not); fails past within_s."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        answer = await route(endpoint, f"probe-{time.monotonic()}")
        if isinstance(answer, pb.RoutePlan) and want_worker:
            assert answer.decode.worker_id == "decode-s"
            return time.monotonic() - t0
        if isinstance(answer, grpc.aio.AioRpcError) and not want_worker:
            assert answer.code() is grpc.StatusCode.UNAVAILABLE, answer
            return time.monotonic() - t0
        await asyncio.sleep(0.2)
    raise AssertionError(f"no {'plan' if want_worker else 'UNAVAILABLE'} within {within_s}s")


async def registered(etcd_url: str) -> list[str]:
    directory = WorkerDirectory(etcd_url, roles=("decode",))
    await directory.start()
    try:
        return [w.worker_id for w in directory.workers("decode")]
    finally:
        await directory.close()


def test_a_frozen_worker_is_routed_around_while_still_registered_and_back_once_it_thaws(
    cluster: LocalCluster,
) -> None:
    router, worker = cluster.endpoints["router-s"], cluster.procs["decode-s"].popen
    assert run(lambda: until(router, True, 30.0), 40.0) >= 0
    worker.send_signal(signal.SIGSTOP)
    try:
        frozen_s = run(lambda: until(router, False, 20.0), 30.0)
        # still registered: its lease (60 s) has not run out; the router went by its silence alone
        assert run(lambda: registered(cluster.etcd.url), 10.0) == ["decode-s"]
        assert frozen_s < 10.0
    finally:
        worker.send_signal(signal.SIGCONT)
    run(lambda: until(router, True, 20.0), 30.0)

    async def decode() -> list[int]:
        async with grpc.aio.insecure_channel(cluster.endpoints["decode-s"]) as channel:
            request = pb.DecodeRequest(request_id="after-thaw", prompt_token_ids=PROMPT, params=greedy(3))
            chunks = [c async for c in pb_grpc.DecodeWorkerStub(channel).Decode(request, timeout=30.0)]
        return [t.token_id for c in chunks for t in c.tokens]

    assert len(run(decode, 40.0)) == 3  # and it serves
