"""The consumer side of KV transfer: a decode worker pulls a published payload named by a TransferTicket, over
the backend the pair agreed on, and gets it back only once it matches the ticket.

One KvSink per decode worker process, used from its asyncio loop. Every pull has a deadline and ends in a
verified Pulled or one of the typed errors in errors.py. TCP and shm pulls verify the published checksum; NIXL
pulls the size and the publication (serial), and the checksum too with nixl_verify_checksum. This module must
never hand back unverified bytes and never wait past the deadline — a dead producer is an error, not a hang.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from . import buffers, protocol, shm
from .budget import DeviceBudget
from .control import NOT_FOUND, Done, Grant, Open, Refusal, Reply, reply_from_wire
from .errors import (
    TransferError,
    TransferIntegrityError,
    TransferNotFound,
    TransferPeerGone,
    TransferTimeout,
    TransferUnavailable,
)
from .nixl import DRAM, Memory, NixlAgent, memory_of, open_agent_if_enabled
from .ticket import (
    CUDA_IPC,
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
T = TypeVar("T")
MAX_IDLE_PER_PRODUCER = 8  # control connections kept open per producer between pulls


class KvSink:
    """Pulls KV payloads. Create with `await KvSink.start(config)`."""

    def __init__(
        self, config: TransferConfig, nixl: NixlAgent | None, lanes: list[NixlAgent] | None = None
    ) -> None:
        self.config = config
        # the NIXL agents a large READ is split over (empty: no NIXL); the first serves every other READ
        self._lanes = [nixl, *(lanes or [])] if nixl is not None else []
        self.node_id = node_id()
        self._peers: dict[NixlAgent, set[str]] = {}  # peers each agent has loaded
        self._registers: dict[str, bool] = {}  # device -> whether NIXL can register its memory here
        self._idle: dict[
            str, list[tuple[socket.socket, float]]
        ] = {}  # producer endpoint -> (conn, idle since)
        self._device = DeviceBudget(config.device_pull_bytes)  # device-direct pulls not yet dropped
        self._host = DeviceBudget(None)  # host payloads their consumers still hold: the same ledger, no cap

    @classmethod
    async def start(cls, config: TransferConfig | None = None) -> KvSink:
        config = config or TransferConfig()
        nixl = open_agent_if_enabled(
            "sink", NIXL in config.backends, config.nixl_progress_thread, config.nixl_log_level
        )
        lanes: list[NixlAgent] = []
        if nixl is not None:
            for i in range(1, config.nixl_lanes):
                lane = open_agent_if_enabled(
                    f"sink-lane{i}", True, config.nixl_progress_thread, config.nixl_log_level
                )
                if lane is None:
                    break
                lanes.append(lane)
        return cls(config, nixl, lanes)

    def resident_bytes(self, memory: str) -> int:
        """Bytes of payloads this sink pulled that are still alive ("host" or "device" memory): a decode worker's
        KV waiting for blocks or being written, outside its KV cache; back to 0 once the engine has written them
        and let them go. Device payloads are what the pull budget holds."""
        return (self._device if memory == "device" else self._host).held

    def device_bytes_held(self) -> int:
        """Device memory counted against config.device_pull_bytes now."""
        return self._device.held

    def _device_buffer(self, key: str, nbytes: int, make: Callable[[], Any]) -> Any:
        """A fresh device tensor of nbytes for a device-direct pull, counted against config.device_pull_bytes until
        its last holder drops it (the engine, once it has written the KV into its blocks). With no room in that
        budget, or no device memory for it now, TransferUnavailable: the pull reads the host bytes instead, which
        the engine uploads a chunk at a time."""
        import torch

        room = self._device.reserve(nbytes)
        if room is None:
            raise TransferUnavailable(
                f"{key}: its {nbytes}-byte device copy would pass the device-direct pull budget "
                f"({self._device.held} of {self._device.cap} bytes held)"
            )
        try:
            local = make()
        except BaseException as exc:
            room.give()
            if isinstance(exc, torch.cuda.OutOfMemoryError):
                raise TransferUnavailable(f"{key}: no device memory for its copy now ({exc})") from exc
            raise
        room.give_with(local)
        return local

    def _resident_while_alive(self, pulled: Pulled) -> Pulled:
        """Count a host payload as resident until its last holder drops it (a device-direct one is counted by
        the pull budget, from its allocation)."""
        if not pulled.device_direct:
            room = self._host.reserve(int(pulled.data.nbytes))
            assert room is not None  # the ledger has no cap
            room.give_with(pulled.data)
        return pulled

    @property
    def supported(self) -> list[str]:
        out = [b for b in self.config.backends if b not in (NIXL, CUDA_IPC)]
        if CUDA_IPC in self.config.backends and _cuda_visible():
            out.append(CUDA_IPC)
        return [*out, NIXL] if self._lanes else out

    def choose(
        self, ticket: TransferTicket, preference: list[str] | tuple[str, ...] = DEFAULT_PREFERENCE
    ) -> str:
        same_node = self.node_id in (ticket.backends.get(SHM), ticket.backends.get(CUDA_IPC))
        return choose_backend(preference, ticket.backends, self.supported, same_node)

    async def pull(
        self,
        ticket: TransferTicket,
        deadline_s: float,
        backend: str | None = None,
        into: Buffer | None = None,
        device: str | None = None,
    ) -> Pulled:
        """Fetch the ticket's payload within deadline_s seconds (backend: default `choose(ticket)`) and verify it:
        the size always, the published checksum over TCP and shm (NIXL: see nixl_verify_checksum). `into`, if
        given, receives the wire bytes (at least ticket.size long; reusing one avoids page faults per pull, and
        NIXL keeps it registered). Without it the payload lands in a fresh huge-page-backed buffer.
        `device`: where the caller's KV lives (a torch device); over NIXL, a producer's device copy on the same
        kind of device is READ straight into a tensor there (`Pulled.data`), not the host bytes."""
        return self._resident_while_alive(await self._pull(ticket, deadline_s, backend, into, device))

    async def _pull(
        self,
        ticket: TransferTicket,
        deadline_s: float,
        backend: str | None,
        into: Buffer | None,
        device: str | None,
    ) -> Pulled:
        backend = backend or self.choose(ticket)
        if backend not in self.supported:
            raise TransferUnavailable(f"backend {backend!r} is not enabled on this sink ({self.supported})")
        # a device-direct read the producer cannot serve (its device copy went once a device reader had it all,
        # or this process cannot map it, or has no device memory for it now) falls back to the host bytes, which
        # stay published
        if backend == CUDA_IPC:
            try:
                return await self._pull_cuda_ipc(ticket, deadline_s, device)
            except TransferUnavailable as exc:
                backend = self._host_backend(ticket, exc)
        if (
            backend == NIXL
            and device is not None
            and _same_kind(ticket.nixl_device, device)
            and await self._can_register(device)
        ):
            try:
                return await self._pull_nixl_device(ticket, deadline_s, device)
            except TransferUnavailable as exc:
                log.info("%s: no device copy to read (%s); reading its host bytes over nixl", ticket.key, exc)
        if into is not None and len(memoryview(into)) < ticket.size:
            raise ValueError(f"into holds {len(memoryview(into))} bytes, the payload needs {ticket.size}")
        view = (
            memoryview(into).cast("B")[: ticket.size] if into is not None else buffers.allocate(ticket.size)
        )
        kind = checksum_kind(ticket.checksum)
        if backend == NIXL and not self.config.nixl_verify_checksum:
            kind = "none"  # size and publication serial only (TransferConfig.nixl_verify_checksum)
        checksum = Checksum(kind)
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(deadline_s):
                if backend == NIXL and self._may_read_eagerly(ticket, deadline_s):
                    verified = await self._fetch_nixl_eager(ticket, view, into, checksum)
                else:
                    verified = await self._fetch(ticket, backend, view, into, checksum)
                if not verified:
                    await _update_in_slices(checksum, view, self.config.nixl_chunk_bytes)
        except TimeoutError as exc:
            raise TransferTimeout(
                f"pull of {ticket.key} ({ticket.size} bytes over {backend}) missed its {deadline_s}s deadline"
            ) from exc
        seconds = time.perf_counter() - t0
        got = checksum.hexdigest()
        if checksum.kind != "none" and got != ticket.checksum:
            raise TransferIntegrityError(
                f"{ticket.key}: checksum {got} on arrival, producer published {ticket.checksum}"
            )
        data: Buffer = view
        if ticket.encoding != "raw":
            from . import codec

            # off the loop: a long prompt's KV takes a decode worker's loop (every stream on it) 0.1 s and more
            data = await asyncio.to_thread(codec.decode, view, ticket.encoding)
            if len(data) != ticket.raw_size:
                raise TransferIntegrityError(
                    f"{ticket.key}: decoded {len(data)} bytes, producer published {ticket.raw_size}"
                )
        log.debug("pulled %s: %d bytes over %s in %.4fs", ticket.key, ticket.size, backend, seconds)
        return Pulled(data=data, bytes=ticket.size, seconds=seconds, backend=backend)

    def _host_backend(self, ticket: TransferTicket, why: TransferUnavailable) -> str:
        """The backend for the host bytes when cuda_ipc cannot serve: the first other one both sides have."""
        offered = {b: v for b, v in ticket.backends.items() if b != CUDA_IPC}
        same_node = self.node_id in (ticket.backends.get(SHM), ticket.backends.get(CUDA_IPC))
        try:
            backend = choose_backend(
                DEFAULT_PREFERENCE, offered, [b for b in self.supported if b != CUDA_IPC], same_node
            )
        except TransferUnavailable:
            raise why from None
        log.info("%s: cuda_ipc unavailable (%s); reading its host bytes over %s", ticket.key, why, backend)
        return backend

    async def _pull_cuda_ipc(
        self, ticket: TransferTicket, deadline_s: float, device: str | None = None
    ) -> Pulled:
        """GPU to GPU on one node: pin the producer's device copy (the open), map it by its IPC handle, copy it
        into this process's own device memory, wait for the copy, unpin (done). The data is a device tensor
        (raw, never encoded: compression is for the wire, and no wire is crossed). It lands on `device` (the
        caller's cache, when on a GPU), not on the producer's GPU, where this process has no memory to spend."""
        from services.kvtransfer import cuda_ipc

        if device is None or not device.startswith("cuda"):
            # a CPU worker (on a node with GPUs) would copy onto the producer's GPU, outside both memory plans,
            # and then down again: the host bytes are the direct way
            raise TransferUnavailable(
                f"{ticket.key}: cuda_ipc is for a GPU reader; this one's KV is on {device}"
            )

        def copy(description: str) -> Any:
            import torch

            remote = cuda_ipc.open_described(json.loads(description))
            into = torch.device(device)
            # allocated on the current stream (the engine's, which frees it after its import); copied on a side
            # stream, so a large copy does not queue ahead of the engine's steps, after the current stream (the
            # open made it wait for the producer's writes); waited for on that stream alone
            nbytes = remote.numel() * remote.element_size()
            # `into` as this (pool) thread's current device: a stream context on a thread whose current device is
            # still 0 would touch GPU 0, and create a CUDA context there, from a worker on another GPU
            with torch.cuda.device(into):
                local = self._device_buffer(ticket.key, nbytes, lambda: torch.empty_like(remote, device=into))
                side = torch.cuda.Stream(into)
                side.wait_stream(torch.cuda.current_stream(into))
                with torch.cuda.stream(side):
                    local.copy_(remote)  # device to device (peer to peer across GPUs); unmapped with `remote`
                side.synchronize()
            return local

        async def move(sock: socket.socket, reply: Grant) -> Any:
            if not reply.device_handle:
                raise TransferUnavailable(
                    f"{ticket.key}: the producer granted cuda_ipc without a device copy"
                )
            try:
                return await asyncio.to_thread(copy, reply.device_handle)
            except cuda_ipc.CudaIpcUnavailable as exc:
                raise TransferUnavailable(f"{ticket.key}: cuda_ipc: {exc}") from exc
            # the driver's open or the copy failed (IPC namespace, MIG, peer limits)
            except RuntimeError as exc:
                raise TransferUnavailable(f"{ticket.key}: cuda_ipc: {type(exc).__name__}: {exc}") from exc

        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(deadline_s):
                data = await self._exchange(ticket, CUDA_IPC, move)
        except TimeoutError as exc:
            raise TransferTimeout(
                f"pull of {ticket.key} over cuda_ipc missed its {deadline_s}s deadline"
            ) from exc
        nbytes = data.numel() * data.element_size()
        if nbytes != ticket.raw_size:
            raise TransferIntegrityError(
                f"{ticket.key}: device copy has {nbytes} bytes, ticket says {ticket.raw_size}"
            )
        seconds = time.perf_counter() - t0
        log.debug("pulled %s: %d bytes over cuda_ipc in %.4fs", ticket.key, nbytes, seconds)
        return Pulled(data=data, bytes=nbytes, seconds=seconds, backend=CUDA_IPC, device_direct=True)

    async def _can_register(self, device: str) -> bool:
        """Whether this sink's NIXL can register memory on `device` (a UCX built without CUDA cannot register
        VRAM): probed once per device with a page of it; where not, NIXL pulls take the host bytes (logged)."""
        if device not in self._registers:
            import torch

            nixl = self._lanes[0]

            def try_it() -> None:
                probe = torch.empty(4096, dtype=torch.uint8, device=device)
                reg, _ = nixl.register(probe.data_ptr(), 4096, memory_of(str(probe.device)))
                nixl.deregister(reg)

            try:
                await nixl.call(try_it)
                self._registers[device] = True
            except Exception as exc:
                log.warning("NIXL cannot register %s memory (%s); NIXL pulls read host bytes", device, exc)
                self._registers[device] = False
        return self._registers[device]

    async def _pull_nixl_device(self, ticket: TransferTicket, deadline_s: float, device: str) -> Pulled:
        """NIXL, device memory to device memory: open for the producer's device copy (pinned till done), READ it
        into a fresh tensor on `device` (UCX: cuda_ipc on one node, GPUDirect RDMA across nodes), done. Raw
        bytes, never encoded; verified by size and publication serial, as a NIXL READ completes only with every
        byte placed."""
        import torch

        local = self._device_buffer(
            ticket.key,
            ticket.raw_size,
            lambda: torch.empty(ticket.raw_size, dtype=torch.uint8, device=device),
        )
        # the allocator hands out memory freed on the stream while kernels queued there may still use it; UCX
        # (or the NIC) writes outside stream order, so nothing queued may touch this memory when the READ does
        if local.is_cuda:
            await asyncio.to_thread(torch.cuda.synchronize, local.device)
        mems = (memory_of(str(local.device)), memory_of(ticket.nixl_device))

        async def move(sock: socket.socket, reply: Grant) -> None:
            if reply.nixl is None or reply.nixl.md is None:
                raise TransferUnavailable(
                    f"producer granted nixl for {ticket.key!r} without its device region"
                )
            await self._nixl_read(ticket, reply.nixl.addr, reply.nixl.md, local, None, Checksum("none"), mems)

        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(deadline_s):
                await self._exchange(ticket, NIXL, move, device=True)
        except BaseException as exc:
            # a READ cut short (deadline, cancel, error) may still be writing: UCX's cuda_ipc copies on streams
            # of its own that a cancel does not stop. Wait for this device's streams before `local` goes back
            # to the allocator, or the next allocation there could receive memory a copy is still filling
            if local.is_cuda:
                await asyncio.shield(asyncio.to_thread(torch.cuda.synchronize, local.device))
            if isinstance(exc, TimeoutError):
                raise TransferTimeout(
                    f"pull of {ticket.key} ({ticket.raw_size} bytes of device memory over nixl) missed its "
                    f"{deadline_s}s deadline"
                ) from exc
            raise
        seconds = time.perf_counter() - t0
        log.debug(
            "pulled %s: %d bytes device to device over nixl in %.4fs", ticket.key, ticket.raw_size, seconds
        )
        return Pulled(data=local, bytes=ticket.raw_size, seconds=seconds, backend=NIXL, device_direct=True)

    async def _fetch(
        self, ticket: TransferTicket, backend: str, view: memoryview, keepalive: object, checksum: Checksum
    ) -> bool:
        """Fill `view`; True when `checksum` has already been fed every byte (NIXL verifies while reading)."""

        async def move(sock: socket.socket, reply: Grant) -> bool:
            if backend == TCP:
                await protocol.recv_exactly(sock, view)
                # A byte past the size the grant announced is neither this payload's nor a reply to the next open
                # on this connection (which read it as its own until 2026-12-07): the pull fails and the
                # connection closes.
                if protocol.peek(sock):
                    raise TransferIntegrityError(
                        f"producer {ticket.endpoint} sent more than the {ticket.size} bytes it granted for "
                        f"{ticket.key}"
                    )
            elif backend == SHM:
                if reply.shm is None:
                    raise TransferUnavailable(f"producer granted shm for {ticket.key!r} without a segment")
                await asyncio.to_thread(shm.copy_out, self.config.shm_dir, reply.shm, view)
            else:
                if reply.nixl is None or reply.nixl.md is None:
                    raise TransferUnavailable(f"producer granted nixl for {ticket.key!r} without its region")
                return await self._nixl_read(
                    ticket, reply.nixl.addr, reply.nixl.md, view, keepalive, checksum
                )
            return False

        return await self._exchange(ticket, backend, move)

    async def _exchange(
        self,
        ticket: TransferTicket,
        backend: str,
        move: Callable[[socket.socket, Grant], Awaitable[T]],
        device: bool = False,
    ) -> T:
        """One pull's control exchange, whatever moves the data: open (the producer pins the publication; with
        `device`, for its device copy), check the reply, `move` the data, done (unpin; TCP's stream ends by
        itself), and keep the connection for the next pull when the exchange ended cleanly."""
        sock, reply = await self._open(ticket, backend, device=device)
        reusable = False
        try:
            reusable = not reply.ok  # a refusal ends the exchange cleanly
            grant = _check_reply(ticket, backend, reply)
            try:
                out = await move(sock, grant)
                if backend != TCP:
                    await protocol.send_message(sock, Done())
                reusable = True
                return out
            except FileNotFoundError as exc:
                raise TransferNotFound(f"shm segment for {ticket.key!r} is gone: {exc}") from exc
            except OSError as exc:
                raise TransferPeerGone(
                    f"producer {ticket.endpoint} went away during {ticket.key} over {backend}: {exc}"
                ) from exc
            except ValueError as exc:
                if backend != SHM:
                    raise
                # the segment the grant names does not hold what the grant says (it is shorter)
                raise TransferIntegrityError(
                    f"producer {ticket.endpoint}'s grant of {ticket.key} over {backend} does not match its data: "
                    f"{exc}"
                ) from exc
        finally:
            self._put_back(ticket, sock, reusable)

    def _put_back(self, ticket: TransferTicket, sock: socket.socket, reusable: bool) -> None:
        idle = self._idle.setdefault(ticket.endpoint, [])
        if reusable and len(idle) < MAX_IDLE_PER_PRODUCER:  # the producer waits for the next open on it
            idle.append((sock, time.monotonic()))
        else:  # mid-exchange (error, deadline, cancel): closing it unpins the payload on the producer
            sock.close()

    def _may_read_eagerly(self, ticket: TransferTicket, deadline_s: float) -> bool:
        """Whether a NIXL pull may READ before the producer's reply: the ticket names the registered region
        and its publication, and the payload is not due to expire while this pull may still be reading (a READ
        that races an expiry is refused all the same, but across nodes it would touch a deregistered region)."""
        expires_in_s = ticket.expires_unix_ms / 1000 - time.time() if ticket.expires_unix_ms else float("inf")
        return (
            self.config.nixl_eager_read
            and ticket.nixl_addr != 0
            and bool(ticket.serial)
            and bool(ticket.agent_metadata)
            and expires_in_s > deadline_s
        )

    async def _fetch_nixl_eager(
        self, ticket: TransferTicket, view: memoryview, keepalive: object, checksum: Checksum
    ) -> bool:
        """A NIXL pull without waiting for the open's reply: the open goes out, the READ of the ticket's region
        starts at once, and the reply is read while the bytes arrive. The bytes count only if the reply says
        the producer holds this very publication (same serial, size, checksum): a publication still held when
        the open arrives was never freed since the ticket was issued, and the open pins it until our done, so
        the region stayed valid for the whole READ. Otherwise the READ's bytes (or its error) are discarded
        and the reply's refusal is raised — a payload that is gone is TransferNotFound, never data."""
        read = self._nixl_start(ticket.nixl_addr, ticket.agent_metadata, view, keepalive, checksum)
        try:
            sock, reused = await self._send_open(ticket, NIXL, eager=True)  # while the agent thread reads
        except BaseException:
            read.release()
            raise
        reusable = False
        reply_task = asyncio.ensure_future(protocol.recv_message(sock))
        read_task = asyncio.ensure_future(self._nixl_complete(ticket, read, checksum))
        read_task.add_done_callback(lambda _: read.release())
        try:
            # A refusal ends the READ at once: a producer that does not hold the key does not make the NIXL
            # progress a first READ from this sink needs, so waiting for the READ would only wait for the deadline.
            await asyncio.wait((reply_task, read_task), return_when=asyncio.FIRST_COMPLETED)
            try:
                reply = reply_from_wire(await reply_task)
            except (OSError, ValueError) as exc:
                if not reused:
                    raise TransferPeerGone(
                        f"producer {ticket.endpoint} went away during {ticket.key}"
                    ) from exc
                # A kept connection the producer had closed: confirm on a fresh one (held now means held since
                # the ticket was issued; the new pin covers the rest of the READ).
                sock.close()
                sock, reply = await self._open(ticket, NIXL, eager=True)
            if not reply.ok:
                reusable = True
            _check_reply(ticket, NIXL, reply)
            await read_task  # its error, if any, now stands: the producer held this publication throughout
            try:
                await protocol.send_message(sock, Done())
            except OSError as exc:
                raise TransferPeerGone(f"producer {ticket.endpoint} went away after {ticket.key}") from exc
            reusable = True
            return True
        finally:
            for task in (reply_task, read_task):
                task.add_done_callback(_discard_outcome)  # a refused READ's error is no unhandled one
                task.cancel()
            self._put_back(ticket, sock, reusable)

    async def _open(
        self, ticket: TransferTicket, backend: str, eager: bool = False, device: bool = False
    ) -> tuple[socket.socket, Reply]:
        """Send the open and read the reply, on an idle connection to this producer if one is kept (a stale
        one — the producer closed it or restarted — is dropped and the open retried on a new connection)."""
        while True:
            sock, reused = await self._send_open(ticket, backend, eager, device)
            try:
                return sock, reply_from_wire(await protocol.recv_message(sock))
            except (OSError, ValueError) as exc:  # a garbled or malformed reply too (ControlMessageError)
                sock.close()
                if not reused:
                    raise TransferPeerGone(f"producer {ticket.endpoint} unreachable: {exc}") from exc
            except BaseException:
                sock.close()
                raise

    async def _send_open(
        self, ticket: TransferTicket, backend: str, eager: bool = False, device: bool = False
    ) -> tuple[socket.socket, bool]:
        """Send an open on a kept idle connection to the producer (True: reused) or on a new one."""
        msg = Open(ticket.key, ticket.serial, backend, eager, device)
        idle = self._idle.get(ticket.endpoint, [])
        while idle:
            sock, since = idle.pop()
            # the producer may be closing it; or it closed it, or sent bytes after an exchange had ended
            if time.monotonic() - since > self.config.control_idle_s / 2 or protocol.peek(sock) is not None:
                sock.close()
                continue
            try:
                await protocol.send_message(sock, msg)
                return sock, True
            except OSError:
                sock.close()
            except BaseException:
                sock.close()
                raise
        loop = asyncio.get_running_loop()
        host, _, port = ticket.endpoint.rpartition(":")
        try:
            # out of file descriptors is a pull that failed, which the caller rebuilds, not a bug (INTERNAL)
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        except OSError as exc:
            raise TransferPeerGone(f"no socket for producer {ticket.endpoint}: {exc}") from exc
        try:
            protocol.tune(sock, self.config.socket_buffer_bytes)
            await loop.sock_connect(sock, (host.strip("[]"), int(port)))
            await protocol.send_message(sock, msg)
            return sock, False
        except (OSError, ValueError) as exc:
            sock.close()
            raise TransferPeerGone(f"producer {ticket.endpoint} unreachable: {exc}") from exc
        except BaseException:
            sock.close()
            raise

    async def _nixl_read(
        self,
        ticket: TransferTicket,
        remote_addr: int,
        peer_md: bytes,
        view: Any,
        keepalive: object,
        checksum: Checksum,
        mems: tuple[Memory, Memory] = (DRAM, DRAM),
    ) -> bool:
        """READ the payload in chunks, all posted at once; the checksum takes chunk i while the agent thread is
        still reading chunk i+1 (UCX cma copies inline in the post), so the check overlaps the copy. `view`: a
        memoryview, or a contiguous tensor (read unchecked), in the memory `mems[0]` names (`mems[1]`: the
        producer's)."""
        read = self._nixl_start(remote_addr, peer_md, view, keepalive, checksum, mems)
        try:
            return await self._nixl_complete(ticket, read, checksum)
        finally:
            read.release()

    def _nixl_start(
        self,
        remote_addr: int,
        peer_md: bytes,
        view: Any,
        keepalive: object,
        checksum: Checksum,
        mems: tuple[Memory, Memory] = (DRAM, DRAM),
    ) -> _PendingRead:
        """Split the READ into one contiguous part per lane (one part below nixl_lane_min_bytes, when the
        checksum is verified, or for device memory), and submit each part's preparation and chunk posts to its
        lane's agent thread; return at once."""
        if isinstance(view, memoryview):
            addr, length = buffers.address_of(view), len(view)
        else:  # a tensor: its bytes are never hashed here
            addr, length = view.data_ptr(), view.numel() * view.element_size()
            if checksum.kind != "none":
                raise ValueError("a NIXL READ into a tensor is not checksummed")
        # A checked READ stays on one lane: its chunks are hashed in payload order while later ones are read,
        # and a second lane's bytes would all wait for the first lane's hashing (measured slower, not faster).
        # Lanes split a host copy over cores; a device copy is the copy engine's or the NIC's, one lane does.
        split = length >= self.config.nixl_lane_min_bytes and checksum.kind == "none" and mems == (DRAM, DRAM)
        lanes = self._lanes if split else self._lanes[:1]
        bounds = lane_bounds(length, len(lanes))
        reused = None
        if (
            keepalive is not None and bounds
        ):  # the caller's reused buffer: each agent registers all of it, once
            whole = memoryview(keepalive).cast("B")  # type: ignore[arg-type]
            reused = (buffers.address_of(whole), len(whole), keepalive)
        parts = []
        for nixl, (start, size) in zip(lanes, bounds, strict=False):
            chunk = self.config.nixl_chunk_bytes if checksum.kind != "none" else size
            chunks = read_chunks(size, chunk)
            local = (addr + start, size)
            prepared = nixl.submit(
                nixl.prepare_read, local, remote_addr + start, peer_md, chunks, reused, mems[0], mems[1]
            )
            # Queued right behind the preparation, so the agent thread starts reading without a round trip back
            # to this loop; a failed preparation fails every post with its error.
            posts = [nixl.submit(nixl.post_prepared, prepared, i) for i in range(len(chunks))]
            parts.append(_LanePart(nixl, start, prepared, posts, chunks))
        return _PendingRead(parts, view)

    async def _nixl_complete(self, ticket: TransferTicket, read: _PendingRead, checksum: Checksum) -> bool:
        """Wait for each chunk of a started READ, lane by lane in payload order, feeding it to the checksum as
        it lands (the later lanes keep reading meanwhile)."""
        view = read.view
        for part in read.parts:
            nixl = part.nixl
            try:
                prepared = await asyncio.wrap_future(part.prepared)
            except Exception as exc:
                if isinstance(exc, TransferError):
                    raise
                raise nixl.classify(exc) from exc
            self._peers.setdefault(nixl, set()).add(prepared.peer)
            try:
                for i, (offset, size) in enumerate(part.chunks):
                    state = await asyncio.wrap_future(part.posts[i])
                    while state == "PROC":
                        await asyncio.sleep(self.config.nixl_poll_s)
                        state = await nixl.call(nixl.check, prepared, i)
                    if state != "DONE":
                        raise TransferPeerGone(f"NIXL READ of {ticket.key} ended in state {state}")
                    if checksum.kind != "none":
                        checksum.update(view[part.start + offset : part.start + offset + size])
            except (TransferError, asyncio.CancelledError):
                raise
            except Exception as exc:
                err = nixl.classify(exc)
                if isinstance(err, TransferPeerGone):
                    nixl.submit(nixl.forget_peer, prepared.peer)
                    self._peers.get(nixl, set()).discard(prepared.peer)
                raise err from exc
        return True

    async def close(self) -> None:
        for conns in self._idle.values():
            for sock, _ in conns:
                sock.close()
        self._idle.clear()
        for nixl in reversed(self._lanes):
            for peer in self._peers.pop(nixl, set()):
                nixl.submit(nixl.forget_peer, peer)
            await asyncio.to_thread(nixl.close)


