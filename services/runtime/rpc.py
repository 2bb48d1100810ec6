"""What every rackserve RPC goes through on the server side: admission, request metadata, and error mapping.

- `AdmissionGate`: requests are admitted only while the worker is serving (not while loading or draining); it
  counts the requests in flight so a drain can wait for them.
- `RpcInterceptor`: applies the gate to the methods that start work, and turns exceptions into gRPC status codes
  with a message the caller can act on — so handlers raise typed errors and never build statuses themselves.
- `request_meta(context)`: the `x-request-id` and W3C `traceparent` the caller sent.

This room must never hold request state or know what a handler does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from services.engine.kv_cache import NoFreeBlocksError
from services.runtime.errors import (
    DuplicateRequestError,
    KvDataLossError,
    KvPreconditionError,
    NotFoundError,
    UnsupportedError,
    WorkerUnavailableError,
)

log = logging.getLogger("rackserve.runtime.rpc")


def status_for(error: BaseException) -> grpc.StatusCode:
    """The gRPC status code for an exception raised by a handler; the message is str(error).

    The engine's own errors need no import here (the router has no engine): a prompt that is too long or a KV
    payload for another model are ValueErrors, so they are INVALID_ARGUMENT like every bad parameter.
    """
    if isinstance(error, WorkerUnavailableError):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(error, KvDataLossError):
        return grpc.StatusCode.DATA_LOSS
    if isinstance(error, KvPreconditionError):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(error, UnsupportedError):
        return grpc.StatusCode.UNIMPLEMENTED
    if isinstance(error, DuplicateRequestError):
        return grpc.StatusCode.ALREADY_EXISTS
    if isinstance(error, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(error, NoFreeBlocksError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(error, NotFoundError):
        return grpc.StatusCode.NOT_FOUND
    return grpc.StatusCode.INTERNAL


@dataclass(frozen=True)
class RequestMeta:
    request_id: str
    traceparent: str


def request_meta(context: grpc.aio.ServicerContext) -> RequestMeta:
    md = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
    return RequestMeta(md.get("x-request-id", ""), md.get("traceparent", ""))


class AdmissionGate:
    """LOADING → SERVING → DRAINING. Admits only while serving; counts what it admitted."""

    def __init__(self) -> None:
        self.state = "loading"
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def draining(self) -> bool:
        return self.state == "draining"

    def open(self) -> None:
        self.state = "serving"

    def close(self) -> None:
        self.state = "draining"

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        if self.state != "serving":
            what = "still loading" if self.state == "loading" else "draining"
            raise WorkerUnavailableError(f"this worker is {what} and takes no new requests; try another one")
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True when nothing is in flight within timeout_s."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
            return True
        except TimeoutError:
            return False


async def _abort(context: grpc.aio.ServicerContext, method: str, error: Exception) -> None:
    code = status_for(error)
    meta = request_meta(context)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("%s failed (x-request-id=%s)", method, meta.request_id, exc_info=error)
    else:
        log.info("%s: %s %s (x-request-id=%s)", method, code.name, error, meta.request_id)
    await context.abort(code, str(error) or type(error).__name__)


class RpcInterceptor(grpc.aio.ServerInterceptor):
    """Admission through `gate` for `gated_methods` (full names, "/pkg.Service/Method"); error mapping for all."""

    def __init__(self, gate: AdmissionGate, gated_methods: Collection[str]) -> None:
        self.gate = gate
        self.gated_methods = frozenset(gated_methods)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        method: str = details.method  # type: ignore[attr-defined]
        gate = self.gate if method in self.gated_methods else None
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, method, gate),
                request_deserializer=_lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, method, gate),
                request_deserializer=_lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        return handler  # client- and bidi-streaming: none in rackserve.v1


@dataclass(frozen=True)
class _Undecodable:
    """A request whose bytes do not parse (not protobuf, a string field that is not UTF-8): grpc would answer
    UNKNOWN and log an error; the handler's wrapper answers INVALID_ARGUMENT instead."""

    error: Exception


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and whatever a parser raises
            return _Undecodable(e)

    return parse


def _undecodable(request: Any, method: str) -> ValueError | None:
    if isinstance(request, _Undecodable):
        return ValueError(f"the request's bytes are not a {method} request: {request.error}")
    return None


def _admission(gate: AdmissionGate | None) -> contextlib.AbstractContextManager[Any]:
    return gate.admit() if gate is not None else contextlib.nullcontext()


def _wrap_unary(behavior: Any, method: str, gate: AdmissionGate | None) -> Any:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            if bad := _undecodable(request, method):
                raise bad
            with _admission(gate):
                return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure becomes a status the caller can act on
            await _abort(context, method, e)

    return unary


def _wrap_stream(behavior: Any, method: str, gate: AdmissionGate | None) -> Any:
    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            if bad := _undecodable(request, method):
                raise bad
            with _admission(gate):
                async for item in behavior(request, context):
                    yield item
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure becomes a status the caller can act on
            await _abort(context, method, e)

    return stream
