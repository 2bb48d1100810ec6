"""The etcd connection: endpoint parsing, picking the first reachable endpoint, deadlines and backoff.

Every call made through this room has a deadline; a caller that loses etcd drops its client and connects
afresh (a new gRPC channel reconnects at once, where an old one would wait out gRPC's own growing backoff).

Security: `https://` endpoints connect with TLS (the CA from `--etcd-ca-file`, else the system roots), with a
client certificate when `--etcd-cert-file`/`--etcd-key-file` are set; `--etcd-username` with
`--etcd-password-file` logs in to etcd's auth. `EtcdSecurity` carries these; its repr never shows secrets.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aetcd
import aetcd.client
import aetcd.rpc
import grpc

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
        if url.scheme not in ("http", "https"):
            raise ValueError(f"etcd url {part!r}: expected an http:// or https:// endpoint")
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


def uses_tls(etcd_url: str) -> bool:
    """True when any endpoint of `etcd_url` is https:// (then all are reached with TLS)."""
    return any(part.strip().startswith("https://") for part in etcd_url.split(","))


def format_endpoints(endpoints: list[tuple[str, int]], tls: bool = False) -> str:
    scheme = "https" if tls else "http"
    return ",".join(f"{scheme}://{_grpc_host(h)}:{p}" for h, p in endpoints)


@dataclass(frozen=True)
class EtcdSecurity:
    """How to reach a secured etcd: TLS (server CA, optional client certificate) and/or user + password."""

    tls: bool = False
    ca_cert: bytes | None = None
    cert_chain: bytes | None = None
    private_key: bytes | None = field(default=None, repr=False)
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EtcdSecurity:
        """From the `--etcd*` flags (services.runtime.args.add_security_arguments); plain etcd when none is set."""

        def read(flag: str) -> bytes | None:
            path = getattr(args, flag.lstrip("-").replace("-", "_"), "")
            if not path:
                return None
            try:
                return Path(path).read_bytes()
            except OSError as e:
                raise ValueError(f"{flag} {path}: {e.strerror or e}") from e

        ca, cert, key = read("--etcd-ca-file"), read("--etcd-cert-file"), read("--etcd-key-file")
        if (cert is None) != (key is None):
            raise ValueError("--etcd-cert-file and --etcd-key-file go together")
        username = getattr(args, "etcd_username", "") or None
        password_raw = read("--etcd-password-file")
        if (username is None) != (password_raw is None):
            raise ValueError("--etcd-username and --etcd-password-file go together")
        password = password_raw.decode().rstrip("\r\n") if password_raw is not None else None
        tls = uses_tls(getattr(args, "etcd", "")) or ca is not None or cert is not None
        return cls(tls, ca, cert, key, username, password)


class _TlsClient(aetcd.Client):
    """aetcd's client over a TLS channel (aetcd itself only opens plaintext channels)."""

    def __init__(self, credentials: grpc.ChannelCredentials, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._credentials = credentials

    @aetcd.client._handle_errors
    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:  # type: ignore[has-type]
            async with asyncio.timeout(self._connect_wait_timeout):
                await self._connected.wait()
            return
        try:
            self._is_connecting = True
            target = f"{self._host}:{self._port}"
            self.channel = grpc.aio.secure_channel(target, self._credentials, options=self._options.items())
            if self._username is not None and self._password is not None:
                self.auth_stub = aetcd.rpc.AuthStub(self.channel)
                request = aetcd.rpc.AuthenticateRequest(name=self._username, password=self._password)
                resp = await self.auth_stub.Authenticate(request, timeout=self._timeout)
                self.metadata = (("token", resp.token),)
            self.kvstub = aetcd.rpc.KVStub(self.channel)
            self.clusterstub = aetcd.rpc.ClusterStub(self.channel)
            self.leasestub = aetcd.rpc.LeaseStub(self.channel)
            self.maintenancestub = aetcd.rpc.MaintenanceStub(self.channel)
            self._watcher = aetcd.client.watcher.Watcher(
                aetcd.rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
            )
            self._connected.set()
        finally:
            self._is_connecting = False


def new_client(host: str, port: int, timeout_s: float, security: EtcdSecurity | None = None) -> aetcd.Client:
    sec = security or EtcdSecurity()
    kwargs: dict[str, Any] = dict(
        host=_grpc_host(host),
        port=port,
        timeout=timeout_s,
        options=CHANNEL_OPTIONS,
        username=sec.username,
        password=sec.password,
    )
    if not sec.tls:
        return aetcd.Client(**kwargs)
    creds = grpc.ssl_channel_credentials(
        root_certificates=sec.ca_cert, private_key=sec.private_key, certificate_chain=sec.cert_chain
    )
    return _TlsClient(creds, **kwargs)


def _grpc_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host  # IPv6 literals need brackets in a gRPC target


async def with_deadline(call: Awaitable[T], timeout_s: float) -> T:
    """`await call`, TimeoutError after `timeout_s` plus the grace.

    `asyncio.timeout`, not `asyncio.wait_for`: on Python 3.11 a `wait_for` whose call completes in the same loop
    turn as a cancel() of the awaiting task returns the result and swallows the cancellation. A lease's keep-alive
    caught that way never stopped, so its worker's deregistration (which waits for it) hung for good."""
    async with asyncio.timeout(timeout_s + DEADLINE_GRACE_S):
        return await call


async def connect_first_reachable(
    endpoints: list[tuple[str, int]], timeout_s: float, security: EtcdSecurity | None = None
) -> aetcd.Client:
    """A client on the first endpoint that answers a read within `timeout_s`; every call it makes has that deadline."""
    errors = []
    for host, port in endpoints:
        client = new_client(host, port, timeout_s, security)
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
        async with asyncio.timeout(1.0):
            await client.close()


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
