"""NIXL (UCX underneath) for KV transfer: the source registers payload memory, the sink READs it one-sided.

One NIXL agent per process side, and every call into it runs on one dedicated thread (the agent is created
without NIXL's thread-safety locks). NIXL's progress thread is off by default: it busy-polls most of a core.
Instead the sink polls check_xfer_state from its event loop, and the source polls notifications while a pull is
open (connection setup needs the source to make progress). A pull is one prepared READ per chunk
(prep_xfer_dlist + make_prepped_xfer, all set up in one call on the agent thread); on one host UCX's cma
copies inside the post, which releases the GIL, so the sink hashes chunk i while the agent thread reads i+1.
Agents are torn down explicitly and in reverse order of creation, also at interpreter exit: a NIXL agent
destroyed during interpreter teardown can segfault.

This module must never choose what to transfer or when to free it; source.py and sink.py decide that.
The `ucx-py` bindings are not used: they are not installable from PyPI; NIXL is UCX underneath.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import importlib.util
import logging
import os
import socket
import threading
import uuid
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from .errors import TransferNotFound, TransferPeerGone, TransferUnavailable

log = logging.getLogger("rackserve.kvtransfer")
T = TypeVar("T")

_live: list[weakref.ref[NixlAgent]] = []
_live_lock = threading.Lock()

Memory = tuple[str, int]  # NIXL's memory kind ("DRAM" | "VRAM") and device index (0 for host memory)
DRAM: Memory = ("DRAM", 0)


def memory_of(device: str) -> Memory:
    """The NIXL memory a torch tensor on `device` ("cpu", "cuda", "cuda:1") lies in."""
    kind, _, index = device.partition(":")
    if kind == "cuda":
        return ("VRAM", int(index or 0))
    if kind == "cpu":
        return DRAM
    raise ValueError(f"NIXL cannot register memory of device {device!r}")


NIXL_MODULE = "nixl_cu12"  # NIXL's Python package, as its wheel installs it


def nixl_installed() -> bool:
    """Whether NIXL's package is there to load (without loading it: a worker decides its memory plan by this)."""
    return importlib.util.find_spec(NIXL_MODULE) is not None


def load_nixl(log_level: str = "WARN") -> Any:
    """The nixl_cu12 module, with NIXL's logging kept out of stdout; TransferUnavailable if it cannot load."""
    os.environ.setdefault("NIXL_LOG_LEVEL", log_level)
    try:
        import nixl_cu12  # type: ignore[import-not-found]
    except Exception as exc:  # ImportError, or a missing shared library
        raise TransferUnavailable(f"NIXL is not installed or cannot load: {exc}") from exc
    # NIXL's Python logger writes to stdout at INFO; route it through ours at the configured level.
    nlog = logging.getLogger("nixl")
    nlog.handlers.clear()
    nlog.propagate = True
    nlog.setLevel({"TRACE": 10, "DEBUG": 10, "INFO": 20, "WARN": 30, "ERROR": 40}.get(log_level.upper(), 30))
    return nixl_cu12


class ChunkedRead:
    """One pull's prepared NIXL READs, one per chunk (offset, bytes); owned by the agent thread."""

    def __init__(self, peer: str, reg: Any, chunks: list[tuple[int, int]]) -> None:
        self.peer = peer
        self.reg = reg
        self.chunks = chunks
        self.local: Any = None
        self.remote: Any = None
        self.handles: list[Any] = []


