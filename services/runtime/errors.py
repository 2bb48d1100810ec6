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
