"""The coordinator's migration rules at the edges real workers do not reach on their own.

Real workers never repeat or skip a token index, and a whole-cluster router outage is slow to stage; here two
scripted in-process decode workers (real gRPC servers on real sockets, each answering from a fixed script that
continues after `emitted_token_ids` exactly as a real worker does) misbehave on purpose, and the test checks what
the client gets from `Coordinator.generate`. Real faults on real workers are tests/cluster/test_chaos.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from services.frontend.coordinator import Coordinator
from services.frontend.errors import ApiError
from services.frontend.request_state import Phase, RequestState
from services.frontend.timeline import timeline_record
from services.rpc import pb, pb_grpc
from services.runtime.channels import ChannelPool
from services.telemetry import metrics
from tests.support.cluster import greedy, run
from tests.support.etcd import free_port

ANSWER = [101, 102, 103, 104, 105, 106, 107, 108]


class ScriptedDecode(pb_grpc.DecodeWorkerServicer):
    """Streams ANSWER from index len(emitted); `mode` breaks it: "repeat" re-sends the last emitted index first
    and then dies after 2 tokens, "skip" jumps an index, "die" resets after 2 tokens, "ok" finishes. Given a
    KvHandle, its first chunk reports a pull of `pull_bytes`, as a real worker reports the one it made."""

    def __init__(self, mode: str, pull_bytes: int = 1000) -> None:
        self.mode = mode
        self.pull_bytes = pull_bytes
        self.calls: list[pb.DecodeRequest] = []

    async def Decode(  # noqa: N802
        self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DecodeChunk]:
        self.calls.append(request)
        start = len(request.emitted_token_ids)
        if self.mode == "repeat" and start:
            start -= 1  # a buggy resume: one token the client already has
        sent = 0
        i = start
        while i < len(ANSWER):
            if self.mode in ("die", "repeat") and sent == 2:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted crash")
            if self.mode == "skip" and sent == 2:
                i += 1
            last = i == len(ANSWER) - 1
            yield pb.DecodeChunk(
                tokens=[pb.Token(token_id=ANSWER[i], index=i)],
                finished=last,
                finish_reason="length" if last else "",
                # a fresh request's prompt partly cached (pulled from a peer); a resumed one reports none, as a
                # real engine does
                cached_tokens=(0 if start else 2) if sent == 0 else 0,
                pulled_tokens=(0 if start else 2) if sent == 0 else 0,
                **(
                    {"transfer_bytes": self.pull_bytes, "transfer_s": 0.001, "transfer_backend": "tcp"}
                    if sent == 0 and request.HasField("kv")
                    else {}
                ),
            )
            sent += 1
            i += 1
            await asyncio.sleep(0.005)


class ScriptedRouter(pb_grpc.RouterServicer):
    """Round-robin over the decode workers not excluded, like the real router's agg mode."""

    def __init__(self, workers: dict[str, str], down: bool = False) -> None:
        self.workers = workers
        self.down = down
        self.reports: list[pb.FailureReport] = []

    async def Route(self, request: pb.RouteRequest, context: grpc.aio.ServicerContext) -> pb.RoutePlan:  # noqa: N802
        if self.down:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "router down")
        live = [w for w in sorted(self.workers) if w not in request.exclude_worker_ids]
        if not live:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no decode workers")
        # each process's epoch, which a failure report must name (d1 -> 101)
        epoch = 100 + int(live[0].removeprefix("d"))
        ref = pb.WorkerRef(worker_id=live[0], endpoint=self.workers[live[0]], role="decode", epoch=epoch)
        return pb.RoutePlan(decode=ref, reason="scripted")

    async def ReportFailure(self, request: pb.FailureReport, context: grpc.aio.ServicerContext) -> pb.Empty:  # noqa: N802
        self.reports.append(request)
        return pb.Empty()


