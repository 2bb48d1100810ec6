"""What prefill and decode workers share: an engine behind a ServiceHost, their WorkerInfo, and Subscribe.

`EngineWorker` is the base of both servicers. Its `Subscribe` is the stream a router opens to every worker it
discovers: first (on request) every cached block hash, then a `LoadSnapshot` and every KV block stored or
evicted, as they happen — load at most every `LOAD_MIN_INTERVAL_S`, and at least every `LOAD_HEARTBEAT_S` while
the engine makes progress (a router takes silence for a frozen, dead or stuck worker; a worker whose engine has not
stepped for `ENGINE_STUCK_S` stops vouching for itself).

`run_engine_worker` is the life of such a process: load the model, start the server, register, wait for
SIGTERM, drain. This room must never hold a service's own logic (prefilling, decoding).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection
from typing import Any

import grpc

from services.engine.engine import LLMEngine
from services.rpc import pb
from services.runtime import wire
from services.runtime.args import engine_config, model_path
from services.runtime.async_engine import ENGINE_STUCK_S, AsyncEngine, LoadStats, RequestTiming
from services.runtime.host import ServiceHost, configure_logging
from services.runtime.rpc import request_meta
from services.telemetry import metrics, tracing

log = logging.getLogger("rackserve.runtime.worker")

LOAD_MIN_INTERVAL_S = 0.05  # a busy engine steps every few tens of ms; coalesce its load updates
LOAD_HEARTBEAT_S = 1.0  # an idle worker still says it is alive and how loaded it is


class EngineWorker:
    def __init__(self, host: ServiceHost, engine: AsyncEngine) -> None:
        self.host = host
        self.engine = engine
        assert engine.engine is not None
        self.facts = engine.engine  # read-only here: fingerprint, kv_layout, max_model_len, model_config
        metrics.export_engine(host.role, engine.stats)
        if self.facts.tier2 is not None:  # observed on the engine thread, after each restore
            self.facts.tier2.restore_observer = metrics.KV_TIER_RESTORE_S.labels(host.role, "host").observe
        if self.facts.disk is not None:
            self.facts.disk.restore_observer = metrics.KV_TIER_RESTORE_S.labels(host.role, "disk").observe

    def request_id(self, given: str, context: grpc.aio.ServicerContext) -> str:
        """The message's request id, else the caller's x-request-id, else a fresh one."""
        return given or request_meta(context).request_id or f"{self.host.role}-{uuid.uuid4().hex}"

    def worker_info(self) -> pb.WorkerInfo:
        e = self.facts
        return self.host.worker_info(
            model_fingerprint=e.fingerprint,
            model_name=e.model_config.name,
            kv_capacity_blocks=self.engine.stats().total_blocks,
            block_size=e.kv_layout.block_size,
            max_model_len=e.max_model_len,
            kv_dtype=wire.KV_DTYPE_NAMES[e.kv_layout.dtype],
            kv_bytes_per_token=wire.kv_bytes_per_token(e.kv_layout),
        )

    def observe_prompt(
        self, span: Any, request_id: str, timing: RequestTiming, prompt_tokens: int, cached_tokens: int
    ) -> None:
        """Metrics and span of a prompt this worker ran: its queue wait, its compute, its prefix-cache hits.

        `span` (the RPC's server span) gets the numbers and two children, `queue_wait` and `compute`, placed
        at the times the engine measured."""
        role = self.host.role
        metrics.QUEUE_S.labels(role).observe(timing.queue_s)
        metrics.PREFILL_S.labels(role).observe(timing.compute_s)
        metrics.PREFIX_CACHE_QUERIES.labels(role).inc(prompt_tokens)
        metrics.PREFIX_CACHE_HITS.labels(role).inc(cached_tokens)
        tracing.set_attributes(
            span,
            {
                "rackserve.worker_id": self.host.worker_id,
                "rackserve.prompt_tokens": prompt_tokens,
                "rackserve.cached_tokens": cached_tokens,
                "rackserve.queue_s": timing.queue_s,
                "rackserve.compute_s": timing.compute_s,
            },
        )
        if span.is_recording():
            submitted = tracing.monotonic_to_unix_s(timing.submitted_s)
            scheduled = submitted + timing.queue_s
            rid = {tracing.REQUEST_ID: request_id}
            tracing.child_span(span, "queue_wait", submitted, scheduled, rid)
            tracing.child_span(span, "compute", scheduled, scheduled + timing.compute_s, rid)

    async def Subscribe(  # noqa: N802 - gRPC method name
        self, request: pb.SubscribeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WorkerEvent]:
        def event(**kw: Any) -> pb.WorkerEvent:
            return pb.WorkerEvent(worker_id=self.host.worker_id, epoch=self.host.epoch_ms, **kw)

        log.info("subscriber %r connected (snapshot=%s)", request.subscriber_id, request.snapshot)
        async with self.engine.events(snapshot=request.snapshot) as ((cached, tier2, disk), updates):
            if cached:  # the snapshot: every cached hash in one message (not one chain, so parent_hash is 0)
                yield event(kv=pb.KvBlockEvent(kind=pb.KvBlockEvent.STORED, block_hashes=cached))
            if tier2:  # and every hash in the host tier
                yield event(kv=pb.KvBlockEvent(kind=pb.KvBlockEvent.OFFLOADED, block_hashes=tier2))
            if disk:  # and on disk (after a restart: the blocks the directory kept)
                yield event(
                    kv=pb.KvBlockEvent(
                        kind=pb.KvBlockEvent.OFFLOADED, block_hashes=disk, tier=pb.KvBlockEvent.DISK
                    )
                )
            last_load = wire.load_snapshot(self.engine.stats())
            yield event(load=last_load)
            last_sent_s = time.monotonic()
            while True:
                batch = []
                try:
                    async with asyncio.timeout(LOAD_HEARTBEAT_S):
                        batch.append(await updates.get())
                except TimeoutError:
                    pass
                while not updates.empty():
                    batch.append(updates.get_nowait())
                newest: LoadStats | None = None
                for update in batch:
                    if isinstance(update, LoadStats):
                        newest = update
                    else:
                        for kv in wire.kv_block_events(update):
                            yield event(kv=kv)
                load = wire.load_snapshot(newest) if newest is not None else last_load
                beat = time.monotonic() - last_sent_s >= LOAD_HEARTBEAT_S
                if load != last_load or (beat and self.engine.progress_age_s() < ENGINE_STUCK_S):
                    yield event(load=load)
                    last_load, last_sent_s = load, time.monotonic()
                await asyncio.sleep(LOAD_MIN_INTERVAL_S)

    async def abort_all(self) -> None:
        for rid in self.engine.live_request_ids():
            await self.engine.abort(rid)

    async def settle(self, timeout_s: float) -> None:
        """On a drain, once no request is in flight: hand over what must outlive the requests (within timeout_s).
        Nothing by default."""


async def run_engine_worker(
    args: argparse.Namespace,
    role: str,
    service_name: str,
    gated_methods: Collection[str],
    make_servicer: Callable[[ServiceHost, AsyncEngine], EngineWorker],
    add_to_server: Callable[[Any, grpc.aio.Server], None],
) -> None:
    """Load, serve, register, and on SIGTERM drain; returns when the process may exit 0."""
    configure_logging()
    host = ServiceHost(args, role, [service_name], gated_methods)
    config, path = engine_config(args), model_path(args)
    loading = asyncio.ensure_future(AsyncEngine.start(lambda: LLMEngine(path, config)))
    signalled = asyncio.ensure_future(host.wait_for_signal())
    try:
        await asyncio.wait((loading, signalled), return_when=asyncio.FIRST_COMPLETED)
    finally:
        signalled.cancel()
    if not loading.done():
        # stopped before it served anything (a pod deleted or scaled down while its model loads): nothing to
        # drain, and no reason to hold the GPU until the load ends. The loading thread is a daemon, gone at exit
        log.info("%s %s stopped while loading its model", role, host.worker_id)
        loading.cancel()
        await host.close()
        return
    engine = loading.result()
    try:
        servicer = make_servicer(host, engine)
        add_to_server(servicer, host.server)
        await host.start()
        await host.serve(servicer.worker_info())
        await host.wait_for_signal()
        await host.drain(servicer.abort_all, servicer.settle)
    finally:
        await host.close()
        await engine.close()
