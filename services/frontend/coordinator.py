"""The request coordinator (docs/design.md, "State map"): owns each request's state and drives its phases.

A `RequestState` holds everything that must outlive a worker: the prompt tokens, the sampling params (always
with a concrete seed, so a replay on another worker draws the same tokens), the tokens emitted so far with the
client's cursor into them, and the phase, with a timestamp per transition — the request's trace:

    QUEUED → ROUTED → PREFILLING → TRANSFERRING → DECODING → DONE
                          └────────────┴─────────────┴──→ MIGRATING → ROUTED …   (any of the three → FAILED)

`Coordinator.generate` follows the plan the router returns:
- aggregated (no prefill worker in the plan): Decode(prompt) on the decode worker, which prefills locally
  (PREFILLING lasts until its first token; TRANSFERRING is skipped);
- disaggregated: Prefill(prompt) on the prefill worker (PREFILLING) → its first token goes to the client at
  once, so TTFT never waits for the KV transfer → Decode(kv=handle, emitted=[first]) on the decode worker
  (TRANSFERRING until its first chunk, which reports the transfer's bytes, seconds and backend) → DECODING.
A broken call (reset, error status, a worker silent for `stall_timeout_s`, a stream that ends early) is a
`WorkerLost`. A busy worker is not a broken one: a decode worker whose KV pool is full queues the request and
sends `waiting` keepalives (no tokens) until its blocks free up, which restart the stall timer and are never a
migration; the time spent so is `decode_queue_s` in the request's log line. `_migrate` reports the worker to
every router at once, records a `Migration` (cause, path, from/to worker, times — data the trace and metrics are
built from) and starts the next attempt from the frozen state, excluding every worker that failed this request:
- re-transfer: the prefill worker still holds the prompt's KV (the decode side acknowledges only when its
  stream ends, the coordinator extends the hold while the stream runs and releases it when the request ends)
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
import enum
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
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
from services.rpc import pb, pb_grpc
from services.runtime.errors import KV_UNAVAILABLE_PREFIX
from services.runtime.tls import GrpcTls, open_channel
from services.telemetry import metrics
from services.telemetry.tracing import new_traceparent

log = logging.getLogger("rackserve.frontend")

ROUTE_TIMEOUT_S = 5.0  # one Route call; routing is an in-memory decision, so seconds mean the router is stuck
REPORT_FAILURE_TIMEOUT_S = 2.0
STUCK_ROUTER_SUPPRESS_S = 5.0  # a router that let a Route call time out is not asked again for this long
FAILED_WORKER_SUPPRESS_S = 10.0  # this frontend's own view hides a failed worker this long (as routers do)
DEFAULT_MIGRATION_LIMIT = 3  # migrations of one request before it fails (--migration-limit)
DEFAULT_STALL_TIMEOUT_S = 30.0  # a worker silent this long on a live call is hung (--worker-stall-timeout-s)
RELEASE_TIMEOUT_S = 2.0
# A held KvHandle closer than this to its expiry is not worth a re-transfer: the pull would race the TTL.
RETRANSFER_MIN_TTL_S = 2.0

# Status codes after which the worker, not the request, is at fault: the router hears about it.
WORKER_FAULTS = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.ABORTED,
    }
)

# A live call the *worker* cancelled (its server stopping) is as much its failure as a reset: migrate it too.
MIGRATABLE = WORKER_FAULTS | {grpc.StatusCode.CANCELLED}


class WorkerView(Protocol):
    """What the coordinator needs from discovery (services.discovery.WorkerDirectory provides it)."""

    def workers(self, role: str) -> list[pb.WorkerInfo]: ...

    def suppress(self, worker_id: str, seconds: float) -> None: ...


class Phase(enum.Enum):
    QUEUED = "queued"
    ROUTED = "routed"
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"
    DECODING = "decoding"
    MIGRATING = "migrating"
    DONE = "done"
    FAILED = "failed"


_MIDDLE = {Phase.MIGRATING, Phase.FAILED}
ALLOWED_TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.QUEUED: frozenset({Phase.ROUTED, Phase.FAILED}),
    Phase.ROUTED: frozenset({Phase.PREFILLING, Phase.TRANSFERRING, Phase.DECODING, Phase.FAILED}),
    # The first token may already end the request (DONE straight from prefill).
    Phase.PREFILLING: frozenset({Phase.TRANSFERRING, Phase.DECODING, Phase.DONE} | _MIDDLE),
    Phase.TRANSFERRING: frozenset({Phase.DECODING} | _MIDDLE),
    Phase.DECODING: frozenset({Phase.DONE} | _MIDDLE),
    Phase.MIGRATING: frozenset({Phase.ROUTED, Phase.FAILED}),
    Phase.DONE: frozenset(),
    Phase.FAILED: frozenset(),
}


@dataclass
class EmittedToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class TokenBatch:
    """Tokens that arrived together; `finish_reason` is set on the last batch of a finished request."""

    tokens: list[EmittedToken]
    finish_reason: str | None = None
    stop_reason: str | None = None


@dataclass
class Migration:
    """One move of a request to another worker: why, how, where from and to, and how long it took."""

    cause: str  # decode_failed | decode_stalled | prefill_failed | prefill_stalled | transfer_failed
    detail: str  # the failure as the coordinator saw it (status and message)
    from_worker_id: str
    from_role: str  # prefill | decode
    at_token: int  # tokens emitted when it broke; the resumed worker continues at this index
    start_unix_s: float
    path: str = ""  # re-transfer (the prefill copy of the KV) | rebuild (prefill again)
    to_worker_id: str = ""
    end_unix_s: float | None = None  # when the first token (or chunk) of the new attempt arrived
    outcome: str = ""  # resumed | failed

    @property
    def recovery_s(self) -> float | None:
        return None if self.end_unix_s is None else self.end_unix_s - self.start_unix_s

    def as_dict(self) -> dict[str, object]:
        return {
            "cause": self.cause,
            "path": self.path,
            "from": self.from_worker_id,
            "to": self.to_worker_id,
            "at_token": self.at_token,
            "outcome": self.outcome,
            "recovery_s": None if self.recovery_s is None else round(self.recovery_s, 6),
        }


@dataclass
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: pb.SamplingParams  # `seed` is always concrete
    traceparent: str
    deadline_s: float  # time.monotonic() past which the request has timed out
    emitted: list[EmittedToken] = field(default_factory=list)
    client_cursor: int = 0  # emitted[:client_cursor] has been handed to the client
    phase: Phase = Phase.QUEUED
    timeline: list[tuple[Phase, float]] = field(default_factory=list)  # (phase, unix time s) per transition
    plan: pb.RoutePlan | None = None
    failed_worker_ids: list[str] = field(default_factory=list)
    migrations: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | None = None
    error: str | None = None
    client_request_id: str | None = None  # the client's x-request-id, for finding its log line
    first_token_unix_s: float | None = None  # when the first token reached the coordinator
    transfer_bytes: int = 0  # the KV transfer of a disaggregated request, as the decode worker reported it
    transfer_s: float = 0.0
    transfer_backend: str | None = None
    parent_traceparent: str | None = None  # the client's traceparent, the parent of our `request` span
    migration_log: list[Migration] = field(default_factory=list)  # one entry per migration, in order
    held_kv: pb.KvHandle | None = None  # the prompt's KV a prefill worker holds for this request
    hold_ttl_s: float = 0.0  # how long the prefill worker holds it per grant (what ExtendHold asks for)
    decode_queue_s: float = 0.0  # seconds in decode workers' queues (waiting for KV blocks), all attempts

    def __post_init__(self) -> None:
        if not self.timeline:
            self.timeline.append((self.phase, time.time()))

    def advance(self, phase: Phase) -> None:
        if phase not in ALLOWED_TRANSITIONS[self.phase]:
            raise RuntimeError(f"request {self.request_id}: no transition {self.phase.name} → {phase.name}")
        self.phase = phase
        self.timeline.append((phase, time.time()))

    def finish(self, finish_reason: str, stop_reason: str | None = None) -> None:
        self.finish_reason, self.stop_reason = finish_reason, stop_reason
        self.advance(Phase.DONE)

    def fail(self, error: str) -> None:
        if self.phase not in (Phase.DONE, Phase.FAILED):
            self.error = error
            self.advance(Phase.FAILED)

    @property
    def finished(self) -> bool:
        return self.phase in (Phase.DONE, Phase.FAILED)

    def take_unseen(self) -> list[EmittedToken]:
        """Tokens the client has not been given yet; moves the cursor past them."""
        new = self.emitted[self.client_cursor :]
        self.client_cursor = len(self.emitted)
        return new

    def remaining_s(self) -> float:
        """Seconds left before the deadline; raises the 504 once there are none."""
        left = self.deadline_s - time.monotonic()
        if left <= 0:
            raise timed_out(f"request {self.request_id} ran past its deadline")
        return left

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("x-request-id", self.request_id), ("traceparent", self.traceparent))

    def time_of(self, phase: Phase) -> float | None:
        return next((t for p, t in self.timeline if p is phase), None)

    @property
    def ttft_s(self) -> float | None:
        first = self.first_token_unix_s or self.time_of(Phase.DECODING)
        return None if first is None else first - self.timeline[0][1]

    def first_token_arrived(self) -> None:
        if self.first_token_unix_s is None:
            self.first_token_unix_s = time.time()
            if (ttft := self.ttft_s) is not None:
                metrics.TTFT_S.observe(ttft)

    def summary(self) -> dict[str, object]:
        """The one log line per finished request (docs/design.md, "Observability")."""
        start = self.timeline[0][1]
        return {
            "request_id": self.request_id,
            "client_request_id": self.client_request_id,
            "traceparent": self.traceparent,
            "phase": self.phase.value,
            "finish_reason": self.finish_reason,
            "error": self.error,
            "prompt_tokens": len(self.prompt_token_ids),
            "completion_tokens": len(self.emitted),
            "cached_tokens": self.cached_tokens,
            "decode_worker": self.plan.decode.worker_id if self.plan is not None else None,
            "prefill_worker": (
                self.plan.prefill.worker_id
                if self.plan is not None and self.plan.HasField("prefill")
                else None
            ),
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 6),
            "transfer": (
                {
                    "bytes": self.transfer_bytes,
                    "s": round(self.transfer_s, 6),
                    "backend": self.transfer_backend,
                }
                if self.transfer_backend
                else None
            ),
            "route_reason": self.plan.reason if self.plan is not None else None,
            "decode_queue_s": round(self.decode_queue_s, 6),
            "migrations": self.migrations,
            "migration_log": [m.as_dict() for m in self.migration_log],
            "timeline_s": [[p.value, round(t - start, 6)] for p, t in self.timeline],
            "start_unix_s": round(start, 6),
        }


# ---- channels ---------------------------------------------------------------------------------------------------


class ChannelPool:
    """One gRPC channel per endpoint, reused by every request to it."""

    def __init__(self, tls: GrpcTls | None = None) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.tls = tls

    def get(self, endpoint: str) -> grpc.aio.Channel:
        channel = self._channels.get(endpoint)
        if channel is None:
            channel = self._channels[endpoint] = open_channel(endpoint, self.tls)
        return channel

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(c.close(grace=None) for c in channels), return_exceptions=True)


# ---- the coordinator ----------------------------------------------------------------------------------------------


class DecodeStreamBroken(Exception):
    """A decode stream ended without its finished chunk, or skipped a token index."""


class WorkerLost(Exception):
    """A worker failed this request in a way another worker can make good: the coordinator migrates it."""

    def __init__(
        self, worker: pb.WorkerRef, role: str, cause: str, detail: str, error: ApiError, blame: bool = True
    ) -> None:
        super().__init__(f"{role} worker {worker.worker_id}: {detail}")
        self.worker = worker
        self.role = role
        self.cause = cause
        self.detail = detail
        self.error = error  # what the client sees if the request cannot be migrated
        self.blame = blame  # the worker itself is at fault (reported to the routers, excluded from now on)


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
        self._background: set[asyncio.Task[None]] = set()
        self._extending: set[str] = set()  # request ids with an ExtendHold in flight

    def new_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: pb.SamplingParams,
        timeout_s: float,
        traceparent: str | None = None,
        client_request_id: str | None = None,
    ) -> RequestState:
        return RequestState(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            traceparent=new_traceparent(traceparent),
            parent_traceparent=traceparent,
            deadline_s=time.monotonic() + timeout_s,
            client_request_id=client_request_id or None,
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
            if state.migration_log and not state.migration_log[-1].outcome:
                self._migration_ended(state, "failed")
            state.fail(e.message)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            state.fail("cancelled: the client went away")
            raise
        finally:
            self._release_held_kv(state)

    async def _attempt(self, state: RequestState) -> AsyncGenerator[TokenBatch, None]:
        """One plan, run until the request finishes or a worker fails (WorkerLost)."""
        migrating = state.phase is Phase.MIGRATING
        kv = self._reusable_kv(state) if migrating else None
        if migrating and kv is None:
            self._release_held_kv(state)  # a rebuild will not pull it
        # A remote prefill only runs a bare prompt: once tokens exist, the decode worker rebuilds (or pulls).
        state.plan = await self._route(state, need_prefill=not state.emitted and kv is None)
        state.advance(Phase.ROUTED)
        if migrating:
            m = state.migration_log[-1]
            m.path = "re-transfer" if kv is not None else "rebuild"
            m.to_worker_id = state.plan.decode.worker_id
        if state.plan.HasField("prefill") and not state.emitted:
            if migrating:
                state.migration_log[-1].to_worker_id = state.plan.prefill.worker_id
            response = await self._prefill(state, state.plan.prefill)
            first = _emitted(response.first_token)
            state.emitted.append(first)
            state.first_token_arrived()
            self._migration_ended(state, "resumed")
            metrics.GENERATION_TOKENS.inc()
            if response.finished:
                state.finish(response.finish_reason or "stop")
                yield TokenBatch([first], state.finish_reason)
                return
            state.held_kv = response.kv
            state.hold_ttl_s = max(1.0, response.kv.expires_unix_ms / 1000 - time.time())
            yield TokenBatch([first])  # TTFT: the client has its first token before any KV moves
            state.advance(Phase.TRANSFERRING)
            decode = self._decode(state, state.plan.decode, response.kv)
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
            stub = pb_grpc.RouterStub(self.channels.get(router.endpoint))
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
                elif e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise last from e
                # Unreachable, or it knows no decode worker: another router may see the cluster differently.
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
        stub = pb_grpc.PrefillWorkerStub(self.channels.get(worker.endpoint))
        peer = f"prefill worker {worker.worker_id}"
        timeout_s = min(self.stall_timeout_s, state.remaining_s())
        try:
            response: pb.PrefillResponse = await stub.Prefill(
                request, metadata=state.metadata(), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:  # a full worker is busy, not failed
                metrics.WORKER_FAILURES.labels("prefill", e.code().name).inc()
            detail = f"{e.code().name}: {e.details()}"
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and state.deadline_s > time.monotonic():
                error = ApiError(504, f"{peer} answered nothing for {timeout_s:g}s", "timeout_error",
                                 code="worker_stalled")  # fmt: skip
                raise WorkerLost(worker, "prefill", "prefill_stalled", detail, error) from e
            if e.code() not in MIGRATABLE:
                raise from_grpc(e, peer) from e
            raise WorkerLost(worker, "prefill", "prefill_failed", detail, from_grpc(e, peer)) from e
        state.cached_tokens = response.cached_tokens
        return response

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
        stub = pb_grpc.DecodeWorkerStub(self.channels.get(worker.endpoint))
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
                    self._migration_ended(state, "resumed")
                if state.phase in (Phase.PREFILLING, Phase.TRANSFERRING):
                    state.advance(Phase.DECODING)
                    if kv is None:
                        state.cached_tokens = chunk.cached_tokens
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
                self._keep_holding(state)
                if tokens:
                    yield TokenBatch(tokens)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:  # a full worker is busy, not failed
                metrics.WORKER_FAILURES.labels("decode", e.code().name).inc()
            detail = f"{e.code().name}: {e.details()}"
            if kv is not None and first_chunk and _is_transfer_failure(e):
                # The pull failed, not the decode worker: the prefill copy is gone (or bad), so rebuild.
                state.held_kv = None
                producer = pb.WorkerRef(worker_id=kv.producer_worker_id, endpoint=kv.producer_endpoint,
                                        role="prefill", epoch=kv.producer_epoch)  # fmt: skip
                raise WorkerLost(
                    producer, "prefill", "transfer_failed", detail, from_grpc(e, peer),
                    blame=e.code() == grpc.StatusCode.UNAVAILABLE,
                ) from e  # fmt: skip
            if e.code() not in MIGRATABLE:
                raise from_grpc(e, peer) from e
            raise WorkerLost(worker, "decode", "decode_failed", detail, from_grpc(e, peer)) from e
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
            chunk = await asyncio.wait_for(call.read(), timeout_s)
        except TimeoutError as e:
            call.cancel()
            state.remaining_s()  # the request's own deadline: 504, not a migration
            metrics.WORKER_FAILURES.labels("decode", "STALLED").inc()
            detail = f"no chunk for {timeout_s:g}s"
            error = ApiError(504, f"{peer} sent nothing for {timeout_s:g}s", "timeout_error",
                             code="worker_stalled")  # fmt: skip
            raise WorkerLost(worker, "decode", "decode_stalled", detail, error) from e
        if chunk is grpc.aio.EOF:
            return None
        assert isinstance(chunk, pb.DecodeChunk)
        return chunk

    # ---- migration --------------------------------------------------------------------------------------

    def _migrate(self, state: RequestState, lost: WorkerLost) -> None:
        """Record the failure, tell the routers, and freeze the request for its next attempt — or raise the
        client's error when the request may not move again."""
        now = time.time()
        if state.migration_log and not state.migration_log[-1].outcome:
            self._migration_ended(state, "failed")  # the previous move broke before it resumed
        if lost.blame:
            state.failed_worker_ids.append(lost.worker.worker_id)
            task = asyncio.get_running_loop().create_task(
                self._report_failure(state, lost.worker.worker_id, f"{lost.cause}: {lost.detail}")
            )
            self._background.add(task)
            task.add_done_callback(self._background.discard)
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
            )
        )
        state.advance(Phase.MIGRATING)

    def _reusable_kv(self, state: RequestState) -> pb.KvHandle | None:
        """The prefill copy of the prompt's KV, if its holder is alive and the hold outlasts a pull."""
        kv = state.held_kv
        if kv is None or kv.producer_worker_id in state.failed_worker_ids:
            return None
        if kv.expires_unix_ms and kv.expires_unix_ms / 1000 - time.time() < RETRANSFER_MIN_TTL_S:
            return None
        alive = {w.worker_id: w.epoch for w in self.directory.workers("prefill")}
        if alive.get(kv.producer_worker_id) != kv.producer_epoch:
            return None  # gone from discovery, or restarted (its blocks went with the old process)
        return kv

    def _keep_holding(self, state: RequestState) -> None:
        """While the stream runs, keep the prefill copy of the KV alive (ExtendHold, in the background) once
        half its grant has passed, so a migration can still re-transfer rather than rebuild."""
        kv = state.held_kv
        if kv is None or not kv.producer_endpoint or state.request_id in self._extending:
            return
        if kv.expires_unix_ms / 1000 - time.time() > state.hold_ttl_s / 2:
            return

        async def extend() -> None:
            stub = pb_grpc.PrefillWorkerStub(self.channels.get(kv.producer_endpoint))
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
        task = asyncio.get_running_loop().create_task(extend())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _migration_ended(self, state: RequestState, outcome: str) -> None:
        if not state.migration_log or state.migration_log[-1].outcome:
            return
        m = state.migration_log[-1]
        m.outcome, m.end_unix_s = outcome, time.time()
        metrics.MIGRATIONS.labels(m.cause, m.path or "none", outcome).inc()
        if outcome == "resumed" and m.recovery_s is not None:
            metrics.MIGRATION_RECOVERY_S.labels(m.path).observe(m.recovery_s)

    def _release_held_kv(self, state: RequestState) -> None:
        """Let the prefill worker free the prompt's KV (idempotent there; its TTL covers a lost Release)."""
        kv, state.held_kv = state.held_kv, None
        if kv is None or not kv.producer_endpoint:
            return

        async def release() -> None:
            stub = pb_grpc.PrefillWorkerStub(self.channels.get(kv.producer_endpoint))
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
            task = asyncio.get_running_loop().create_task(release())
        except RuntimeError:  # no running loop (a generator finalized at shutdown): the TTL frees it
            return
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _report_failure(self, state: RequestState, worker_id: str, cause: str) -> None:
        report = pb.FailureReport(worker_id=worker_id, request_id=state.request_id, cause=cause)

        async def tell(router: pb.WorkerInfo) -> None:
            stub = pb_grpc.RouterStub(self.channels.get(router.endpoint))
            try:
                await stub.ReportFailure(report, metadata=state.metadata(), timeout=REPORT_FAILURE_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                log.warning("router %s did not take the failure report: %s", router.worker_id, e.code().name)

        # Every router keeps its own view of the workers, so every router hears about it; so does this
        # frontend's own view, which the fallback plan uses.
        self.directory.suppress(worker_id, FAILED_WORKER_SUPPRESS_S)
        await asyncio.gather(*(tell(r) for r in self.directory.workers("router")))

    async def close(self) -> None:
        """Let pending failure reports and releases finish (each has its own deadline)."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)


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
        token = _emitted(t)
        state.emitted.append(token)
        new.append(token)
    return new


def _is_transfer_failure(e: grpc.aio.AioRpcError) -> bool:
    """The decode worker could not get the KV it was handed (its own health is not in question)."""
    if e.code() in (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.FAILED_PRECONDITION):
        return True
    return e.code() == grpc.StatusCode.UNAVAILABLE and (e.details() or "").startswith(KV_UNAVAILABLE_PREFIX)


def _emitted(token: pb.Token) -> EmittedToken:
    if not token.has_logprob:
        return EmittedToken(token.token_id)
    top = [(t.token_id, t.logprob) for t in token.top_logprobs]
    return EmittedToken(token.token_id, token.logprob, top)
