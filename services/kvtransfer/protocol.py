"""The control channel every pull starts with: length-prefixed JSON messages over one TCP connection.

    sink -> source  Open(key, serial, backend "tcp"|"shm"|"nixl"|"cuda_ipc"[, eager])
    source -> sink  Grant(size, checksum, encoding, serial, <backend fields>) or Refusal(error, detail)
    tcp:       N raw payload bytes follow the reply on the same connection
    shm, nixl, cuda_ipc: the sink reads through the side channel, then sends Done(); closing also unpins
    then the next Open may follow on the same connection (the sink keeps idle ones per producer)

The messages and their JSON shape are control.py's; this module frames them (a 4-byte big-endian length, then
the compact JSON object).

The open pins the payload on the source until done or disconnect, so a retract or TTL expiry never frees memory
under a reader. An eager NIXL reader (the ticket names the region) starts its READ as it sends the open and keeps
the bytes only if the reply names the ticket's serial: held at the open means never freed since publish.
This module only frames messages; it must never hold payloads or know about backends.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from typing import Any

from .control import ControlMessage

_LEN = struct.Struct("!I")
MAX_MESSAGE_BYTES = 1 << 20


async def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from the socket; EOF before it is full raises ConnectionResetError."""
    loop = asyncio.get_running_loop()
    got = 0
    while got < len(view):
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise ConnectionResetError(f"peer closed after {got} of {len(view)} bytes")
        got += n


def peek(sock: socket.socket) -> bytes | None:
    """What waits to be read on a non-blocking socket, left unread: None when nothing does, b"" when the peer
    has closed (or reset) it, else its first unread byte. Between exchanges a producer sends nothing, so a
    kept connection with either is not clean."""
    try:
        return sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return None
    except OSError:
        return b""


def encode(msg: ControlMessage) -> bytes:
    """The bytes `msg` travels as: its length, then its JSON object, compact."""
    body = json.dumps(msg.to_wire(), separators=(",", ":")).encode()
    return _LEN.pack(len(body)) + body


async def send_message(sock: socket.socket, msg: ControlMessage) -> None:
    await asyncio.get_running_loop().sock_sendall(sock, encode(msg))


async def recv_message(sock: socket.socket) -> dict[str, Any]:
    head = bytearray(_LEN.size)
    await recv_exactly(sock, memoryview(head))
    (n,) = _LEN.unpack(head)
    if n > MAX_MESSAGE_BYTES:
        raise ValueError(f"control message of {n} bytes exceeds {MAX_MESSAGE_BYTES}")
    body = bytearray(n)
    await recv_exactly(sock, memoryview(body))
    try:
        msg = json.loads(body)
    except RecursionError as exc:  # "[[[[…": nested past the parser's stack, within the size bound
        raise ValueError("control message is nested too deeply") from exc
    if not isinstance(msg, dict):
        raise ValueError("control message is not a JSON object")
    return msg


def tune(sock: socket.socket, buffer_bytes: int) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)
        except OSError:
            pass
