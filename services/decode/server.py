"""The decode worker: streams a request's tokens with continuous batching over a paged KV cache.

Two ways in. With `DecodeRequest.kv` unset (aggregated) it prefills the prompt (and any tokens the client already
saw) itself, then decodes. With `kv` set (disaggregated) it checks the KvHandle against its own engine's layout
(a mismatch is INVALID_ARGUMENT naming the field, never a reinterpretation), pulls the bytes from the producer
through services.kvtransfer within `--kv-pull-timeout-s` over the first backend of `--kv-backend-preference`
that both sides have (shm only on the same node), imports them, decodes after `emitted_token_ids`, and
acknowledges with the producer's `Release` (in the background, with its own deadline) once the request has
finished — not at the pull: while the stream runs, the producer's copy is what a migration re-transfers from
if this worker dies (the frontend releases it too when the request ends; the TTL covers both acks lost). A pull
that fails is UNAVAILABLE with a message starting `KV unavailable: ` (producer gone, key expired, deadline) or
DATA_LOSS (bytes differ from what was published), within the deadline.

Each engine output becomes one `DecodeChunk`; token indices count from the start of the whole output, so a
request resumed with `emitted_token_ids` continues where it stopped. The first chunk of a pulled request reports
the transfer's bytes, seconds and backend, and every first chunk the seconds the request waited in this worker's
queue. A full KV pool is a wait, never an error: the request queues in the engine until its blocks can be
allocated (bounded by the call's deadline), sending an empty `waiting` chunk every `QUEUE_HEARTBEAT_S` so the
caller knows the worker is busy, not hung; the wait is observed as `queue{role=decode}` and a `kv_admission` span.

A local prefill whose request carries a `PrefixPull` first copies the named prefix blocks from the peer prefill
worker (runtime/prefix_pull.py; any failure recomputes) and reports `pulled_tokens` on the first chunk.

This room must never hold state past a request's stream, or talk to the router; the only other worker it
calls is a KV producer, to pull and to acknowledge.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace

from services.engine.engine import KvExport, RequestOutput
from services.kvtransfer import (
    KvSink,
    Pulled,
    TransferError,
    TransferIntegrityError,
    TransferTicket,
)
from services.rpc import pb, pb_grpc
from services.runtime import wire
from services.runtime.args import (
    add_engine_arguments,
    add_flag,
    add_kv_transfer_arguments,
    add_service_arguments,
    kv_sink_config,
)
from services.runtime.async_engine import ENGINE_STUCK_S, AsyncEngine, RequestStream, RequestTiming
from services.runtime.channels import ChannelPool
from services.runtime.errors import (
    KV_UNAVAILABLE_PREFIX,
    KvDataLossError,
    KvPreconditionError,
    KvUnavailableError,
    WorkerUnavailableError,
)
from services.runtime.host import ServiceHost, service_main
from services.runtime.prefix_pull import PrefixPuller, PullResult
from services.runtime.rpc import request_meta
from services.runtime.tasks import BackgroundTasks
from services.runtime.worker import EngineWorker, run_engine_worker
from services.telemetry import metrics, tracing

log = logging.getLogger("rackserve.decode")

ROLE = "decode"
SERVICE_NAME = "rackserve.v1.DecodeWorker"
GATED_METHODS = (f"/{SERVICE_NAME}/Decode",)
# While a request waits in the engine's queue (its KV blocks not yet free) the stream sends an empty `waiting`
# chunk this often, well inside any caller's stall timeout. A starved CPU can make one step take tens of seconds
# (busy, not hung; a stopped process sends nothing anyway), so only an engine that has not stepped for
# ENGINE_STUCK_S (a step stuck for good) sends none.
QUEUE_HEARTBEAT_S = 1.0


class DecodeWorker(EngineWorker, pb_grpc.DecodeWorkerServicer):
    def __init__(
        self,
        host: ServiceHost,
        engine: AsyncEngine,
        sink: KvSink,
        preference: tuple[str, ...] = ("shm", "nixl", "tcp"),
        pull_timeout_s: float = 10.0,
        release_timeout_s: float = 2.0,
        debug_die_after_tokens: int = 0,
        prefix_pull_deadline_s: float = 2.0,
    ) -> None:
        super().__init__(host, engine)
        self.debug_die_after_tokens = debug_die_after_tokens
        self.sink = sink
        self.preference = preference
        self.pull_timeout_s = pull_timeout_s
        self.release_timeout_s = release_timeout_s
        self._producers = ChannelPool(host.tls)  # a channel per producer endpoint, for Release
        self._acks = BackgroundTasks()
        self.puller = PrefixPuller(
            engine, sink, self._producers, ROLE, preference, prefix_pull_deadline_s, release_timeout_s
        )
        # export a zero per failure reason from the start, so rate() reads 0 rather than nothing
        for reason in ("unavailable", "data_loss", "precondition"):
            metrics.KV_TRANSFER_FAILURES.labels(reason)

    async def Decode(  # noqa: N802 - gRPC method name
        self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DecodeChunk]:
        request_id = self.request_id(request.request_id, context)
        params = wire.sampling_params(request.params)
        await self.engine.compile_grammar(params)  # off the engine thread, bounded; before any KV moves
        index = len(request.emitted_token_ids)
        kv: KvExport | None = None
        pulled: Pulled | None = None
        traceparent = request_meta(context).traceparent
        if self.debug_die_after_tokens and index >= self.debug_die_after_tokens:
            self._die(request_id, index)  # a resumed request that already has N tokens: die at its start
        if request.HasField("kv"):
            with tracing.server_span("kv_transfer", traceparent, request_id) as span:
                pulled = await self._pull(request_id, request.kv, len(request.prompt_token_ids), span)
            n = request.kv.num_tokens
            kv = KvExport(self.facts.kv_layout, list(request.prompt_token_ids[:n]), pulled.data)  # type: ignore[arg-type]
            # the engine holds the payload until it has written it into its blocks; nothing here may keep it for
            # the stream's life (a device-direct one is GPU memory outside the cache's plan, a host one the
            # prompt's KV again in RAM)
            pulled.data = None
        prefix: PullResult | None = None
        if not request.HasField("kv") and request.HasField(
            "prefix_pull"
        ):  # local prefill: its prefix from a peer
            with tracing.server_span("prefix_pull", traceparent, request_id) as span:
                tokens = [*request.prompt_token_ids, *request.emitted_token_ids]
                prefix = await self.puller.pull(request_id, request.prefix_pull, tokens)
                tracing.set_attributes(
                    span,
                    {
                        "rackserve.pull.source_worker_id": prefix.source_worker_id,
                        "rackserve.pull.outcome": prefix.outcome,
                        "rackserve.pull.blocks": prefix.blocks,
                    },
                )
        try:
            first = True
            async with self.engine.generate(
                request_id, request.prompt_token_ids, params, output_ids=request.emitted_token_ids, kv=kv
            ) as stream:
                kv = None  # handed to the engine
                async for out in _with_heartbeats(stream, self.engine):
                    if out is None:  # still queued for KV blocks (or a slow step): busy, not hung
                        yield pb.DecodeChunk(waiting=True)
                        continue
                    if out.finish_reason == "abort" and self.host.gate.draining:
                        raise WorkerUnavailableError(
                            f"worker {self.host.worker_id} drained before request {request_id!r} finished; "
                            "resume it elsewhere with the tokens emitted so far"
                        )
                    chunk = pb.DecodeChunk(
                        tokens=wire.tokens(out, index),
                        finished=out.finished,
                        finish_reason=out.finish_reason or "",
                        stop_reason=wire.stop_reason(out),
                    )
                    if first:
                        chunk.prompt_tokens, chunk.cached_tokens = (
                            out.num_prompt_tokens,
                            out.num_cached_tokens,
                        )
                        chunk.queue_s = stream.timing.queue_s
                        if prefix is not None:
                            await self.puller.release(prefix)  # admitted: the pulled prefix needs no pin now
                            chunk.pulled_tokens = prefix.pulled_tokens(
                                self.facts.kv_layout.block_size, out.num_cached_tokens
                            )
                        if pulled is None:  # aggregated: this worker ran the prompt
                            self._local_prefill_span(
                                traceparent, request_id, stream.timing, out, chunk.pulled_tokens
                            )
                        if pulled is not None:
                            chunk.transfer_bytes, chunk.transfer_s = pulled.bytes, pulled.seconds
                            chunk.transfer_backend = pulled.backend
                            self._admission_span(traceparent, request_id, stream.timing)
                        first = False
                    index += len(out.new_token_ids)
                    yield chunk
                    if not out.finished and 0 < self.debug_die_after_tokens <= index:
                        await asyncio.sleep(0.2)  # let the chunk leave, so the client sees exactly N tokens
                        self._die(request_id, index)
        finally:
            if prefix is not None:  # a stream that ended before its first chunk: unpin the prefix too
                await self.puller.release(prefix)
        if pulled is not None:
            self._ack(request.kv)  # finished: the producer may free its copy

    def _die(self, request_id: str, index: int) -> None:
        """--debug-die-after-tokens (test-only): a real SIGKILL of this process, at an exact token index."""
        log.warning("--debug-die-after-tokens %d: SIGKILL at token %d of %s",
                    self.debug_die_after_tokens, index, request_id)  # fmt: skip
        os.kill(os.getpid(), signal.SIGKILL)

    def _local_prefill_span(
        self,
        traceparent: str,
        request_id: str,
        timing: RequestTiming,
        out: RequestOutput,
        pulled_tokens: int = 0,
    ) -> None:
        start_unix_s = tracing.monotonic_to_unix_s(timing.submitted_s)
        span = tracing.tracer().start_span(
            "prefill",
            context=tracing.context_of(traceparent),
            kind=tracing.SpanKind.SERVER,
            start_time=tracing.unix_ns(start_unix_s),
            attributes={
                tracing.REQUEST_ID: request_id,
                "rackserve.local": True,
                "rackserve.pulled_tokens": pulled_tokens,
            },
        )
        self.observe_prompt(span, request_id, timing, out.num_prompt_tokens, out.num_cached_tokens)
        span.end(end_time=tracing.unix_ns(start_unix_s + timing.queue_s + timing.compute_s))

    def _admission_span(self, traceparent: str, request_id: str, timing: RequestTiming) -> None:
        """The wait of pulled KV for blocks in this worker's pool: queue time, in the metrics and the trace."""
        metrics.QUEUE_S.labels(ROLE).observe(timing.queue_s)
        start_unix_s = tracing.monotonic_to_unix_s(timing.submitted_s)
        span = tracing.tracer().start_span(
            "kv_admission",
            context=tracing.context_of(traceparent),
            kind=tracing.SpanKind.SERVER,
            start_time=tracing.unix_ns(start_unix_s),
            attributes={
                tracing.REQUEST_ID: request_id,
                "rackserve.worker_id": self.host.worker_id,
                "rackserve.queue_s": timing.queue_s,
            },
        )
        span.end(end_time=tracing.unix_ns(start_unix_s + timing.queue_s))

    async def _pull(
        self, request_id: str, handle: pb.KvHandle, num_prompt_tokens: int, span: trace.Span
    ) -> Pulled:
        """Validate the handle and pull its bytes within the deadline (the ack waits for the stream's end)."""
        tracing.set_attributes(
            span,
            {
                "rackserve.worker_id": self.host.worker_id,
                "rackserve.producer_worker_id": handle.producer_worker_id,
                "rackserve.kv_tokens": handle.num_tokens,
                "rackserve.kv_blocks": len(handle.block_ids),
            },
        )
        try:
            pulled = await self._pull_checked(request_id, handle, num_prompt_tokens)
        except KvDataLossError:
            metrics.KV_TRANSFER_FAILURES.labels("data_loss").inc()
            raise
        except KvUnavailableError:
            metrics.KV_TRANSFER_FAILURES.labels("unavailable").inc()
            raise
        except (KvPreconditionError, ValueError):
            metrics.KV_TRANSFER_FAILURES.labels("precondition").inc()
            raise
        metrics.KV_TRANSFER_S.labels(pulled.backend).observe(pulled.seconds)
        metrics.KV_TRANSFER_BYTES.labels(pulled.backend).observe(pulled.bytes)
        if pulled.seconds > 0:
            metrics.KV_TRANSFER_BANDWIDTH.labels(pulled.backend).set(pulled.gb_per_s)
        tracing.set_attributes(
            span,
            {
                "rackserve.transfer_bytes": pulled.bytes,
                "rackserve.transfer_backend": pulled.backend,
                "rackserve.transfer_device_direct": pulled.device_direct,
                "rackserve.transfer_s": pulled.seconds,
                "rackserve.transfer_gb_per_s": pulled.gb_per_s if pulled.seconds > 0 else None,
            },
        )
        return pulled

    async def _pull_checked(self, request_id: str, handle: pb.KvHandle, num_prompt_tokens: int) -> Pulled:
        wire.check_kv_handle(self.facts.kv_layout, handle, num_prompt_tokens)
        if handle.expires_unix_ms and handle.expires_unix_ms < time.time() * 1000:
            raise KvPreconditionError(
                f"KvHandle of {handle.request_id!r} expired {time.time() - handle.expires_unix_ms / 1000:.1f}s "
                f"ago (producer {handle.producer_worker_id}); prefill again"
            )
        try:
            ticket = TransferTicket.from_json(handle.transfer_endpoint, handle.agent_metadata)
        except ValueError as e:
            raise ValueError(f"KvHandle.transfer_endpoint: {e}") from e
        try:
            backend = self.sink.choose(ticket, self.preference)
            pulled = await self.sink.pull(
                ticket, self.pull_timeout_s, backend=backend, device=self.engine.device
            )
        except TransferIntegrityError as e:
            raise KvDataLossError(f"KV of {request_id!r} from {handle.producer_worker_id}: {e}") from e
        except TransferError as e:
            raise KvUnavailableError(
                f"{KV_UNAVAILABLE_PREFIX}KV of {request_id!r} from {handle.producer_worker_id} did not arrive "
                f"({type(e).__name__}): {e}"
            ) from e
        log.info(
            "pulled KV of %s: %d tokens, %d bytes over %s%s in %.4fs (%.2f GB/s)",
            request_id, handle.num_tokens, pulled.bytes, pulled.backend,
            " device to device" if pulled.device_direct else "", pulled.seconds, pulled.gb_per_s,
        )  # fmt: skip
        return pulled

    def _ack(self, handle: pb.KvHandle) -> None:
        """Tell the producer it may free the blocks (fire and forget: its TTL covers a lost ack)."""
        if not handle.producer_endpoint:
            return

        async def release() -> None:
            try:
                await pb_grpc.PrefillWorkerStub(
                    self._producers.get(handle.producer_endpoint, handle.producer_epoch)
                ).Release(
                    pb.ReleaseRequest(request_id=handle.request_id),
                    metadata=(("x-request-id", handle.request_id),),
                    timeout=self.release_timeout_s,
                )
            except grpc.aio.AioRpcError as e:
                log.warning(
                    "Release of %r to %s failed (%s); its TTL frees it",
                    handle.request_id, handle.producer_worker_id, e.code().name,
                )  # fmt: skip

        self._acks.spawn(release(), name=f"release {handle.request_id}")

    async def close(self) -> None:
        await self._acks.wait()
        await self.puller.close()
        await self._producers.close()


