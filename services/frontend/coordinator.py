"""The request coordinator (docs/design.md, "State map"): drives each request through its phases, over workers.

A request's state — prompt, params with a concrete seed, emitted tokens, phase and timeline, migration records —
is a `RequestState` (request_state.py); the coordinator moves it from phase to phase:

    QUEUED → ROUTED → PREFILLING → TRANSFERRING → DECODING → DONE
                          └────────────┴─────────────┴──→ MIGRATING → ROUTED …   (any of the three → FAILED)

`Coordinator.generate` follows the plan the router returns:
- aggregated (no prefill worker in the plan): Decode(prompt) on the decode worker, which prefills locally
  (PREFILLING lasts until its first token; TRANSFERRING is skipped);
- disaggregated: Prefill(prompt) on the prefill worker (PREFILLING) → its first token goes to the client at
  once, so TTFT never waits for the KV transfer → Decode(kv=handle, emitted=[first]) on the decode worker
  (TRANSFERRING until its first chunk, which reports the transfer's bytes, seconds and backend) → DECODING.
A broken call (reset, error status, a worker silent for `stall_timeout_s`, a stream that ends early) is a
`WorkerLost` (worker_lost.py says which failures are). A busy worker is not a broken one: a prefill worker still
registered in discovery is waited for up to the request's deadline (its call sends nothing until the prompt is
done, and a queue of long prompts on a slow CPU outlasts any fixed stall timeout); a decode worker whose
KV pool is full queues the request and sends `waiting` keepalives (no tokens) until its blocks free up, which
restart the stall timer and are never a migration; the time spent so is `decode_queue_s` in the request's log
line. `_migrate` reports the worker to every router at once, records a `Migration` (cause, path, from/to worker,
times — data the trace and metrics are built from) and starts the next attempt from the frozen state, excluding
every worker that failed this request:
- re-transfer: the prefill worker still holds the prompt's KV (the decode side acknowledges only when its
  stream ends; the hold is extended while the stream runs and released when the request ends: kv_hold.py)
  → Decode(kv, emitted) elsewhere;
- rebuild: otherwise → Decode(prompt, emitted) on a new worker, which prefills prompt + emitted itself; a
  prefill that failed before its first token is simply re-run through a new plan.
Sampling at step i depends only on (seed, i, logits), so the continuation is the one the dead worker would have
produced; tokens are kept by index, so the client never sees a token twice or misses one. Past
`migration_limit` migrations, or the request's deadline, the request fails with an error that names the
failures. When no router answers, a local fallback plan (aggregated, round-robin over live decode workers)
keeps requests flowing.

This room deals in token ids only: text, stop strings and the HTTP shape belong to output.py and app.py.
Every call it makes carries `x-request-id`, `traceparent` and a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from typing import Protocol

import grpc

from services.frontend.errors import (
    RETRY_AFTER_S,
    SERVER_ERROR,
    SERVICE_UNAVAILABLE,
    ApiError,
    from_grpc,
    timed_out,
    unavailable,
)
from services.frontend.kv_hold import KvHolds
from services.frontend.request_state import (
    ANONYMOUS_KEY_NAME,
    EmittedToken,
    Migration,
    Phase,
    RequestState,
    TokenBatch,
    emitted_token,
)
from services.frontend.worker_lost import (
    DecodeStreamBroken,
    WorkerLost,
    call_failed,
    is_transfer_failure,
    lost_or_refused,
    stalled,
)
from services.rpc import pb, pb_grpc
from services.runtime.channels import ChannelPool
from services.runtime.tasks import BackgroundTasks
from services.telemetry import metrics
from services.telemetry.tracing import new_traceparent

log = logging.getLogger("rackserve.frontend")

ROUTE_TIMEOUT_S = 5.0  # one Route call; routing is an in-memory decision, so seconds mean the router is stuck
REPORT_FAILURE_TIMEOUT_S = 2.0
STUCK_ROUTER_SUPPRESS_S = 5.0  # a router that let a Route call time out is not asked again for this long
FAILED_WORKER_SUPPRESS_S = 10.0  # this frontend's own view hides a failed worker this long (as routers do)
DEFAULT_MIGRATION_LIMIT = 3  # migrations of one request before it fails (--migration-limit)
DEFAULT_STALL_TIMEOUT_S = 30.0  # a worker silent this long on a live call is hung (--worker-stall-timeout-s)


class WorkerView(Protocol):
    """What the coordinator needs from discovery (services.discovery.WorkerDirectory provides it)."""

    def workers(self, role: str) -> list[pb.WorkerInfo]: ...

    def suppress(self, worker_id: str, seconds: float, epoch: int | None = None) -> None: ...


class Coordinator:
    def __init__(
        self,
        directory: WorkerView,
        channels: ChannelPool,
        route_timeout_s: float = ROUTE_TIMEOUT_S,
        migration_limit: int = DEFAULT_MIGRATION_LIMIT,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
    ) -> None:
        self.directory = directory
        self.channels = channels
        self.route_timeout_s = route_timeout_s
        self.migration_limit = migration_limit
        self.stall_timeout_s = stall_timeout_s
        self._router_turn = itertools.count()
        self._fallback_turn = itertools.count()
        self._background = BackgroundTasks()  # failure reports, ExtendHolds and Releases in flight
        self.holds = KvHolds(channels, self._background)

    def new_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: pb.SamplingParams,
        timeout_s: float,
        traceparent: str | None = None,
        client_request_id: str | None = None,
        api_key_name: str = ANONYMOUS_KEY_NAME,
    ) -> RequestState:
        return RequestState(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            traceparent=new_traceparent(traceparent),
            parent_traceparent=traceparent,
            deadline_s=time.monotonic() + timeout_s,
            client_request_id=client_request_id or None,
            api_key_name=api_key_name,
        )

    async def generate(self, state: RequestState) -> AsyncGenerator[TokenBatch, None]:
        """Drive `state` to DONE, yielding each batch of new tokens as it arrives, migrating it to another
        worker when one fails.

        Raises ApiError (state FAILED) when it cannot; a consumer that stops early (a stop string) finishes
        the state first and then closes this generator, which cancels the worker's call."""
        try:
            while True:
                try:
                    async with contextlib.aclosing(self._attempt(state)) as batches:
                        async for batch in batches:
                            yield batch
                    return
                except WorkerLost as lost:
                    self._migrate(state, lost)  # raises the client's error past the limit or deadline
        except ApiError as e:
            state.migration_ended("failed")
            state.fail(e.message)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            state.fail("cancelled: the client went away")
            raise
        finally:
            self.holds.release(state)

    async def _attempt(self, state: RequestState) -> AsyncGenerator[TokenBatch, None]:
        """One plan, run until the request finishes or a worker fails (WorkerLost)."""
        migrating = state.phase is Phase.MIGRATING
        kv = self.holds.reusable(state, self.directory.workers("prefill")) if migrating else None
        if migrating and kv is None:
            self.holds.release(state)  # a rebuild will not pull it
        # A remote prefill only runs a bare prompt: once tokens exist, the decode worker rebuilds (or pulls).
        state.plan = await self._route(state, need_prefill=not state.emitted and kv is None)
        if state.placement is None:
            state.placement = state.plan
        state.advance(Phase.ROUTED)
        if migrating:
            m = state.migration_log[-1]
            m.path = "re-transfer" if kv is not None else "rebuild"
            m.to_worker_id = state.plan.decode.worker_id
        if state.plan.HasField("prefill") and not state.emitted:
            if migrating:
                state.migration_log[-1].to_worker_id = state.plan.prefill.worker_id
            response = await self._prefill(state, state.plan.prefill)
            state.prefill_worker = state.plan.prefill.worker_id
            first = emitted_token(response.first_token)
            state.emitted.append(first)
            state.first_token_arrived()
            state.migration_ended("resumed")
            metrics.GENERATION_TOKENS.inc()
            if response.finished:  # its first token ended it: which token, for a stop_reason
                state.finish(response.finish_reason or "stop", str(first.token_id))
                yield TokenBatch([first], state.finish_reason)
                return
            # no handle: the prefill worker's hold ended before its KV was published, and the decode worker
            # prefills the prompt and the first token itself
            held = response.kv if response.HasField("kv") else None
            if held is not None:
                self.holds.hold(state, held)
            yield TokenBatch([first])  # TTFT: the client has its first token before any KV moves
            if held is not None:
                state.advance(Phase.TRANSFERRING)
            decode = self._decode(state, state.plan.decode, held)
        elif kv is not None:
            state.advance(Phase.TRANSFERRING)  # the new decode worker pulls the prefill worker's copy
            decode = self._decode(state, state.plan.decode, kv)
        else:
            state.advance(Phase.PREFILLING)  # the decode worker runs the prompt (and emitted tokens) itself
            decode = self._decode(state, state.plan.decode)
        async with contextlib.aclosing(decode) as batches:
            async for batch in batches:
                yield batch

    async def _route(self, state: RequestState, need_prefill: bool = True) -> pb.RoutePlan:
        routers = self.directory.workers("router")
        request = pb.RouteRequest(
            request_id=state.request_id,
            token_ids=state.prompt_token_ids,
            exclude_worker_ids=state.failed_worker_ids,
            need_prefill=need_prefill,
        )
        last: ApiError | None = None
        first = next(self._router_turn) % len(routers) if routers else 0
        for router in routers[first:] + routers[:first]:
            stub = pb_grpc.RouterStub(self.channels.get(router.endpoint, router.epoch))
            try:
                plan: pb.RoutePlan = await stub.Route(
                    request,
                    metadata=state.metadata(),
                    timeout=min(self.route_timeout_s, state.remaining_s()),
                )
                if last is not None:
                    metrics.RETRIES.labels("router", "ok").inc()
                return plan
            except grpc.aio.AioRpcError as e:
                if last is not None:
                    metrics.RETRIES.labels("router", "failed").inc()
                metrics.WORKER_FAILURES.labels("router", e.code().name).inc()
                last = from_grpc(e, f"router {router.worker_id}")
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and state.deadline_s > time.monotonic():
                    # The router is stuck, not the request out of time: skip it for a while, ask another.
                    self.directory.suppress(router.worker_id, STUCK_ROUTER_SUPPRESS_S)
                elif e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    raise last from e
                # Unreachable, or it knows no decode worker: another router may see the cluster differently. A
                # router whose server stops (a rolling restart) answers CANCELLED to the calls it had in flight:
                # it holds no request state, so the next router is asked (until 2026-12-07 the client got 503).
        fallback = self._fallback_plan(state)
        if fallback is not None:
            return fallback
        if last is None:
            raise unavailable("no router is available (none registered in discovery)", code="no_routers")
        raise last

    def _fallback_plan(self, state: RequestState) -> pb.RoutePlan | None:
        """When no router answers (all dead, stuck or unregistered): an aggregated plan, round-robin over the
        decode workers this frontend sees, so a router outage does not fail requests."""
        failed = set(state.failed_worker_ids)
        decodes = sorted(
            (w for w in self.directory.workers("decode") if w.worker_id not in failed),
            key=lambda w: w.worker_id,
        )
        if not decodes:
            return None
        chosen = decodes[next(self._fallback_turn) % len(decodes)]
        log.warning("request %s: no router answered; local fallback plan on %s",
                    state.request_id, chosen.worker_id)  # fmt: skip
        ref = pb.WorkerRef(
            worker_id=chosen.worker_id, endpoint=chosen.endpoint, role=chosen.role, epoch=chosen.epoch
        )
        return pb.RoutePlan(decode=ref, reason="agg: frontend fallback, no router answered; round_robin")

    async def _prefill(self, state: RequestState, worker: pb.WorkerRef) -> pb.PrefillResponse:
        """PREFILLING on a prefill worker: the first token and a KvHandle naming the blocks it holds for us."""
        state.advance(Phase.PREFILLING)
        request = pb.PrefillRequest(
            request_id=state.request_id, token_ids=state.prompt_token_ids, params=state.params
        )
        if state.plan is not None and state.plan.HasField("prefix_pull"):  # copy the prefix from a peer first
            request.prefix_pull.CopyFrom(state.plan.prefix_pull)
        stub = pb_grpc.PrefillWorkerStub(self.channels.get(worker.endpoint, worker.epoch))
        peer = f"prefill worker {worker.worker_id}"
        # A unary call sends nothing until the prompt is done, and a long prompt queued behind others on a busy
        # worker can take longer than the stall timeout: busy is not failed. So the call runs to the request's
        # deadline, and after each stall window without an answer the worker must still hold its registration
        # (a hung or frozen process stops renewing its lease and leaves discovery; a live worker whose engine
        # stopped stepping fails the call itself, services/prefill/server.py).
        call = stub.Prefill(request, metadata=state.metadata(), timeout=state.remaining_s())
        waiting: asyncio.Future[pb.PrefillResponse] = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({waiting}, timeout=self.stall_timeout_s)
                if done:
                    response: pb.PrefillResponse = waiting.result()
                    break
                if not self._registered(worker, "prefill"):
                    call.cancel()
                    raise stalled(
                        worker, "prefill", "left discovery with the call in flight",
                        f"{peer} answered nothing for {self.stall_timeout_s:g}s and left discovery",
                    )  # fmt: skip
        except grpc.aio.AioRpcError as e:
            detail = call_failed(e, "prefill")
            raise lost_or_refused(e, worker, "prefill", detail, peer) from e
        finally:
            if not waiting.done():
                waiting.cancel()
        state.cached_tokens = response.cached_tokens  # a prefill runs only before any token was sent
        state.pulled_tokens = response.pulled_tokens
        return response

    def _registered(self, worker: pb.WorkerRef, role: str) -> bool:
        """Whether discovery still lists this very worker (same id and epoch): a live process renews its lease."""
        return any(
            w.worker_id == worker.worker_id and w.epoch == worker.epoch for w in self.directory.workers(role)
        )

    async def _decode(
        self, state: RequestState, worker: pb.WorkerRef, kv: pb.KvHandle | None = None
    ) -> AsyncGenerator[TokenBatch, None]:
        """PREFILLING (aggregated) or TRANSFERRING (kv given) until the first chunk, then DECODING."""
        request = pb.DecodeRequest(
            request_id=state.request_id,
            prompt_token_ids=state.prompt_token_ids,
            emitted_token_ids=[t.token_id for t in state.emitted],
            params=state.params,
            kv=kv,
        )
        if kv is None and state.plan is not None and state.plan.HasField("prefix_pull"):
            request.prefix_pull.CopyFrom(
                state.plan.prefix_pull
            )  # a local prefill: its prefix from a peer first
        stub = pb_grpc.DecodeWorkerStub(self.channels.get(worker.endpoint, worker.epoch))
        call = stub.Decode(request, metadata=state.metadata(), timeout=state.remaining_s())
        peer = f"decode worker {worker.worker_id}"
        last_arrival = time.monotonic()
        first_chunk = True
        try:
            while True:
                chunk = await self._next_chunk(state, call, worker, peer)
                if chunk is None:
                    raise DecodeStreamBroken(f"{peer} ended the stream before the request finished")
                if chunk.waiting:  # queued behind a full KV pool: busy, not failed; the stall timer restarts
                    continue
                now = time.monotonic()
                if first_chunk:
                    first_chunk = False
                    state.decode_queue_s += chunk.queue_s
                    state.migration_ended("resumed")
                if state.phase in (Phase.PREFILLING, Phase.TRANSFERRING):
                    state.advance(Phase.DECODING)
                    # usage counts the cache of the attempt the first token came from: a request rebuilt after
                    # a migration (its prompt plus the tokens already sent) reports its own, not the client's;
                    # so does what a prefix pull brought, which the timeline shows beside the placement's pull
                    # (the latest attempt's, beside the first plan's and so above cached_tokens, until 2026-12-07)
                    if kv is None and state.first_token_unix_s is None:
                        state.cached_tokens = chunk.cached_tokens
                        state.pulled_tokens = chunk.pulled_tokens
                    if chunk.transfer_backend:
                        state.transfer_bytes, state.transfer_s = chunk.transfer_bytes, chunk.transfer_s
                        state.transfer_backend = chunk.transfer_backend
                if state.first_token_unix_s is None:
                    state.first_token_arrived()
                elif chunk.tokens:
                    gap = (now - last_arrival) / len(chunk.tokens)
                    for _ in chunk.tokens:
                        metrics.INTER_TOKEN_S.observe(gap)
                last_arrival = now
                tokens = _keep_new(state, chunk.tokens, peer)
                metrics.GENERATION_TOKENS.inc(len(tokens))
                if chunk.finished:
                    stop_reason = chunk.stop_reason or None
                    state.finish(chunk.finish_reason or "stop", stop_reason)
                    yield TokenBatch(tokens, state.finish_reason, stop_reason)
                    return
                self.holds.keep_alive(state)
                if tokens:
                    yield TokenBatch(tokens)
        except grpc.aio.AioRpcError as e:
            detail = call_failed(e, "decode")
            if kv is not None and first_chunk and is_transfer_failure(e):
                # The pull failed, not the decode worker: the prefill copy is gone (or bad, or out of reach of
                # this worker), so rebuild — and tell its producer, which may be alive and holding it, to free it
                self.holds.release(state)
                producer = pb.WorkerRef(worker_id=kv.producer_worker_id, endpoint=kv.producer_endpoint,
                                        role="prefill", epoch=kv.producer_epoch)  # fmt: skip
                raise WorkerLost(
                    producer, "prefill", "transfer_failed", detail, from_grpc(e, peer),
                    blame=e.code() == grpc.StatusCode.UNAVAILABLE,
                ) from e  # fmt: skip
            raise lost_or_refused(e, worker, "decode", detail, peer) from e
        except DecodeStreamBroken as e:
            metrics.WORKER_FAILURES.labels("decode", "STREAM_ENDED").inc()
            error = ApiError(502, str(e), SERVER_ERROR, code="worker_error")
            raise WorkerLost(worker, "decode", "decode_failed", str(e), error) from e
        finally:
            if not call.done():
                call.cancel()  # the client went away, a stop string ended it, or the worker hung

    async def _next_chunk(
        self,
        state: RequestState,
        call: grpc.aio.UnaryStreamCall,  # type: ignore[type-arg]
        worker: pb.WorkerRef,
        peer: str,
    ) -> pb.DecodeChunk | None:
        """The next chunk, None at the end of the stream; a worker silent for stall_timeout_s is hung."""
        timeout_s = min(self.stall_timeout_s, state.remaining_s())
        try:
            async with asyncio.timeout(timeout_s):
                chunk = await call.read()
        except TimeoutError as e:
            call.cancel()
            state.remaining_s()  # the request's own deadline: 504, not a migration
            metrics.WORKER_FAILURES.labels("decode", "STALLED").inc()
            detail = f"no chunk for {timeout_s:g}s"
            raise stalled(worker, "decode", detail, f"{peer} sent nothing for {timeout_s:g}s") from e
        if chunk is grpc.aio.EOF:
            return None
        assert isinstance(chunk, pb.DecodeChunk)
        return chunk

    # ---- migration --------------------------------------------------------------------------------------

    def _migrate(self, state: RequestState, lost: WorkerLost) -> None:
        """Record the failure, tell the routers, and freeze the request for its next attempt — or raise the
        client's error when the request may not move again."""
        now = time.time()
        state.migration_ended("failed")  # the previous move broke before it resumed
        if lost.blame:
            state.failed_worker_ids.append(lost.worker.worker_id)
            self._background.spawn(
                self._report_failure(state, lost.worker, f"{lost.cause}: {lost.detail}"),
                name=f"report failure {lost.worker.worker_id}",
            )
        log.warning("request %s: %s worker %s failed after %d tokens (%s): %s", state.request_id, lost.role,
                    lost.worker.worker_id, len(state.emitted), lost.cause, lost.detail)  # fmt: skip
        causes = [m.cause for m in state.migration_log] + [lost.cause]
        if state.migrations >= self.migration_limit:
            metrics.MIGRATIONS.labels(lost.cause, "none", "limit_exceeded").inc()
            raise ApiError(
                503,
                f"request {state.request_id} failed after {len(state.emitted)} tokens: {lost.error.message}; "
                f"it was moved to another worker {state.migrations} times (--migration-limit "
                f"{self.migration_limit}), failures: {', '.join(causes)}",
                SERVICE_UNAVAILABLE,
                code="migration_limit_exceeded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from lost
        if state.deadline_s <= time.monotonic():
            metrics.MIGRATIONS.labels(lost.cause, "none", "deadline_exceeded").inc()
            raise timed_out(
                f"request {state.request_id} ran past its deadline after {len(state.emitted)} tokens; "
                f"last failure: {lost.error.message}"
            ) from lost
        state.migrations += 1
        state.migration_log.append(
            Migration(
                cause=lost.cause,
                detail=lost.detail,
                from_worker_id=lost.worker.worker_id,
                from_role=lost.role,
                at_token=len(state.emitted),
                start_unix_s=now,
                transfer=state.take_transfer(),
            )
        )
        state.advance(Phase.MIGRATING)

    async def _report_failure(self, state: RequestState, worker: pb.WorkerRef, cause: str) -> None:
        worker_id = worker.worker_id
        report = pb.FailureReport(
            worker_id=worker_id, request_id=state.request_id, cause=cause, worker_epoch=worker.epoch
        )

        async def tell(router: pb.WorkerInfo) -> None:
            stub = pb_grpc.RouterStub(self.channels.get(router.endpoint, router.epoch))
            try:
                await stub.ReportFailure(report, metadata=state.metadata(), timeout=REPORT_FAILURE_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                log.warning("router %s did not take the failure report: %s", router.worker_id, e.code().name)

        # Every router keeps its own view of the workers, so every router hears about it; so does this
        # frontend's own view, which the fallback plan uses.
        self.directory.suppress(worker_id, FAILED_WORKER_SUPPRESS_S, epoch=worker.epoch or None)
        await asyncio.gather(*(tell(r) for r in self.directory.workers("router")))

    async def close(self) -> None:
        """Let pending failure reports and releases finish (each has its own deadline)."""
        await self._background.wait()


def _keep_new(state: RequestState, tokens: Sequence[pb.Token], peer: str) -> list[EmittedToken]:
    """Append the tokens past what `state` already has, by index: a resumed worker may repeat none, but a
    token index seen before is dropped rather than sent twice, and a gap is the worker's fault."""
    new = []
    for t in tokens:
        if t.index < len(state.emitted):
            if state.emitted[t.index].token_id != t.token_id:
                log.warning("request %s: %s sent token %d at index %d, already had %d", state.request_id,
                            peer, t.token_id, t.index, state.emitted[t.index].token_id)  # fmt: skip
            continue
        if t.index > len(state.emitted):
            raise DecodeStreamBroken(f"{peer} skipped from token index {len(state.emitted)} to {t.index}")
        token = emitted_token(t)
        state.emitted.append(token)
        new.append(token)
    return new
