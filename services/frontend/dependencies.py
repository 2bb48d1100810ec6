"""Request limits and body parsing as FastAPI dependencies, so handlers only ever see a validated request.

`json_body(Model)` reads the body under the size limit (413 before the rest is read), parses it (400 for
malformed JSON) and validates it against the pydantic model (400 naming the field, not FastAPI's 422).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from services.frontend.errors import INVALID_REQUEST, ApiError, validation_error

M = TypeVar("M", bound=BaseModel)


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"request body is larger than the limit of {limit} bytes",
        INVALID_REQUEST,
        code="request_too_large",
    )


async def limited_body(request: Request) -> bytes:
    """The raw body, refused with 413 as soon as it is known to exceed `max_body_bytes`, and with 408 when it has
    not arrived whole within `body_timeout_s` (a client trickling megabytes held them in memory for good)."""
    config = request.app.state.config
    limit: int = config.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(config.body_timeout_s):
            async for (
                chunk
            ) in request.stream():  # a chunked upload has no content-length: count as it arrives
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(
            408, f"the request body did not arrive within {config.body_timeout_s:g} s", code="request_timeout"
        ) from None
    return b"".join(chunks)


def json_body(model: type[M]) -> Callable[[Request], Awaitable[M]]:
    """A dependency yielding the body validated as `model`."""

    async def parse(request: Request) -> M:
        raw = await limited_body(request)
        if not raw.strip():
            raise ApiError(400, "the request body is empty; expected a JSON object", code="invalid_json")
        try:
            return model.model_validate_json(raw)
        except ValidationError as e:
            raise validation_error(e.errors(include_url=False)) from e

    parse.__name__ = f"parse_{model.__name__}"
    return parse


def openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI `requestBody` of a route that reads its body through `json_body(model)`: FastAPI cannot see a
    body parsed inside a dependency, so clients, docs and fuzzers would otherwise not know its schema."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}
