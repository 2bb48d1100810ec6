"""The consumer side of KV transfer: a decode worker pulls a published payload named by a TransferTicket, over
the backend the pair agreed on, and gets it back only once its size and checksum match the ticket.

One KvSink per decode worker process, used from its asyncio loop. Every pull has a deadline and ends in a
verified Pulled or one of the typed errors in errors.py. This module must never hand back unverified bytes and
never wait past the deadline — a dead producer is an error, not a hang.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import socket
import time
from typing import Any

import numpy as np

from . import protocol, shm
from .errors import (
    TransferError,
    TransferIntegrityError,
    TransferNotFound,
    TransferPeerGone,
    TransferTimeout,
    TransferUnavailable,
)
from .nixl import NixlAgent, open_agent_if_enabled
from .ticket import (
    DEFAULT_PREFERENCE,
    NIXL,
    SHM,
    TCP,
    Pulled,
    TransferConfig,
    TransferTicket,
    checksum_of,
    choose_backend,
    node_id,
)

log = logging.getLogger("rackserve.kvtransfer")
Buffer = bytearray | memoryview


class KvSink:
    """Pulls KV payloads. Create with `await KvSink.start(config)`."""

    def __init__(self, config: TransferConfig, nixl: NixlAgent | None) -> None:
        self.config = config
        self._nixl = nixl
        self.node_id = node_id()
        self._peers: set[str] = set()

    @classmethod
    async def start(cls, config: TransferConfig | None = None) -> KvSink:
        config = config or TransferConfig()
        nixl = open_agent_if_enabled(
            "sink", NIXL in config.backends, config.nixl_progress_thread, config.nixl_log_level
        )
        return cls(config, nixl)

    @property
    def supported(self) -> list[str]:
        out = [b for b in self.config.backends if b != NIXL]
        return [*out, NIXL] if self._nixl is not None else out

    def choose(
        self, ticket: TransferTicket, preference: list[str] | tuple[str, ...] = DEFAULT_PREFERENCE
    ) -> str:
        same_node = ticket.backends.get(SHM) == self.node_id
        return choose_backend(preference, ticket.backends, self.supported, same_node)

    async def pull(
        self,
        ticket: TransferTicket,
        deadline_s: float,
        backend: str | None = None,
        into: Buffer | None = None,
    ) -> Pulled:
        """Fetch the ticket's payload within deadline_s seconds (backend: default `choose(ticket)`). `into`, if
        given, receives the wire bytes (at least ticket.size long; reusing one avoids page faults per pull)."""
        backend = backend or self.choose(ticket)
        if backend not in self.supported:
            raise TransferUnavailable(f"backend {backend!r} is not enabled on this sink ({self.supported})")
        if into is not None and len(memoryview(into)) < ticket.size:
            raise ValueError(f"into holds {len(memoryview(into))} bytes, the payload needs {ticket.size}")
        buf: Buffer = into if into is not None else bytearray(ticket.size)
        view = memoryview(buf).cast("B")[: ticket.size]
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(deadline_s):
                await self._fetch(ticket, backend, view, into)
                got = await asyncio.to_thread(checksum_of, view, ticket.checksum.split(":")[0])
        except TimeoutError as exc:
            raise TransferTimeout(
                f"pull of {ticket.key} ({ticket.size} bytes over {backend}) missed its {deadline_s}s deadline"
            ) from exc
        seconds = time.perf_counter() - t0
        if got != ticket.checksum:
            raise TransferIntegrityError(
                f"{ticket.key}: checksum {got} on arrival, producer published {ticket.checksum}"
            )
        data: Buffer = view if into is not None else buf
        if ticket.encoding != "raw":
            from . import codec

            data = codec.decode(view, ticket.encoding)
            if len(data) != ticket.raw_size:
                raise TransferIntegrityError(
                    f"{ticket.key}: decoded {len(data)} bytes, producer published {ticket.raw_size}"
                )
        log.debug("pulled %s: %d bytes over %s in %.4fs", ticket.key, ticket.size, backend, seconds)
        return Pulled(data=data, bytes=ticket.size, seconds=seconds, backend=backend)

    async def _fetch(
        self, ticket: TransferTicket, backend: str, view: memoryview, keepalive: object = None
    ) -> None:
        loop = asyncio.get_running_loop()
        host, _, port = ticket.endpoint.rpartition(":")
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        protocol.tune(sock, self.config.socket_buffer_bytes)
        try:
            try:
                await loop.sock_connect(sock, (host.strip("[]"), int(port)))
                await protocol.send_message(sock, {"op": "open", "key": ticket.key, "backend": backend})
                reply = await protocol.recv_message(sock)
            except (OSError, ValueError) as exc:
                raise TransferPeerGone(f"producer {ticket.endpoint} unreachable: {exc}") from exc
            if not reply.get("ok"):
                error = reply.get("error")
                if error == "not_found":
                    raise TransferNotFound(f"producer {ticket.endpoint} does not hold {ticket.key!r}")
                raise TransferUnavailable(f"producer refused {backend} for {ticket.key!r}: {reply}")
            if reply.get("size") != ticket.size or reply.get("checksum") != ticket.checksum:
                raise TransferIntegrityError(
                    f"{ticket.key}: producer now holds {reply.get('size')} bytes / {reply.get('checksum')}, "
                    f"the ticket says {ticket.size} / {ticket.checksum}"
                )
            try:
                if backend == TCP:
                    await protocol.recv_exactly(sock, view)
                    return
                if backend == SHM:
                    await asyncio.to_thread(shm.copy_out, self.config.shm_dir, reply["shm"], view)
                else:
                    await self._nixl_read(ticket, reply["nixl"], view, keepalive)
                await protocol.send_message(sock, {"op": "done"})
            except FileNotFoundError as exc:
                raise TransferNotFound(f"shm segment for {ticket.key!r} is gone: {exc}") from exc
            except OSError as exc:
                raise TransferPeerGone(
                    f"producer {ticket.endpoint} went away during {ticket.key} over {backend}: {exc}"
                ) from exc
        finally:
            sock.close()

    async def _nixl_read(
        self, ticket: TransferTicket, info: dict[str, Any], view: memoryview, keepalive: object
    ) -> None:
        nixl = self._nixl
        assert nixl is not None
        if len(view) == 0:
            return
        local = (int(np.frombuffer(view, dtype=np.uint8).ctypes.data), len(view))
        try:
            if keepalive is not None:  # the caller's reused buffer: register all of it, once
                whole = memoryview(keepalive).cast("B")  # type: ignore[arg-type]
                addr = int(np.frombuffer(whole, dtype=np.uint8).ctypes.data)
                await nixl.call(nixl.register_cached, addr, len(whole), keepalive)
            peer = await nixl.call(nixl.load_peer, base64.b64decode(info["md"]))
            self._peers.add(peer)
            handle, reg, state = await nixl.call(
                nixl.start_read, local, (int(info["addr"]), len(view)), peer, ticket.key.encode()
            )
        except TransferError:
            raise
        except Exception as exc:
            raise nixl.classify(exc) from exc
        try:
            while state == "PROC":
                await asyncio.sleep(self.config.nixl_poll_s)
                state = await nixl.call(nixl.check, handle)
            if state != "DONE":
                raise TransferPeerGone(f"NIXL READ of {ticket.key} ended in state {state}")
        except TransferError:
            raise
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            err = nixl.classify(exc)
            if isinstance(err, TransferPeerGone):
                nixl.submit(nixl.forget_peer, peer)
                self._peers.discard(peer)
            raise err from exc
        finally:
            # Ordered on the agent thread; `view` stays referenced until the handle is released.
            def finish(keep: memoryview = view) -> None:
                nixl.finish_read(handle, reg)

            nixl.submit(finish)

    async def close(self) -> None:
        if self._nixl is not None:
            nixl = self._nixl
            for peer in list(self._peers):
                nixl.submit(nixl.forget_peer, peer)
            self._peers.clear()
            await asyncio.to_thread(nixl.close)
