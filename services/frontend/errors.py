"""Errors the client can act on, in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Handlers and the coordinator raise `ApiError`; the handlers installed by `install_error_handlers` turn it (and
FastAPI's own validation and routing errors) into a JSON body with the right status. gRPC failures from the
router and the workers are mapped here, in one table, so every path answers the same way for the same cause.
Nothing here may answer 500 for a cause the client or the cluster state explains.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.telemetry import metrics

log = logging.getLogger("rackserve.frontend")

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
SERVICE_UNAVAILABLE = "service_unavailable_error"
TIMEOUT = "timeout_error"
SERVER_ERROR = "server_error"

# Seconds a client should wait before retrying when the cluster has no router or worker to serve it.
RETRY_AFTER_S = 1

# Status for a request whose client went away before the answer (nginx's convention; never sent).
CLIENT_CLOSED_REQUEST = 499


class ApiError(Exception):
    """A failure with the HTTP status and the OpenAI error fields the client sees."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, INVALID_REQUEST, param, code)


def model_not_found(model: str, served: str | None) -> ApiError:
    """404 for a model not served; `served` None: the caller may not know which is (its key may not use it)."""
    why = f"; this server serves {served!r}" if served is not None else " or this key may not use it"
    # a name is echoed whole only when short: a 3 MB `model` came back as a 3 MB error (until 2026-12-07)
    shown = repr(model) if len(model) <= 200 else f"{model[:100]!r}... ({len(model)} characters)"
    return ApiError(
        404,
        f"The model {shown} does not exist{why}",
        INVALID_REQUEST,
        "model",
        "model_not_found",
    )


def unavailable(message: str, code: str = "no_workers") -> ApiError:
    return ApiError(503, message, SERVICE_UNAVAILABLE, None, code, {"Retry-After": str(RETRY_AFTER_S)})


def overloaded(message: str) -> ApiError:
    """429: this frontend is at its admission limit; the request was not started."""
    return ApiError(429, message, "rate_limit_error", None, "overloaded", {"Retry-After": str(RETRY_AFTER_S)})


def timed_out(message: str) -> ApiError:
    return ApiError(504, message, TIMEOUT, None, "timeout")


def from_grpc(err: grpc.aio.AioRpcError, peer: str) -> ApiError:
    """The client-facing error for a failed call to `peer` (e.g. "router r1", "decode worker d2")."""
    code = err.code()
    details = err.details() or code.name
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return bad_request(f"{peer} rejected the request: {details}")
    if code == grpc.StatusCode.OUT_OF_RANGE:
        return bad_request(f"{peer} rejected the request: {details}", code="context_length_exceeded")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return timed_out(f"{peer} did not answer before the request's deadline")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ApiError(
            503, f"{peer} is overloaded: {details}", SERVICE_UNAVAILABLE, None, "overloaded",
            {"Retry-After": str(RETRY_AFTER_S)},
        )  # fmt: skip
    if code == grpc.StatusCode.UNAVAILABLE:
        return unavailable(f"{peer} is unavailable: {details}")
    if code == grpc.StatusCode.CANCELLED:
        return ApiError(
            503, f"{peer} cancelled the request: {details}", SERVICE_UNAVAILABLE, code="cancelled"
        )
    return ApiError(502, f"{peer} failed: {code.name}: {details}", SERVER_ERROR, None, "worker_error")


# ---- FastAPI's own errors, reshaped ---------------------------------------------------------------------------


def validation_error(errors: Sequence[Any], what: str = "request body") -> ApiError:
    """One 400 naming the first offending field, from pydantic's error list."""
    if not errors:
        return bad_request(f"invalid {what}")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error") or first.get("msg", "")
        return bad_request(f"the {what} is not valid JSON: {detail}", code="invalid_json")
    param = field_path(first.get("loc", ()))
    same = [e for e in errors if field_path(e.get("loc", ())) == param]
    if param and isinstance(first.get("input"), dict | list):
        # An object or a list where a union was expected, and only one member of the union has errors inside
        # it: that member is the one the client meant, and its error says what is wrong there (tool_choice
        # {"type": "function", "function": {}} lacks function.name; it is not that it is not "none"). When
        # several members have (a mixed prompt list), no one of them is the client's: the union's errors stand.
        inside = [e for e in same if len(_path_parts(e.get("loc", ()), skip_tags=True)) > _depth(param)]
        members = {_member(e.get("loc", ())) for e in inside}
        if inside and len(members) == 1:
            first = inside[0]
            param = _joined(_path_parts(first.get("loc", ()), skip_tags=True))
            same = [e for e in inside if _joined(_path_parts(e.get("loc", ()), skip_tags=True)) == param]
    if first.get("type") == "extra_forbidden" and first.get("loc"):
        key = first["loc"][-1]  # the unknown key itself, whatever its spelling ("json-schema")
        parent = field_path(first["loc"][:-1])
        param = f"{parent}.{key}" if parent and key != "" else parent or str(key)
        same = [first]
    # A union reports one error per member it tried; together they say what was expected.
    messages = [_message(e) for e in same]
    unique = list(dict.fromkeys(messages))
    where = param or what
    got = _shown(first.get("input"))
    return bad_request(f"{where}: {' or '.join(unique)}{got}", param=param or None, code="invalid_value")


