"""The control channel every pull starts with: length-prefixed JSON messages over one TCP connection.

    sink -> source  {"op": "open", "key": ..., "backend": "tcp"|"shm"|"nixl"[, "eager": true]}
    source -> sink  {"ok": true, "size": N, "checksum": ..., "serial": ..., <backend fields>}
                    or  {"ok": false, "error": ...}
    tcp:       N raw payload bytes follow the reply on the same connection
    shm, nixl: the sink reads through the side channel, then sends {"op": "done"}; closing also unpins
    then the next {"op": "open"} may follow on the same connection (the sink keeps idle ones per producer)

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


async def send_message(sock: socket.socket, msg: dict[str, Any]) -> None:
    body = json.dumps(msg, separators=(",", ":")).encode()
    await asyncio.get_running_loop().sock_sendall(sock, _LEN.pack(len(body)) + body)


async def recv_message(sock: socket.socket) -> dict[str, Any]:
    head = bytearray(_LEN.size)
    await recv_exactly(sock, memoryview(head))
    (n,) = _LEN.unpack(head)
    if n > MAX_MESSAGE_BYTES:
        raise ValueError(f"control message of {n} bytes exceeds {MAX_MESSAGE_BYTES}")
    body = bytearray(n)
    await recv_exactly(sock, memoryview(body))
    msg = json.loads(body)
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
