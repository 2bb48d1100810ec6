"""KV transfer between prefill and decode workers: one interface (KvSource publishes, KvSink pulls), three
backends — NIXL/UCX (primary; one-sided READ, RDMA where the hardware has it), same-host shared memory, TCP.

    source = await KvSource.start(TransferConfig())        # prefill worker; advertise() goes into etcd
    ticket = source.publish(key, kv_bytes, ttl_s=30)        # ticket.to_json() -> KvHandle.transfer_endpoint
    sink = await KvSink.start(TransferConfig())             # decode worker
    pulled = await sink.pull(ticket, deadline_s=5)          # verified bytes, or a typed TransferError
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