def field_path(loc: Sequence[Any]) -> str:
    """pydantic's loc as the client wrote it: ('messages', 0, 'content') → 'messages[0].content'.

    Stops at a union's member tag ('str', 'list[str]', 'function-after[...]', a model's class name such as
    'NamedToolChoice'), which names no field."""
    return _joined(_path_parts(loc, skip_tags=False))


def _path_parts(loc: Sequence[Any], skip_tags: bool) -> list[str | int]:
    """The loc's field names and list indexes; at a union member's tag, stop (or with `skip_tags`, go on past it:
    ('messages', 0, 'content', 'list[TextPart]', 0, 'text') → messages, 0, content, 0, text)."""
    parts: list[str | int] = []
    for part in loc:
        if part in ("body", "query", "path") and not parts:
            continue  # FastAPI's own prefix (where the parameter was)
        if isinstance(part, int) or (isinstance(part, str) and not _is_tag(part)):
            parts.append(part)
        elif not skip_tags:
            break
    return parts


def _member(loc: Sequence[Any]) -> str:
    """The tag of the union member an error is in: the first in its loc (field_path stops there)."""
    tags = [p for p in loc if isinstance(p, str) and _is_tag(p)]
    return tags[0] if tags else ""


def _depth(param: str) -> int:
    return param.count(".") + param.count("[") + 1


def _joined(parts: Sequence[str | int]) -> str:
    path = ""
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else part)
    return path


def _is_tag(part: str) -> bool:
    return not part.isidentifier() or part in _TYPE_TAGS or part in _model_names()


@functools.cache
def _model_names() -> frozenset[str]:
    """The request models' class names: pydantic tags a union member that is a model with its class name."""
    from services.frontend import protocol

    return frozenset(
        name for name, obj in vars(protocol).items() if isinstance(obj, type) and issubclass(obj, BaseModel)
    )


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "literal", "tagged-union"})


def _message(error: Mapping[str, Any]) -> str:
    if error.get("type") == "value_error":
        return str((error.get("ctx") or {}).get("error", error.get("msg", "")))
    if error.get("type") == "missing":
        return "field required"
    return str(error.get("msg", "invalid value"))


def _shown(value: Any) -> str:
    if value is None or isinstance(value, dict | list):
        return ""
    text = repr(value)
    return f" (got {text[:60]}{'…' if len(text) > 60 else ''})"


# the endpoints whose requests rackserve_frontend_requests_total counts, each by its `endpoint` label
COUNTED_ENDPOINTS = {"/v1/chat/completions": "chat_completions", "/v1/completions": "completions"}


def mark_counted(request: Request) -> None:
    """The request was taken: it is counted when it finishes (app.Frontend._finished), not by a handler here."""
    request.state.counted = True


def _answer(request: Request, error: ApiError) -> JSONResponse:
    """The error's response, counted in the request metrics if the request was refused before it was taken
    (a bad body or parameter, a key, a limit, admission): those never reach the count at a request's end."""
    endpoint = COUNTED_ENDPOINTS.get(request.url.path)
    if endpoint is not None and not getattr(request.state, "counted", False):
        mark_counted(request)
        metrics.REQUESTS.labels(endpoint, str(error.status)).inc()
        metrics.REQUEST_ERRORS.labels(str(error.status), error.code or error.type).inc()
    return error.response()


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return _answer(request, exc)


async def _request_validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return _answer(request, validation_error(exc.errors()))


async def _http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    kind = NOT_FOUND if exc.status_code == 404 else INVALID_REQUEST
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return _answer(request, ApiError(exc.status_code, message, kind, headers=exc.headers))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    message = f"internal error: {type(exc).__name__}: {exc}"
    # this handler answers outside every middleware (Starlette's ServerErrorMiddleware): name the request here
    rid = response_request_id(request.headers.get("x-request-id"))
    return _answer(
        request, ApiError(500, message, SERVER_ERROR, code="internal_error", headers={"x-request-id": rid})
    )


def client_request_id(value: str | None) -> str | None:
    """The client's x-request-id, if it is one we echo and log: 1 to 128 printable characters."""
    return value if value and len(value) <= 128 and value.isprintable() else None


def response_request_id(value: str | None) -> str:
    """The x-request-id a response carries when no request state names one: the client's, or a fresh one."""
    return client_request_id(value) or uuid.uuid4().hex


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _request_validation)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    app.add_exception_handler(Exception, _unexpected)
