"""A worker's presence in etcd: its WorkerInfo under a lease that a background task keeps alive.

The worker is listed while it renews the lease; a crashed or hung worker vanishes when the lease expires, and a
draining worker deletes its key first (`close()`), so it disappears for everyone at once. The keep-alive runs on
an event loop of its own, in its own thread: a worker whose serving loop is saturated (an engine at full load,
thousands of streams) is busy, not dead, and must not drop out of discovery for it. Losing etcd never
crashes the worker: the task retries with backoff, and if the lease expired meanwhile it grants a new one and
writes the key again by itself. Never put request data here: etcd carries liveness and endpoints only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import aetcd

from services.discovery.etcd import (
    Backoff,
    EtcdSecurity,
    close_quietly,
    connect_first_reachable,
    describe,
    format_endpoints,
    parse_etcd_urls,
    uses_tls,
    with_deadline,
)
from services.discovery.keys import encode_worker_info, worker_key
from services.rpc import pb

log = logging.getLogger("rackserve.discovery")

T = TypeVar("T")


class Registration:
    """Keeps `worker_key(info.role, info.worker_id)` -> JSON(info) in etcd under a lease of `ttl_s`."""

    def __init__(
        self,
        etcd_url: str,
        info: pb.WorkerInfo,
        ttl_s: float = 3.0,
        request_timeout_s: float = 1.0,
        security: EtcdSecurity | None = None,
    ):
        if ttl_s < 1.0:
            raise ValueError(f"ttl_s must be at least 1 s (etcd leases count whole seconds), got {ttl_s}")
        self.key = worker_key(info.role, info.worker_id)
        self.info = info
        self.ttl_s = ttl_s
        self.refresh_interval_s = ttl_s / 3
        self.request_timeout_s = min(request_timeout_s, self.refresh_interval_s)
        self._endpoints = parse_etcd_urls(etcd_url)
        self._security = security or EtcdSecurity(tls=uses_tls(etcd_url))
        self._url = format_endpoints(self._endpoints, self._security.tls)
        self._value = encode_worker_info(info)
        self._client: aetcd.Client | None = None
        self._lease_id: int | None = None
        self._key_revision: int | None = None  # mod revision of our last put; None until the key is in etcd
        self._lease_ttl_s = float(math.ceil(ttl_s))
        self._renewed_at = 0.0  # time.monotonic() when the last successful grant/refresh was sent
        self._held_by: int | None = None  # the other lease our key was last seen under (a namesake's), if any
        self._task: asyncio.Task[None] | None = None  # the keep-alive, on self._loop
        self._closed = False
        self._loop = asyncio.new_event_loop()  # the lease's own loop: etcd client, keep-alive, close
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"lease {self.key}", daemon=True)

    @classmethod
    async def start(
        cls,
        etcd_url: str,
        info: pb.WorkerInfo,
        ttl_s: float = 3.0,
        request_timeout_s: float = 1.0,
        security: EtcdSecurity | None = None,
    ) -> Registration:
        """Register now if etcd answers; otherwise return anyway and keep trying in the background."""
        reg = cls(etcd_url, info, ttl_s, request_timeout_s, security)
        reg._thread.start()
        await reg._on_own_loop(reg._first_registration())
        return reg

    async def _on_own_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def _first_registration(self) -> None:
        try:
            await self._connect()
            await self._register()
        except Exception as e:
            log.warning(
                "etcd %s: could not register %s yet (%s); retrying in the background",
                self._url,
                self.key,
                describe(e),
            )
            await self._drop_client()
        self._task = asyncio.get_running_loop().create_task(
            self._keep_alive(), name=f"registration {self.key}"
        )

    @property
    def registered(self) -> bool:
        """True while, to the best of our knowledge, the key is in etcd (its lease renewed within its TTL)."""
        if self._closed or self._lease_id is None or self._key_revision is None:
            return False
        return time.monotonic() - self._renewed_at < self._lease_ttl_s

    @property
    def lease_id(self) -> int | None:
        return self._lease_id

    async def close(self) -> None:
        """Deregister: delete the key (gone for every watcher at once), then revoke the lease.

        The delete only applies if the key is still the one we wrote: a newer process registered under the
        same worker id keeps its entry.
        """
        if self._closed:
            return
        self._closed = True
        if not self._thread.is_alive():  # never started
            self._loop.close()
            return
        try:
            await self._on_own_loop(self._deregister())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            await asyncio.to_thread(self._thread.join)
            self._loop.close()

    async def _deregister(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        lease_id, key_revision = self._lease_id, self._key_revision
        self._lease_id = self._key_revision = None
        if (
            lease_id is not None
        ):  # also when a put may have landed without our hearing back: the revoke cleans up
            try:
                await self._connect()
                client = self._client
                assert client is not None
                if key_revision is not None:
                    key = self.key.encode()
                    await with_deadline(
                        client.transaction(
                            compare=[client.transactions.mod(key) == key_revision],
                            success=[client.transactions.delete(key)],
                            failure=[],
                        ),
                        self.request_timeout_s,
                    )
                await with_deadline(client.revoke_lease(lease_id), self.request_timeout_s)
                log.info("etcd %s: deregistered %s", self._url, self.key)
            except Exception as e:
                log.warning(
                    "etcd %s: could not deregister %s (%s); it disappears when its lease expires",
                    self._url,
                    self.key,
                    describe(e),
                )
        await self._drop_client()

    async def _keep_alive(self) -> None:
        backoff = Backoff(first_s=0.1, max_s=self.refresh_interval_s)
        failing = False
        while not self._closed:  # close() also cancels; the flag ends the loop even if a cancel were lost
            try:
                await self._connect()
                if self._lease_id is None or self._key_revision is None:
                    await self._register()
                elif not await self._refresh():
                    log.warning("etcd %s: lease of %s expired; registering again", self._url, self.key)
                    self._lease_id = self._key_revision = None
                    continue
                else:
                    await self._ensure_key()
                if failing:
                    log.info("etcd %s: reachable again; %s is registered", self._url, self.key)
                    failing = False
                backoff.reset()
                await asyncio.sleep(self.refresh_interval_s)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # whatever etcd or the network does, the worker keeps running
                if not failing:
                    log.warning(
                        "etcd %s: keep-alive of %s failed (%s); retrying", self._url, self.key, describe(e)
                    )
                    failing = True
                else:
                    log.debug("etcd %s: keep-alive of %s failed again: %s", self._url, self.key, describe(e))
                await self._drop_client()
                await asyncio.sleep(backoff.next_s())

    async def _connect(self) -> None:
        if self._client is None:
            self._client = await connect_first_reachable(
                self._endpoints, self.request_timeout_s, self._security
            )

    async def _drop_client(self) -> None:
        client, self._client = self._client, None
        await close_quietly(client)

    async def _register(self) -> None:
        """Grant a fresh lease and put the key under it. A lease granted for a failed put expires unused."""
        assert self._client is not None
        sent_at = time.monotonic()
        self._lease_id = self._key_revision = None
        lease = await with_deadline(self._client.lease(math.ceil(self.ttl_s)), self.request_timeout_s)
        self._lease_id, self._lease_ttl_s = lease.id, float(lease.ttl)
        put = await with_deadline(
            self._client.put(self.key.encode(), self._value, lease=lease), self.request_timeout_s
        )
        self._key_revision, self._renewed_at = put.header.revision, sent_at
        log.info("etcd %s: registered %s (lease %x, ttl %ss)", self._url, self.key, lease.id, lease.ttl)

    async def _refresh(self) -> bool:
        """Renew the lease; False when etcd no longer knows it (it expired while we could not reach etcd)."""
        assert self._client is not None and self._lease_id is not None
        sent_at = time.monotonic()
        reply = await with_deadline(self._client.refresh_lease(self._lease_id), self.request_timeout_s)
        if reply is None or reply.TTL <= 0:
            return False
        self._renewed_at = sent_at
        return True

    async def _ensure_key(self) -> None:
        """Every round, after the lease is renewed: the lease may live while the key does not (deleted by hand,
        a restore from backup, an outage that etcd renewed the lease across), and another process registered
        under the same worker id (two `rackserve up` on one etcd both name theirs decode-0, ...) holds the key
        under its own lease while ours renews a lease with nothing under it: it deletes the key when it stops.
        Put the key back when it is missing; while another lease holds it, say so once and leave it. Checked
        only after an outage until 2026-12-07: the process that lost the key to a namesake kept running, and
        renewing, out of discovery for good once the namesake stopped."""
        assert self._client is not None and self._lease_id is not None
        current = await with_deadline(self._client.get(self.key.encode()), self.request_timeout_s)
        held_by = current.lease if current is not None and current.lease != self._lease_id else None
        shared, self._held_by = held_by is not None and held_by != self._held_by, held_by
        if current is None:
            put = await with_deadline(
                self._client.put(self.key.encode(), self._value, lease=self._lease_id), self.request_timeout_s
            )
            self._key_revision = put.header.revision
            log.info("etcd %s: key %s was missing; put it back", self._url, self.key)
        elif shared:
            log.warning(
                "etcd %s: %s is held by another lease (%x): two processes share worker id %r",
                self._url,
                self.key,
                current.lease,
                self.info.worker_id,
            )