@dataclass
class _LanePart:
    """One lane's share of a READ: bytes [start, start + its chunks) of the payload, on that lane's agent."""

    nixl: NixlAgent
    start: int
    prepared: concurrent.futures.Future[Any]
    posts: list[concurrent.futures.Future[Any]]
    chunks: list[tuple[int, int]]  # (offset from start, bytes)


class _PendingRead:
    """A NIXL READ handed to the lanes' agent threads: per lane, its preparation and one post per chunk.
    release() (once) drops the posts not started yet and frees the handles behind every started one; `view`
    lives until then."""

    def __init__(self, parts: list[_LanePart], view: Any) -> None:
        self.parts, self.view = parts, view
        self.released = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        view = self.view
        for part in self.parts:
            for post in part.posts:
                post.cancel()  # the ones not started yet (a failure or the deadline came first)

            # ordered on the lane's agent thread after every post of the lane; `view` stays referenced till then
            def finish(part: _LanePart = part, keep: Any = view) -> None:
                part.nixl.finish_prepared(part.prepared)

            part.nixl.submit(finish)


def _cuda_visible() -> bool:
    """torch with a GPU in this process (torch is imported only here, and only when cuda_ipc is enabled)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _same_kind(a: str, b: str) -> bool:
    """Two torch devices ("cuda:0", "cuda:1", "cpu") of the same kind; False when either is ""."""
    return bool(a) and bool(b) and a.partition(":")[0] == b.partition(":")[0]


def _discard_outcome(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def lane_bounds(size: int, lanes: int) -> list[tuple[int, int]]:
    """(start, bytes) of each lane's contiguous part of a `size`-byte READ: page-aligned starts, the last part
    ragged; fewer parts than lanes when the payload is too small to give each a page, none when it is empty."""
    if size == 0:
        return []
    step = -(-size // lanes // 4096) * 4096
    return [(start, min(step, size - start)) for start in range(0, size, step)]


def read_chunks(size: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """(offset, bytes) of a checked READ: chunks of chunk_bytes, the last one split in halves down to an
    eighth, so the hash of the final piece — the only one not overlapped with reading — is short."""
    if size <= chunk_bytes:
        return [(0, size)]
    body = (size - 1) // chunk_bytes * chunk_bytes  # whole chunks before the last (partial or full) one
    out = [(off, chunk_bytes) for off in range(0, body, chunk_bytes)]
    off, piece = body, chunk_bytes // 2
    while size - off > piece > 0 and piece >= chunk_bytes // 8:
        out.append((off, piece))
        off += piece
        piece //= 2
    out.append((off, size - off))
    return out


def _check_reply(ticket: TransferTicket, backend: str, reply: Reply) -> Grant:
    """The grant, if it is for the publication the ticket names; else the typed error for a refused open or for
    a producer that now holds another publication."""
    if isinstance(reply, Refusal):
        if reply.error == NOT_FOUND:
            raise TransferNotFound(f"producer {ticket.endpoint} does not hold {ticket.key!r}")
        raise TransferUnavailable(f"producer refused {backend} for {ticket.key!r}: {reply.to_wire()}")
    if ticket.serial and reply.serial != ticket.serial:  # a source refuses another serial; older ones did not
        raise TransferNotFound(
            f"producer {ticket.endpoint} no longer holds the publication of {ticket.key!r} this ticket names"
        )
    if reply.size != ticket.size or reply.checksum != ticket.checksum:
        raise TransferIntegrityError(
            f"{ticket.key}: producer now holds {reply.size} bytes / {reply.checksum}, "
            f"the ticket says {ticket.size} / {ticket.checksum}"
        )
    return reply


async def _update_in_slices(checksum: Checksum, view: memoryview, slice_bytes: int) -> None:
    """Feed the whole payload to the checksum a slice at a time, yielding to the loop in between (xxhash holds
    the GIL, so one 64 MiB call would stall every other coroutine for its whole duration)."""
    if checksum.kind == "none":
        return
    for start in range(0, len(view), slice_bytes):
        checksum.update(view[start : start + slice_bytes])
        await asyncio.sleep(0)
