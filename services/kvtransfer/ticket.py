"""What both ends of a KV transfer agree on: configuration, the ticket that travels in a KvHandle, the result
of a pull, the checksum, and the choice of backend for a producer/consumer pair.

Plain data and pure functions only; this module must never open a socket, map memory or import NIXL or torch.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import zlib
from dataclasses import dataclass, field
from typing import Any

import xxhash

TCP, SHM, NIXL, CUDA_IPC = "tcp", "shm", "nixl", "cuda_ipc"
BACKENDS = (CUDA_IPC, SHM, NIXL, TCP)
# Same node first — GPU to GPU by CUDA IPC handle when both caches are on GPUs, else one copy through the page
# cache —, then NIXL (one-sided READ; RDMA across nodes), TCP last.
DEFAULT_PREFERENCE = (CUDA_IPC, SHM, NIXL, TCP)
SAME_NODE_ONLY = (CUDA_IPC, SHM)
CHECKSUMS = ("xxh3", "crc32", "none")
ENCODINGS = ("raw", "nvfp4", "fp8")


@dataclass
class TransferConfig:
    """One producer's or consumer's transfer settings. Defaults work on a laptop: TCP + shm, NIXL if installed."""

    backends: tuple[str, ...] = (TCP, SHM, NIXL)  # the ones to open; NIXL is skipped if it cannot load
    host: str = "127.0.0.1"  # the TCP control/data listener (source side)
    port: int = 0  # 0: any free port
    advertise_host: str | None = None  # what peers dial; default: host
    # xxh3 (64-bit xxHash) runs at ~10 GB/s per core, crc32 (zlib) at ~2 GB/s; "none" checks only the size.
    # Source: what publish computes. Sink: TCP and shm pulls verify it on arrival.
    checksum: str = "xxh3"
    # Sink: NIXL pulls verify the size and the publication serial, not the checksum: the READ completes only
    # with every byte placed (cma: a kernel copy on one host; RDMA: per-packet ICRC end to end) — see README.
    # True: also verify the published checksum, chunk by chunk while later chunks are still being read.
    nixl_verify_checksum: bool = False
    # NIXL's own progress thread busy-polls most of a core; off by default, the asyncio loop polls instead.
    nixl_progress_thread: bool = False
    nixl_poll_s: float = 0.0005  # sink: pause between check_xfer_state polls
    nixl_source_poll_s: float = 0.001  # source: first pause between progress polls while a NIXL pull is open
    nixl_source_poll_max_s: float = 0.05  # ... doubling up to this
    # Sink: agents (each with its own thread and UCX connection) that split one large NIXL READ into contiguous
    # parts read in parallel. On one host cma copies in the reader's thread, so one lane is bounded by one
    # core's copy speed; two reach ~1.5x a memcpy here. 1: a single agent.
    nixl_lanes: int = 2
    nixl_lane_min_bytes: int = 8 << 20  # payloads smaller than this use one lane
    nixl_chunk_bytes: int = 8 << 20  # NIXL READs of a checked payload: hash chunk i while chunk i+1 is read
    # NIXL pulls start the READ from the ticket's address and metadata while the open is still on its way,
    # and hand the bytes back only once the producer's reply confirms the same publication was held (see
    # sink.py). False: wait for the reply (the pin) before reading.
    nixl_eager_read: bool = True
    nixl_log_level: str = "WARN"  # NIXL_LOG_LEVEL for the process, unless already set
    shm_dir: str = "/dev/shm"
    tcp_chunk_bytes: int = 4 << 20
    socket_buffer_bytes: int = 4 << 20
    # a consumer holding a key this long without reading (or, over NIXL/shm/cuda_ipc, without saying it is done)
    # loses its pin
    max_pin_s: float = 60.0
    # Source: device memory the device copies of publications (for cuda_ipc and NIXL VRAM readers) may take at
    # once; a publication past it is offered as host bytes only. None: no limit.
    device_copy_bytes: int | None = None
    # Sink: device memory device-direct pulls (cuda_ipc, NIXL VRAM) may hold at once, from the pull until their
    # consumer drops the tensor (a decode worker's engine, once it has written the KV into its blocks); a pull
    # past it reads the host bytes. None: no limit.
    device_pull_bytes: int | None = None
    control_idle_s: float = 30.0  # a control connection idle this long between pulls is closed (both sides)

    def __post_init__(self) -> None:
        unknown = [b for b in self.backends if b not in BACKENDS]
        if unknown:
            raise ValueError(f"TransferConfig.backends: unknown {unknown}; known: {list(BACKENDS)}")
        if self.checksum not in CHECKSUMS:
            raise ValueError(f"TransferConfig.checksum must be one of {CHECKSUMS}, got {self.checksum!r}")
        if self.nixl_lanes < 1:
            raise ValueError(f"TransferConfig.nixl_lanes must be at least 1, got {self.nixl_lanes}")
        if self.nixl_chunk_bytes <= 0:
            raise ValueError(f"TransferConfig.nixl_chunk_bytes must be positive, got {self.nixl_chunk_bytes}")
        if TCP not in self.backends:
            # The TCP listener is also the control channel every backend opens a pull with.
            self.backends = (*self.backends, TCP)


class Checksum:
    """An incremental checksum of one kind: update() with consecutive pieces, then hexdigest() gives the same
    value as checksum_of(all the pieces) — so a sink can verify chunks as they arrive."""

    def __init__(self, kind: str) -> None:
        if kind not in CHECKSUMS:
            raise ValueError(f"unknown checksum kind {kind!r}; known: {list(CHECKSUMS)}")
        self.kind = kind
        self._xxh3 = xxhash.xxh3_64() if kind == "xxh3" else None
        self._crc = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        if self._xxh3 is not None:
            self._xxh3.update(data)
        elif self.kind == "crc32":
            self._crc = zlib.crc32(data, self._crc)

    def hexdigest(self) -> str:
        """'xxh3:<16 hex>', 'crc32:<8 hex>' or 'none'."""
        if self._xxh3 is not None:
            return f"xxh3:{self._xxh3.intdigest():016x}"
        if self.kind == "crc32":
            return f"crc32:{self._crc:08x}"
        return "none"


def checksum_kind(checksum: str) -> str:
    """The kind a published checksum string was made with ('xxh3:…' -> 'xxh3')."""
    return checksum.split(":", 1)[0]


def checksum_of(data: bytes | bytearray | memoryview, kind: str) -> str:
    """'xxh3:<16 hex>', 'crc32:<8 hex>' or 'none'. zlib.crc32 releases the GIL; xxhash holds it (but is ~5x
    faster), so feed large payloads to a Checksum in pieces where the caller's loop must stay responsive."""
    c = Checksum(kind)
    c.update(data)
    return c.hexdigest()


