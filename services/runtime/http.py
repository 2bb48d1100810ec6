"""An HTTP client whose deadline bounds a whole call: the one the services use to ask each other over HTTP.

httpx's `timeout` bounds each connect, read and write on its own, not a call: a peer that sends its answer a
byte at a time, each byte within the read timeout, stretched one call without limit (a Kubernetes API, a
scraped /metrics or /traffic, a planner's /plan did, until 2026-12-07). `DeadlineClient(deadline_s)` gives
every call, answer included, that deadline too; past it the call raises `CallDeadlineExceeded`, an
`httpx.TimeoutException` (so `except httpx.HTTPError` handles it as any failed call) and a `TimeoutError`.
Calls that stream their answer (`stream=True`) are bounded only up to their headers.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx


class CallDeadlineExceeded(httpx.TimeoutException, TimeoutError):
    """The whole call, answer included, took longer than the client's deadline."""


class DeadlineClient(httpx.AsyncClient):
    def __init__(self, deadline_s: float, **kwargs: Any) -> None:
        super().__init__(timeout=deadline_s, **kwargs)
        self.deadline_s = deadline_s

    async def send(self, request: httpx.Request, **kwargs: Any) -> httpx.Response:
        try:
            async with asyncio.timeout(self.deadline_s):
                return await super().send(request, **kwargs)
        except TimeoutError:  # this deadline's (httpx's own timeouts are not TimeoutErrors)
            raise CallDeadlineExceeded(
                f"{request.method} {request.url}: no whole answer within {self.deadline_s:g} s",
                request=request,
            ) from None
