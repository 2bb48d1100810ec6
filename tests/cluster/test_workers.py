"""Workers and router as real processes against a real etcd: the aggregated path end to end.

One module-scoped cluster — two decode workers, one prefill worker, one router — serves every test that leaves
it intact; the last two tests kill the decode workers (SIGKILL, then SIGTERM with a stream in flight), so they
run last, in file order. Everything runs SmolLM2-135M in float32 with one torch thread per process.
"""

from __future__ import annotations

import asyncio
import math
import signal
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.engine.model import PagedKvCache
from services.engine.model_files import smollm2_gguf_path
from services.engine.tokenizer import Tokenizer
from services.rpc import pb, pb_grpc
from tests.support.cluster import (
    LEASE_TTL_S,
    RPC_TIMEOUT_S,
    WORKER_FLAGS,
    LocalCluster,
    Proc,
    decode,
    greedy,
    local_cluster,
    run,
    start_process,
    token_ids,
    token_indices,
    wait_for_load,
)

KV_TTL_S = 4.0
SUPPRESS_S = 1.5
FRANCE_ANSWER = "The capital of France is Paris."


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    log_dir = str(tmp_path_factory.mktemp("workers"))

    def start(etcd_url: str) -> list[Proc]:
        prefill_flags = [*WORKER_FLAGS, "--kv-ttl-s", str(KV_TTL_S)]
        return [
            start_process("services.decode.server", "decode-a", etcd_url, log_dir, *WORKER_FLAGS),
            start_process("services.decode.server", "decode-b", etcd_url, log_dir, *WORKER_FLAGS),
            start_process("services.prefill.server", "prefill-a", etcd_url, log_dir, *prefill_flags),
            start_process(
                "services.router.server", "router-a", etcd_url, log_dir,
                "--suppress-s", str(SUPPRESS_S), "--policy", "round_robin",
            ),
        ]  # fmt: skip

    with local_cluster(log_dir, start, {"decode": 2, "prefill": 1, "router": 1}) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf_path())


@pytest.fixture(scope="module")
def france_prompt(tokenizer: Tokenizer) -> list[int]:
    return list(tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}]))


async def route(endpoint: str, request: pb.RouteRequest) -> pb.RoutePlan:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        return await pb_grpc.RouterStub(channel).Route(request, timeout=5.0)


# ------------------------------------------------------------------------------------------------ decode


def test_decode_streams_the_france_answer(
    cluster: LocalCluster, tokenizer: Tokenizer, france_prompt: list[int]
) -> None:
    chunks = run(
        lambda: decode(
            cluster.endpoints["decode-a"],
            pb.DecodeRequest(request_id="france-1", prompt_token_ids=france_prompt, params=greedy()),
        )
    )
    ids = token_ids(chunks)
    assert tokenizer.decode(ids, skip_special_tokens=True) == FRANCE_ANSWER
    assert token_indices(chunks) == list(range(len(ids)))
    assert chunks[0].prompt_tokens == len(france_prompt)
    assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].finish_reason == "stop"


def test_decode_resumed_with_emitted_tokens_continues_without_repeats(
    cluster: LocalCluster, tokenizer: Tokenizer, france_prompt: list[int]
) -> None:
    """The resumed half runs on the other worker: continuation depends only on tokens and seed."""
    full = token_ids(
        run(
            lambda: decode(
                cluster.endpoints["decode-a"],
                pb.DecodeRequest(request_id="resume-full", prompt_token_ids=france_prompt, params=greedy()),
            )
        )
    )
    emitted = full[:3]
    rest = run(
        lambda: decode(
            cluster.endpoints["decode-b"],
            pb.DecodeRequest(
                request_id="resume-rest",
                prompt_token_ids=france_prompt,
                emitted_token_ids=emitted,
                params=greedy(),
            ),
        )
    )
    assert token_indices(rest) == list(range(3, len(full)))
    assert emitted + token_ids(rest) == full
    assert tokenizer.decode(emitted + token_ids(rest), skip_special_tokens=True) == FRANCE_ANSWER


