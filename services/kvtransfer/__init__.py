"""KV transfer between prefill and decode workers: one interface (KvSource publishes, KvSink pulls), four
backends — NIXL/UCX (primary; one-sided READ, RDMA where the hardware has it, from host or GPU memory), same-host
shared memory, TCP, and CUDA IPC between GPUs of one node.

    source = await KvSource.start(TransferConfig())        # prefill worker; advertise() goes into etcd
    ticket = await source.publish(key, kv_bytes, ttl_s=30)  # ticket.to_json() -> KvHandle.transfer_endpoint
    sink = await KvSink.start(TransferConfig())             # decode worker
    pulled = await sink.pull(ticket, deadline_s=5)          # verified bytes, or a typed TransferError
    pulled = await sink.pull(ticket, 5, device="cuda:0")    # a GPU consumer: device to device where offered
    source.retract(key)                                     # on the decode side's ack (or the TTL does it)

This package moves opaque bytes with a deadline and a checksum; it must never interpret KV layout, decide
routing, or import a service.
"""

from .errors import (
    TransferError,
    TransferIntegrityError,
    TransferNotFound,
    TransferPeerGone,
    TransferTimeout,
    TransferUnavailable,
)
from .sink import KvSink
from .source import KvSource
from .ticket import (
    BACKENDS,
    DEFAULT_PREFERENCE,
    NIXL,
    SHM,
    TCP,
    Published,
    Pulled,
    TransferConfig,
    TransferTicket,
    choose_backend,
    node_id,
)

__all__ = [
    "BACKENDS",
    "DEFAULT_PREFERENCE",
    "NIXL",
    "SHM",
    "TCP",
    "KvSink",
    "KvSource",
    "Published",
    "Pulled",
    "TransferConfig",
    "TransferError",
    "TransferIntegrityError",
    "TransferNotFound",
    "TransferPeerGone",
    "TransferTicket",
    "TransferTimeout",
    "TransferUnavailable",
    "choose_backend",
    "node_id",
]
