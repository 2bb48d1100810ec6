"""When a failed call to a worker is a lost worker (the coordinator migrates the request) and when it is the
request's own error (the client gets it).

A call to a worker that breaks with a status in `MIGRATABLE` (reset, error status, the worker's server
cancelling it) is a `WorkerLost`: another worker can make it good. So is a worker silent for the stall timeout
(`stalled`), a decode stream that ends early or skips a token index (`DecodeStreamBroken`), and a pull of the KV
that failed on the producer's side (`is_transfer_failure`: the prefill copy is gone, so the request rebuilds).
Any other status (a bad parameter, an overloaded worker, the request's own deadline) is the client's error.
`WorkerLost.error` is what the client sees if the request may not move again.

This room only classifies failures; the coordinator decides what a migration does.
"""

from __future__ import annotations

import grpc

from services.frontend.errors import ApiError, from_grpc
from services.rpc import pb
from services.runtime.errors import KV_UNAVAILABLE_PREFIX
from services.telemetry import metrics

# Status codes after which the worker, not the request, is at fault: the router hears about it.
WORKER_FAULTS = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.ABORTED,
    }
)

# A live call the *worker* cancelled (its server stopping) is as much its failure as a reset: migrate it too.
MIGRATABLE = WORKER_FAULTS | {grpc.StatusCode.CANCELLED}


class DecodeStreamBroken(Exception):
    """A decode stream ended without its finished chunk, or skipped a token index."""


class WorkerLost(Exception):
    """A worker failed this request in a way another worker can make good: the coordinator migrates it."""

    def __init__(
        self, worker: pb.WorkerRef, role: str, cause: str, detail: str, error: ApiError, blame: bool = True
    ) -> None:
        super().__init__(f"{role} worker {worker.worker_id}: {detail}")
        self.worker = worker
        self.role = role
        self.cause = cause
        self.detail = detail
        self.error = error  # what the client sees if the request cannot be migrated
        self.blame = blame  # the worker itself is at fault (reported to the routers, excluded from now on)


def call_failed(e: grpc.aio.AioRpcError, role: str) -> str:
    """Count a failed call to a `role` worker and describe it as a migration record keeps it. A full worker
    (RESOURCE_EXHAUSTED) is busy, not failed, and is not counted."""
    if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        metrics.WORKER_FAILURES.labels(role, e.code().name).inc()
    return f"{e.code().name}: {e.details()}"


def lost_or_refused(
    e: grpc.aio.AioRpcError, worker: pb.WorkerRef, role: str, detail: str, peer: str
) -> WorkerLost | ApiError:
    """What a failed call to `worker` means: the worker is lost (`<role>_failed`) for a migratable status, else
    the client's error for the request itself."""
    error = from_grpc(e, peer)
    if e.code() not in MIGRATABLE:
        return error
    return WorkerLost(worker, role, f"{role}_failed", detail, error)


def stalled(worker: pb.WorkerRef, role: str, detail: str, message: str) -> WorkerLost:
    """A worker that stayed silent on a live call for the stall timeout: hung, so lost (`<role>_stalled`)."""
    error = ApiError(504, message, "timeout_error", code="worker_stalled")
    return WorkerLost(worker, role, f"{role}_stalled", detail, error)


def is_transfer_failure(e: grpc.aio.AioRpcError) -> bool:
    """The decode worker could not get the KV it was handed (its own health is not in question)."""
    if e.code() in (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.FAILED_PRECONDITION):
        return True
    return e.code() == grpc.StatusCode.UNAVAILABLE and (e.details() or "").startswith(KV_UNAVAILABLE_PREFIX)
