"""The KV-hold lifecycle: the prefill worker's copy of a prompt's KV, kept alive for as long as the request may
still want it, so that a migration can re-transfer it instead of rebuilding it.

A disaggregated prefill returns a `KvHandle` the prefill worker holds for a grant (its TTL). `KvHolds`:
- `hold`: the request keeps the handle (`RequestState.held_kv`) and the length of a grant;
- `keep_alive`: while the decode stream runs, ExtendHold (in the background) once half the grant has passed;
- `reusable`: on a migration, the handle if its holder is still the same live process and the hold outlasts a
  pull (`RETRANSFER_MIN_TTL_S`), else None (the request rebuilds);
- `release`: when the request ends (or a rebuild will not pull it), Release in the background; idempotent on the
  prefill worker, whose TTL also frees a hold whose Release was lost.
Every call carries the request's metadata and a deadline.

This room owns the hold's RPCs only; which worker runs what is the coordinator's decision.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import grpc

from services.frontend.request_state import RequestState
from services.rpc import pb, pb_grpc
from services.runtime.channels import ChannelPool
from services.runtime.tasks import BackgroundTasks

log = logging.getLogger("rackserve.frontend")

RELEASE_TIMEOUT_S = 2.0  # one Release or ExtendHold call
# A held KvHandle closer than this to its expiry is not worth a re-transfer: the pull would race the TTL.
RETRANSFER_MIN_TTL_S = 2.0


class KvHolds:
    def __init__(self, channels: ChannelPool, background: BackgroundTasks) -> None:
        self.channels = channels
        self.background = background
        self._extending: set[str] = set()  # request ids with an ExtendHold in flight

    def hold(self, state: RequestState, kv: pb.KvHandle) -> None:
        """The request keeps the prefill worker's copy of its KV; a grant lasts as long as this first one."""
        state.held_kv = kv
        state.hold_ttl_s = max(1.0, kv.expires_unix_ms / 1000 - time.time())

    def reusable(self, state: RequestState, prefill_workers: Iterable[pb.WorkerInfo]) -> pb.KvHandle | None:
        """The prefill copy of the prompt's KV, if its holder is alive (among `prefill_workers`, same epoch)
        and the hold outlasts a pull."""
        kv = state.held_kv
        if kv is None or kv.producer_worker_id in state.failed_worker_ids:
            return None
        if kv.expires_unix_ms and kv.expires_unix_ms / 1000 - time.time() < RETRANSFER_MIN_TTL_S:
            return None
        alive = {w.worker_id: w.epoch for w in prefill_workers}
        if alive.get(kv.producer_worker_id) != kv.producer_epoch:
            return None  # gone from discovery, or restarted (its blocks went with the old process)
        return kv

    def keep_alive(self, state: RequestState) -> None:
        """While the stream runs, keep the prefill copy of the KV alive (ExtendHold, in the background) once
        half its grant has passed, so a migration can still re-transfer rather than rebuild."""
        kv = state.held_kv
        if kv is None or not kv.producer_endpoint or state.request_id in self._extending:
            return
        if kv.expires_unix_ms / 1000 - time.time() > state.hold_ttl_s / 2:
            return

        async def extend() -> None:
            stub = pb_grpc.PrefillWorkerStub(self.channels.get(kv.producer_endpoint, kv.producer_epoch))
            try:
                reply = await stub.ExtendHold(
                    pb.ExtendHoldRequest(request_id=kv.request_id, ttl_s=state.hold_ttl_s),
                    metadata=state.metadata(),
                    timeout=RELEASE_TIMEOUT_S,
                )
            except grpc.aio.AioRpcError as e:
                log.info("ExtendHold of %s on %s: %s", kv.request_id, kv.producer_worker_id, e.code().name)
                return
            finally:
                self._extending.discard(state.request_id)
            if state.held_kv is kv:
                if reply.held and reply.expires_unix_ms > kv.expires_unix_ms:
                    kv.expires_unix_ms = reply.expires_unix_ms
                elif not reply.held:
                    state.held_kv = None  # expired or released: nothing to re-transfer from

        self._extending.add(state.request_id)
        self.background.spawn(extend(), name=f"extend hold {kv.request_id}")

    def release(self, state: RequestState) -> None:
        """Let the prefill worker free the prompt's KV (idempotent there; its TTL covers a lost Release)."""
        kv, state.held_kv = state.held_kv, None
        if kv is None or not kv.producer_endpoint:
            return

        async def release() -> None:
            stub = pb_grpc.PrefillWorkerStub(self.channels.get(kv.producer_endpoint, kv.producer_epoch))
            try:
                await stub.Release(
                    pb.ReleaseRequest(request_id=kv.request_id),
                    metadata=state.metadata(),
                    timeout=RELEASE_TIMEOUT_S,
                )
            except grpc.aio.AioRpcError as e:
                log.info("Release of %s to %s: %s (its TTL frees it)", kv.request_id, kv.producer_worker_id,
                         e.code().name)  # fmt: skip

        try:
            self.background.spawn(release(), name=f"release {kv.request_id}")
        except RuntimeError:  # no running loop (a generator finalized at shutdown): the TTL frees it
            return