def test_eight_concurrent_decode_streams_all_complete(cluster: LocalCluster, tokenizer: Tokenizer) -> None:
    questions = [
        f"Name a fruit that is {c}." for c in ("red", "yellow", "green", "orange", "purple", "small")
    ]
    questions += ["What is 2 + 2?", "Say hello."]
    requests = [
        pb.DecodeRequest(
            request_id=f"concurrent-{i}",
            prompt_token_ids=tokenizer.encode_chat([{"role": "user", "content": q}]),
            params=pb.SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, seed=100 + i, logprobs=-1),
        )
        for i, q in enumerate(questions)
    ]

    async def all_streams() -> list[list[pb.DecodeChunk]]:
        return await asyncio.gather(*(decode(cluster.endpoints["decode-a"], r) for r in requests))

    results = run(all_streams, 90.0)
    assert len(results) == 8
    for chunks in results:
        n = len(token_ids(chunks))
        assert chunks[-1].finished and chunks[-1].finish_reason in ("stop", "length")
        assert 1 <= n <= 12 and token_indices(chunks) == list(range(n))


def test_client_cancel_aborts_the_request_on_the_worker(
    cluster: LocalCluster, france_prompt: list[int]
) -> None:
    endpoint = cluster.endpoints["decode-b"]

    async def body() -> pb.LoadSnapshot:
        async with grpc.aio.insecure_channel(endpoint) as channel:
            call = pb_grpc.DecodeWorkerStub(channel).Decode(
                pb.DecodeRequest(
                    request_id="cancel-me",
                    prompt_token_ids=france_prompt,
                    params=greedy(2000, ignore_eos=True),
                ),
                timeout=RPC_TIMEOUT_S,
            )
            seen = 0
            async for chunk in call:
                seen += len(chunk.tokens)
                if seen >= 3:
                    break
            await wait_for_load(endpoint, pb_grpc.DecodeWorkerStub, lambda load: load.running == 1)
            call.cancel()
        # 2000 tokens take minutes; an engine that still ran the request would fail this
        return await wait_for_load(
            endpoint, pb_grpc.DecodeWorkerStub, lambda s: s.running == 0 and s.waiting == 0
        )

    load = run(body)
    assert load.free_blocks == load.total_blocks


@pytest.mark.parametrize(
    ("params", "field_name"),
    [
        (pb.SamplingParams(max_tokens=8, top_p=1.5), "top_p"),
        (pb.SamplingParams(max_tokens=0), "max_tokens"),
        (pb.SamplingParams(max_tokens=8, temperature=-1.0), "temperature"),
        (pb.SamplingParams(max_tokens=8, logprobs=50), "logprobs"),
    ],
)
def test_bad_params_are_invalid_argument_naming_the_field(
    cluster: LocalCluster, france_prompt: list[int], params: pb.SamplingParams, field_name: str
) -> None:
    request = pb.DecodeRequest(request_id=f"bad-{field_name}", prompt_token_ids=france_prompt, params=params)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        run(lambda: decode(cluster.endpoints["decode-a"], request))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert field_name in (err.value.details() or "")


def test_prompts_that_cannot_run_are_refused_with_the_limit_named(cluster: LocalCluster) -> None:
    max_len = cluster.infos["decode-a"].max_model_len
    capacity_tokens = cluster.infos["decode-a"].kv_capacity_blocks * cluster.infos["decode-a"].block_size
    # the context is capped at what the cache holds: a prompt past it is refused as too long, never left to wait
    # for blocks it cannot get
    assert max_len <= capacity_tokens
    cases = [
        ([1] * max_len, grpc.StatusCode.INVALID_ARGUMENT, "context length"),
        ([], grpc.StatusCode.INVALID_ARGUMENT, "empty"),
        ([1] * (capacity_tokens + 1), grpc.StatusCode.INVALID_ARGUMENT, "context length"),
    ]
    for prompt, code, words in cases:
        request = pb.DecodeRequest(prompt_token_ids=prompt, params=greedy(4))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            run(lambda request=request: decode(cluster.endpoints["decode-a"], request))
        assert err.value.code() is code
        assert words in (err.value.details() or "")