class NixlAgent:
    """A NIXL agent with the UCX backend, owned by one thread; every method is a coroutine for the loop."""

    def __init__(self, role: str, progress_thread: bool, log_level: str) -> None:
        self.closed = False
        self.agent: Any = None
        self._cached: dict[tuple[int, int], tuple[Any, object]] = {}
        self.max_cached_regs = 4
        self.nixl = load_nixl(log_level)
        self.name = f"rackserve-{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="nixl")
        conf = self.nixl.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
        try:
            self.agent = self._thread.submit(self.nixl.nixl_agent, self.name, conf).result()
        except Exception as exc:
            self._thread.shutdown(wait=False)
            raise TransferUnavailable(f"NIXL agent could not start with UCX: {exc}") from exc
        if "UCX" not in self.agent.backends:
            self._close_now()
            raise TransferUnavailable("NIXL has no UCX plugin")
        with _live_lock:
            _live.append(weakref.ref(self))
        log.info("NIXL agent %s up (UCX, progress thread %s)", self.name, "on" if progress_thread else "off")

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        if self.closed:
            raise TransferUnavailable("NIXL agent is closed")
        return await asyncio.wrap_future(self._thread.submit(fn, *args))

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        """Run on the agent thread without waiting (ordered after every earlier call)."""
        return self._thread.submit(fn, *args)

    # --- source side (run on the agent thread) ---
    def register(self, addr: int, size: int, mem: Memory = DRAM) -> tuple[Any, bytes]:
        """Register [addr, +size) of `mem` (host memory, or a GPU's: VRAM) and give its partial metadata, what
        a reader loads to READ it."""
        kind, dev = mem
        descs = self.agent.register_memory([(addr, size, dev, "")], kind)
        return descs, self.agent.get_partial_agent_metadata(descs, True)

    def deregister(self, descs: Any) -> None:
        self.agent.deregister_memory(descs)

    def drain_notifs(self) -> dict[str, list[bytes]]:
        return self.agent.get_new_notifs()  # also makes progress on connection setup

    # --- sink side ---
    def load_peer(self, metadata: bytes) -> str:
        name = self.agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else name  # NIXL returns the name as bytes

    def forget_peer(self, name: str) -> None:
        try:
            self.agent.remove_remote_agent(name)
        except Exception as exc:
            log.debug("NIXL remove_remote_agent(%s): %s", name, exc)

    def register_cached(self, addr: int, size: int, keepalive: object) -> None:
        """Keep a caller's reused receive buffer registered across pulls (registering 64 MiB costs more than
        reading it); the few most recent stay, holding their buffer alive, older ones are deregistered."""
        key = (addr, size)
        if key in self._cached:
            self._cached[key] = self._cached.pop(key)  # most recent last
            return
        self._cached[key] = (self.agent.register_memory([(addr, size, 0, "")], "DRAM"), keepalive)
        while len(self._cached) > self.max_cached_regs:
            old = next(iter(self._cached))
            reg, _ = self._cached.pop(old)
            self.agent.deregister_memory(reg)

    def drop_cached(self) -> None:
        for reg, _ in self._cached.values():
            self.agent.deregister_memory(reg)
        self._cached.clear()

    def prepare_read(
        self,
        local: tuple[int, int],
        remote_addr: int,
        peer_md: bytes,
        chunks: list[tuple[int, int]],
        reused: tuple[int, int, object] | None = None,
        local_mem: Memory = DRAM,
        remote_mem: Memory = DRAM,
    ) -> ChunkedRead:
        """Load the peer's metadata and prepare READs of [remote_addr, +local size) into `local`, one transfer
        per chunk (offset, bytes). `local` is registered for this read only, unless it lies in `reused` (addr,
        size, owner: a caller's receive buffer, kept registered by register_cached) — one hop for all of it.
        Either side may be a GPU's memory (`*_mem`: VRAM and its device index); UCX moves it device to device
        (cuda_ipc on one node, GPUDirect RDMA across nodes) where the hardware allows."""
        if reused is not None:
            self.register_cached(*reused)
        peer = self.load_peer(peer_md)
        addr, size = local
        (lkind, ldev), (rkind, rdev) = local_mem, remote_mem
        cached = local_mem == DRAM and any(a <= addr and addr + size <= a + n for a, n in self._cached)
        reg = None if cached else self.agent.register_memory([(addr, size, ldev, "")], lkind)
        read = ChunkedRead(peer, reg, chunks)
        try:
            read.local = self.agent.prep_xfer_dlist("", [(addr + o, n, ldev) for o, n in read.chunks], lkind)
            read.remote = self.agent.prep_xfer_dlist(
                peer, [(remote_addr + o, n, rdev) for o, n in read.chunks], rkind
            )
            # No notification: a READ with one is not DONE until the target's agent makes progress (the
            # source polls only every nixl_source_poll_s); the control channel's "done" tells the source.
            read.handles = [
                self.agent.make_prepped_xfer("READ", read.local, [i], read.remote, [i])
                for i in range(len(read.chunks))
            ]
        except Exception:
            self.finish_read(read)
            raise
        return read

    def post(self, read: ChunkedRead, i: int) -> str:
        """Start chunk i: 'DONE' when the backend finished it inline (UCX cma on one host), else 'PROC'."""
        return self.agent.transfer(read.handles[i])

    def post_prepared(self, prepared: concurrent.futures.Future[ChunkedRead], i: int) -> str:
        """post() for a read whose prepare_read was submitted just before (so it has finished by now)."""
        return self.post(prepared.result(timeout=0), i)

    def finish_prepared(self, prepared: concurrent.futures.Future[ChunkedRead]) -> None:
        if prepared.done() and not prepared.cancelled() and prepared.exception() is None:
            self.finish_read(prepared.result())

    def check(self, read: ChunkedRead, i: int) -> str:
        return self.agent.check_xfer_state(read.handles[i])

    def finish_read(self, read: ChunkedRead) -> None:
        for handle in read.handles:
            try:
                self.agent.release_xfer_handle(handle)
            except (
                Exception
            ) as exc:  # an in-flight transfer that cannot be cancelled; the agent frees it later
                log.debug("NIXL release_xfer_handle: %s", exc)
        for dlist in (read.local, read.remote):
            if dlist is not None:
                self.agent.release_dlist_handle(dlist)
        if read.reg is not None:
            self.agent.deregister_memory(read.reg)
        read.handles, read.local, read.remote, read.reg = [], None, None, None

    def classify(self, exc: BaseException) -> Exception:
        kind = type(exc).__name__
        if kind == "nixlRemoteDisconnectError":
            return TransferPeerGone(f"NIXL peer disconnected: {exc}")
        if kind == "nixlNotFoundError":
            return TransferNotFound(f"NIXL: remote memory not registered (retracted?): {exc}")
        return TransferPeerGone(f"NIXL transfer failed ({kind}): {exc}")

    # --- teardown ---
    def _close_now(self) -> None:
        agent = self.agent
        self.agent = None

        def drop() -> None:
            nonlocal agent
            agent = None  # the last reference: the C++ agent is destroyed here, on its own thread

        if agent is not None and self._cached:
            try:
                self._thread.submit(self.drop_cached).result(timeout=10)
            except Exception as exc:
                log.debug("NIXL deregistering cached buffers: %s", exc)
        if agent is not None:
            try:
                self._thread.submit(drop).result(timeout=10)
            except RuntimeError:  # interpreter exit: executors take no new work; no other thread uses it now
                drop()
        self._thread.shutdown(wait=True)

    def close(self) -> None:
        """Destroy the agent now (idempotent). Callers deregister their memory first."""
        if self.closed:
            return
        self.closed = True
        try:
            self._close_now()
        except Exception as exc:
            log.warning("NIXL agent %s teardown: %s", self.name, exc)
        log.info("NIXL agent %s closed", self.name)


def open_agent_if_enabled(
    name: str, enabled: bool, progress_thread: bool, log_level: str
) -> NixlAgent | None:
    """The NIXL agent of a source or sink, or None (logged) when NIXL is not enabled or cannot start here:
    the other backends still serve."""
    if not enabled:
        return None
    try:
        return NixlAgent(name, progress_thread, log_level)
    except TransferUnavailable as exc:
        log.warning("KV %s without NIXL: %s", name, exc)
        return None


@atexit.register
def _close_all_agents() -> None:
    # Newest first: a sink created after a source in the same process goes before it.
    with _live_lock:
        refs = list(reversed(_live))
        _live.clear()
    for ref in refs:
        agent = ref()
        if agent is not None and not agent.closed:
            agent.close()