async def _with_heartbeats(stream: RequestStream, engine: AsyncEngine) -> AsyncIterator[RequestOutput | None]:
    """The stream's outputs, and None after every QUEUE_HEARTBEAT_S without one while the engine is still
    stepping: a request waiting for KV blocks behind a full pool keeps its caller's stall timer from firing.
    A stuck engine thread sends no heartbeats, so the caller still sees a hung worker as one."""
    task: asyncio.Future[RequestOutput | None] | None = None
    try:
        while True:
            if task is None:
                task = asyncio.ensure_future(anext(stream, None))
            done, _ = await asyncio.wait({task}, timeout=QUEUE_HEARTBEAT_S)
            if not done:
                if engine.progress_age_s() < ENGINE_STUCK_S:
                    yield None
                continue
            out, task = task.result(), None
            if out is None:
                return
            yield out
    finally:
        if task is not None:
            task.cancel()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_service_arguments(parser)
    add_engine_arguments(parser)
    add_kv_transfer_arguments(parser, ROLE)
    g = parser.add_argument_group("testing (never in production)")
    add_flag(g, "--debug-die-after-tokens", 0, "TEST ONLY: SIGKILL this process once a stream has sent this "
             "many tokens (output index; 0: never) — the chaos suite's exact-index fault", int)  # fmt: skip


async def serve(args: argparse.Namespace) -> None:
    sink = await KvSink.start(kv_sink_config(args))
    metrics.export_pulled_resident(sink.resident_bytes)
    workers: list[DecodeWorker] = []

    def make(host: ServiceHost, engine: AsyncEngine) -> DecodeWorker:
        worker = DecodeWorker(
            host,
            engine,
            sink,
            tuple(args.kv_backend_preference),
            args.kv_pull_timeout_s,
            args.kv_release_timeout_s,
            args.debug_die_after_tokens,
            args.kv_prefix_pull_deadline_s,
        )
        workers.append(worker)
        return worker

    try:
        await run_engine_worker(
            args, ROLE, SERVICE_NAME, GATED_METHODS, make, pb_grpc.add_DecodeWorkerServicer_to_server
        )
    finally:
        for worker in workers:
            await worker.close()
        await sink.close()  # after the engine: tears NIXL down in order (no segfault at exit)


if __name__ == "__main__":
    sys.exit(service_main(ROLE, __doc__ or "", add_arguments, serve))