def test_decode_with_an_empty_kv_handle_is_refused_naming_the_field(
    cluster: LocalCluster, france_prompt: list[int]
) -> None:
    request = pb.DecodeRequest(
        request_id="with-kv", prompt_token_ids=france_prompt, params=greedy(), kv=pb.KvHandle(request_id="x")
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        run(lambda: decode(cluster.endpoints["decode-a"], request))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "KvHandle.model_fingerprint" in (err.value.details() or "")


def test_workers_serve_grpc_health(cluster: LocalCluster) -> None:
    services = {
        "decode-a": "rackserve.v1.DecodeWorker",
        "prefill-a": "rackserve.v1.PrefillWorker",
        "router-a": "rackserve.v1.Router",
    }

    async def body() -> dict[tuple[str, str], int]:
        statuses = {}
        for worker_id, service in services.items():
            async with grpc.aio.insecure_channel(cluster.endpoints[worker_id]) as channel:
                for name in ("", service):
                    reply = await health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service=name), timeout=5.0
                    )
                    statuses[worker_id, name] = int(reply.status)
        return statuses

    statuses = run(body)
    assert len(statuses) == 6 and set(statuses.values()) == {health_pb2.HealthCheckResponse.SERVING}


# ------------------------------------------------------------------------------------------------ prefill


async def prefill(endpoint: str, request: pb.PrefillRequest) -> pb.PrefillResponse:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        return await pb_grpc.PrefillWorkerStub(channel).Prefill(request, timeout=RPC_TIMEOUT_S)


async def release(endpoint: str, request_id: str) -> None:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        await pb_grpc.PrefillWorkerStub(channel).Release(
            pb.ReleaseRequest(request_id=request_id), timeout=5.0
        )


def test_prefill_returns_a_kv_handle_and_release_frees_its_blocks(
    cluster: LocalCluster, tokenizer: Tokenizer, france_prompt: list[int]
) -> None:
    endpoint = cluster.endpoints["prefill-a"]
    info = cluster.infos["prefill-a"]
    sent_ms = time.time() * 1000

    async def body() -> tuple[pb.PrefillResponse, pb.LoadSnapshot, pb.LoadSnapshot]:
        response = await prefill(
            endpoint, pb.PrefillRequest(request_id="prefill-1", token_ids=france_prompt, params=greedy())
        )
        n_blocks = len(response.kv.block_ids)
        held = await wait_for_load(endpoint, pb_grpc.PrefillWorkerStub, lambda s: s.running == 0)
        await release(endpoint, "prefill-1")
        freed = await wait_for_load(
            endpoint, pb_grpc.PrefillWorkerStub, lambda s: s.free_blocks == held.free_blocks + n_blocks
        )
        return response, held, freed

    response, held, freed = run(body)
    kv = response.kv
    assert kv.request_id == "prefill-1"
    assert kv.producer_worker_id == "prefill-a" and kv.producer_epoch == info.epoch
    assert kv.model_fingerprint == info.model_fingerprint == cluster.infos["decode-a"].model_fingerprint
    assert (kv.num_layers, kv.num_kv_heads, kv.head_dim, kv.block_size) == (30, 3, 64, 16)  # SmolLM2-135M
    assert kv.dtype == pb.KV_DTYPE_FP32 and kv.layout == PagedKvCache.LAYOUT
    assert kv.num_tokens == len(france_prompt)
    assert len(kv.block_ids) == math.ceil(len(france_prompt) / kv.block_size)
    assert sent_ms + (KV_TTL_S - 1) * 1000 < kv.expires_unix_ms < time.time() * 1000 + KV_TTL_S * 1000
    assert tokenizer.decode([response.first_token.token_id]) == "The" and response.first_token.index == 0
    assert not response.finished
    assert held.free_blocks == held.total_blocks - len(kv.block_ids)
    assert freed.free_blocks == freed.total_blocks


