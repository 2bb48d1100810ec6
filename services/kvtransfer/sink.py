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

from . import buffers, protocol, shm
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
    Checksum,
    Pulled,
    TransferConfig,
    TransferTicket,
    checksum_kind,
    choose_backend,
    node_id,
)

log = logging.getLogger("rackserve.kvtransfer")
Buffer = bytearray | memoryview
MAX_IDLE_PER_PRODUCER = 8  # control connections kept open per producer between pulls


class KvSink:
    """Pulls KV payloads. Create with `await KvSink.start(config)`."""

    def __init__(self, config: TransferConfig, nixl: NixlAgent | None) -> None:
        self.config = config
        self._nixl = nixl
        self.node_id = node_id()
        self._peers: set[str] = set()
        self._idle: dict[
            str, list[tuple[socket.socket, float]]
        ] = {}  # producer endpoint -> (conn, idle since)

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
        given, receives the wire bytes (at least ticket.size long; reusing one avoids page faults per pull, and
        NIXL keeps it registered). Without it the payload lands in a fresh huge-page-backed buffer."""
        backend = backend or self.choose(ticket)
        if backend not in self.supported:
            raise TransferUnavailable(f"backend {backend!r} is not enabled on this sink ({self.supported})")
        if into is not None and len(memoryview(into)) < ticket.size:
            raise ValueError(f"into holds {len(memoryview(into))} bytes, the payload needs {ticket.size}")
        view = (
            memoryview(into).cast("B")[: ticket.size] if into is not None else buffers.allocate(ticket.size)
        )
        checksum = Checksum(checksum_kind(ticket.checksum))
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(deadline_s):
                verified = await self._fetch(ticket, backend, view, into, checksum)
                if not verified:
                    await _update_in_slices(checksum, view, self.config.nixl_chunk_bytes)
        except TimeoutError as exc:
            raise TransferTimeout(
                f"pull of {ticket.key} ({ticket.size} bytes over {backend}) missed its {deadline_s}s deadline"
            ) from exc
        seconds = time.perf_counter() - t0
        got = checksum.hexdigest()
        if got != ticket.checksum:
            raise TransferIntegrityError(
                f"{ticket.key}: checksum {got} on arrival, producer published {ticket.checksum}"
            )
        data: Buffer = view
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
        self, ticket: TransferTicket, backend: str, view: memoryview, keepalive: object, checksum: Checksum
    ) -> bool:
        """Fill `view`; True when `checksum` has already been fed every byte (NIXL verifies while reading)."""
        sock, reply = await self._open(ticket, backend)
        reusable = False
        try:
            if not reply.get("ok"):
                reusable = True
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
                verified = False
                if backend == TCP:
                    await protocol.recv_exactly(sock, view)
                elif backend == SHM:
                    await asyncio.to_thread(shm.copy_out, self.config.shm_dir, reply["shm"], view)
                else:
                    verified = await self._nixl_read(ticket, reply["nixl"], view, keepalive, checksum)
                if backend != TCP:
                    await protocol.send_message(sock, {"op": "done"})
                reusable = True
                return verified
            except FileNotFoundError as exc:
                raise TransferNotFound(f"shm segment for {ticket.key!r} is gone: {exc}") from exc
            except OSError as exc:
                raise TransferPeerGone(
                    f"producer {ticket.endpoint} went away during {ticket.key} over {backend}: {exc}"
                ) from exc
        finally:
            idle = self._idle.setdefault(ticket.endpoint, [])
            if reusable and len(idle) < MAX_IDLE_PER_PRODUCER:  # the producer waits for the next open on it
                idle.append((sock, time.monotonic()))
            else:  # mid-exchange (error, deadline, cancel): closing it unpins the payload on the producer
                sock.close()

    async def _open(self, ticket: TransferTicket, backend: str) -> tuple[socket.socket, dict[str, Any]]:
        """Send the open and read the reply, on an idle connection to this producer if one is kept (a stale
        one — the producer closed it or restarted — is dropped and the open retried on a new connection)."""
        idle = self._idle.get(ticket.endpoint, [])
        while idle:
            sock, since = idle.pop()
            if time.monotonic() - since > self.config.control_idle_s / 2:  # the producer may be closing it
                sock.close()
                continue
            try:
                return sock, await self._exchange_open(sock, ticket, backend)
            except (OSError, ValueError):
                sock.close()
            except BaseException:
                sock.close()
                raise
        loop = asyncio.get_running_loop()
        host, _, port = ticket.endpoint.rpartition(":")
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        protocol.tune(sock, self.config.socket_buffer_bytes)
        try:
            await loop.sock_connect(sock, (host.strip("[]"), int(port)))
            return sock, await self._exchange_open(sock, ticket, backend)
        except (OSError, ValueError) as exc:
            sock.close()
            raise TransferPeerGone(f"producer {ticket.endpoint} unreachable: {exc}") from exc
        except BaseException:
            sock.close()
            raise

    @staticmethod
    async def _exchange_open(sock: socket.socket, ticket: TransferTicket, backend: str) -> dict[str, Any]:
        await protocol.send_message(sock, {"op": "open", "key": ticket.key, "backend": backend})
        return await protocol.recv_message(sock)

    async def _nixl_read(
        self,
        ticket: TransferTicket,
        info: dict[str, Any],
        view: memoryview,
        keepalive: object,
        checksum: Checksum,
    ) -> bool:
        """READ the payload in chunks, all posted at once; the checksum takes chunk i while the agent thread is
        still reading chunk i+1 (UCX cma copies inline in the post), so the check overlaps the copy."""
        nixl = self._nixl
        assert nixl is not None
        if len(view) == 0:
            return True
        chunk = self.config.nixl_chunk_bytes if checksum.kind != "none" else len(view)
        reused = None
        if keepalive is not None:  # the caller's reused buffer: register all of it, once
            whole = memoryview(keepalive).cast("B")  # type: ignore[arg-type]
            reused = (buffers.address_of(whole), len(whole), keepalive)
        prepared = nixl.submit(
            nixl.prepare_read,
            (buffers.address_of(view), len(view)),
            int(info["addr"]),
            base64.b64decode(info["md"]),
            chunk,
            reused,
        )
        # Queued right behind the preparation, so the agent thread starts reading without a round trip back to
        # this loop; a failed preparation fails every post with its error.
        posts = [nixl.submit(nixl.post_prepared, prepared, i) for i in range(0, -(-len(view) // chunk))]
        try:
            read = await asyncio.wrap_future(prepared)
        except BaseException as exc:
            for post in posts:
                post.cancel()
            nixl.submit(nixl.finish_prepared, prepared)  # a preparation that completes after a cancel
            if isinstance(exc, TransferError) or not isinstance(exc, Exception):
                raise
            raise nixl.classify(exc) from exc
        self._peers.add(read.peer)
        try:
            for i, (offset, size) in enumerate(read.chunks):
                state = await asyncio.wrap_future(posts[i])
                while state == "PROC":
                    await asyncio.sleep(self.config.nixl_poll_s)
                    state = await nixl.call(nixl.check, read, i)
                if state != "DONE":
                    raise TransferPeerGone(f"NIXL READ of {ticket.key} ended in state {state}")
                checksum.update(view[offset : offset + size])
        except TransferError:
            raise
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            err = nixl.classify(exc)
            if isinstance(err, TransferPeerGone):
                nixl.submit(nixl.forget_peer, read.peer)
                self._peers.discard(read.peer)
            raise err from exc
        finally:
            for post in posts:
                post.cancel()  # the ones not started yet (a failure or the deadline came first)

            # Ordered on the agent thread after every post; `view` stays referenced until the handles go.
            def finish(keep: memoryview = view) -> None:
                nixl.finish_read(read)

            nixl.submit(finish)
        return True

    async def close(self) -> None:
        for conns in self._idle.values():
            for sock, _ in conns:
                sock.close()
        self._idle.clear()
        if self._nixl is not None:
            nixl = self._nixl
            for peer in list(self._peers):
                nixl.submit(nixl.forget_peer, peer)
            self._peers.clear()
            await asyncio.to_thread(nixl.close)


async def _update_in_slices(checksum: Checksum, view: memoryview, slice_bytes: int) -> None:
    """Feed the whole payload to the checksum a slice at a time, yielding to the loop in between (xxhash holds
    the GIL, so one 64 MiB call would stall every other coroutine for its whole duration)."""
    if checksum.kind == "none":
        return
    for start in range(0, len(view), slice_bytes):
        checksum.update(view[start : start + slice_bytes])
        await asyncio.sleep(0)
