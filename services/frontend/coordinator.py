"""The request coordinator (DESIGN.md §2): owns each request's state and drives it through its phases.

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
A failed worker is reported to the router and ends the request as FAILED; `_worker_lost` is where a later change
resumes it on another worker from `emitted` instead.

This room deals in token ids only: text, stop strings and the HTTP shape belong to output.py and app.py.
Every call it makes carries `x-request-id`, `traceparent` and a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import re
import secrets
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from services.frontend.errors import SERVER_ERROR, ApiError, from_grpc, timed_out, unavailable
from services.rpc import pb, pb_grpc
from services.runtime.tls import GrpcTls, open_channel
from services.telemetry import metrics

log = logging.getLogger("rackserve.frontend")

ROUTE_TIMEOUT_S = 5.0  # one Route call; routing is an in-memory decision, so seconds mean the router is stuck
REPORT_FAILURE_TIMEOUT_S = 2.0
STUCK_ROUTER_SUPPRESS_S = 5.0  # a router that let a Route call time out is not asked again for this long

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
    Phase.ROUTED: frozenset({Phase.PREFILLING, Phase.DECODING, Phase.FAILED}),
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
        """The one log line per finished request (DESIGN.md §7)."""
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
            "migrations": self.migrations,
            "timeline_s": [[p.value, round(t - start, 6)] for p, t in self.timeline],
            "start_unix_s": round(start, 6),
        }


# ---- trace context ----------------------------------------------------------------------------------------------

_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def new_traceparent(parent: str | None = None) -> str:
    """A W3C traceparent for this request's span: continues the client's trace when it sent a valid one."""
    match = _TRACEPARENT.match(parent.strip().lower()) if parent else None
    if match and match.group(1) != "0" * 32:
        trace_id, flags = match.group(1), match.group(3)
    else:
        trace_id, flags = secrets.token_hex(16), "01"
    return f"00-{trace_id}-{secrets.token_hex(8)}-{flags}"


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
    """A decode stream ended without its finished chunk."""


class Coordinator:
    def __init__(
        self, directory: WorkerView, channels: ChannelPool, route_timeout_s: float = ROUTE_TIMEOUT_S
    ) -> None:
        self.directory = directory
        self.channels = channels
        self.route_timeout_s = route_timeout_s
        self._router_turn = itertools.count()
        self._background: set[asyncio.Task[None]] = set()

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
        """Drive `state` to DONE, yielding each batch of new tokens as it arrives.

        Raises ApiError (state FAILED) when it cannot; a consumer that stops early (a stop string) finishes
        the state first and then closes this generator, which cancels the worker's call."""
        try:
            state.plan = await self._route(state)
            state.advance(Phase.ROUTED)
            if state.plan.HasField("prefill"):
                response = await self._prefill(state, state.plan.prefill)
                first = _emitted(response.first_token)
                state.emitted.append(first)
                state.first_token_arrived()
                metrics.GENERATION_TOKENS.inc()
                if response.finished:
                    state.finish(response.finish_reason or "stop")
                    yield TokenBatch([first], state.finish_reason)
                    return
                yield TokenBatch([first])  # TTFT: the client has its first token before any KV moves
                state.advance(Phase.TRANSFERRING)
                decode = self._decode(state, state.plan.decode, response.kv)
            else:
                state.advance(Phase.PREFILLING)  # the decode worker runs the prompt itself
                decode = self._decode(state, state.plan.decode)
            async with contextlib.aclosing(decode) as batches:
                async for batch in batches:
                    yield batch
        except ApiError as e:
            state.fail(e.message)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            state.fail("cancelled: the client went away")
            raise

    async def _route(self, state: RequestState) -> pb.RoutePlan:
        routers = self.directory.workers("router")
        if not routers:
            raise unavailable("no router is available (none registered in discovery)", code="no_routers")
        first = next(self._router_turn) % len(routers)
        request = pb.RouteRequest(
            request_id=state.request_id,
            token_ids=state.prompt_token_ids,
            exclude_worker_ids=state.failed_worker_ids,
            need_prefill=True,
        )
        last: ApiError | None = None
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
        assert last is not None
        raise last

    async def _prefill(self, state: RequestState, worker: pb.WorkerRef) -> pb.PrefillResponse:
        """PREFILLING on a prefill worker: the first token and a KvHandle naming the blocks it holds for us."""
        state.advance(Phase.PREFILLING)
        request = pb.PrefillRequest(
            request_id=state.request_id, token_ids=state.prompt_token_ids, params=state.params
        )
        stub = pb_grpc.PrefillWorkerStub(self.channels.get(worker.endpoint))
        peer = f"prefill worker {worker.worker_id}"
        try:
            response: pb.PrefillResponse = await stub.Prefill(
                request, metadata=state.metadata(), timeout=state.remaining_s()
            )
        except grpc.aio.AioRpcError as e:
            metrics.WORKER_FAILURES.labels("prefill", e.code().name).inc()
            if e.code() not in WORKER_FAULTS:
                raise from_grpc(e, peer) from e
            raise self._worker_lost(
                state, worker, f"{e.code().name}: {e.details()}", from_grpc(e, peer)
            ) from e
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
        try:
            async for chunk in call:
                now = time.monotonic()
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
                tokens = [_emitted(t) for t in chunk.tokens]
                state.emitted.extend(tokens)
                metrics.GENERATION_TOKENS.inc(len(tokens))
                if chunk.finished:
                    stop_reason = chunk.stop_reason or None
                    state.finish(chunk.finish_reason or "stop", stop_reason)
                    yield TokenBatch(tokens, state.finish_reason, stop_reason)
                    return
                yield TokenBatch(tokens)
            raise DecodeStreamBroken(f"{peer} ended the stream before the request finished")
        except grpc.aio.AioRpcError as e:
            metrics.WORKER_FAILURES.labels("decode", e.code().name).inc()
            if e.code() not in WORKER_FAULTS:
                raise from_grpc(e, peer) from e
            raise self._worker_lost(
                state, worker, f"{e.code().name}: {e.details()}", from_grpc(e, peer)
            ) from e
        except DecodeStreamBroken as e:
            metrics.WORKER_FAILURES.labels("decode", "STREAM_ENDED").inc()
            raise self._worker_lost(
                state, worker, str(e), ApiError(502, str(e), SERVER_ERROR, code="worker_error")
            ) from e
        finally:
            if not call.done():
                call.cancel()  # the client went away or a stop string ended it: the worker drops the request

    def _worker_lost(
        self, state: RequestState, worker: pb.WorkerRef, cause: str, error: ApiError
    ) -> ApiError:
        """A worker failed mid-request: tell the router at once (in the background, the client's
        error does not wait for it) and return the client's error. Migration — resuming on another worker
        from `state.emitted` — belongs here and is a later change; until then the request fails."""
        state.failed_worker_ids.append(worker.worker_id)
        log.warning("request %s: %s worker %s failed: %s", state.request_id, worker.role or "a",
                    worker.worker_id, cause)  # fmt: skip
        task = asyncio.get_running_loop().create_task(self._report_failure(state, worker.worker_id, cause))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        if state.emitted:
            error.message += f" (after {len(state.emitted)} tokens; the request was not resumed elsewhere)"
        return error

    async def _report_failure(self, state: RequestState, worker_id: str, cause: str) -> None:
        report = pb.FailureReport(worker_id=worker_id, request_id=state.request_id, cause=cause)

        async def tell(router: pb.WorkerInfo) -> None:
            stub = pb_grpc.RouterStub(self.channels.get(router.endpoint))
            try:
                await stub.ReportFailure(report, metadata=state.metadata(), timeout=REPORT_FAILURE_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                log.warning("router %s did not take the failure report: %s", router.worker_id, e.code().name)

        # Every router keeps its own view of the workers, so every router hears about it.
        await asyncio.gather(*(tell(r) for r in self.directory.workers("router")))

    async def close(self) -> None:
        """Let pending failure reports finish (each has its own deadline)."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)


def _emitted(token: pb.Token) -> EmittedToken:
    if not token.has_logprob:
        return EmittedToken(token.token_id)
    top = [(t.token_id, t.logprob) for t in token.top_logprobs]
    return EmittedToken(token.token_id, token.logprob, top)