def test_prefill_kv_not_released_expires_after_its_ttl(
    cluster: LocalCluster, france_prompt: list[int]
) -> None:
    endpoint = cluster.endpoints["prefill-a"]

    async def body() -> tuple[pb.LoadSnapshot, pb.LoadSnapshot]:
        await prefill(
            endpoint, pb.PrefillRequest(request_id="prefill-ttl", token_ids=france_prompt, params=greedy())
        )
        held = await wait_for_load(endpoint, pb_grpc.PrefillWorkerStub, lambda s: s.running == 0)
        expired = await wait_for_load(
            endpoint, pb_grpc.PrefillWorkerStub, lambda s: s.free_blocks == s.total_blocks, KV_TTL_S + 5
        )
        return held, expired

    held, expired = run(body)
    assert held.free_blocks < held.total_blocks
    assert expired.free_blocks == expired.total_blocks


def test_prefill_first_token_ending_the_request_holds_no_kv(
    cluster: LocalCluster, france_prompt: list[int]
) -> None:
    endpoint = cluster.endpoints["prefill-a"]
    request = pb.PrefillRequest(request_id="prefill-one", token_ids=france_prompt, params=greedy(1))
    response = run(lambda: prefill(endpoint, request))
    assert response.finished and response.finish_reason == "length"
    assert not response.HasField("kv")
    load = run(lambda: wait_for_load(endpoint, pb_grpc.PrefillWorkerStub, lambda s: True))
    assert load.free_blocks == load.total_blocks


def test_a_drained_prefill_worker_stays_until_the_kv_it_handed_out_is_pulled(
    cluster: LocalCluster, tokenizer: Tokenizer, france_prompt: list[int]
) -> None:
    """A scale-down between a prefill and its pull: SIGTERM with no RPC in flight, but a KvHandle out that no
    decode worker has read yet. The worker keeps serving that KV and exits (0) once it has been pulled; the
    decode worker continues from the pulled KV, not from a recompute. Stops prefill-a."""
    proc, endpoint = cluster.procs["prefill-a"], cluster.endpoints["prefill-a"]

    async def body() -> tuple[pb.PrefillResponse, bool, list[pb.DecodeChunk]]:
        response = await prefill(
            endpoint, pb.PrefillRequest(request_id="drain-pull", token_ids=france_prompt, params=greedy())
        )
        proc.popen.send_signal(signal.SIGTERM)
        await asyncio.sleep(2.0)  # no RPC in flight: before, the worker was gone (and its KV with it) by now
        alive = proc.popen.poll() is None
        chunks = await decode(
            cluster.endpoints["decode-a"],
            pb.DecodeRequest(
                request_id="drain-pull",
                prompt_token_ids=france_prompt,
                emitted_token_ids=[response.first_token.token_id],
                params=greedy(),
                kv=response.kv,
            ),
        )
        return response, alive, chunks

    response, alive, chunks = run(body)
    assert alive
    assert chunks[0].transfer_bytes > 0 and chunks[0].transfer_backend  # the KV came over the wire
    text = tokenizer.decode([response.first_token.token_id, *token_ids(chunks)], skip_special_tokens=True)
    assert text == FRANCE_ANSWER
    assert proc.popen.wait(timeout=15) == 0


# ------------------------------------------------------------------------------------------------ router


def test_router_round_robins_over_decode_workers_and_honours_exclusions(cluster: LocalCluster) -> None:
    router = cluster.endpoints["router-a"]

    async def body() -> tuple[list[pb.RoutePlan], list[str], list[str]]:
        plans = [await route(router, pb.RouteRequest(request_id=f"rr-{i}")) for i in range(4)]
        excluded = [
            (await route(router, pb.RouteRequest(exclude_worker_ids=["decode-a"]))).decode.worker_id
            for _ in range(3)
        ]
        async with grpc.aio.insecure_channel(router) as channel:
            await pb_grpc.RouterStub(channel).ReportFailure(
                pb.FailureReport(worker_id="decode-b", request_id="rr-x", cause="test"), timeout=5.0
            )
        suppressed = [(await route(router, pb.RouteRequest())).decode.worker_id for _ in range(3)]
        return plans, excluded, suppressed

    plans, excluded, suppressed = run(body)
    chosen = [p.decode.worker_id for p in plans]
    assert sorted(chosen[:2]) == ["decode-a", "decode-b"] and chosen[2:] == chosen[:2]
    # need_prefill unset: nothing to disaggregate, so aggregated whatever the mode
    assert all(p.reason.startswith("agg") and "round_robin" in p.reason for p in plans)
    assert not any(p.HasField("prefill") for p in plans)
    assert plans[0].decode.endpoint == cluster.endpoints[chosen[0]]
    assert excluded == ["decode-b"] * 3
    assert suppressed == ["decode-a"] * 3