class Workers:
    def __init__(self, infos: list[pb.WorkerInfo]) -> None:
        self.infos = infos
        self.suppressed: set[str] = set()

    def workers(self, role: str) -> list[pb.WorkerInfo]:
        return [w for w in self.infos if w.role == role and w.worker_id not in self.suppressed]

    def suppress(self, worker_id: str, seconds: float, epoch: int | None = None) -> None:
        self.suppressed.add(worker_id)


async def serve(servicer: object, add: object) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    add(servicer, server)  # type: ignore[operator]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def generate(
    modes: dict[str, str], router_down: bool = False, limit: int = 3
) -> tuple[list[list[int]], RequestState | ApiError, ScriptedRouter, dict[str, ScriptedDecode]]:
    """Run one request through a coordinator over scripted decode workers; the batches the client got."""
    servers, endpoints, decodes = [], {}, {}
    for worker_id, mode in modes.items():
        decodes[worker_id] = ScriptedDecode(mode)
        server, endpoints[worker_id] = await serve(
            decodes[worker_id], pb_grpc.add_DecodeWorkerServicer_to_server
        )
        servers.append(server)
    router = ScriptedRouter(endpoints, down=router_down)
    server, router_endpoint = await serve(router, pb_grpc.add_RouterServicer_to_server)
    servers.append(server)
    infos = [pb.WorkerInfo(worker_id="router-s", role="router", endpoint=router_endpoint)]
    infos += [pb.WorkerInfo(worker_id=w, role="decode", endpoint=e) for w, e in endpoints.items()]
    channels = ChannelPool()
    coordinator = Coordinator(Workers(infos), channels, migration_limit=limit, stall_timeout_s=5.0)
    state = coordinator.new_request("r1", [1, 2, 3], greedy(len(ANSWER)), timeout_s=20.0)
    batches, outcome = await drive(coordinator, state, channels, servers)
    return batches, outcome, router, decodes


async def drive(
    coordinator: Coordinator, state: RequestState, channels: ChannelPool, servers: list[grpc.aio.Server]
) -> tuple[list[list[int]], RequestState | ApiError]:
    """Run the request to its end: the token ids of each batch the client got, and the state or the error; then
    close the coordinator, the channels and the servers."""
    batches: list[list[int]] = []
    outcome: RequestState | ApiError = state
    try:
        async for batch in coordinator.generate(state):
            batches.append([t.token_id for t in batch.tokens])
    except ApiError as e:
        outcome = e
    finally:
        await coordinator.close()
        await channels.close()
        for s in servers:
            await s.stop(0)
    return batches, outcome


def test_a_resumed_worker_that_repeats_a_token_index_does_not_repeat_it_to_the_client() -> None:
    batches, state, router, decodes = run(lambda: generate({"d1": "die", "d2": "repeat", "d3": "ok"}))
    assert isinstance(state, RequestState) and state.phase is Phase.DONE
    assert [t for b in batches for t in b] == ANSWER  # each token once, in order, despite the repeat
    assert [m.from_worker_id for m in state.migration_log] == ["d1", "d2"]
    assert [m.at_token for m in state.migration_log] == [2, 3]
    assert [len(c.emitted_token_ids) for c in decodes["d3"].calls] == [3]
    assert {(r.worker_id, r.worker_epoch) for r in router.reports} == {("d1", 101), ("d2", 102)}
    # usage's cached_tokens is the first attempt's, the one the client's first token came from (a resumed
    # worker's 0 overwrote it until 2026-12-07), and so is what a prefix pull brought to it
    assert state.cached_tokens == 2 and state.pulled_tokens == 2


def test_a_worker_that_skips_a_token_index_is_failed_and_the_request_resumes_at_the_gap() -> None:
    batches, state, _, decodes = run(lambda: generate({"d1": "skip", "d2": "ok"}))
    assert isinstance(state, RequestState) and state.phase is Phase.DONE
    assert [t for b in batches for t in b] == ANSWER
    assert state.migration_log[0].cause == "decode_failed" and "skipped" in state.migration_log[0].detail
    assert list(decodes["d2"].calls[0].emitted_token_ids) == ANSWER[:2]


