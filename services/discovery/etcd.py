"""The etcd connection: endpoint parsing, picking the first reachable endpoint, deadlines and backoff.

Every call made through this room has a deadline; a caller that loses etcd drops its client and connects
afresh (a new gRPC channel reconnects at once, where an old one would wait out gRPC's own growing backoff).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable
from typing import TypeVar
from urllib.parse import urlsplit

import aetcd

log = logging.getLogger("rackserve.discovery")

DEFAULT_PORT = 2379
PROBE_KEY = b"/rackserve/v1/probe"  # never written; reading it is the cheapest "are you there"
DEADLINE_GRACE_S = 0.5  # asyncio-side margin over the gRPC deadline, in case a call ignores its own
CHANNEL_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
}

T = TypeVar("T")


class EtcdUnavailableError(ConnectionError):
    """No etcd endpoint answered in time."""


def parse_etcd_urls(etcd_url: str) -> list[tuple[str, int]]:
    """'http://h:p', 'h:p' or 'h' (port 2379), or a comma-separated list of those, in order."""
    endpoints = []
    for part in etcd_url.split(","):
        part = part.strip()
        if not part:
            continue
        url = urlsplit(part if "://" in part else f"http://{part}")
        if url.scheme != "http":
            raise ValueError(f"etcd url {part!r}: only plain http:// endpoints are supported (no TLS)")
        try:
            port = url.port or DEFAULT_PORT
        except ValueError as e:
            raise ValueError(f"etcd url {part!r}: bad port") from e
        if not url.hostname:
            raise ValueError(f"etcd url {part!r}: no host")
        endpoints.append((url.hostname, port))
    if not endpoints:
        raise ValueError(f"etcd url {etcd_url!r}: expected http://host:port (comma-separated for several)")
    return endpoints


def parse_etcd_url(etcd_url: str) -> tuple[str, int]:
    """(host, port) of the first endpoint in `etcd_url`; connecting tries the others when it is unreachable."""
    return parse_etcd_urls(etcd_url)[0]


def format_endpoints(endpoints: list[tuple[str, int]]) -> str:
    return ",".join(f"http://{_grpc_host(h)}:{p}" for h, p in endpoints)


def _grpc_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host  # IPv6 literals need brackets in a gRPC target


async def with_deadline(call: Awaitable[T], timeout_s: float) -> T:
    return await asyncio.wait_for(call, timeout_s + DEADLINE_GRACE_S)


async def connect_first_reachable(endpoints: list[tuple[str, int]], timeout_s: float) -> aetcd.Client:
    """A client on the first endpoint that answers a read within `timeout_s`; every call it makes has that deadline."""
    errors = []
    for host, port in endpoints:
        client = aetcd.Client(host=_grpc_host(host), port=port, timeout=timeout_s, options=CHANNEL_OPTIONS)
        try:
            await with_deadline(client.get(PROBE_KEY), timeout_s)
            return client
        except Exception as e:  # any failure means "not this endpoint"; the caller decides how to retry
            errors.append(f"{_grpc_host(host)}:{port}: {describe(e)}")
            await close_quietly(client)
    raise EtcdUnavailableError("no etcd endpoint answered: " + "; ".join(errors))


async def close_quietly(client: aetcd.Client | None) -> None:
    if client is None:
        return
    with contextlib.suppress(Exception):
        await asyncio.wait_for(client.close(), 1.0)


def describe(error: BaseException) -> str:
    text = str(error).strip()
    if isinstance(error, TimeoutError) or not text:
        return type(error).__name__
    return f"{type(error).__name__}: {text}"


class Backoff:
    """Exponential backoff with ±20 % jitter: first_s, 2·first_s, ... capped at max_s; reset() on success."""

    def __init__(self, first_s: float = 0.1, max_s: float = 1.0) -> None:
        self.first_s = first_s
        self.max_s = max(max_s, first_s)
        self._next_s = first_s

    def reset(self) -> None:
        self._next_s = self.first_s

    def next_s(self) -> float:
        delay = self._next_s
        self._next_s = min(self._next_s * 2, self.max_s)
        return delay * random.uniform(0.8, 1.2)