# ------------------------------------------------------------------------------- these two kill the decode pool


def wait_until_not_routed(router: str, worker_id: str, timeout_s: float) -> float:
    """Seconds until Route stops naming worker_id (two routes in a row without it, or no decode worker)."""

    async def body() -> float:
        t0 = time.monotonic()
        misses = 0
        while misses < 2:
            try:
                plan = await route(router, pb.RouteRequest())
                misses = misses + 1 if plan.decode.worker_id != worker_id else 0
            except grpc.aio.AioRpcError as e:
                assert e.code() is grpc.StatusCode.UNAVAILABLE
                break
            await asyncio.sleep(0.05)
        return time.monotonic() - t0

    return run(body, timeout_s)


def test_sigkilled_decode_worker_leaves_the_router_view_within_ttl(cluster: LocalCluster) -> None:
    time.sleep(SUPPRESS_S)  # let the suppression of the previous test lapse
    router = cluster.endpoints["router-a"]
    assert {run(lambda: route(router, pb.RouteRequest())).decode.worker_id for _ in range(2)} == {
        "decode-a",
        "decode-b",
    }
    cluster.procs["decode-b"].popen.kill()
    t0 = time.monotonic()
    wait_until_not_routed(router, "decode-b", LEASE_TTL_S + 5)
    assert time.monotonic() - t0 <= LEASE_TTL_S + 1


def test_sigterm_drains_the_in_flight_stream_then_exits_and_leaves_at_once(
    cluster: LocalCluster, france_prompt: list[int]
) -> None:
    proc = cluster.procs["decode-a"]
    endpoint, router = cluster.endpoints["decode-a"], cluster.endpoints["router-a"]
    max_tokens = 40

    async def body() -> tuple[list[pb.DecodeChunk], float, grpc.StatusCode]:
        async with grpc.aio.insecure_channel(endpoint) as channel:
            stub = pb_grpc.DecodeWorkerStub(channel)
            call = stub.Decode(
                pb.DecodeRequest(
                    request_id="drain-me",
                    prompt_token_ids=france_prompt,
                    params=greedy(max_tokens, ignore_eos=True),
                ),
                timeout=RPC_TIMEOUT_S,
            )
            chunks = [await call.read()]
            proc.popen.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            while True:  # the key goes first: the router stops routing here at once, before the stream ends
                try:
                    await route(router, pb.RouteRequest())
                except grpc.aio.AioRpcError as e:
                    assert e.code() is grpc.StatusCode.UNAVAILABLE and e.details() == "no decode workers"
                    break
                await asyncio.sleep(0.02)
            gone_after_s = time.monotonic() - t0
            refused = grpc.StatusCode.OK
            try:
                await stub.Decode(
                    pb.DecodeRequest(prompt_token_ids=france_prompt, params=greedy(4)), timeout=5.0
                ).read()
            except grpc.aio.AioRpcError as e:
                refused = e.code()
            while (chunk := await call.read()) is not grpc.aio.EOF:
                chunks.append(chunk)
            return chunks, gone_after_s, refused

    # every call inside has its own deadline; the whole body gets more than run()'s 60 s default because on a
    # loaded 2-core box a 40-token greedy stream plus the router's watch catching up once took longer (CI)
    chunks, gone_after_s, refused = run(body, timeout_s=150.0)
    assert gone_after_s < LEASE_TTL_S / 2  # deleted by the drain, not expired
    assert refused is grpc.StatusCode.UNAVAILABLE
    assert token_indices(chunks) == list(range(max_tokens))
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    assert proc.popen.wait(timeout=30) == 0