@pytest.mark.parametrize("limit", [0, 1])
def test_past_the_migration_limit_the_error_names_the_limit_and_every_failure(limit: int) -> None:
    batches, error, _, _ = run(lambda: generate({"d1": "die", "d2": "die", "d3": "ok"}, limit=limit))
    assert isinstance(error, ApiError) and error.status == 503 and error.code == "migration_limit_exceeded"
    assert f"--migration-limit {limit}" in error.message
    assert "decode_failed" in error.message and f"after {2 * (limit + 1)} tokens" in error.message
    assert [t for b in batches for t in b] == ANSWER[: 2 * (limit + 1)]  # what it got, once each


def test_with_every_router_down_a_local_fallback_plan_serves_the_request() -> None:
    batches, state, _, _ = run(lambda: generate({"d1": "ok"}, router_down=True))
    assert isinstance(state, RequestState) and state.phase is Phase.DONE
    assert [t for b in batches for t in b] == ANSWER
    assert state.plan is not None and "fallback" in state.plan.reason


class RestartedRouter(ScriptedRouter):
    """Plans d1 at whatever epoch its process has now (a restart makes a new one)."""

    epoch = 1

    async def Route(self, request: pb.RouteRequest, context: grpc.aio.ServicerContext) -> pb.RoutePlan:  # noqa: N802
        ref = pb.WorkerRef(worker_id="d1", endpoint=self.workers["d1"], role="decode", epoch=self.epoch)
        return pb.RoutePlan(decode=ref, reason="scripted")


def test_a_decode_worker_restarted_on_its_address_is_served_at_once() -> None:
    """A worker restarted on its own address (a container restarted in its pod keeps the pod's IP and the chart's
    port) is a new process, a new epoch. The coordinator's channel to the dead one had lost its connection, and
    gRPC backs off its reconnects (toward two minutes), failing every call on it at once meanwhile: until
    2026-12-07 the new, healthy process got "failed to connect" until that backoff ran out (31 s of 503s after a
    40 s outage on a real cluster). A newer epoch gets a fresh channel: the first request after the restart is
    served, with no migration."""
    endpoint = f"127.0.0.1:{free_port()}"

    async def start() -> grpc.aio.Server:
        server = grpc.aio.server()
        pb_grpc.add_DecodeWorkerServicer_to_server(ScriptedDecode("ok"), server)
        server.add_insecure_port(endpoint)
        await server.start()
        return server

    async def go() -> tuple[list[list[int]], RequestState | ApiError, list[str]]:
        router = RestartedRouter({"d1": endpoint})
        router_server, router_endpoint = await serve(router, pb_grpc.add_RouterServicer_to_server)
        infos = [pb.WorkerInfo(worker_id="router-s", role="router", endpoint=router_endpoint)]
        infos.append(pb.WorkerInfo(worker_id="d1", role="decode", endpoint=endpoint, epoch=1))
        channels = ChannelPool()
        coordinator = Coordinator(Workers(infos), channels, stall_timeout_s=5.0)
        worker = await start()
        first = coordinator.new_request("r1", [1, 2, 3], greedy(len(ANSWER)), timeout_s=20.0)
        async for _ in coordinator.generate(first):
            pass
        await worker.stop(0)
        # calls while it is gone drive the old channel's reconnect backoff up (1 s, 1.6 s, 2.6 s, 4.1 s, ...)
        refused = []
        stub = pb_grpc.DecodeWorkerStub(channels.get(endpoint, 1))
        end = time.monotonic() + 8.0
        while time.monotonic() < end:
            try:
                await stub.Decode(pb.DecodeRequest(request_id="probe"), timeout=1.0).read()
            except grpc.aio.AioRpcError as e:
                refused.append(e.code().name)
            await asyncio.sleep(0.2)
        worker = await start()
        router.epoch = 2
        state = coordinator.new_request("r2", [1, 2, 3], greedy(len(ANSWER)), timeout_s=20.0)
        batches, outcome = await drive(coordinator, state, channels, [worker, router_server])
        return batches, outcome, refused

    batches, outcome, refused = run(go)
    assert refused and set(refused) == {"UNAVAILABLE"}  # the outage was seen on the old channel
    assert isinstance(outcome, RequestState), outcome
    assert [t for b in batches for t in b] == ANSWER and outcome.migration_log == []


