"""The router's Subscribe stream to a worker, against a scripted worker in this process (no cluster).

The stream has a deadline (`SUBSCRIBE_DEADLINE_S`, 300 s) and is reopened with a fresh snapshot when it passes.
A worker takes that snapshot between two engine steps — seconds apart on a CPU under a long prompt — so the
snapshot can come a while after the stream opens. Until 2026-12-07 the router forgot the worker's blocks when it
opened the stream: every reopen hid a busy worker's whole cache from routing until its step ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from services.engine.block_hash import block_hashes
from services.router import server as router_server
from services.router.policy import RouteQuery, WorkerState, make_policy
from services.router.state import RouterState
from services.rpc import pb, pb_grpc

PROMPT = [(i * 37) % 4000 + 10 for i in range(320)]
HASHES = block_hashes(PROMPT, 16)
EPOCH = 7
SNAPSHOT_DELAY_S = 1.0  # the reopened stream's snapshot waits this long: the worker's engine is inside a step


class BusyWorker(pb_grpc.PrefillWorkerServicer):
    """Subscribe as a worker answers it: the cached blocks, then a load report every 0.1 s; from the second
    stream on, the snapshot comes only after SNAPSHOT_DELAY_S."""

    def __init__(self) -> None:
        self.streams = 0

    async def Subscribe(  # noqa: N802 - gRPC method name
        self, request: pb.SubscribeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WorkerEvent]:
        self.streams += 1
        if self.streams > 1:
            await asyncio.sleep(SNAPSHOT_DELAY_S)
        stored = pb.KvBlockEvent(kind=pb.KvBlockEvent.STORED, block_hashes=HASHES)
        yield pb.WorkerEvent(worker_id="p", epoch=EPOCH, kv=stored)
        while True:
            yield pb.WorkerEvent(worker_id="p", epoch=EPOCH, load=pb.LoadSnapshot(free_blocks=100))
            await asyncio.sleep(0.1)


class OneWorkerDirectory:
    def __init__(self, *infos: pb.WorkerInfo) -> None:
        self.infos = infos

    def subscribe(self, callback: Any) -> None:
        pass

    def workers(self, role: str) -> list[pb.WorkerInfo]:
        return [i for i in self.infos if i.role == role]


def test_a_reopened_stream_keeps_the_workers_blocks_until_its_snapshot_comes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(router_server, "SUBSCRIBE_DEADLINE_S", 1.0)

    async def body() -> tuple[int, list[int], list[float]]:
        worker = BusyWorker()
        server = grpc.aio.server()
        pb_grpc.add_PrefillWorkerServicer_to_server(worker, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        state = RouterState(make_policy("ttft", "disagg"), silent_after_s=10.0)
        info = pb.WorkerInfo(worker_id="p", role="prefill", epoch=EPOCH, endpoint=f"127.0.0.1:{port}")
        state.add_worker(WorkerState("d", "decode", epoch=1))  # not followed: never silent
        views = router_server.WorkerViews(OneWorkerDirectory(info), state, subscriber_id="router")  # type: ignore[arg-type]
        views.sync()
        try:
            while state.index.blocks_of("p") == 0:  # the first snapshot
                await asyncio.sleep(0.02)
            blocks, cached = [], []
            # past two reopens, each with its snapshot SNAPSHOT_DELAY_S late
            for i in range(int((2 * (1.0 + SNAPSHOT_DELAY_S) + 0.5) / 0.05)):
                blocks.append(state.index.blocks_of("p"))
                plan = state.route(RouteQuery(f"q{i}", token_ids=PROMPT), asyncio.get_running_loop().time())
                cached.append(plan.chosen.terms["cached_tokens"])
                state.reservations.expire(state.workers, float("inf"))  # only the index counts here
                await asyncio.sleep(0.05)
            return worker.streams, blocks, cached
        finally:
            await views.close()
            await server.stop(None)

    streams, blocks, cached = asyncio.run(body())
    assert streams >= 2, "the stream was not reopened"
    assert min(blocks) == len(HASHES), blocks
    assert min(cached) == 319, cached
