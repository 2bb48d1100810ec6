"""The failures a worker reports, one class per thing the caller can do about it (rpc.status_for maps them).

Kept free of heavy imports (no torch, no engine), so a process without an engine — the router — can use them.
"""

from __future__ import annotations


class WorkerUnavailableError(RuntimeError):
    """This worker is not taking requests (loading or draining): the caller should go elsewhere."""


class EngineClosedError(WorkerUnavailableError):
    """The engine thread has stopped; no new work is accepted."""


class UnsupportedError(RuntimeError):
    """The request asks for something this worker does not do (yet)."""


class NotFoundError(LookupError):
    """The request names something (a held KV, a request id) this worker does not have."""


class DuplicateRequestError(ValueError):
    """A request id that is already live on this worker."""


# How a KvUnavailableError's message starts, so a caller can tell "the KV did not arrive" (rebuild it) from "the
# worker is unavailable" (go elsewhere): both are UNAVAILABLE on the wire.
KV_UNAVAILABLE_PREFIX = "KV unavailable: "


class KvUnavailableError(WorkerUnavailableError):
    """The KV a request names could not be fetched in time (producer gone, key expired, deadline passed): the
    caller should rebuild it (re-prefill) or try another pair."""


class KvDataLossError(RuntimeError):
    """KV bytes arrived but differ from what the producer published; they were not used."""


class KvPreconditionError(RuntimeError):
    """A KvHandle this worker could read in principle but not now (expired, from a restarted producer)."""
