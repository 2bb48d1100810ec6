"""The producer side of KV transfer: a prefill worker publishes a request's KV bytes under a key and keeps them
readable — over TCP, a same-host shm segment, or a NIXL registration — until it retracts them or their TTL ends.

One KvSource per prefill worker process, driven from its asyncio loop (publish is a coroutine, retract a plain call
made on that loop). A consumer opening a key pins it: retract and expiry free the memory only once no reader holds
it. This module must never interpret the bytes (block layout, dtype) beyond the optional wire encoding, and never
pass over a payload on the loop: publish encodes, copies, checksums and registers it on a publishing thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import itertools
import json
import logging
import secrets
import socket
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from services.runtime.tasks import BackgroundTasks

from . import buffers, protocol, shm
from .budget import DeviceBudget, DeviceRoom
from .control import (
    BAD_REQUEST,
    NOT_FOUND,
    UNAVAILABLE,
    ControlMessageError,
    Done,
    Grant,
    NixlRegion,
    Open,
    Refusal,
)
from .nixl import NixlAgent, memory_of, open_agent_if_enabled
from .ticket import (
    CUDA_IPC,
    NIXL,
    SHM,
    TCP,
    Published,
    TransferConfig,
    TransferTicket,
    checksum_of,
    node_id,
)

log = logging.getLogger("rackserve.kvtransfer")
ACCEPT_RETRY_S = 0.1  # after a failed accept (file descriptors exhausted, say), the next try


@dataclass
class _Publication:
    key: str
    view: memoryview  # the bytes readers get: onto the caller's payload, or onto the shm segment
    owner: Any  # keeps the memory alive (the caller's object or the Segment)
    checksum: str
    encoding: str
    raw_size: int
    expires_unix_ms: int
    serial: str
    segment: shm.Segment | None = None
    nixl_reg: Any = None
    nixl_md: bytes = b""
    addr: int = 0
    # the device tensor (cuda_ipc readers map it, NIXL readers READ it): kept until a device reader has it all
    # (or the publication goes), as it sits in GPU memory outside the cache's plan; later readers get the host
    # bytes
    device_copy: Any = None
    device_room: DeviceRoom | None = None  # what device_copy counts against config.device_copy_bytes
    nixl_dev_reg: Any = None  # the device copy's NIXL registration and its metadata
    nixl_dev_md: bytes = b""
    pins: int = 0
    served: int = 0  # pulls of it that finished (the reader got every byte)
    device_served: bool = False  # a device reader finished: the device copy goes when no reader holds it
    retracted: bool = False
    expiry: asyncio.TimerHandle | None = field(default=None, repr=False)


class KvSource:
    """Holds published payloads and serves pulls. Create with `await KvSource.start(config)`."""

    def __init__(
        self,
        config: TransferConfig,
        listener: socket.socket,
        nixl: NixlAgent | None,
        shm_owner: shm.Owner | None = None,
    ) -> None:
        self.config = config
        self._listener = listener
        self._nixl = nixl
        # this source's claim on the shm segments it makes (their names, and the lock a sweeper checks)
        self._shm_owner = shm_owner
        self._pubs: dict[str, _Publication] = {}
        self._preparing: dict[str, bool] = {}  # keys a publish is preparing -> retracted meanwhile
        # publish's encode, copy, checksum and registrations: two at a time (each is a pass over memory)
        self._publisher = ThreadPoolExecutor(2, thread_name_prefix="kv-publish")
        self._conns = BackgroundTasks()  # one task per control connection being served
        self._nixl_readers = 0
        self._progress: asyncio.Task[None] | None = None
        self._closed = False
        self._warned_device = False
        self._warned_share = False
        # held by publications' device copies, and reserved for copies being made
        self._device = DeviceBudget(config.device_copy_bytes)
        # a publication's serial: which one it is (this source, a counter) and its secret (128 random bits),
        # which a reader must present (Open.serial) and which only the ticket carries
        self._serials = (f"{uuid.uuid4().hex[:12]}-{n}-{secrets.token_hex(16)}" for n in itertools.count(1))
        self.node_id = node_id()
        host, port = listener.getsockname()[:2]
        self.endpoint = f"{config.advertise_host or host}:{port}"
        self._accept = asyncio.get_running_loop().create_task(self._accept_loop())
        self._test_stall_after_bytes: int | None = None
        # Test-only fault hook (the prefill worker's --debug-die-in transfer): called with the key as a pull
        # of it begins, before any reply — a real fault injected at an exact moment of the transfer.
        self.debug_on_pull: Callable[[str], None] | None = None

    @classmethod
    async def start(cls, config: TransferConfig | None = None) -> KvSource:
        config = config or TransferConfig()
        owner = None
        if SHM in config.backends:
            shm.sweep_orphans(config.shm_dir)
            # first: a shm_dir it cannot write fails the start with nothing left open
            owner = shm.Owner(config.shm_dir)
        nixl = open_agent_if_enabled(
            "source", NIXL in config.backends, config.nixl_progress_thread, config.nixl_log_level
        )
        listener = socket.create_server((config.host, config.port), backlog=128)
        listener.setblocking(False)
        source = cls(config, listener, nixl, owner)
        log.info("KV source listening on %s, backends %s", source.endpoint, sorted(source.advertise()))
        return source

    def advertise(self) -> dict[str, str]:
        """Backend -> address, for etcd WorkerInfo.transfer_endpoint (JSON-encode it there)."""
        out = {TCP: self.endpoint}
        if SHM in self.config.backends:
            out[SHM] = self.node_id
        if self._nixl is not None:
            out[NIXL] = self._nixl.name
        return out

    def device_room(self, nbytes: int) -> DeviceRoom | None:
        """Reserve room for a device copy of nbytes, to be kept for device-direct readers: None where no backend
        reads one (cuda_ipc, or NIXL that can register device memory) or it would not fit in
        config.device_copy_bytes beside those held and reserved. A worker reserves before it makes the copy
        and hands the room to publish, which keeps it with the copy; give() it back if no publish takes it
        (giving is idempotent: once taken by a publication, the source gives it when the copy goes)."""
        if CUDA_IPC not in self.config.backends and (self._nixl is None or self._warned_device):
            return None
        return self._device.reserve(nbytes)

    def device_bytes_held(self) -> int:
        return self._device.held

    def live_keys(self) -> list[str]:
        return list(self._pubs)

    def unserved(self) -> list[str]:
        """Keys still published that no reader has pulled yet, and keys a pull is reading right now."""
        return [k for k, pub in self._pubs.items() if pub.served == 0 or pub.pins > 0]

    async def wait_served(self, timeout_s: float, poll_s: float = 0.05) -> list[str]:
        """Wait up to timeout_s until every publication has been pulled at least once (or retracted, or has
        expired): what a draining producer waits for before it exits, so that KV it handed out but nobody has
        read yet is not lost with the process. Returns the keys still unserved ([] when all were)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (left := self.unserved()) and loop.time() < deadline:
            await asyncio.sleep(min(poll_s, max(0.0, deadline - loop.time())))
        return left

    # --- publish / retract ---
    async def publish(
        self,
        key: str,
        payload: bytes | bytearray | memoryview,
        ttl_s: float,
        *,
        compress: str | None = None,
        kv_dtype: str = "fp32",
        head_dim: int = 0,
        device_payload: Any = None,
        device_room: DeviceRoom | None = None,
    ) -> Published:
        """Make `payload` pullable under `key` for `ttl_s` seconds. With shm it is copied into a segment; with
        NIXL (and no shm) from 2 MiB up into huge-page memory (NIXL reads it ~25 % faster than 4 KiB pages);
        otherwise it is not copied: keep it unchanged until retracted. compress="nvfp4"|"fp8" ships it
        quantized along head_dim (kv_dtype is its element type) and the sink hands back the dequantized bytes
        in the same dtype. device_payload, a CUDA tensor holding the same (raw) bytes, is offered to same-node
        readers by CUDA IPC handle when cuda_ipc is enabled, and registered with NIXL (VRAM) when NIXL is: those
        readers copy GPU to GPU and never touch the host bytes. (Any contiguous tensor is registered as the
        memory it lies in; export_kv makes one only on a GPU.)

        The encoding, the copy, the checksum and the registrations run on a publishing thread, not on the loop:
        for a 32 k-token prompt they take a third of a second uncompressed and seconds with compress, and the
        loop meanwhile serves other pulls and the worker's other calls. The key is taken from the start (a
        second publish of it is refused); retracted or closed meanwhile, or the caller cancelled, nothing is
        published and what was prepared is freed (a retract or close raises here)."""
        if self._closed:
            raise RuntimeError("KvSource is closed")
        if key in self._pubs or key in self._preparing:
            raise ValueError(f"key {key!r} is already published; retract it first")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        loop = asyncio.get_running_loop()
        self._preparing[key] = False
        try:
            serial = next(self._serials)  # here: a generator is not for two threads at once
            job = loop.run_in_executor(
                self._publisher,
                self._prepare,
                key,
                serial,
                payload,
                compress,
                kv_dtype,
                head_dim,
                device_payload,
                device_room,
            )
            try:
                pub, ticket = await asyncio.shield(job)
            except asyncio.CancelledError:  # the thread goes on: free what it makes
                job.add_done_callback(self._free_abandoned)
                raise
        finally:
            withdrawn = self._preparing.pop(key)
        if withdrawn or self._closed:
            self._free(pub)
            raise RuntimeError(f"{key}: {'closed' if self._closed else 'retracted'} while being published")
        pub.expiry = loop.call_later(ttl_s, self._expire, key, pub)
        pub.expires_unix_ms = int((time.time() + ttl_s) * 1000)
        self._pubs[key] = pub
        log.debug("published %s: %d bytes (%s), ttl %.1fs", key, len(pub.view), pub.encoding, ttl_s)
        return dataclasses.replace(ticket, expires_unix_ms=pub.expires_unix_ms)

    def _free_abandoned(self, job: asyncio.Future[tuple[_Publication, Published]]) -> None:
        if not job.cancelled() and job.exception() is None:
            self._free(job.result()[0])

    def _prepare(
        self,
        key: str,
        serial: str,
        payload: bytes | bytearray | memoryview,
        compress: str | None,
        kv_dtype: str,
        head_dim: int,
        device_payload: Any,
        device_room: DeviceRoom | None,
    ) -> tuple[_Publication, Published]:
        """publish's work off the loop (on the publishing thread): encode, stage, checksum, register."""
        raw_size = len(memoryview(payload).cast("B"))
        encoding = "raw"
        if compress is not None:
            from . import codec

            payload = codec.encode(payload, compress, kv_dtype, head_dim)
            encoding = compress
        view = memoryview(payload).cast("B")
        owner: Any = payload
        segment = None
        if SHM in self.config.backends:
            assert self._shm_owner is not None
            segment = shm.Segment(self.config.shm_dir, self._shm_owner.segment_name(), view)
            view.release()
            view, owner = segment.view(), segment
        elif self._nixl is not None and len(view) >= buffers.HUGE_PAGE_BYTES:
            staged = buffers.allocate(len(view))
            staged[:] = view  # one memcpy
            view.release()
            view, owner = staged, staged
        pub = _Publication(
            key, view, owner, "", encoding, raw_size, 0, serial, segment
        )  # expiry: on the loop
        try:
            pub.checksum = checksum_of(view, self.config.checksum)
            backends, nixl_device = self._register(pub, device_payload, device_room)
        except BaseException:
            self._free(pub)
            raise
        ticket = TransferTicket(
            key=key,
            size=len(view),
            checksum=pub.checksum,
            endpoint=self.endpoint,
            backends=backends,
            encoding=encoding,
            raw_size=raw_size,
            expires_unix_ms=0,
            serial=pub.serial,
            nixl_addr=pub.addr if pub.nixl_reg is not None else 0,
            agent_metadata=pub.nixl_md,
            nixl_device=nixl_device,
        )
        return pub, ticket

    def _register(
        self, pub: _Publication, device_payload: Any, device_room: DeviceRoom | None = None
    ) -> tuple[dict[str, str], str]:
        """Offer the publication on every backend that can serve it: (backends, the NIXL device copy's device)."""
        key, view = pub.key, pub.view
        backends = {TCP: self.endpoint}
        if pub.segment is not None:
            backends[SHM] = self.node_id
        if self._nixl is not None and len(view) > 0:
            pub.addr = buffers.address_of(view)
            pub.nixl_reg, pub.nixl_md = self._nixl.submit(self._nixl.register, pub.addr, len(view)).result()
            backends[NIXL] = self._nixl.name
        nixl_device = ""
        if device_payload is None or device_payload.numel() == 0:
            if device_room is not None:
                device_room.give()
            return backends, nixl_device
        if not device_payload.is_contiguous():
            raise ValueError(f"{key}: device_payload must be contiguous")
        nbytes = device_payload.numel() * device_payload.element_size()
        if nbytes != pub.raw_size:
            raise ValueError(f"{key}: device_payload has {nbytes} bytes, the payload {pub.raw_size}")
        ipc = CUDA_IPC in self.config.backends and getattr(device_payload, "is_cuda", False)
        if not (ipc or self._nixl is not None):
            if device_room is not None:
                device_room.give()
            return backends, nixl_device
        room = (
            device_room
            if device_room is not None and device_room.nbytes == nbytes
            else self._device.reserve(nbytes)
        )
        if device_room is not None and room is not device_room:
            device_room.give()
        if room is None:  # past the budget: readers get the host bytes
            log.debug("%s: no room for its %d-byte device copy; offered as host bytes", key, nbytes)
            return backends, nixl_device
        pub.device_room = room
        if ipc:  # shared (described) per reader when one opens it: _serve_one
            pub.device_copy = device_payload
            backends[CUDA_IPC] = self.node_id
        if self._nixl is not None:
            nixl_device = str(device_payload.device)
            try:
                pub.nixl_dev_reg, pub.nixl_dev_md = self._nixl.submit(
                    self._nixl.register, device_payload.data_ptr(), nbytes, memory_of(nixl_device)
                ).result()
                pub.device_copy = device_payload
            except Exception as exc:  # e.g. a UCX without CUDA support: readers take the host bytes
                if not self._warned_device:
                    log.warning(
                        "NIXL cannot register %s memory (%s); NIXL readers get host bytes", nixl_device, exc
                    )
                    self._warned_device = True
                nixl_device = ""
        if pub.device_copy is None:  # nothing keeps it: its room goes back
            room.give()
            pub.device_room = None
        return backends, nixl_device

    def _share(self, device_copy: Any) -> str:
        """A cuda_ipc description of the device copy for one reader. torch counts every share until that
        reader's mapping is gone (and keeps the memory until then), so it is made only for a reader that opens;
        made at publication, the copies nobody read over cuda_ipc (remote and host readers, expiries) stayed on
        the GPU for good. A failure is logged once and refuses the open: the reader takes the host bytes."""
        from services.kvtransfer import cuda_ipc

        try:
            return json.dumps(cuda_ipc.describe(device_copy), separators=(",", ":"))
        except Exception as exc:
            if not self._warned_share:
                log.warning("cannot share a KV device copy over cuda_ipc (%s); readers get host bytes", exc)
                self._warned_share = True
            raise

    def retract(self, key: str) -> None:
        """Stop serving `key` (the consumer acknowledged, or the request ended); memory is freed once no reader
        holds it. Unknown keys are ignored: expiry may have come first."""
        if key in self._preparing:  # publish frees it and raises once its thread is done
            self._preparing[key] = True
        pub = self._pubs.pop(key, None)
        if pub is not None:
            self._retire(pub, "retracted")

    def _expire(self, key: str, pub: _Publication) -> None:
        if self._pubs.get(key) is pub:
            del self._pubs[key]
            self._retire(pub, "expired")

    def _retire(self, pub: _Publication, why: str) -> None:
        pub.retracted = True
        if pub.expiry is not None:
            pub.expiry.cancel()
        log.debug("%s %s (%d readers)", why, pub.key, pub.pins)
        if pub.pins == 0:
            self._free(pub)

    def _free_device(self, pub: _Publication) -> None:
        """Let the device copy go (the host bytes stay): it returns to torch's allocator once no IPC reader
        holds it and NIXL has let it go."""
        device_copy, dev_reg = pub.device_copy, pub.nixl_dev_reg
        pub.device_copy = pub.nixl_dev_reg = None
        if pub.device_room is not None:
            pub.device_room.give()
            pub.device_room = None
        if dev_reg is not None and self._nixl is not None and not self._nixl.closed:
            nixl = self._nixl

            def release_device(keep: Any = device_copy) -> None:
                nixl.deregister(dev_reg)

            nixl.submit(release_device)

    def _free(self, pub: _Publication) -> None:
        self._free_device(pub)
        segment, reg, owner = pub.segment, pub.nixl_reg, pub.owner
        if segment is not None:
            segment.unlink()  # the name goes now; the mapping after NIXL lets go of it
        with contextlib.suppress(BufferError):  # a slice still alive in a finished send; GC frees it
            pub.view.release()
        pub.owner = None
        if reg is not None and self._nixl is not None and not self._nixl.closed:

            def release(keep: Any = owner) -> None:  # the memory outlives its registration
                assert self._nixl is not None
                self._nixl.deregister(reg)
                if segment is not None:
                    segment.close()

            self._nixl.submit(release)
        elif segment is not None:
            segment.close()

    def _flip_byte_for_test(self, key: str, offset: int) -> None:
        """Test hook: corrupt one published byte in place (the published checksum stays)."""
        pub = self._pubs[key]
        if pub.segment is not None:
            pub.segment.map[offset] ^= 0xFF
        else:
            pub.view[offset] ^= 0xFF

    # --- serving ---
    async def _accept_loop(self) -> None:
        """Accept control connections for good: a failed accept (out of file descriptors, a connection reset
        before it was taken) is logged and retried, never the end of the listener (it was until 2026-12-07, and
        every later pull of this worker's KV then waited out its deadline)."""
        loop = asyncio.get_running_loop()
        failing = False
        while True:
            try:
                conn, _ = await loop.sock_accept(self._listener)
            except OSError as exc:
                if not failing:
                    log.warning("KV transfer listener: accept failed (%s); retrying", exc)
                failing = True
                await asyncio.sleep(ACCEPT_RETRY_S)
                continue
            failing = False
            try:
                protocol.tune(conn, self.config.socket_buffer_bytes)
            except OSError as exc:
                log.debug("KV pull connection dropped before it was served: %s", exc)
                conn.close()
                continue
            self._conns.spawn(self._serve(conn))

    async def _serve(self, conn: socket.socket) -> None:
        """Serve pulls on one control connection, one after another: a sink keeps its connection for the next
        pull (no connect per pull) until it has been idle for control_idle_s."""
        try:
            timeout = 10.0  # the first open comes right after connect
            while await self._serve_one(conn, timeout):
                timeout = self.config.control_idle_s
        finally:
            conn.close()

    async def _serve_one(self, conn: socket.socket, timeout: float) -> bool:
        """One pull: open, reply, data or the sink's read, done. True when the connection may serve another."""
        # the publication this reader pinned: only a granted open pins, and only its pin comes off at the end (a
        # refused open took another reader's pin until 2026-12-07, freeing the bytes under its read)
        pinned: _Publication | None = None
        nixl_reader = device_reader = False
        try:
            try:
                async with asyncio.timeout(timeout):
                    msg = await protocol.recv_message(conn)
            except ConnectionResetError:
                return False  # the sink closed its idle connection
            try:
                open_ = Open.from_wire(msg)
            except ControlMessageError as exc:  # not an open ("expected open"), or a malformed one
                await protocol.send_message(conn, Refusal(BAD_REQUEST, str(exc)))
                return False
            key, backend = open_.key, open_.backend
            pub = self._pubs.get(key)
            # the serial is the publication's secret: a reader without its ticket learns nothing, not even
            # whether the key is published
            if pub is None or not hmac.compare_digest(open_.serial.encode(), pub.serial.encode()):
                await protocol.send_message(conn, Refusal(NOT_FOUND, key))
                return True
            reply = Grant(len(pub.view), pub.checksum, pub.encoding, pub.serial)
            if backend == SHM and pub.segment is not None:
                reply = dataclasses.replace(reply, shm=pub.segment.name)
            elif backend == NIXL and open_.device:
                if pub.nixl_dev_reg is None or self._nixl is None:
                    await protocol.send_message(conn, Refusal(UNAVAILABLE, f"{backend}: no device copy"))
                    return True
                region = NixlRegion(pub.device_copy.data_ptr(), self._nixl.name, pub.nixl_dev_md)
                reply = dataclasses.replace(reply, nixl=region)
            elif backend == NIXL and pub.nixl_reg is not None and self._nixl is not None:
                md = None if open_.eager else pub.nixl_md  # an eager reader took the metadata from its ticket
                reply = dataclasses.replace(reply, nixl=NixlRegion(pub.addr, self._nixl.name, md))
            elif backend == CUDA_IPC and pub.device_copy is not None and CUDA_IPC in self.config.backends:
                try:  # this reader's own share of the copy (the open pins it)
                    handle = self._share(pub.device_copy)
                except Exception as exc:  # noqa: BLE001 - e.g. an allocator that cannot share: the host bytes
                    await protocol.send_message(conn, Refusal(UNAVAILABLE, f"{backend}: cannot share: {exc}"))
                    return True
                reply = dataclasses.replace(reply, cuda_ipc=True, device_handle=handle)
            elif backend != TCP:
                await protocol.send_message(conn, Refusal(UNAVAILABLE, backend))
                return True
            pub.pins += 1
            pinned = pub
            device_reader = reply.cuda_ipc or (reply.nixl is not None and open_.device)
            if self.debug_on_pull is not None:
                self.debug_on_pull(key)
            # A reader that makes no progress for max_pin_s loses its pin: one that stops reading without
            # closing (a SIGSTOPped decode worker, a stray client) would otherwise block the send for good and
            # hold the publication's memory past its retraction and expiry. A slow reader that keeps reading
            # (a large KV over a slow link) is not cut: the payload's deadline is per chunk.
            async with asyncio.timeout(self.config.max_pin_s):
                await protocol.send_message(conn, reply)
            if backend == TCP:
                await self._send_payload(conn, pub.view)
                pub.served += 1
                return True
            if backend == NIXL:
                nixl_reader = True
                self._nixl_readers += 1
                self._ensure_progress()
            async with asyncio.timeout(self.config.max_pin_s):
                Done.from_wire(await protocol.recv_message(conn))  # or EOF when the reader goes away
            pub.served += 1
            pub.device_served |= device_reader
            return True
        except (OSError, ValueError, TimeoutError) as exc:
            log.debug("KV pull connection ended: %s", exc)
            return False
        finally:
            if nixl_reader:
                self._nixl_readers -= 1
            if pinned is not None:
                pinned.pins -= 1
                if pinned.retracted and pinned.pins == 0:
                    self._free(pinned)
                elif pinned.device_served and pinned.pins == 0 and pinned.device_copy is not None:
                    self._free_device(pinned)

    async def _send_payload(self, conn: socket.socket, view: memoryview) -> None:
        loop = asyncio.get_running_loop()
        stall = self._test_stall_after_bytes
        if stall is not None:
            await loop.sock_sendall(conn, view[:stall])
            await loop.sock_recv(conn, 1)  # stalls until the reader hangs up
            raise ConnectionResetError("test stall: reader hung up")
        # sock_sendall of a memoryview sends from the payload itself: no copy into a transport buffer.
        chunk = self.config.tcp_chunk_bytes
        for start in range(0, len(view), chunk):
            async with asyncio.timeout(
                self.config.max_pin_s
            ):  # no progress for this long: the reader is gone
                await loop.sock_sendall(conn, view[start : start + chunk])

    def _ensure_progress(self) -> None:
        if self._progress is None or self._progress.done():
            self._progress = asyncio.get_running_loop().create_task(self._progress_loop())

    async def _progress_loop(self) -> None:
        # Without NIXL's progress thread, the source must make progress for a reader's connection setup (the
        # READs themselves are one-sided). That happens in the first polls, so the pause doubles up to a cap:
        # polling every millisecond for a whole pull took CPU from the copy on a small machine.
        assert self._nixl is not None
        pause = self.config.nixl_source_poll_s
        while self._nixl_readers > 0 and not self._nixl.closed:
            notifs = await self._nixl.call(self._nixl.drain_notifs)
            if notifs:
                log.debug("NIXL notifications: %s", notifs)
            await asyncio.sleep(pause)
            pause = min(2 * pause, self.config.nixl_source_poll_max_s)

    async def close(self) -> None:
        """Stop serving, free every publication, tear NIXL down. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._accept.cancel()
        if self._progress is not None:
            self._progress.cancel()
        await self._conns.cancel()
        await asyncio.gather(
            self._accept, *([self._progress] if self._progress else []), return_exceptions=True
        )
        self._listener.close()
        # a publish being prepared frees it itself (it sees the source closed); its registrations come first
        await asyncio.to_thread(self._publisher.shutdown, wait=True)
        for key in list(self._pubs):
            self.retract(key)
        if self._nixl is not None:
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(self._nixl.submit(lambda: None))
            await asyncio.to_thread(self._nixl.close)
        if self._shm_owner is not None:
            self._shm_owner.close()
        log.info("KV source %s closed", self.endpoint)
