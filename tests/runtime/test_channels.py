"""ChannelPool over real gRPC servers in this process: workers that come and go on new addresses (pods get new
IPs on every restart) leave no channel behind once idle, no channel is closed under a call in flight, and a
pool's channel has a connection of its own."""

from __future__ import annotations

import asyncio
import socket
import time

import grpc

from services.rpc import pb, pb_grpc
from services.runtime.channels import ChannelPool
from services.runtime.tls import open_channel
from tests.support.cluster import run

IDLE_S = 0.5


class Worker(pb_grpc.PrefillWorkerServicer, pb_grpc.DecodeWorkerServicer):
    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.Empty:  # noqa: N802
        return pb.Empty()

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        for i in range(6):
            yield pb.DecodeChunk(tokens=[pb.Token(token_id=i, index=i)])
            await asyncio.sleep(0.3)


async def start_worker() -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    pb_grpc.add_PrefillWorkerServicer_to_server(Worker(), server)
    pb_grpc.add_DecodeWorkerServicer_to_server(Worker(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def release(pool: ChannelPool, endpoint: str) -> grpc.StatusCode:
    try:
        await pb_grpc.PrefillWorkerStub(pool.get(endpoint, 1)).Release(
            pb.ReleaseRequest(request_id="r"), timeout=5
        )
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def dials(address: socket.socket, seconds: float) -> int:
    """Connection attempts to `address` (bound, not listening until now) within `seconds`."""
    address.listen(16)
    address.settimeout(0.1)
    n, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            address.accept()[0].close()
            n += 1
        except TimeoutError:
            pass
    return n


def test_channels_to_workers_that_left_are_closed_once_idle_and_stop_redialling() -> None:
    async def body() -> None:
        pool = ChannelPool()
        pool.idle_close_s = IDLE_S
        old = []
        for _ in range(10):  # workers that each served a call and went away, as pods restarting on new IPs
            server, endpoint = await start_worker()
            assert await release(pool, endpoint) == grpc.StatusCode.OK
            old.append(pool.get(endpoint, 1))
            await server.stop(0)
        # one that crashed before a call reached it: gRPC keeps redialling a channel whose call failed.
        # Its address is held (bound, refusing) so that no later server takes it.
        address = socket.socket()
        address.bind(("127.0.0.1", 0))
        crashed = f"127.0.0.1:{address.getsockname()[1]}"
        assert await release(pool, crashed) == grpc.StatusCode.UNAVAILABLE
        old.append(pool.get(crashed, 1))
        await asyncio.sleep(IDLE_S + 0.1)
        server, endpoint = await start_worker()
        assert await release(pool, endpoint) == grpc.StatusCode.OK  # the next call closes the idle ones
        await asyncio.sleep(0.2)
        assert [c.get_state() for c in old] == [grpc.ChannelConnectivity.SHUTDOWN] * len(old)
        assert await asyncio.to_thread(dials, address, 3.0) == 0
        # idle by now too: asked for again, it gets a fresh channel
        assert await release(pool, endpoint) == grpc.StatusCode.OK
        await server.stop(0)
        await pool.close()
        address.close()

    run(body, 60)


def test_a_stream_outlives_the_idle_time_on_a_draining_worker() -> None:
    """A draining worker (GOAWAY: its channel shows IDLE) finishes its streams, however long unasked-for."""

    async def body() -> None:
        pool = ChannelPool()
        pool.idle_close_s = IDLE_S
        server, endpoint = await start_worker()
        call = pb_grpc.DecodeWorkerStub(pool.get(endpoint, 1)).Decode(pb.DecodeRequest(), timeout=30)
        chunks = [await call.read()]
        draining = asyncio.create_task(server.stop(grace=30))
        other, elsewhere = await start_worker()
        while (chunk := await call.read()) is not grpc.aio.EOF:
            chunks.append(chunk)
            assert await release(pool, elsewhere) == grpc.StatusCode.OK  # asked for, the pool sweeps
        assert await call.code() == grpc.StatusCode.OK
        assert [c.tokens[0].index for c in chunks] == list(range(6))
        await draining
        await other.stop(0)
        await pool.close()

    run(body, 60)


def test_a_stream_on_a_channel_a_newer_epoch_replaces_runs_to_its_end() -> None:
    """A channel may carry a live call when a newer epoch of its address is asked for (it reconnected to the
    restarted process before a router had heard of it, and a stale plan used it): the replaced channel closes
    once that call is done, not under it."""

    async def body() -> None:
        pool = ChannelPool()
        server, endpoint = await start_worker()
        old = pool.get(endpoint, 1)
        call = pb_grpc.DecodeWorkerStub(old).Decode(pb.DecodeRequest(), timeout=30)
        chunks = [await call.read()]
        fresh = pool.get(endpoint, 2)
        assert fresh is not old
        assert await release(pool, endpoint) == grpc.StatusCode.OK  # on the fresh channel
        while (chunk := await call.read()) is not grpc.aio.EOF:
            chunks.append(chunk)
        assert await call.code() == grpc.StatusCode.OK
        assert [c.tokens[0].index for c in chunks] == list(range(6))
        await asyncio.sleep(0.2)
        assert old.get_state() == grpc.ChannelConnectivity.SHUTDOWN  # closed once the call was done
        await server.stop(0)
        await pool.close()

    run(body, 60)


class Peers(pb_grpc.PrefillWorkerServicer):
    """Answers each Release with nothing, noting the client address the call came from."""

    def __init__(self) -> None:
        self.peers: list[str] = []

    async def Release(  # noqa: N802
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.Empty:
        self.peers.append(context.peer())
        return pb.Empty()


def test_a_pools_channel_has_a_connection_of_its_own() -> None:
    """gRPC shares one connection per address among a process's channels of the same settings. A fresh channel
    for a worker restarted on its address (a newer epoch) must not take over one still backing off its reconnects
    to the dead process (the restarted worker was failed at once, in 2 of 5 runs, until 2026-12-07), so a pool's
    channels connect on their own: another channel to the same address never lends them its connection."""

    async def go() -> list[str]:
        peers = Peers()
        server = grpc.aio.server()
        pb_grpc.add_PrefillWorkerServicer_to_server(peers, server)
        endpoint = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        other = open_channel(endpoint, None)
        pool = ChannelPool()
        try:
            await pb_grpc.PrefillWorkerStub(other).Release(pb.ReleaseRequest(request_id="a"), timeout=5)
            for epoch in (1, 2):
                stub = pb_grpc.PrefillWorkerStub(pool.get(endpoint, epoch))
                await stub.Release(pb.ReleaseRequest(request_id="b"), timeout=5)
        finally:
            await other.close()
            await pool.close()
            await server.stop(0)
        return peers.peers

    peers = asyncio.run(go())
    assert len(peers) == 3 and len(set(peers)) == 3, peers
