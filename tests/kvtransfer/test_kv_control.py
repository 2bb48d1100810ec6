"""The KV transfer's control messages (services/kvtransfer/control.py): the bytes each typed message travels as
are the bytes the protocol has always sent for the same fields, and a malformed message is refused by name —
by the parser, and by a real KvSource over a real socket."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import struct
from typing import Any

import pytest

from services.kvtransfer import TCP, KvSink, KvSource, TransferConfig, protocol
from services.kvtransfer.control import (
    ControlMessageError,
    Done,
    Grant,
    NixlRegion,
    Open,
    Refusal,
    reply_from_wire,
)


def frame_as_before(msg: dict[str, Any]) -> bytes:
    """What the protocol sent before the messages were typed: a 4-byte big-endian length, then compact JSON."""
    body = json.dumps(msg, separators=(",", ":")).encode()
    return struct.pack("!I", len(body)) + body


MD = b"\x00agent metadata\xff"
# (typed message, the dict the untyped code built for the same fields)
SAME_FIELDS = [
    (Open("req-1/kv", "s-7", "tcp"), {"op": "open", "key": "req-1/kv", "serial": "s-7", "backend": "tcp"}),
    (
        Open("req-1/kv", "s-7", "nixl", eager=True),
        {"op": "open", "key": "req-1/kv", "serial": "s-7", "backend": "nixl", "eager": True},
    ),
    (
        Grant(4096, "xxh3:0123abcd", "raw", "s-7"),
        {"ok": True, "size": 4096, "checksum": "xxh3:0123abcd", "encoding": "raw", "serial": "s-7"},
    ),
    (
        Grant(4096, "xxh3:0123abcd", "fp8", "s-7", shm="rackserve-kv-1"),
        {
            "ok": True,
            "size": 4096,
            "checksum": "xxh3:0123abcd",
            "encoding": "fp8",
            "serial": "s-7",
            "shm": "rackserve-kv-1",
        },
    ),  # fmt: skip
    (
        Grant(4096, "xxh3:0123abcd", "raw", "s-7", nixl=NixlRegion(140234, "source-1", MD)),
        {
            "ok": True,
            "size": 4096,
            "checksum": "xxh3:0123abcd",
            "encoding": "raw",
            "serial": "s-7",
            "nixl": {"addr": 140234, "agent": "source-1", "md": base64.b64encode(MD).decode()},
        },
    ),  # fmt: skip
    (
        Grant(4096, "xxh3:0123abcd", "raw", "s-7", nixl=NixlRegion(140234, "source-1")),  # eager: no metadata
        {
            "ok": True,
            "size": 4096,
            "checksum": "xxh3:0123abcd",
            "encoding": "raw",
            "serial": "s-7",
            "nixl": {"addr": 140234, "agent": "source-1"},
        },
    ),  # fmt: skip
    (
        Grant(4096, "xxh3:0123abcd", "raw", "s-7", cuda_ipc=True),
        {
            "ok": True,
            "size": 4096,
            "checksum": "xxh3:0123abcd",
            "encoding": "raw",
            "serial": "s-7",
            "cuda_ipc": True,
        },
    ),  # fmt: skip
    (Refusal("not_found", "req-1/kv"), {"ok": False, "error": "not_found", "detail": "req-1/kv"}),
    (Refusal("unavailable", "nixl"), {"ok": False, "error": "unavailable", "detail": "nixl"}),
    (
        Refusal("bad_request", "expected open"),
        {"ok": False, "error": "bad_request", "detail": "expected open"},
    ),
    (Done(), {"op": "done"}),
]


@pytest.mark.parametrize(("message", "before"), SAME_FIELDS, ids=lambda v: type(v).__name__)
def test_each_message_travels_as_the_same_bytes_and_parses_back_to_itself(message: Any, before: dict) -> None:
    assert protocol.encode(message) == frame_as_before(before)
    parsed = json.loads(protocol.encode(message)[4:])
    parse = reply_from_wire if isinstance(message, (Grant, Refusal)) else type(message).from_wire
    assert parse(parsed) == message


def test_the_open_is_byte_for_byte_the_documented_frame() -> None:
    frame = b'{"op":"open","key":"k","serial":"s","backend":"shm"}'
    assert protocol.encode(Open("k", "s", "shm")) == b"\x00\x00\x00\x34" + frame


@pytest.mark.parametrize(
    ("parse", "msg", "says"),
    [
        (Open.from_wire, {"op": "close", "key": "k", "serial": "s", "backend": "tcp"}, "expected open"),
        (Open.from_wire, {"op": "open", "serial": "s", "backend": "tcp"}, "open: missing 'key'"),
        (Open.from_wire, {"op": "open", "key": "k", "backend": "tcp"}, "open: missing 'serial'"),
        (
            Open.from_wire,
            {"op": "open", "key": 7, "serial": "s", "backend": "tcp"},
            "open: 'key' must be str, got 7",
        ),
        (
            Open.from_wire,
            {"op": "open", "key": "k", "serial": "s", "backend": "tcp", "eager": "yes"},
            "'eager' must be bool",
        ),
        (reply_from_wire, {"size": 1}, "reply: 'ok' must be true or false"),
        (
            reply_from_wire,
            {"ok": True, "size": "4096", "checksum": "c", "encoding": "raw", "serial": "s"},
            "reply: 'size' must be int, got '4096'",
        ),  # fmt: skip
        (
            reply_from_wire,
            {"ok": True, "size": True, "checksum": "c", "encoding": "raw", "serial": "s"},
            "reply: 'size' must be int, got True",
        ),  # fmt: skip
        (
            reply_from_wire,
            {"ok": True, "size": 1, "checksum": "c", "encoding": "raw"},
            "reply: missing 'serial'",
        ),
        (
            reply_from_wire,
            {
                "ok": True,
                "size": 1,
                "checksum": "c",
                "encoding": "raw",
                "serial": "s",
                "nixl": {"addr": 1, "agent": "a", "md": "not base64!"},
            },
            "'md' is not base64",
        ),  # fmt: skip
        (reply_from_wire, {"ok": False, "detail": "x"}, "refusal: missing 'error'"),
        (Done.from_wire, {"op": "open"}, "expected done"),
    ],
)
def test_a_malformed_message_is_refused_naming_what_is_wrong(parse: Any, msg: dict, says: str) -> None:
    with pytest.raises(ControlMessageError, match=says.replace("(", r"\(")) as caught:
        parse(msg)
    assert isinstance(caught.value, ValueError)  # the framing's errors and the messages' are handled alike


async def exchange(endpoint: str, frame: bytes) -> dict[str, Any]:
    """Send one framed message to a real source on a connection of its own; its reply."""
    host, _, port = endpoint.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    try:
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_sendall(sock, frame)
        return await asyncio.wait_for(protocol.recv_message(sock), 5)
    finally:
        sock.close()


def test_a_real_source_refuses_a_malformed_open_with_a_clear_error_and_still_serves_a_good_one() -> None:
    async def go() -> None:
        source = await KvSource.start(TransferConfig(backends=(TCP,)))
        sink = await KvSink.start(TransferConfig(backends=(TCP,)))
        try:
            ticket = await source.publish("good", b"kv bytes" * 100, ttl_s=30)
            wrong_op = await exchange(source.endpoint, frame_as_before({"op": "read", "key": "good"}))
            assert wrong_op == {"ok": False, "error": "bad_request", "detail": "expected open"}
            bad_key = await exchange(
                source.endpoint, frame_as_before({"op": "open", "key": 3, "serial": "s", "backend": "tcp"})
            )
            assert bad_key == {
                "ok": False,
                "error": "bad_request",
                "detail": "open: 'key' must be str, got 3",
            }
            unknown = await exchange(source.endpoint, protocol.encode(Open("nope", ticket.serial, TCP)))
            assert unknown == {"ok": False, "error": "not_found", "detail": "nope"}
            assert bytes((await sink.pull(ticket, 5.0)).data) == b"kv bytes" * 100
        finally:
            await sink.close()
            await source.close()

    asyncio.run(go())


def test_only_the_ticket_reads_a_publication_and_a_guess_learns_not_even_that_it_exists() -> None:
    """The transfer listeners take connections from anything that reaches their port; a publication's serial,
    which only its ticket carries (inside the services' gRPC calls), is what lets a reader in. A reader that
    knows the key but not the serial — none, the public part of it, another publication's — gets the very reply
    an unpublished key gets, and the ticket's holder still reads the bytes."""

    async def ask(endpoint: str, msg: dict[str, Any]) -> dict[str, Any]:
        return await exchange(endpoint, frame_as_before(msg))

    async def go() -> None:
        source = await KvSource.start(TransferConfig(backends=(TCP,)))
        sink = await KvSink.start(TransferConfig(backends=(TCP,)))
        try:
            ticket = await source.publish("req-1/kv", b"secret kv" * 100, ttl_s=30)
            other = await source.publish("req-2/kv", b"other kv" * 100, ttl_s=30)
            public, _, secret = ticket.serial.rpartition("-")
            assert len(secret) == 32 and public  # 128 random bits after the source's id and counter
            unpublished = await ask(
                source.endpoint, {"op": "open", "key": "req-3/kv", "serial": "", "backend": "tcp"}
            )
            assert unpublished == {"ok": False, "error": "not_found", "detail": "req-3/kv"}
            for guess in ("", public, public + "-" + "0" * 32, other.serial, ticket.serial + "0"):
                reply = await ask(
                    source.endpoint, {"op": "open", "key": "req-1/kv", "serial": guess, "backend": "tcp"}
                )
                assert reply == {"ok": False, "error": "not_found", "detail": "req-1/kv"}, guess
            no_serial = await ask(source.endpoint, {"op": "open", "key": "req-1/kv", "backend": "tcp"})
            assert no_serial == {"ok": False, "error": "bad_request", "detail": "open: missing 'serial'"}
            assert bytes((await sink.pull(ticket, 5.0)).data) == b"secret kv" * 100
            assert bytes((await sink.pull(other, 5.0)).data) == b"other kv" * 100
        finally:
            await sink.close()
            await source.close()

    asyncio.run(go())