ROUTER_RESTARTS = 40


class OneToken(pb_grpc.DecodeWorkerServicer):
    async def Decode(  # noqa: N802
        self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DecodeChunk]:
        yield pb.DecodeChunk(
            tokens=[pb.Token(token_id=ANSWER[0], index=0)], finished=True, finish_reason="length"
        )


def test_requests_whose_router_stops_under_them_are_routed_by_the_next_router() -> None:
    """A router's gRPC server that stops (SIGTERM, a rolling restart) answers CANCELLED to the calls it had
    received and not yet run. It holds no request state: the next router plans them. Until 2026-12-07 each such
    request failed with 503 ("router … cancelled the request") with another router up; a real router did it
    under load on SIGTERM (2 of 658 requests over 4 restarts of one of two routers)."""

    async def body() -> tuple[list[RequestState | ApiError], float]:
        cancelled = metrics.WORKER_FAILURES.labels("router", "CANCELLED")
        before = cancelled._value.get()
        decode_server, decode_endpoint = await serve(
            ScriptedDecode("ok"), pb_grpc.add_DecodeWorkerServicer_to_server
        )
        workers = {"d1": decode_endpoint}
        servers = [
            await serve(ScriptedRouter(workers), pb_grpc.add_RouterServicer_to_server) for _ in range(2)
        ]
        infos = [
            pb.WorkerInfo(worker_id=f"router-{i}", role="router", endpoint=e)
            for i, (_, e) in enumerate(servers)
        ]
        infos.append(pb.WorkerInfo(worker_id="d1", role="decode", endpoint=decode_endpoint))
        channels = ChannelPool()
        coordinator = Coordinator(Workers(infos), channels, stall_timeout_s=5.0)
        outcomes: list[RequestState | ApiError] = []
        stopped = asyncio.Event()

        async def client(k: int) -> None:
            n = 0
            while not stopped.is_set():
                state = coordinator.new_request(f"r{k}-{n}", [1, 2, 3], greedy(2), timeout_s=20.0)
                try:
                    async for _ in coordinator.generate(state):
                        pass
                    outcomes.append(state)
                except ApiError as e:
                    outcomes.append(e)
                n += 1

        clients = [asyncio.ensure_future(client(k)) for k in range(64)]
        try:
            # router-0 restarts until it has answered CANCELLED (a race: the calls it had received
            # and not yet run when its server stopped); this frontend's discovery never sees it leave
            for _ in range(ROUTER_RESTARTS):
                await asyncio.sleep(0.3)
                await servers[0][0].stop(1.0)
                if cancelled._value.get() > before:
                    break
                servers[0] = await serve(ScriptedRouter(workers), pb_grpc.add_RouterServicer_to_server)
                infos[0] = pb.WorkerInfo(worker_id="router-0", role="router", endpoint=servers[0][1])
            stopped.set()
            await asyncio.gather(*clients)
        finally:
            await coordinator.close()
            await channels.close()
            for s in (decode_server, servers[0][0], servers[1][0]):
                await s.stop(0)
        return outcomes, cancelled._value.get() - before

    outcomes, cancelled = run(body)
    assert cancelled > 0  # router-0 did answer CANCELLED (this test exercises that path)
    failed = [o.message for o in outcomes if isinstance(o, ApiError)]
    assert not failed, failed[:3]
    assert all(o.phase is Phase.DONE for o in outcomes if isinstance(o, RequestState))


# ---- a disaggregated request: a scripted prefill worker that holds the prompt's KV ----------------------------


