"""Who may call the API and how often: API keys and a per-key rate limit, as one FastAPI dependency.

    keys = load_api_keys(flag_value, key_file)        # --api-key / RACKSERVE_API_KEY, --api-key-file
    app.state.guard = Guard(AuthConfig(keys, rate_limit_rps=5, rate_limit_burst=10))
    @api.post(..., dependencies=[Depends(authorize)])

- No keys configured: the API is open (a laptop). Any key configured: every `/v1/*` call needs
  `Authorization: Bearer <key>` — 401 without one or with an unknown one, 403 when the key may not use the
  requested model, 429 + `Retry-After` past the key's rate. `/health` and `/metrics` stay open for probes and
  scrapers (the chart's NetworkPolicy limits who reaches `/metrics`).
- Keys are compared in constant time: the presented token's SHA-256 against each key's, every key, with
  `hmac.compare_digest`. The secret itself is never kept in the key object's repr, a log line or a metric;
  logs name a key by its `name`.
- The keys come from services/runtime/api_keys.py (`load_api_keys`, where the key file's format and the rules a
  key must meet live: `rackserve up` checks `--api-key` by them before it starts anything). The file is read at
  start: a changed file takes effect when the frontend restarts (the chart rolls the pods when the Secret named
  in its values changes only if told to).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import time
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from services.frontend.errors import INVALID_REQUEST, ApiError
from services.frontend.request_state import ANONYMOUS_KEY_NAME
from services.runtime.api_keys import MAX_TOKEN_CHARS, ApiKey

log = logging.getLogger("rackserve.frontend.auth")

PERMISSION_ERROR = "permission_error"
RATE_LIMIT_ERROR = "rate_limit_error"


class TokenBucket:
    """`rate` tokens a second, at most `burst` saved up; take() says how long to wait when empty."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, float(max(burst, 1))
        self.tokens, self.stamp = self.burst, time.monotonic()

    def take(self) -> float:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


@dataclass(frozen=True)
class AuthConfig:
    keys: tuple[ApiKey, ...] = ()
    rate_limit_rps: float = 0.0  # per key (per server when the API is open); 0: no limit
    rate_limit_burst: int = 0  # 0: one second's worth of requests


@dataclass(frozen=True)
class Principal:
    """Who is calling: a key's name ("anonymous" on an open API) and the models it may use."""

    name: str
    models: frozenset[str] | None = None

    def check_model(self, model: str) -> None:
        if self.models is not None and model not in self.models:
            raise ApiError(
                403,
                f"The API key {self.name!r} may not use the model {model!r}",
                PERMISSION_ERROR,
                "model",
                "model_not_allowed",
            )


ANONYMOUS = Principal(ANONYMOUS_KEY_NAME)


class Guard:
    def __init__(self, config: AuthConfig | None = None) -> None:
        self.config = config or AuthConfig()
        self._buckets: dict[str, TokenBucket] = {}

    def authenticate(self, authorization: str | None) -> Principal:
        keys = self.config.keys
        if not keys:
            return ANONYMOUS
        if not authorization:
            raise _unauthorized(
                "You didn't provide an API key. You need to provide your API key in an Authorization header "
                "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
            )
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token or len(token) > MAX_TOKEN_CHARS:
            raise _unauthorized("The Authorization header must be 'Bearer YOUR_KEY'.")
        presented = hashlib.sha256(token.encode(errors="replace")).digest()
        found: ApiKey | None = None
        for key in keys:  # every key, no early exit: the time taken does not depend on which key matched
            if hmac.compare_digest(presented, key.digest):
                found = key
        if found is None:
            raise _unauthorized("Incorrect API key provided.", code="invalid_api_key")
        return Principal(found.name, found.models)

    def admit(self, principal: Principal) -> None:
        rate = self.config.rate_limit_rps
        if rate <= 0:
            return
        bucket = self._buckets.get(principal.name)
        if bucket is None:
            burst = self.config.rate_limit_burst or math.ceil(rate)
            bucket = self._buckets[principal.name] = TokenBucket(rate, burst)
        wait_s = bucket.take()
        if wait_s > 0:
            log.debug("rate limit: %s over %.3g requests/s", principal.name, rate)
            raise ApiError(
                429,
                f"Rate limit reached for {principal.name!r}: {rate:g} requests per second; retry after "
                f"{wait_s:.2f}s",
                RATE_LIMIT_ERROR,
                None,
                "rate_limit_exceeded",
                {"Retry-After": str(max(1, math.ceil(wait_s)))},
            )


def _unauthorized(message: str, code: str | None = None) -> ApiError:
    return ApiError(401, message, INVALID_REQUEST, None, code, {"WWW-Authenticate": "Bearer"})


# Declares the scheme in the OpenAPI document; the header itself is checked by Guard (auto_error off: our 401 shape).
_bearer = HTTPBearer(
    auto_error=False, description="an API key (--api-key, --api-key-file); required when set"
)


async def authorize(
    request: Request, _declared: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Principal:
    """The dependency: who is calling (401 if nobody we know), admitted under their rate (429 if not)."""
    principal = await identify(request, _declared)
    request.app.state.guard.admit(principal)
    return principal


async def identify(
    request: Request, _declared: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Principal:
    """`authorize` without the rate: for reads about the caller's own traffic (a request's timeline), which a
    load generator fetches after each request and which should not spend the budget its requests need."""
    guard: Guard = request.app.state.guard
    principal = guard.authenticate(request.headers.get("authorization"))
    request.state.principal = principal
    return principal
