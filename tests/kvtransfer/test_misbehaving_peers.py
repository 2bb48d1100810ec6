"""KV transfer between a real KvSource or KvSink and a peer that misbehaves: a stranger guessing at a publication,
a producer whose grant lies, a listener that runs out of file descriptors. Every failure a pull meets is a
TransferError (the decode worker rebuilds on those; anything else failed the request), and nothing a peer does
frees bytes another reader is still reading."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from services.kvtransfer import (
    SHM,
    TCP,
    KvSink,
    KvSource,
    TransferConfig,
    TransferError,
    TransferIntegrityError,
    TransferPeerGone,
    TransferTicket,
    TransferTimeout,
    protocol,
    shm,
)
from services.kvtransfer.control import Done, Open
from services.kvtransfer.ticket import checksum_of, node_id


def frame(obj: Any) -> bytes:
    body = json.dumps(obj).encode()
    return struct.pack("!I", len(body)) + body


async def connect(endpoint: str) -> socket.socket:
    host, _, port = endpoint.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.setblocking(False)
    return sock


async def ask(sock: socket.socket, msg: Any) -> dict[str, Any]:
    await asyncio.get_running_loop().sock_sendall(
        sock, protocol.encode(msg) if not isinstance(msg, bytes) else msg
    )
    return await asyncio.wait_for(protocol.recv_message(sock), 5)


def segment_of(source: KvSource, key: str) -> str:
    segment = source._pubs[key].segment
    assert segment is not None
    return segment.path


def test_a_refused_open_leaves_the_reader_who_holds_the_publication_its_pin() -> None:
    """Reader A holds a shm grant (pinned until its done). A stranger who knows the key and guesses a serial is
    refused — and until 2026-12-07 the refusal took A's pin, so the retract that came next deleted the segment
    under A's read. Now the segment lives until A is done, then goes."""

    async def go() -> None:
        source = await KvSource.start(TransferConfig(backends=(TCP, SHM)))
        try:
            ticket = await source.publish("req-1/kv", os.urandom(64 << 10), ttl_s=30)
            path = segment_of(source, "req-1/kv")
            reader = await connect(source.endpoint)
            grant = await ask(reader, Open("req-1/kv", ticket.serial, SHM))
            assert grant["ok"] and grant["shm"] == os.path.basename(path)
            for guess in ("", "0" * 32, ticket.serial + "x"):
                stranger = await connect(source.endpoint)
                assert (await ask(stranger, Open("req-1/kv", guess, SHM)))["error"] == "not_found"
                stranger.close()
            await asyncio.sleep(0.05)  # the stranger's connection ends on the source
            source.retract("req-1/kv")
            assert os.path.exists(path), "the retract freed a segment a reader still holds"
            await asyncio.get_running_loop().sock_sendall(reader, protocol.encode(Done()))
            for _ in range(100):
                if not os.path.exists(path):
                    break
                await asyncio.sleep(0.02)
            assert not os.path.exists(path)
            reader.close()
        finally:
            await source.close()

    asyncio.run(go())


def test_a_failed_accept_is_retried_and_the_source_serves_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """One accept that failed (file descriptors exhausted by a storm of connections) ended the listener for good
    until 2026-12-07: the worker looked healthy, and every later pull of its KV waited out its deadline."""

    async def go() -> bytes:
        loop = asyncio.get_running_loop()
        real = loop.sock_accept
        failures = [OSError(24, "Too many open files")]

        async def flaky(sock: socket.socket) -> tuple[socket.socket, Any]:
            if failures:
                raise failures.pop()
            return await real(sock)

        monkeypatch.setattr(loop, "sock_accept", flaky)
        source = await KvSource.start(TransferConfig(backends=(TCP,)))
        sink = await KvSink.start(TransferConfig(backends=(TCP,)))
        try:
            ticket = await source.publish("after-emfile", b"kv" * 1000, ttl_s=30)
            await asyncio.sleep(0.05)
            assert not failures  # the listener met its failure before the pull
            return bytes((await sink.pull(ticket, 5.0)).data)
        finally:
            await sink.close()
            await source.close()

    assert asyncio.run(go()) == b"kv" * 1000