@dataclass(frozen=True)
class TransferTicket:
    """Everything a consumer needs to pull one published payload; serialized into KvHandle.transfer_endpoint
    (JSON), while the NIXL agent metadata goes into KvHandle.agent_metadata."""

    key: str
    size: int  # bytes on the wire (after encoding)
    checksum: str  # of the wire bytes
    endpoint: str  # host:port of the producer's control listener
    backends: dict[
        str, str
    ]  # backend -> producer-side address (shm: node id, nixl: agent name, tcp: host:port)
    encoding: str = "raw"  # raw | nvfp4 | fp8
    raw_size: int = 0  # bytes after decoding (== size when raw)
    expires_unix_ms: int = 0
    # Which publication of `key` this is (the producer instance + a counter): a key retracted and published
    # again gets a new serial, so a reader holding the old ticket is refused instead of reading the new bytes.
    serial: str = ""
    nixl_addr: int = 0  # the registered payload's address in the producer (0: not registered with NIXL)
    # NIXL: the producer's device copy of the payload is registered too (raw, never encoded), on this torch
    # device ("cuda:0"); a reader whose KV lives on the same kind of device READs it device to device.
    # "" when there is none (a CPU producer, or NIXL off)
    nixl_device: str = ""
    agent_metadata: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        # a ticket comes off the wire (from_json): a field of the wrong type is a bad request here, not an
        # AttributeError deep in a pull (an INTERNAL until 2026-12-07)
        for f in dataclasses.fields(self):
            value, want = getattr(self, f.name), _TICKET_TYPES.get(f.name)
            if want is not None and (not isinstance(value, want) or isinstance(value, bool)):
                raise TypeError(f"{f.name} must be {want.__name__}, got {type(value).__name__}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.backends.items()):
            raise TypeError("backends must map backend names to addresses (strings)")

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d.pop("agent_metadata")
        return json.dumps(d, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str, agent_metadata: bytes = b"") -> TransferTicket:
        try:
            d = json.loads(text)
            known = {f.name for f in dataclasses.fields(cls)} - {"agent_metadata"}
            # Fields a newer producer added are ignored, so producers can be upgraded before consumers.
            return cls(**{k: v for k, v in d.items() if k in known}, agent_metadata=agent_metadata)
        except (ValueError, TypeError, AttributeError) as exc:
            raise ValueError(f"transfer_endpoint is not a transfer ticket: {exc}") from exc


_TICKET_TYPES: dict[str, type] = {
    "key": str, "size": int, "checksum": str, "endpoint": str, "backends": dict, "encoding": str,
    "raw_size": int, "expires_unix_ms": int, "serial": str, "nixl_addr": int, "nixl_device": str,
    "agent_metadata": bytes,
}  # fmt: skip

# What publish returns is exactly the ticket.
Published = TransferTicket


@dataclass
class Pulled:
    """A payload that arrived, verified: its bytes (decoded if it was encoded), wire bytes and time taken."""

    data: Any  # bytearray | memoryview; a device tensor (torch.Tensor) over cuda_ipc and NIXL device reads
    bytes: int  # on the wire
    seconds: float
    backend: str
    # device memory to device memory (cuda_ipc, NIXL VRAM): no host copy on the way
    device_direct: bool = False

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def node_id() -> str:
    """Identifies this host for same-node checks: hostname plus boot id (containers on one kernel share it)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown"
    return f"{socket.gethostname()}/{boot}"


def choose_backend(
    preference: list[str] | tuple[str, ...],
    producer_advertised: dict[str, str] | list[str],
    consumer_supported: list[str] | tuple[str, ...] | set[str],
    same_node: bool,
) -> str:
    """The first backend in `preference` that both sides have; shm and cuda_ipc only on the same node.
    Raises TransferUnavailable when none fits (TCP is always available on a source, so it means TCP was left
    out of `preference` or `consumer_supported`)."""
    from .errors import TransferUnavailable

    for backend in preference:
        if backend not in producer_advertised or backend not in consumer_supported:
            continue
        if backend in SAME_NODE_ONLY and not same_node:
            continue
        return backend
    raise TransferUnavailable(
        f"no common transfer backend: preference {list(preference)}, producer advertises "
        f"{sorted(producer_advertised)}, consumer supports {sorted(consumer_supported)}, same_node={same_node}"
    )
