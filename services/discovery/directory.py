"""The live set of workers, as routers and frontends see it: list the etcd prefix, then watch from that revision.

After any watch error (etcd restarted, revision compacted, connection lost, etcd hung and a probe timed out) the
directory re-lists and watches again, reconciling: workers whose keys are gone are removed, new ones added.
While etcd is unreachable the view is frozen, never emptied: traffic keeps flowing to the last known workers.
`suppress()` lets the caller hide a worker it just saw fail, without waiting for its lease to expire.

This room only reads etcd. It never writes there and never carries request data.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import Literal

import aetcd

from services.discovery.etcd import (
    PROBE_KEY,
    Backoff,
    EtcdSecurity,
    EtcdUnavailableError,
    close_quietly,
    connect_first_reachable,
    describe,
    format_endpoints,
    parse_etcd_urls,
    uses_tls,
    with_deadline,
)
from services.discovery.keys import ROLES, WORKERS_PREFIX, decode_worker_info, split_worker_key
from services.rpc import pb

log = logging.getLogger("rackserve.discovery")

EventKind = Literal["added", "removed"]
Subscriber = Callable[[EventKind, pb.WorkerInfo], None]


class DiscoveryTimeoutError(TimeoutError):
    """wait_for() did not see enough workers in time."""


def _identity(info: pb.WorkerInfo) -> tuple[str, str, int]:
    # A changed endpoint or epoch means a different process behind the same worker id: subscribers must drop
    # what they hold for the old one (streams, cached-block index) and treat the new one as new.
    return info.endpoint, info.transfer_endpoint, info.epoch


class WorkerDirectory:
    """A read-only, eventually consistent view of the workers of some roles; callbacks run on the event loop.

    The WorkerInfo objects it hands out are shared: treat them as read-only.
    """

    def __init__(
        self,
        etcd_url: str,
        roles: Iterable[str] = ("prefill", "decode", "router"),
        connect_timeout_s: float = 5.0,
        request_timeout_s: float = 1.0,
        probe_interval_s: float = 1.0,
        security: EtcdSecurity | None = None,
    ) -> None:
        self.roles = tuple(roles)
        unknown = [r for r in self.roles if r not in ROLES]
        if unknown or not self.roles:
            raise ValueError(f"roles must be a non-empty subset of {ROLES}, got {self.roles}")
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self.probe_interval_s = probe_interval_s
        self._endpoints = parse_etcd_urls(etcd_url)
        self._security = security or EtcdSecurity(tls=uses_tls(etcd_url))
        self.url = format_endpoints(self._endpoints, self._security.tls)
        self.connected = False
        self._by_key: dict[str, pb.WorkerInfo] = {}
        self._key_by_id: dict[str, str] = {}
        self._suppressed_until: dict[str, float] = {}  # worker_id -> time.monotonic() deadline
        # worker_id -> the one process suppressed, where one was named
        self._suppressed_epoch: dict[str, int] = {}
        self._unsuppress_timers: dict[str, asyncio.TimerHandle] = {}
        self._subscribers: list[Subscriber] = []
        self._changed = asyncio.Event()
        self._client: aetcd.Client | None = None
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------------------------------ the view

    def workers(self, role: str) -> list[pb.WorkerInfo]:
        """The visible workers of `role`, ordered by worker_id."""
        found = [
            info
            for key, info in self._by_key.items()
            if key.startswith(f"{WORKERS_PREFIX}{role}/") and not self._is_suppressed(info.worker_id)
        ]
        return sorted(found, key=lambda info: info.worker_id)

    def get(self, worker_id: str) -> pb.WorkerInfo | None:
        key = self._key_by_id.get(worker_id)
        if key is None or self._is_suppressed(worker_id):
            return None
        return self._by_key.get(key)

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """callback("added" | "removed", info) on every change of the visible set; returns an unsubscribe."""
        self._subscribers.append(callback)

        def unsubscribe() -> None:
            with contextlib.suppress(ValueError):
                self._subscribers.remove(callback)

        return unsubscribe

    def suppress(self, worker_id: str, seconds: float, epoch: int | None = None) -> None:
        """Hide `worker_id` from this directory now, for `seconds` (extends an earlier suppression). With `epoch`,
        only that process: nothing is hidden if another holds the id already, and one registering under the id
        meanwhile (a restart) is visible at once."""
        visible_before = self.get(worker_id)
        current = self._current(worker_id)
        if epoch is not None and current is not None and current.epoch != epoch:
            log.info("worker %s: suppression of epoch %d skipped, epoch %d holds the id", worker_id, epoch,
                     current.epoch)  # fmt: skip
            return
        if epoch is None:
            self._suppressed_epoch.pop(worker_id, None)
        elif worker_id not in self._suppressed_until or worker_id in self._suppressed_epoch:
            self._suppressed_epoch[worker_id] = epoch
        until = max(time.monotonic() + seconds, self._suppressed_until.get(worker_id, 0.0))
        self._suppressed_until[worker_id] = until
        old_timer = self._unsuppress_timers.pop(worker_id, None)
        if old_timer is not None:
            old_timer.cancel()
        loop = asyncio.get_running_loop()
        self._unsuppress_timers[worker_id] = loop.call_at(
            loop.time() + (until - time.monotonic()), self._unsuppress, worker_id
        )
        if visible_before is not None:
            log.info("worker %s suppressed for %.1fs", worker_id, seconds)
            self._emit("removed", visible_before)

    async def wait_for(self, role: str, n: int, timeout_s: float) -> list[pb.WorkerInfo]:
        """The workers of `role` once at least `n` are visible; DiscoveryTimeoutError after `timeout_s`."""
        if role not in self.roles:
            raise ValueError(f"this directory follows roles {self.roles}, not {role!r}")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            found = self.workers(role)
            if len(found) >= n:
                return found
            remaining = deadline - loop.time()
            if remaining <= 0:
                ids = ", ".join(w.worker_id for w in found) or "none"
                state = "connected" if self.connected else "unreachable, view frozen"
                raise DiscoveryTimeoutError(
                    f"waited {timeout_s:g}s for {n} {role} worker(s) in etcd {self.url}: "
                    f"{len(found)} visible ({ids}); etcd {state}"
                )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await self._changed.wait()

    # ------------------------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """List and watch; EtcdUnavailableError if etcd does not answer within connect_timeout_s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.connect_timeout_s
        backoff = Backoff(first_s=0.1, max_s=1.0)
        while True:
            try:
                watch = await self._connect_list_watch()
                break
            except Exception as e:
                delay = backoff.next_s()
                if loop.time() + delay >= deadline:
                    raise EtcdUnavailableError(
                        f"etcd {self.url} unreachable for {self.connect_timeout_s:g}s at start: {describe(e)}"
                    ) from e
                await asyncio.sleep(delay)
        self._task = loop.create_task(self._follow_forever(watch), name=f"worker directory {self.url}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._drop_client()
        self.connected = False
        for timer in self._unsuppress_timers.values():
            timer.cancel()
        self._unsuppress_timers.clear()

    async def _follow_forever(self, watch: aetcd.Watch) -> None:
        backoff = Backoff(first_s=0.1, max_s=1.0)
        while True:
            try:
                await self._follow(watch)
                reason = "watch stream ended"
            except asyncio.CancelledError:
                raise
            except Exception as e:
                reason = describe(e)
            if self.connected:
                log.warning(
                    "etcd %s: lost (%s); keeping the last known %d worker(s) until it returns",
                    self.url,
                    reason,
                    len(self._by_key),
                )
            self.connected = False
            self._notify_waiters()
            await self._drop_client()
            while True:
                await asyncio.sleep(backoff.next_s())
                try:
                    watch = await self._connect_list_watch()
                    break
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    log.debug("etcd %s: still unreachable: %s", self.url, describe(e))
            backoff.reset()
            log.info("etcd %s: reachable again; re-listed %d worker(s)", self.url, len(self._by_key))

    async def _connect_list_watch(self) -> aetcd.Watch:
        """Connect, replace the view with a fresh listing, and watch from the revision after it.
        On failure nothing changes: the view stays as it was and the client is dropped."""
        self._client = client = await connect_first_reachable(
            self._endpoints, self.request_timeout_s, self._security
        )
        try:
            listing = await with_deadline(client.get_prefix(WORKERS_PREFIX.encode()), self.request_timeout_s)
            watch = await with_deadline(
                client.watch_prefix(WORKERS_PREFIX.encode(), start_revision=listing.header.revision + 1),
                self.request_timeout_s,
            )
        except BaseException:
            await self._drop_client()
            raise
        snapshot = {}
        for kv in listing:
            info = self._parse(kv.key, kv.value)
            if info is not None:
                snapshot[kv.key.decode()] = info
        for key in [k for k in self._by_key if k not in snapshot]:
            self._remove(key)
        for key, info in snapshot.items():
            self._upsert(key, info)
        self.connected = True
        self._notify_waiters()
        return watch

    async def _follow(self, watch: aetcd.Watch) -> None:
        """Apply watch events until the stream fails, or until a probe shows etcd stopped answering
        (a hung etcd keeps the stream open and silent)."""
        events = asyncio.create_task(self._apply_events(watch))
        probes = asyncio.create_task(self._probe())
        try:
            done, _ = await asyncio.wait({events, probes}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # raises the failure, if any
        finally:
            for task in (events, probes):
                task.cancel()
            await asyncio.gather(events, probes, return_exceptions=True)

    async def _apply_events(self, watch: aetcd.Watch) -> None:
        async for event in watch:
            key = event.kv.key.decode()
            if event.kind == aetcd.EventKind.PUT:
                info = self._parse(event.kv.key, event.kv.value)
                if info is not None:
                    self._upsert(key, info)
                else:
                    self._remove(key)
            else:
                self._remove(key)

    async def _probe(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            assert self._client is not None
            await with_deadline(self._client.get(PROBE_KEY), self.request_timeout_s)

    async def _drop_client(self) -> None:
        client, self._client = self._client, None
        await close_quietly(client)

    # ------------------------------------------------------------------------------------------ changes

    def _parse(self, raw_key: bytes, value: bytes) -> pb.WorkerInfo | None:
        """The WorkerInfo for a key of one of our roles; None for other roles and for unreadable values."""
        parsed = split_worker_key(raw_key.decode(errors="replace"))
        if parsed is None or parsed[0] not in self.roles:
            return None
        try:
            info = decode_worker_info(value)
        except ValueError as e:
            log.warning(
                "etcd %s: ignoring %s: not a WorkerInfo (%s)", self.url, raw_key.decode(errors="replace"), e
            )
            return None
        info.role, info.worker_id = parsed  # the key is the truth for where a worker is listed
        return info

    def _upsert(self, key: str, info: pb.WorkerInfo) -> None:
        old = self._by_key.get(key)
        self._by_key[key] = info
        self._key_by_id[info.worker_id] = key
        suppressed_epoch = self._suppressed_epoch.get(info.worker_id)
        if (
            suppressed_epoch is not None
            and suppressed_epoch != info.epoch
            and self._is_suppressed(info.worker_id)
        ):
            # a new process under a suppressed process's id: not the one that failed. The old one was hidden,
            # so subscribers saw it go already; the new one is simply added.
            self._lift(info.worker_id)
            old = None
        if self._is_suppressed(info.worker_id):
            return
        if old is None:
            log.info("worker added: %s/%s at %s", info.role, info.worker_id, info.endpoint)
            self._emit("added", info)
        elif _identity(old) != _identity(info):
            log.info(
                "worker replaced: %s/%s now at %s (epoch %d)",
                info.role,
                info.worker_id,
                info.endpoint,
                info.epoch,
            )
            self._emit("removed", old)
            self._emit("added", info)
        else:
            self._notify_waiters()

    def _remove(self, key: str) -> None:
        old = self._by_key.pop(key, None)
        if old is None:
            return
        if self._key_by_id.get(old.worker_id) == key:
            del self._key_by_id[old.worker_id]
        if not self._is_suppressed(old.worker_id):
            log.info("worker removed: %s/%s", old.role, old.worker_id)
            self._emit("removed", old)

    def _is_suppressed(self, worker_id: str) -> bool:
        until = self._suppressed_until.get(worker_id)
        return until is not None and time.monotonic() < until

    def _current(self, worker_id: str) -> pb.WorkerInfo | None:
        """The registered worker of that id, suppressed or not."""
        key = self._key_by_id.get(worker_id)
        return self._by_key.get(key) if key is not None else None

    def _lift(self, worker_id: str) -> None:
        timer = self._unsuppress_timers.pop(worker_id, None)
        if timer is not None:
            timer.cancel()
        self._suppressed_until.pop(worker_id, None)
        self._suppressed_epoch.pop(worker_id, None)

    def _unsuppress(self, worker_id: str) -> None:
        self._unsuppress_timers.pop(worker_id, None)
        self._suppressed_until.pop(worker_id, None)
        self._suppressed_epoch.pop(worker_id, None)
        info = self.get(worker_id)
        if info is not None:
            log.info("worker %s visible again after suppression", worker_id)
            self._emit("added", info)

    def _emit(self, kind: EventKind, info: pb.WorkerInfo) -> None:
        for callback in list(self._subscribers):
            try:
                callback(kind, info)
            except Exception:
                log.exception("discovery subscriber %r failed on %s %s", callback, kind, info.worker_id)
        self._notify_waiters()

    def _notify_waiters(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
