"""A busy prefill worker is not a failed one (docs/overload.md, "Busy is not failed").

A Prefill call is unary: it sends nothing until the prompt is done, and a queue of long prompts on a slow CPU
outlasts any fixed stall timeout. The coordinator waits for a prefill worker as long as discovery still lists it
(same id and epoch); one that leaves discovery with the call in flight (a frozen process stops renewing its lease)
is stalled and the request moves. Scripted prefill workers on real gRPC servers answer after a set delay, or
never, and the test checks what the client gets from `Coordinator.generate` and what the routers are told.
"""

from __future__ import annotations

import asyncio
import threading
import types

import grpc
import pytest

from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine, RequestOutput
from services.engine.sampling import SamplingParams
from services.frontend.coordinator import Coordinator
from services.frontend.errors import ApiError
from services.frontend.request_state import RequestState
from services.prefill import server as prefill_server
from services.rpc import pb, pb_grpc
from services.runtime.async_engine import AsyncEngine
from services.runtime.channels import ChannelPool
from services.runtime.errors import WorkerUnavailableError
from tests.conftest import tiny_llama
from tests.frontend.test_migration import ANSWER, ScriptedDecode, drive, serve
from tests.support.cluster import greedy, run

STALL_S = 1.0


class ScriptedPrefill(pb_grpc.PrefillWorkerServicer):
    """Answers the first token (a one-token request: finished) after `delay_s`; None: never."""

    def __init__(self, delay_s: float | None) -> None:
        self.delay_s = delay_s
        self.calls = 0
        self.cancelled = 0

    async def Prefill(
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> pb.PrefillResponse:  # noqa: N802
        self.calls += 1
        try:
            await asyncio.sleep(3600 if self.delay_s is None else self.delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return pb.PrefillResponse(
            first_token=pb.Token(token_id=ANSWER[0], index=0), finished=True, finish_reason="length"
        )


class DisaggRouter(pb_grpc.RouterServicer):
    """A disaggregated plan on the first prefill worker not excluded."""

    def __init__(self, prefill: dict[str, str], decode: tuple[str, str]) -> None:
        self.prefill = prefill
        self.decode = decode
        self.reports: list[pb.FailureReport] = []

    async def Route(self, request: pb.RouteRequest, context: grpc.aio.ServicerContext) -> pb.RoutePlan:  # noqa: N802
        live = [w for w in sorted(self.prefill) if w not in request.exclude_worker_ids]
        if not live:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no prefill workers")
        return pb.RoutePlan(
            prefill=pb.WorkerRef(worker_id=live[0], endpoint=self.prefill[live[0]], role="prefill", epoch=1),
            decode=pb.WorkerRef(worker_id=self.decode[0], endpoint=self.decode[1], role="decode", epoch=1),
            reason="scripted disagg",
        )

    async def ReportFailure(self, request: pb.FailureReport, context: grpc.aio.ServicerContext) -> pb.Empty:  # noqa: N802
        self.reports.append(request)
        return pb.Empty()


class Directory:
    """Discovery as the coordinator sees it; `leave` drops a worker as an expired lease does."""

    def __init__(self, infos: list[pb.WorkerInfo]) -> None:
        self.infos = infos

    def workers(self, role: str) -> list[pb.WorkerInfo]:
        return [w for w in self.infos if w.role == role]

    def suppress(self, worker_id: str, seconds: float, epoch: int | None = None) -> None:
        pass

    def leave(self, worker_id: str) -> None:
        self.infos = [w for w in self.infos if w.worker_id != worker_id]


async def one_request(
    delays: dict[str, float | None], leaves: str | None = None, timeout_s: float = 20.0
) -> tuple[list[int], RequestState | ApiError, DisaggRouter, dict[str, ScriptedPrefill]]:
    servers, prefill_endpoints, prefills = [], {}, {}
    for worker_id, delay in delays.items():
        prefills[worker_id] = ScriptedPrefill(delay)
        server, prefill_endpoints[worker_id] = await serve(
            prefills[worker_id], pb_grpc.add_PrefillWorkerServicer_to_server
        )
        servers.append(server)
    server, decode_endpoint = await serve(ScriptedDecode("ok"), pb_grpc.add_DecodeWorkerServicer_to_server)
    servers.append(server)
    router = DisaggRouter(prefill_endpoints, ("decode-a", decode_endpoint))
    server, router_endpoint = await serve(router, pb_grpc.add_RouterServicer_to_server)
    servers.append(server)
    infos = [pb.WorkerInfo(worker_id="router-s", role="router", endpoint=router_endpoint, epoch=1)]
    infos += [pb.WorkerInfo(worker_id="decode-a", role="decode", endpoint=decode_endpoint, epoch=1)]
    infos += [
        pb.WorkerInfo(worker_id=w, role="prefill", endpoint=e, epoch=1) for w, e in prefill_endpoints.items()
    ]
    directory = Directory(infos)
    channels = ChannelPool()
    coordinator = Coordinator(directory, channels, stall_timeout_s=STALL_S)
    state = coordinator.new_request("r1", [1, 2, 3], greedy(1), timeout_s=timeout_s)
    if leaves is not None:
        asyncio.get_running_loop().call_later(0.3, directory.leave, leaves)
    batches, outcome = await drive(coordinator, state, channels, servers)
    return [t for b in batches for t in b], outcome, router, prefills


def test_a_prefill_worker_busy_past_the_stall_timeout_answers_the_request_without_a_migration() -> None:
    """Three stall windows without an answer, the worker registered throughout: one call, its token, no
    migration, no failure report (the old rule failed it at the first window and re-ran the prompt elsewhere)."""
    tokens, outcome, router, prefills = run(
        lambda: one_request({"prefill-a": 3.5 * STALL_S, "prefill-b": 0.0})
    )
    assert isinstance(outcome, RequestState), outcome
    assert tokens == [ANSWER[0]] and outcome.finish_reason == "length"
    # the token that ended it is kept, for a stop_reason (None until 2026-12-07 when the prefill's first
    # token ended a request: a stop token id there was reported as null)
    assert outcome.stop_reason == str(ANSWER[0])
    assert outcome.migration_log == [] and router.reports == []
    assert (prefills["prefill-a"].calls, prefills["prefill-b"].calls) == (1, 0)


def test_a_prefill_worker_that_leaves_discovery_mid_call_is_stalled_and_the_request_moves() -> None:
    """It never answers and drops out of discovery (its lease expired): after the stall window the call is
    cancelled, the routers hear `prefill_stalled`, and the prompt runs on the other worker."""
    tokens, outcome, router, prefills = run(
        lambda: one_request({"prefill-a": None, "prefill-b": 0.0}, leaves="prefill-a")
    )
    assert isinstance(outcome, RequestState), outcome
    assert tokens == [ANSWER[0]]
    assert [(m.cause, m.from_worker_id, m.to_worker_id) for m in outcome.migration_log] == [
        ("prefill_stalled", "prefill-a", "prefill-b")
    ]
    assert [r.worker_id for r in router.reports] == ["prefill-a"]
    assert prefills["prefill-a"].cancelled == 1 and prefills["prefill-b"].calls == 1


def test_a_registered_prefill_worker_that_never_answers_is_bounded_by_the_request_deadline() -> None:
    """Nothing hangs: waiting for a busy worker ends at the request's own deadline, a 504 naming the worker."""
    tokens, outcome, router, prefills = run(lambda: one_request({"prefill-a": None}, timeout_s=2.5 * STALL_S))
    assert tokens == []
    assert isinstance(outcome, ApiError) and outcome.status == 504, outcome
    assert "prefill-a" in str(outcome.body())


def test_a_prefill_worker_fails_its_call_once_its_engine_step_hangs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's half of the contract: the caller waits for a registered worker, so a live worker whose
    engine thread is stuck must fail the call itself (UNAVAILABLE, naming the worker) — here a real AsyncEngine
    whose first step does not come back, with ENGINE_STUCK_S shortened to 1 s. A slow step that does come back
    in time is waited for."""
    monkeypatch.setattr(prefill_server, "ENGINE_STUCK_S", 1.0)
    monkeypatch.setattr(prefill_server, "STUCK_CHECK_S", 0.1)
    release = threading.Event()

    async def first_token(engine: AsyncEngine, rid: str) -> int:
        params = SamplingParams(max_tokens=1, temperature=0.0)
        async with engine.generate(rid, [1, 2, 3], params) as stream:
            return [t async for o in stream for t in o.new_token_ids][0]

    async def main() -> tuple[str, int]:
        config = EngineConfig(dtype="float32", block_size=16, num_kv_blocks=8, num_threads=1)
        engine = await AsyncEngine.start(lambda: LLMEngine(tiny_llama(), config))
        try:
            assert engine.engine is not None
            real_step = engine.engine.step
            delay: dict[str, float | None] = {"s": 0.3}

            def step() -> list[RequestOutput]:
                release.wait(30 if delay["s"] is None else delay["s"])
                return real_step()

            engine.engine.step = step  # type: ignore[method-assign]
            worker = types.SimpleNamespace(engine=engine, host=types.SimpleNamespace(worker_id="prefill-7"))
            slow = await prefill_server.PrefillWorker._unless_stuck(worker, first_token(engine, "slow"))  # type: ignore[arg-type]
            delay["s"] = None
            with pytest.raises(WorkerUnavailableError) as err:
                await asyncio.wait_for(
                    prefill_server.PrefillWorker._unless_stuck(worker, first_token(engine, "hung")),  # type: ignore[arg-type]
                    10,
                )
            return str(err.value), slow
        finally:
            release.set()
            await engine.close()

    message, slow = asyncio.run(main())
    assert isinstance(slow, int)  # 0.3 s steps are busy, not stuck: the call answered
    assert "prefill-7" in message and "has not stepped" in message


@pytest.mark.parametrize("ttl_s", [float("nan"), 0.0, -1.0])
def test_an_extend_hold_with_a_ttl_that_is_not_positive_is_refused_and_keeps_the_hold(ttl_s: float) -> None:
    """ExtendHold(ttl_s=NaN) passed the `<= 0` check, replaced the hold's timer with one that fired at once,
    and only then failed: the caller was told no, and the KV it meant to keep was freed (until 2026-12-07)."""
    cancelled: list[bool] = []
    rescheduled: list[float] = []
    timer = types.SimpleNamespace(cancel=lambda: cancelled.append(True))
    worker = types.SimpleNamespace(
        _expiry={"held-1": timer}, _held_since={"held-1": 0.0}, kv_max_hold_s=60.0,
        _expire_at=lambda rid, until_s: rescheduled.append(until_s),
    )  # fmt: skip
    request = pb.ExtendHoldRequest(request_id="held-1", ttl_s=ttl_s)
    with pytest.raises(ValueError, match="ttl_s must be positive"):
        run(lambda: prefill_server.PrefillWorker.ExtendHold(worker, request, None))  # type: ignore[arg-type]
    assert cancelled == [] and rescheduled == [] and worker._expiry["held-1"] is timer