async def against(behave: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]], backend: str,
                  size: int = 1 << 16) -> BaseException:  # fmt: skip
    """What a sink's pull of a ticket from a producer that answers with `behave` raises."""
    server = await asyncio.start_server(behave, "127.0.0.1", 0)
    endpoint = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    ticket = TransferTicket(
        key="k", size=size, checksum="none", endpoint=endpoint, backends={TCP: endpoint, SHM: node_id()},
        serial="s-1", raw_size=size,
    )  # fmt: skip
    sink = await KvSink.start(TransferConfig(backends=(TCP, SHM)))
    try:
        await sink.pull(ticket, 3.0, backend=backend)
    except BaseException as exc:  # noqa: BLE001 - the test looks at whatever came out
        return exc
    finally:
        await sink.close()
        server.close()
    raise AssertionError("the pull returned data")


def test_a_grant_of_a_segment_shorter_than_the_payload_is_an_integrity_error() -> None:
    """A producer whose grant names a shm segment holding less than the payload: a ValueError escaped the pull
    (the decode worker answered INVALID_ARGUMENT and the request failed instead of rebuilding)."""
    name = f"{shm.PREFIX}{os.getpid()}-5407"
    with open(f"/dev/shm/{name}", "wb") as f:
        f.write(b"\0" * 4096)

    async def short(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        (n,) = struct.unpack("!I", await r.readexactly(4))
        await r.readexactly(n)
        grant = {
            "ok": True,
            "size": 1 << 16,
            "checksum": "none",
            "encoding": "raw",
            "serial": "s-1",
            "shm": name,
        }
        w.write(frame(grant))
        await w.drain()
        await asyncio.sleep(5)

    try:
        error = asyncio.run(against(short, SHM))
    finally:
        os.unlink(f"/dev/shm/{name}")
    assert isinstance(error, TransferIntegrityError), repr(error)


def test_a_reply_nested_past_the_parsers_stack_is_a_peer_gone() -> None:
    """`[[[[…` within the 1 MiB bound: a RecursionError escaped the pull (the decode worker answered INTERNAL)."""
    deep = b"[" * 200_000 + b"]" * 200_000

    async def nested(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        (n,) = struct.unpack("!I", await r.readexactly(4))
        await r.readexactly(n)
        w.write(struct.pack("!I", len(deep)) + deep)
        await w.drain()
        await asyncio.sleep(5)

    error = asyncio.run(against(nested, TCP))
    assert isinstance(error, TransferPeerGone), repr(error)


def test_an_open_nested_past_the_parsers_stack_is_dropped_quietly_and_the_source_serves_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The same bytes as an open: the source logged a traceback for each such connection."""
    deep = b"[" * 200_000 + b"]" * 200_000

    async def at_a_source() -> tuple[list[BaseException], bytes]:
        errors: list[BaseException] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: errors.append(ctx.get("exception")))
        source = await KvSource.start(TransferConfig(backends=(TCP,)))
        sink = await KvSink.start(TransferConfig(backends=(TCP,)))
        try:
            ticket = await source.publish("still-served", b"ok" * 100, ttl_s=30)
            sock = await connect(source.endpoint)
            await asyncio.get_running_loop().sock_sendall(sock, struct.pack("!I", len(deep)) + deep)
            assert await asyncio.get_running_loop().sock_recv(sock, 1) == b""  # the source closed it
            sock.close()
            return errors, bytes((await sink.pull(ticket, 5.0)).data)
        finally:
            await sink.close()
            await source.close()

    errors, data = asyncio.run(at_a_source())
    assert errors == [] and data == b"ok" * 100
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []


def test_a_sink_out_of_file_descriptors_fails_the_pull_as_a_transfer_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No socket for a new connection (EMFILE) was a bare OSError out of the pull: the decode worker answered
    INTERNAL instead of rebuilding the request."""
    from services.kvtransfer import sink as sink_mod

    async def go() -> BaseException:
        source = await KvSource.start(TransferConfig(backends=(TCP,)))
        sink = await KvSink.start(TransferConfig(backends=(TCP,)))
        try:
            ticket = await source.publish("no-fds", b"kv" * 100, ttl_s=30)

            def no_fds(*_: Any, **__: Any) -> socket.socket:
                raise OSError(24, "Too many open files")

            monkeypatch.setattr(sink_mod.socket, "socket", no_fds)
            try:
                await sink.pull(ticket, 3.0)
            except BaseException as exc:  # noqa: BLE001 - the test looks at whatever came out
                return exc
            raise AssertionError("the pull returned data")
        finally:
            monkeypatch.undo()
            await sink.close()
            await source.close()

    error = asyncio.run(go())
    assert isinstance(error, TransferPeerGone) and "Too many open files" in str(error), repr(error)


@pytest.mark.parametrize("sends", ["more", "more_after_the_pull", "fewer_then_waits", "fewer_then_closes"])
def test_a_producer_that_sends_another_size_than_it_granted_never_feeds_the_next_pull(sends: str) -> None:
    """A producer's grant announces the payload's size; it sends more, or fewer. The extra bytes stayed in the
    connection the sink then kept for its next pull, which took them for its reply and payload (a whole other
    request's pull failed, or read bytes that were not its own) until 2026-12-07. Now a pull that sees more or
    fewer bytes than granted fails as a TransferError (the request rebuilds), and a connection with bytes nobody
    asked for is closed, never reused: the next pull gets its own bytes over a new one."""
    first, second, stale = os.urandom(4096), os.urandom(4096), os.urandom(4096)
    sums = {"k1": checksum_of(first, "xxh3"), "k2": checksum_of(second, "xxh3")}
    payloads = {"k1": first, "k2": second}
    connections: list[int] = []

    def grant(key: str, size: int) -> bytes:
        return frame(
            {"ok": True, "size": size, "checksum": sums[key], "encoding": "raw", "serial": f"s-{key}"}
        )

    async def producer(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            while True:
                (n,) = struct.unpack("!I", await r.readexactly(4))
                key = json.loads(await r.readexactly(n))["key"]
                payload = payloads[key]
                w.write(grant(key, len(payload)))
                if key == "k2":
                    w.write(payload)
                elif sends.startswith("more"):
                    # the payload, then what reads as a reply to the next open: a grant of k2 and bytes of no one
                    w.write(payload)
                    if sends == "more_after_the_pull":
                        await w.drain()
                        await asyncio.sleep(0.2)
                    w.write(grant("k2", len(stale)) + stale)
                else:
                    w.write(payload[:1000])
                    if sends == "fewer_then_closes":
                        await w.drain()
                        w.close()
                        return
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            w.close()

    async def go() -> tuple[BaseException | bytes, bytes]:
        server = await asyncio.start_server(producer, "127.0.0.1", 0)
        endpoint = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        tickets = [
            TransferTicket(key=k, size=4096, checksum=sums[k], endpoint=endpoint, backends={TCP: endpoint},
                           serial=f"s-{k}", raw_size=4096)
            for k in ("k1", "k2")
        ]  # fmt: skip
        sink = await KvSink.start(TransferConfig(backends=(TCP,)))
        try:
            try:
                got: BaseException | bytes = bytes((await sink.pull(tickets[0], 1.0)).data)
            except TransferError as exc:
                got = exc
            await asyncio.sleep(0.4)  # whatever the producer sends late has arrived
            return got, bytes((await sink.pull(tickets[1], 3.0)).data)
        finally:
            await sink.close()
            server.close()

    got, after = asyncio.run(go())
    expected = {
        "more": TransferIntegrityError,
        "fewer_then_waits": TransferTimeout,
        "fewer_then_closes": TransferPeerGone,
    }
    if sends == "more_after_the_pull":
        assert got == first  # it had every byte granted, verified, before the extra ones came
    else:
        assert isinstance(got, expected[sends]), repr(got)
    assert after == second
    assert len(connections) == 2  # the first connection was not used again