class ScriptedPrefill(pb_grpc.PrefillWorkerServicer):
    """Answers ANSWER[0] and a KvHandle naming itself as the producer, held for `hold_s` (None: no handle, as
    a real one answers when the hold ended before its KV was published); records the Releases it gets."""

    def __init__(self, hold_s: float | None = 30.0) -> None:
        self.endpoint = ""
        self.hold_s = hold_s
        self.released: list[str] = []

    async def Prefill(
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> pb.PrefillResponse:  # noqa: N802
        kv = pb.KvHandle(
            request_id=request.request_id, producer_worker_id="p1", producer_endpoint=self.endpoint,
            producer_epoch=7, num_tokens=len(request.token_ids),
            expires_unix_ms=int((time.time() + (self.hold_s or 0)) * 1000),
        )  # fmt: skip
        if self.hold_s is None:
            return pb.PrefillResponse(first_token=pb.Token(token_id=ANSWER[0], index=0))
        return pb.PrefillResponse(first_token=pb.Token(token_id=ANSWER[0], index=0), kv=kv)

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.Empty:  # noqa: N802
        self.released.append(request.request_id)
        return pb.Empty()

    async def ExtendHold(  # noqa: N802
        self, request: pb.ExtendHoldRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExtendHoldResponse:
        return pb.ExtendHoldResponse(held=True, expires_unix_ms=int((time.time() + 30) * 1000))


class CorruptPull(pb_grpc.DecodeWorkerServicer):
    """A decode worker whose pull of the KV arrived corrupt: DATA_LOSS before any token (the producer is fine)."""

    async def Decode(  # noqa: N802
        self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DecodeChunk]:
        await context.abort(grpc.StatusCode.DATA_LOSS, "KV checksum mismatch")
        yield pb.DecodeChunk()


class DisaggRouter(pb_grpc.RouterServicer):
    """First plan: prefill p1 then decode d1; every later plan: decode d2 alone."""

    def __init__(self, prefill: str, d1: str, d2: str) -> None:
        self.prefill, self.d1, self.d2, self.calls = prefill, d1, d2, 0

    async def Route(self, request: pb.RouteRequest, context: grpc.aio.ServicerContext) -> pb.RoutePlan:  # noqa: N802
        self.calls += 1
        if self.calls == 1:
            return pb.RoutePlan(
                prefill=pb.WorkerRef(worker_id="p1", endpoint=self.prefill, role="prefill", epoch=7),
                decode=pb.WorkerRef(worker_id="d1", endpoint=self.d1, role="decode", epoch=1),
                reason="disagg: scripted",
            )
        return pb.RoutePlan(
            decode=pb.WorkerRef(worker_id="d2", endpoint=self.d2, role="decode", epoch=2),
            reason="scripted retry",
        )

    async def ReportFailure(self, request: pb.FailureReport, context: grpc.aio.ServicerContext) -> pb.Empty:  # noqa: N802
        return pb.Empty()


async def disaggregated(
    first_decode: pb_grpc.DecodeWorkerServicer, hold_s: float | None = 30.0
) -> tuple[RequestState, ScriptedPrefill]:
    """One request: prefill on p1 (its KV held for `hold_s`), decode on `first_decode` (d1), whose failure moves
    it to a decode worker d2 that finishes (a pull there reports 2000 bytes); returns the state once the request
    is over and the prefill worker's Releases have landed."""
    prefill = ScriptedPrefill(hold_s)
    sp, prefill.endpoint = await serve(prefill, pb_grpc.add_PrefillWorkerServicer_to_server)
    s1, d1 = await serve(first_decode, pb_grpc.add_DecodeWorkerServicer_to_server)
    s2, d2 = await serve(ScriptedDecode("ok", pull_bytes=2000), pb_grpc.add_DecodeWorkerServicer_to_server)
    sr, router = await serve(DisaggRouter(prefill.endpoint, d1, d2), pb_grpc.add_RouterServicer_to_server)
    infos = [
        pb.WorkerInfo(worker_id="router-s", role="router", endpoint=router),
        pb.WorkerInfo(worker_id="p1", role="prefill", endpoint=prefill.endpoint, epoch=7),
    ]
    channels = ChannelPool()
    coordinator = Coordinator(Workers(infos), channels, stall_timeout_s=5.0)
    state = coordinator.new_request("r1", [1, 2, 3], greedy(len(ANSWER)), timeout_s=20.0)
    try:
        got = [t.token_id async for batch in coordinator.generate(state) for t in batch.tokens]
        assert got == ANSWER and state.phase is Phase.DONE
        for _ in range(100):  # a Release is sent in the background
            if prefill.released:
                break
            await asyncio.sleep(0.02)
    finally:
        await coordinator.close()
        await channels.close()
        for s in (sp, s1, s2, sr):
            await s.stop(0)
    return state, prefill


def test_a_failed_pull_tells_the_live_prefill_worker_to_free_its_copy() -> None:
    """A corrupt pull (DATA_LOSS) rebuilds the request on another decode worker; the prefill worker, alive and
    holding the prompt's KV, is told to free it (it kept it for its whole TTL until 2026-12-07)."""
    state, prefill = run(lambda: disaggregated(CorruptPull()), 30)
    assert [(m.cause, m.path) for m in state.migration_log] == [("transfer_failed", "rebuild")]
    assert prefill.released == ["r1"]


def test_a_migrated_requests_record_names_the_prefill_worker_and_the_placement() -> None:
    """The request's log line and timeline name the prefill worker that ran its prompt and the router's
    placement after the decode worker died (null and the retry plan's reason until 2026-12-07)."""
    state, _ = run(lambda: disaggregated(ScriptedDecode("die")), 30)
    assert [m.path for m in state.migration_log] == ["re-transfer"]
    record = state.summary()
    assert (record["prefill_worker"], record["decode_worker"]) == ("p1", "d2")
    assert record["route_reason"] == "disagg: scripted"
    timeline = timeline_record(state, "/v1/completions", 200)
    assert timeline["workers"] == {"prefill": "p1", "decode": "d2"}
    assert timeline["route"]["reason"] == "disagg: scripted"


@pytest.mark.parametrize(("hold_s", "path"), [(30.0, "re-transfer"), (1.5, "rebuild")])
def test_a_migrated_requests_timeline_has_the_transfer_of_the_attempt_that_answered(
    hold_s: float, path: str
) -> None:
    """d1 pulls the prompt's KV (1000 bytes) and dies; d2 either pulls it again (2000 bytes) or, the prefill
    copy about to expire, rebuilds it without a pull. The request's transfer is the attempt that answered's and
    the migration names the one it left: until 2026-12-07 a rebuilt request kept d1's pull as its own."""
    state, _ = run(lambda: disaggregated(ScriptedDecode("die", pull_bytes=1000), hold_s), 30)
    assert [m.path for m in state.migration_log] == [path]
    timeline = timeline_record(state, "/v1/completions", 200)
    assert timeline["workers"]["decode"] == "d2"
    if path == "re-transfer":
        assert timeline["transfer"] is not None and timeline["transfer"]["bytes"] == 2000
    else:
        assert timeline["transfer"] is None
    [left] = timeline["migration_log"]
    assert (left["from"], left["transfer"]["bytes"], left["transfer"]["backend"]) == ("d1", 1000, "tcp")
    assert state.summary()["transfer"] == timeline["transfer"]  # the log line says the same


def test_a_prefill_answer_without_a_handle_is_decoded_by_a_rebuild_without_a_migration() -> None:
    """A prefill worker whose hold ended before its KV was published answers the first token and no handle. The
    coordinator passed the absent handle on as an empty one; now the decode worker gets none and prefills the
    prompt and the first token itself, at once: no refused pull, no migration (which --migration-limit 0 would
    have turned into a 503)."""
    first = ScriptedDecode("ok")
    state, prefill = run(lambda: disaggregated(first, hold_s=None), 30)
    assert state.migration_log == []
    [call] = first.calls
    assert not call.HasField("kv") and list(call.emitted_token_ids) == ANSWER[:1]
    assert Phase.TRANSFERRING not in [p for p, _ in state.timeline]
    assert state.held_kv is None and prefill.released == []
