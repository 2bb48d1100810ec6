"""The prefill worker: runs a prompt, keeps its KV blocks for a decode worker to pull, returns a KvHandle.

`Prefill` computes the prompt and samples the first token with the request's own parameters and seed, so the
decode side continues exactly as if it had run the prompt itself. It then exports the prompt's KV blocks and
publishes them on its KvSource (services.kvtransfer: TCP, same-host shm, NIXL — `--kv-backends`, optionally
compressed for the wire with `--kv-compress`); the KvHandle it returns carries the transfer ticket. The blocks
and the publication stay until `Release` (the decode side's acknowledgement) or until the handle's
`expires_unix_ms` (`--kv-ttl-s`) passes — whichever comes first frees both; released blocks stay in the prefix
cache until evicted. The TTL runs from the moment the prompt has run, and a hold that ends before its KV is
published (a copy out of the pool slower than the TTL) hands out no handle: the response has the first token
only, and the decode worker prefills the prompt and that token itself.

The decode side acknowledges only when its request has finished, so the copy stays for a migration to
re-transfer from while the stream runs; the frontend keeps it alive past the TTL with `ExtendHold` while the
stream runs (never past `--kv-max-hold-s` from the prefill) and releases it when the request ends; the TTL
frees what every ack missed. `--debug-die-in prefill|transfer` (test-only) makes the process SIGKILL itself during a
Prefill call or as the first pull of its KV begins: the chaos suite's exact-moment prefill faults.

Prefix pulls between workers: `ExportPrefix` holds the longest run of asked chained hashes this pool caches (from
the first asked one) under the caller's id and publishes their bytes on the KvSource exactly like a prefill's KV
(same KvHandle, TTL, ExtendHold and Release); none cached is an empty answer and no hold. A Prefill whose request
carries a `PrefixPull` first copies those blocks from the named peer with this worker's KvSink
(runtime/prefix_pull.py) — any failure recomputes — and reports `pulled_tokens`.

This room must never decode past the first token, and never hold blocks without a deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
from opentelemetry import trace

from services.engine.engine import ExportJob, LLMEngine
from services.kvtransfer import KvSink, KvSource, TransferConfig
from services.kvtransfer.budget import DeviceRoom
from services.kvtransfer.ticket import Published
from services.rpc import pb, pb_grpc
from services.runtime import wire
from services.runtime.args import (
    add_engine_arguments,
    add_flag,
    add_kv_transfer_arguments,
    add_service_arguments,
    advertised_host,
    kv_device_copy_bytes,
    kv_sink_config,
)
from services.runtime.async_engine import ENGINE_STUCK_S, AsyncEngine
from services.runtime.channels import ChannelPool
from services.runtime.errors import WorkerUnavailableError
from services.runtime.host import ServiceHost, service_main
from services.runtime.prefix_pull import PrefixPuller, PullResult
from services.runtime.rpc import request_meta
from services.runtime.tasks import BackgroundTasks
from services.runtime.worker import EngineWorker, run_engine_worker
from services.telemetry import metrics, tracing

log = logging.getLogger("rackserve.prefill")


@dataclasses.dataclass
class _Copied:
    """A KV export copied out of the pool: host bytes, maybe the device copy and the room it holds."""

    job: ExportJob
    host: memoryview
    device: Any
    room: DeviceRoom | None


def _give_room(task: asyncio.Task[_Copied | None]) -> None:
    if not task.cancelled() and task.exception() is None and (copied := task.result()) and copied.room:
        copied.room.give()


ROLE = "prefill"
SERVICE_NAME = "rackserve.v1.PrefillWorker"
GATED_METHODS = (f"/{SERVICE_NAME}/Prefill",)
DEFAULT_KV_TTL_S = 30.0
DEFAULT_KV_MAX_HOLD_S = 600.0  # ExtendHold never keeps a request's KV longer than this after its prefill
DEBUG_DIE_IN = ("none", "prefill", "transfer")
STUCK_CHECK_S = 1.0  # how often a prefill call in flight checks that the engine still steps


class PrefillWorker(EngineWorker, pb_grpc.PrefillWorkerServicer):
    def __init__(
        self,
        host: ServiceHost,
        engine: AsyncEngine,
        source: KvSource,
        kv_ttl_s: float = DEFAULT_KV_TTL_S,
        kv_compress: str | None = None,
        debug_die_in: str = "none",
        kv_max_hold_s: float = DEFAULT_KV_MAX_HOLD_S,
        puller: PrefixPuller | None = None,
    ) -> None:
        super().__init__(host, engine)
        self.source = source
        self.puller = puller  # None: PrefixPulls are ignored (the prompt is computed here)
        self.kv_max_hold_s = max(kv_max_hold_s, kv_ttl_s)
        self._held_since: dict[str, float] = {}  # request id -> when its hold began (time.time())
        self.debug_die_in = debug_die_in
        if debug_die_in == "transfer":
            source.debug_on_pull = lambda key: _die(f"a pull of {key} began")
        self.kv_ttl_s = kv_ttl_s
        self.kv_compress = kv_compress
        self._expiry: dict[str, asyncio.TimerHandle] = {}  # request id -> the timer that frees its held KV
        self._expiring = BackgroundTasks()
        # KV copies off the engine thread (a cancelled call's runs to its end)
        self._copies = BackgroundTasks()
        for outcome in ("held", "empty"):
            metrics.PREFIX_EXPORTS.labels(outcome)

    async def Prefill(  # noqa: N802 - gRPC method name
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> pb.PrefillResponse:
        request_id = self.request_id(request.request_id, context)
        traceparent = request_meta(context).traceparent
        with tracing.server_span("prefill", traceparent, request_id) as span:
            pull: PullResult | None = None
            if request.HasField("prefix_pull") and self.puller is not None:
                with tracing.tracer().start_as_current_span("prefix_pull") as pull_span:
                    pull = await self.puller.pull(request_id, request.prefix_pull, request.token_ids)
                    pull_attributes(pull_span, pull)
            try:
                response = await self._unless_stuck(self._prefill(request_id, request, span))
            finally:
                if pull is not None and self.puller is not None:
                    await self.puller.release(pull)  # admitted (or failed): the prefix needs no pin now
            if pull is not None:
                response.pulled_tokens = pull.pulled_tokens(
                    self.facts.kv_layout.block_size, response.cached_tokens
                )
            tracing.set_attributes(
                span,
                {
                    "rackserve.kv_blocks": len(response.kv.block_ids),
                    "rackserve.pulled_tokens": response.pulled_tokens,
                },
            )
            return response

    async def _unless_stuck(self, work: Coroutine[Any, Any, pb.PrefillResponse]) -> pb.PrefillResponse:
        """`work`, failed (UNAVAILABLE) once the engine has not stepped for ENGINE_STUCK_S: the caller waits for a
        busy prefill worker as long as it stays registered, so a stuck engine in a live process must say so."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=STUCK_CHECK_S)
                if done:
                    return task.result()
                age = self.engine.progress_age_s()
                if age >= ENGINE_STUCK_S:
                    raise WorkerUnavailableError(
                        f"worker {self.host.worker_id}: its engine has not stepped for {age:.0f}s"
                    )
        finally:
            if not task.done():
                task.cancel()

    async def _prefill(
        self, request_id: str, request: pb.PrefillRequest, span: trace.Span
    ) -> pb.PrefillResponse:
        params = wire.sampling_params(request.params)
        prompt = list(request.token_ids)
        if self.debug_die_in == "prefill":
            _die(f"prefilling {request_id}")
        # one token only: the first one, drawn exactly as a local decode would draw it (same seed, index 0)
        first_only = dataclasses.replace(params, max_tokens=1)
        await self.engine.compile_grammar(first_only)
        async with self.engine.generate(request_id, prompt, first_only, hold_kv=True) as stream:
            outs = [o async for o in stream]
        # The engine holds the blocks from here: the deadline starts before anything else can fail, so they are
        # freed whatever ends this call (until 2026-12-07 it started once the response was built, and an error
        # before that left them held with no timer for the life of the process).
        expires_unix_ms = self._hold(request_id)
        try:
            out = outs[-1]
            timing = stream.timing
            if out.finish_reason == "abort":  # drained before it ran; nothing is held
                raise WorkerUnavailableError(
                    f"worker {self.host.worker_id} drained before prefilling {request_id!r}"
                )
            self.observe_prompt(span, request_id, timing, len(prompt), out.num_cached_tokens)
            finished = (
                out.finish_reason == "stop"
                or params.max_tokens == 1
                or len(prompt) + 1 >= self.facts.max_model_len
            )
            response = pb.PrefillResponse(
                first_token=wire.tokens(out, 0)[0],
                cached_tokens=out.num_cached_tokens,
                queue_s=timing.queue_s,
                compute_s=timing.compute_s,
                finished=finished,
                finish_reason=(out.finish_reason or "") if finished else "",
            )
            if finished:  # nobody will pull this KV
                await self._release(request_id)
                return response
            copied = await self._copy_out(lambda e, pin: e.begin_export(pin, request_id))
            assert copied is not None  # a live request always has blocks
            job = copied.job
            ticket = await self._publish(request_id, copied)
        except BaseException:
            await self._release(request_id)  # nothing will be pulled; free the blocks now, not at the TTL
            raise
        if not self._still_held(request_id):
            # A handle would send the decode worker to a pull it refuses, a migration the request may not have
            # left (--migration-limit): without one it prefills the prompt and the first token itself.
            return response
        layout = self.facts.kv_layout
        kv = wire.kv_handle(
            layout,
            request_id,
            job.block_ids,
            len(job.token_ids),
            self.host.worker_id,
            self.host.epoch_ms,
            expires_unix_ms,
        )
        kv.producer_endpoint = self.host.endpoint
        kv.transfer_endpoint = ticket.to_json()
        kv.agent_metadata = ticket.agent_metadata
        kv.transfer_backend = ",".join(sorted(ticket.backends))  # what is offered; the consumer chooses
        response.kv.CopyFrom(kv)
        return response

    async def ExportPrefix(  # noqa: N802 - gRPC method name
        self, request: pb.ExportPrefixRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExportPrefixResponse:
        """Hold and publish the longest cached run of the asked blocks for a peer; nothing cached: empty."""
        hold_id = request.request_id
        if not hold_id:
            raise ValueError("ExportPrefixRequest.request_id (the hold's id) is empty")
        if hold_id in self._expiry:
            raise ValueError(f"a hold named {hold_id!r} exists already on this worker")
        ttl_s = request.ttl_s if request.ttl_s > 0 else self.kv_ttl_s
        hashes = list(request.block_hashes)
        with tracing.server_span("export_prefix", request_meta(context).traceparent, hold_id) as span:
            # the deadline starts before any await, so the blocks are freed even if this call dies from here on
            expires_unix_ms = self._hold(hold_id, min(ttl_s, self.kv_max_hold_s))

            def begin(e: LLMEngine, pin: str) -> ExportJob | None:
                job = e.begin_prefix_export(hold_id, hashes)
                if job is not None:  # the hold can be released (Release, its TTL) while the copy reads
                    e.pin_held(pin, hold_id)
                return job

            try:
                copied = await self._copy_out(begin)
            except ValueError:  # the id names a request or hold of the engine's: nothing here is ours to free
                self._held_since.pop(hold_id, None)
                timer = self._expiry.pop(hold_id, None)
                if timer is not None:
                    timer.cancel()
                raise
            except BaseException:
                await self._release(hold_id)
                raise
            tracing.set_attributes(
                span,
                {
                    "rackserve.asked_blocks": len(hashes),
                    "rackserve.matched_blocks": len(copied.job.block_ids) if copied else 0,
                },
            )
            if copied is None:
                await self._release(hold_id)  # nothing is held
                metrics.PREFIX_EXPORTS.labels("empty").inc()
                return pb.ExportPrefixResponse()
            export = copied.job
            try:
                # never with the lossy wire encoding (--kv-compress): the puller commits these bytes to its prefix
                # cache under the exact blocks' hashes, so every later hit there would answer other tokens
                ticket = await self._publish(hold_id, copied, exact=True)
            except BaseException:
                await self._release(hold_id)
                raise
            if not self._still_held(hold_id):  # its handle would be refused: the peer recomputes, as for none
                metrics.PREFIX_EXPORTS.labels("empty").inc()
                return pb.ExportPrefixResponse()
            layout = self.facts.kv_layout
            n = len(export.block_ids)
            kv = wire.kv_handle(
                layout, hold_id, export.block_ids, n * layout.block_size,
                self.host.worker_id, self.host.epoch_ms, expires_unix_ms,
            )  # fmt: skip
            kv.producer_endpoint = self.host.endpoint
            kv.transfer_endpoint = ticket.to_json()
            kv.agent_metadata = ticket.agent_metadata
            kv.transfer_backend = ",".join(sorted(ticket.backends))
            metrics.PREFIX_EXPORTS.labels("held").inc()
            metrics.PREFIX_EXPORT_BLOCKS.inc(n)
            return pb.ExportPrefixResponse(kv=kv, matched_blocks=n)

    def worker_info(self) -> pb.WorkerInfo:
        info = super().worker_info()
        info.transfer_endpoint = json.dumps(self.source.advertise(), sort_keys=True)
        return info

    async def settle(self, timeout_s: float) -> None:
        """A drained prefill worker stays until every KV it handed out has been pulled once (or released, or has
        expired), within what is left of --drain-grace-s: a decode worker still pulls from its KvSource after
        the worker has left discovery, so a scale-down between a prefill and its pull costs no recompute. A
        pulled KV's later hold (for a migration's re-transfer) does not keep it."""
        left = await self.source.wait_served(timeout_s)
        if left:
            log.warning("exiting with %d published KV never pulled (%s): their requests will recompute",
                        len(left), ", ".join(left[:5]))  # fmt: skip

    async def Release(  # noqa: N802 - gRPC method name
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.Empty:
        """Idempotent: releasing what is not (or no longer) held is not an error. Released blocks stay in the
        prefix cache either way (the engine has no way to drop them early), so keep_as_prefix_cache is moot."""
        await self._release(request.request_id)
        return pb.Empty()

    async def ExtendHold(  # noqa: N802 - gRPC method name
        self, request: pb.ExtendHoldRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExtendHoldResponse:
        """Push a held request's expiry to now + ttl_s, never past kv_max_hold_s after its prefill."""
        timer = self._expiry.get(request.request_id)
        if timer is None:
            return pb.ExtendHoldResponse(held=False)
        if not request.ttl_s > 0:  # NaN too: it passed `<= 0`, and the hold then expired at once
            raise ValueError(f"ttl_s must be positive, got {request.ttl_s}")
        until_s = min(time.time() + request.ttl_s, self._held_since[request.request_id] + self.kv_max_hold_s)
        timer.cancel()
        self._expiry[request.request_id] = self._expire_at(request.request_id, until_s)
        return pb.ExtendHoldResponse(held=True, expires_unix_ms=int(until_s * 1000))

    async def _copy_out(self, begin: Callable[[LLMEngine, str], ExportJob | None]) -> _Copied | None:
        """Pin blocks on the engine's thread (`begin(engine, pin)`, None: nothing to export), copy them out off
        it (the engine steps other requests meanwhile), unpin them. One task does all three, and a cancelled
        call does not stop it, so the pin is released exactly once and never before the copy has read the
        blocks. A device copy is kept for device-direct readers only where the source has room for it."""
        pin = f"copy\x00{uuid.uuid4().hex}"  # no request or hold has this id, nor any other copy's pin
        loop = asyncio.get_running_loop()

        async def pin_copy_unpin() -> _Copied | None:
            try:
                job = await self.engine.call(lambda e: begin(e, pin))
                if job is None:
                    return None
                room = self.source.device_room(job.nbytes) if job.kv.device.type != "cpu" else None
                try:
                    host, device = await loop.run_in_executor(None, job.copy_out, room is not None)
                except BaseException:
                    if room is not None:
                        room.give()
                    raise
                if device is None and room is not None:  # the device had no memory for it after all
                    room.give()
                    room = None
                return _Copied(job, host, device, room)
            finally:
                try:
                    await self.engine.release(pin)
                except Exception as exc:  # an engine shutting down frees everything anyway
                    log.debug("unpinning %s: %s", pin, exc)

        task = self._copies.spawn(pin_copy_unpin(), name="kv copy")
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:  # nobody will publish what the task copies: its device room goes back
            task.add_done_callback(_give_room)
            raise

    async def _publish(self, key: str, copied: _Copied, exact: bool = False) -> Published:
        """Publish copied KV under `key`: encoded as --kv-compress says, unless `exact` (the bytes as they are)."""
        layout = self.facts.kv_layout
        try:
            return await self.source.publish(
                key,
                copied.host,
                self.kv_max_hold_s,  # our own timer (_hold) retracts it first; this is the backstop
                compress=None if exact else self.kv_compress,
                kv_dtype=wire.KV_DTYPE_NAMES[layout.dtype],
                head_dim=layout.head_dim,
                device_payload=copied.device,  # GPU caches: offered to device-direct readers (cuda_ipc, NIXL)
                device_room=copied.room,
            )
        except BaseException:
            if copied.room is not None:  # a publication that took it has given it back already: no-op
                copied.room.give()
            raise

    def _still_held(self, request_id: str) -> bool:
        """Whether the hold outlived the copy and publication; if not (its TTL passed while the blocks were copied
        out), retract what was just published: that expiry found nothing to retract yet, and with the hold gone
        no Release or expiry ever would, so the bytes stayed published (and in /dev/shm) until the source's
        backstop, --kv-max-hold-s. The caller then hands out no handle (until 2026-12-07 it handed out the
        expired one)."""
        if request_id in self._expiry:
            return True
        self.source.retract(request_id)
        return False

    async def _release(self, request_id: str) -> None:
        self._held_since.pop(request_id, None)
        timer = self._expiry.pop(request_id, None)
        if timer is not None:
            timer.cancel()
            self.source.retract(request_id)
            await self.engine.release(request_id)

    def _hold(self, request_id: str, ttl_s: float | None = None) -> int:
        """Free the request's blocks ttl_s (default kv_ttl_s) from now unless released first; returns that time,
        unix ms."""
        ttl_s = self.kv_ttl_s if ttl_s is None else ttl_s
        now = time.time()
        self._held_since[request_id] = now
        self._expiry[request_id] = self._expire_at(request_id, now + ttl_s)
        return int((now + ttl_s) * 1000)

    def _expire_at(self, request_id: str, unix_s: float) -> asyncio.TimerHandle:
        loop = asyncio.get_running_loop()

        def expire() -> None:
            self._expiring.spawn(self._expire(request_id), name=f"expire {request_id}")

        return loop.call_later(max(0.0, unix_s - time.time()), expire)

    async def _expire(self, request_id: str) -> None:
        since = self._held_since.pop(request_id, None)
        if self._expiry.pop(request_id, None) is not None:
            held_s = time.time() - since if since is not None else self.kv_ttl_s
            log.info("held KV of %r expired after %.1fs without a Release; freeing it", request_id, held_s)
            self.source.retract(request_id)
            await self.engine.release(request_id)


def _die(moment: str) -> None:
    """--debug-die-in (test-only): a real SIGKILL of this process at a chosen moment."""
    log.warning("--debug-die-in: SIGKILL while %s", moment)
    os.kill(os.getpid(), signal.SIGKILL)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_service_arguments(parser)
    add_engine_arguments(parser)
    g = parser.add_argument_group("prefill")
    add_flag(g, "--kv-ttl-s", DEFAULT_KV_TTL_S, "how long produced KV stays held without a Release", float)
    add_flag(g, "--kv-max-hold-s", DEFAULT_KV_MAX_HOLD_S, "the longest ExtendHold may keep produced KV held "
             "after its prefill", float)  # fmt: skip
    add_kv_transfer_arguments(parser, ROLE)
    t = parser.add_argument_group("testing (never in production)")
    add_flag(t, "--debug-die-in", "none", "TEST ONLY: SIGKILL this process during its first Prefill call "
             "(prefill) or as the first pull of its KV begins (transfer)", choices=DEBUG_DIE_IN)  # fmt: skip


def pull_attributes(span: trace.Span, pull: PullResult) -> None:
    tracing.set_attributes(
        span,
        {
            "rackserve.pull.source_worker_id": pull.source_worker_id,
            "rackserve.pull.outcome": pull.outcome,
            "rackserve.pull.first_block": pull.first_block,
            "rackserve.pull.blocks": pull.blocks,
            "rackserve.pull.seconds": pull.seconds,
        },
    )


async def serve(args: argparse.Namespace) -> None:
    source = await KvSource.start(
        TransferConfig(
            backends=tuple(args.kv_backends),
            host=args.host,
            advertise_host=advertised_host(args),
            device_copy_bytes=kv_device_copy_bytes(args),
        )
    )
    # a prefill worker pulls too: the prefix blocks a plan's PrefixPull names, from a peer's KvSource
    sink = await KvSink.start(kv_sink_config(args))
    metrics.export_pulled_resident(sink.resident_bytes)
    compress = None if args.kv_compress == "none" else args.kv_compress
    pullers: list[tuple[PrefixPuller, ChannelPool]] = []

    def make(host: ServiceHost, engine: AsyncEngine) -> PrefillWorker:
        channels = ChannelPool(host.tls)
        puller = PrefixPuller(
            engine, sink, channels, ROLE, args.kv_backend_preference, args.kv_prefix_pull_deadline_s,
            args.kv_release_timeout_s, args.kv_ttl_s,
        )  # fmt: skip
        pullers.append((puller, channels))
        return PrefillWorker(
            host, engine, source, args.kv_ttl_s, compress, args.debug_die_in, args.kv_max_hold_s, puller
        )

    try:
        await run_engine_worker(
            args, ROLE, SERVICE_NAME, GATED_METHODS, make, pb_grpc.add_PrefillWorkerServicer_to_server
        )
    finally:
        for puller, channels in pullers:
            await puller.close()
            await channels.close()
        await sink.close()
        await source.close()  # after the engine: tears NIXL down in order (no segfault at exit)


if __name__ == "__main__":
    sys.exit(service_main(ROLE, __doc__ or "", add_arguments, serve))
