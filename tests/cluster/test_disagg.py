"""Disaggregated prefill → decode with real KV transfer, real processes and a real etcd.

One module-scoped cluster: a prefill worker offering every backend, three decode workers each forced onto one
backend by `--kv-backend-preference` (tcp, shm, nixl), and a router in `--mode disagg`. Everything runs
SmolLM2-135M in float32 with one torch thread per process. The two tests after it kill processes (a decode
worker, then the prefill worker), so they run in file order; the last test starts its own bf16 pair.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.discovery import WorkerDirectory
from services.engine.model_files import smollm2_gguf_path
from services.engine.tokenizer import Tokenizer
from services.frontend.coordinator import Coordinator
from services.frontend.request_state import Phase
from services.kvtransfer import KvSink, TransferConfig, TransferNotFound, TransferTicket
from services.rpc import pb, pb_grpc
from services.runtime.channels import ChannelPool
from tests.support.cluster import (
    RPC_TIMEOUT_S,
    WORKER_FLAGS,
    LocalCluster,
    Proc,
    greedy,
    local_cluster,
    run,
    start_process,
    token_ids,
    wait_for_load,
)

KV_TTL_S = 6.0
PULL_TIMEOUT_S = 3.0
BACKENDS = ("tcp", "shm", "nixl")
QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why each is prime.",
)
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    log_dir = str(tmp_path_factory.mktemp("disagg"))

    def start(etcd_url: str) -> list[Proc]:
        decode_flags = [*WORKER_FLAGS, "--kv-pull-timeout-s", str(PULL_TIMEOUT_S)]
        prefill_flags = [*WORKER_FLAGS, "--kv-ttl-s", str(KV_TTL_S)]
        return [
            start_process("services.prefill.server", "prefill-a", etcd_url, log_dir, *prefill_flags),
            *(
                start_process(
                    "services.decode.server",
                    f"decode-{b}",
                    etcd_url,
                    log_dir,
                    *decode_flags,
                    "--kv-backend-preference",
                    b,
                )  # fmt: skip
                for b in BACKENDS
            ),
            start_process("services.router.server", "router-a", etcd_url, log_dir, "--mode", "disagg"),
        ]

    with local_cluster(log_dir, start, {"decode": 3, "prefill": 1, "router": 1}) as c:
        yield c


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tok = Tokenizer.from_gguf(smollm2_gguf_path())
    return [list(tok.encode_chat([{"role": "user", "content": q}])) for q in QUESTIONS]


@pytest.fixture(scope="module")
def agg_outputs(cluster: LocalCluster, prompts: list[list[int]]) -> list[list[int]]:
    """The aggregated reference: each prompt prefilled and decoded on one decode worker."""

    async def body() -> list[list[int]]:
        async with grpc.aio.insecure_channel(cluster.endpoints["decode-tcp"]) as channel:
            stub = pb_grpc.DecodeWorkerStub(channel)
            outs = []
            for i, prompt in enumerate(prompts):
                request = pb.DecodeRequest(
                    request_id=f"agg-{i}", prompt_token_ids=prompt, params=greedy(MAX_TOKENS)
                )
                outs.append(token_ids([c async for c in stub.Decode(request, timeout=RPC_TIMEOUT_S)]))
            return outs

    return run(body)


async def prefill(endpoint: str, request_id: str, prompt: list[int]) -> pb.PrefillResponse:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        request = pb.PrefillRequest(request_id=request_id, token_ids=prompt, params=greedy(MAX_TOKENS))
        return await pb_grpc.PrefillWorkerStub(channel).Prefill(request, timeout=RPC_TIMEOUT_S)


async def decode_with_kv(
    endpoint: str, request_id: str, prompt: list[int], response: pb.PrefillResponse, timeout_s: float = 30.0
) -> list[pb.DecodeChunk]:
    request = pb.DecodeRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        emitted_token_ids=[response.first_token.token_id],
        params=greedy(MAX_TOKENS),
        kv=response.kv,
    )
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = pb_grpc.DecodeWorkerStub(channel)
        return [c async for c in stub.Decode(request, timeout=timeout_s)]


async def release(endpoint: str, request_id: str) -> None:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        await pb_grpc.PrefillWorkerStub(channel).Release(
            pb.ReleaseRequest(request_id=request_id), timeout=5.0
        )


@contextlib.contextmanager
def pair_cluster(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    flags: list[str],
    backend: str,
    prefill_extra: list[str] | None = None,
) -> Iterator[LocalCluster]:
    """A cluster of its own: prefill-NAME and decode-NAME (pulling over `backend`) with `flags`, no router."""
    log_dir = str(tmp_path_factory.mktemp(f"disagg-{name}"))

    def start(etcd_url: str) -> list[Proc]:
        return [
            start_process(
                "services.prefill.server",
                f"prefill-{name}",
                etcd_url,
                log_dir,
                *flags,
                *(prefill_extra or []),
            ),
            start_process(
                "services.decode.server",
                f"decode-{name}",
                etcd_url,
                log_dir,
                *flags,
                "--kv-backend-preference",
                backend,
            ),  # fmt: skip
        ]

    with local_cluster(log_dir, start, {"decode": 1, "prefill": 1}) as c:
        yield c


# ------------------------------------------------------------------------------------------ same tokens


@pytest.mark.parametrize("backend", BACKENDS)
def test_disagg_greedy_output_is_token_for_token_the_aggregated_output(
    cluster: LocalCluster, prompts: list[list[int]], agg_outputs: list[list[int]], backend: str
) -> None:
    async def body() -> list[tuple[list[int], pb.DecodeChunk]]:
        results = []
        for i, prompt in enumerate(prompts):
            rid = f"disagg-{backend}-{i}"
            response = await prefill(cluster.endpoints["prefill-a"], rid, prompt)
            assert response.kv.num_tokens == len(prompt)
            assert set(response.kv.transfer_backend.split(",")) == set(BACKENDS)
            chunks = await decode_with_kv(cluster.endpoints[f"decode-{backend}"], rid, prompt, response)
            results.append(([response.first_token.token_id, *token_ids(chunks)], chunks[0]))
        return results

    results = run(body)
    for (tokens, first_chunk), expected in zip(results, agg_outputs, strict=True):
        assert tokens == expected
        assert first_chunk.transfer_backend == backend and first_chunk.transfer_bytes > 0
        assert first_chunk.tokens[0].index == 1  # continues after the prefill's token


def test_the_decode_side_ack_frees_the_prefill_blocks_before_the_ttl(
    cluster: LocalCluster, prompts: list[list[int]]
) -> None:
    endpoint = cluster.endpoints["prefill-a"]

    async def body() -> tuple[pb.LoadSnapshot, pb.LoadSnapshot, float]:
        response = await prefill(endpoint, "ack-0", prompts[2])
        held = await wait_for_load(
            endpoint, pb_grpc.PrefillWorkerStub, lambda s: s.free_blocks < s.total_blocks
        )
        await decode_with_kv(cluster.endpoints["decode-shm"], "ack-0", prompts[2], response)
        t0 = time.monotonic()
        freed = await wait_for_load(
            endpoint, pb_grpc.PrefillWorkerStub, lambda s: s.free_blocks == s.total_blocks, KV_TTL_S
        )
        return held, freed, time.monotonic() - t0

    held, freed, waited_s = run(body)
    assert held.free_blocks < held.total_blocks and freed.free_blocks == freed.total_blocks
    assert waited_s < KV_TTL_S / 2  # the Release, not the TTL, freed them


def test_the_decode_worker_lets_go_of_the_pulled_kv_once_written_while_its_stream_goes_on(
    cluster: LocalCluster, prompts: list[list[int]]
) -> None:
    """The pulled KV is the prompt's KV a second time, outside the decode worker's cache (on a GPU, device memory
    within --kv-device-pull-bytes): once the engine has written it into its blocks nothing may keep it for the
    stream's life, minutes of decoding. The worker's /metrics says what pulled KV it still holds."""
    rid = "resident-0"

    async def body() -> tuple[pb.DecodeChunk, dict[str, float], pb.DecodeChunk]:
        response = await prefill(cluster.endpoints["prefill-a"], rid, prompts[2])
        request = pb.DecodeRequest(
            request_id=rid,
            prompt_token_ids=prompts[2],
            emitted_token_ids=[response.first_token.token_id],
            params=greedy(400, ignore_eos=True),
            kv=response.kv,
        )
        async with grpc.aio.insecure_channel(cluster.endpoints["decode-tcp"]) as channel:
            call = pb_grpc.DecodeWorkerStub(channel).Decode(request, timeout=120)
            first = await call.read()
            while not first.tokens:  # heartbeats while it waits for blocks
                first = await call.read()
            held = await asyncio.to_thread(pulled_resident, cluster.infos["decode-tcp"].metrics_endpoint)
            later = await call.read()
            call.cancel()
        return first, held, later

    first, held, later = run(body)
    assert first.transfer_backend == "tcp" and first.transfer_bytes > 0
    assert held == {"host": 0.0, "device": 0.0}
    assert later.tokens and not later.finished  # it was measured mid-stream


def pulled_resident(metrics_endpoint: str) -> dict[str, float]:
    text = httpx.get(f"http://{metrics_endpoint}/metrics", timeout=10).text
    return {
        s.labels["memory"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "rackserve_kv_pulled_resident_bytes"
    }


def test_coordinator_through_a_disagg_router_streams_the_same_tokens_and_records_each_phase(
    cluster: LocalCluster, prompts: list[list[int]], agg_outputs: list[list[int]]
) -> None:
    async def body() -> list[tuple[list[int], object]]:
        directory = WorkerDirectory(cluster.etcd.url, roles=("router", "prefill", "decode"))
        await directory.start()
        channels = ChannelPool()
        coordinator = Coordinator(directory, channels)
        out = []
        try:
            await directory.wait_for("router", 1, 10.0)
            for i, prompt in enumerate(prompts):
                state = coordinator.new_request(f"coord-{i}", prompt, greedy(MAX_TOKENS), timeout_s=60.0)
                first_batch_phase = None
                async for batch in coordinator.generate(state):
                    first_batch_phase = first_batch_phase or state.phase
                    assert batch.tokens
                out.append(([t.token_id for t in state.emitted], (first_batch_phase, state)))
        finally:
            await coordinator.close()
            await channels.close()
            await directory.close()
        return out

    for (tokens, (first_phase, state)), expected in zip(run(body), agg_outputs, strict=True):
        assert tokens == expected
        assert first_phase is Phase.PREFILLING  # the first token reached the client before any KV moved
        phases = [p for p, _ in state.timeline]  # type: ignore[attr-defined]
        assert phases == [
            Phase.QUEUED, Phase.ROUTED, Phase.PREFILLING, Phase.TRANSFERRING, Phase.DECODING, Phase.DONE
        ]  # fmt: skip
        assert state.transfer_backend in BACKENDS and state.transfer_bytes > 0  # type: ignore[attr-defined]
        assert state.ttft_s < state.timeline[-1][1] - state.timeline[0][1]  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model_fingerprint", "sha256:another-model"),
        ("dtype", pb.KV_DTYPE_BF16),
        ("block_size", 32),
        ("layout", "token,layer,kv,kv_head,head_dim"),
        ("num_kv_heads", 1),
    ],
)
def test_a_kv_handle_for_another_model_dtype_or_layout_is_refused_naming_the_field(
    cluster: LocalCluster, prompts: list[list[int]], field: str, value: object
) -> None:
    rid = f"mismatch-{field}"

    async def body() -> grpc.aio.AioRpcError:
        response = await prefill(cluster.endpoints["prefill-a"], rid, prompts[0])
        setattr(response.kv, field, value)
        try:
            await decode_with_kv(cluster.endpoints["decode-tcp"], rid, prompts[0], response)
        except grpc.aio.AioRpcError as e:
            return e
        finally:
            await release(cluster.endpoints["prefill-a"], rid)
        raise AssertionError("a mismatched KvHandle was accepted")

    err = run(body)
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"KvHandle.{field} mismatch" in (err.details() or "")


# ------------------------------------------------------------------------------------------ failures (last)


def test_killed_decode_worker_leaves_no_pinned_blocks_or_publication_after_the_ttl(
    cluster: LocalCluster, prompts: list[list[int]]
) -> None:
    endpoint = cluster.endpoints["prefill-a"]

    async def body() -> tuple[pb.LoadSnapshot, pb.LoadSnapshot, BaseException | None]:
        response = await prefill(endpoint, "orphan-0", prompts[1])
        held = await wait_for_load(
            endpoint, pb_grpc.PrefillWorkerStub, lambda s: s.free_blocks < s.total_blocks
        )
        doomed = cluster.procs["decode-nixl"].popen  # the decode worker this KV was meant for dies unacked
        doomed.send_signal(signal.SIGKILL)
        doomed.wait()
        freed = await wait_for_load(
            endpoint, pb_grpc.PrefillWorkerStub, lambda s: s.free_blocks == s.total_blocks, KV_TTL_S + 5
        )
        sink = await KvSink.start(TransferConfig(backends=("tcp",)))
        try:
            ticket = TransferTicket.from_json(response.kv.transfer_endpoint)
            await sink.pull(ticket, 5.0, backend="tcp")
        except TransferNotFound as e:
            return held, freed, e
        finally:
            await sink.close()
        return held, freed, None

    held, freed, pull_error = run(body, KV_TTL_S + 30)
    assert held.free_blocks < held.total_blocks
    assert freed.free_blocks == freed.total_blocks
    assert isinstance(pull_error, TransferNotFound)  # the publication went with the blocks


def test_a_stalled_then_killed_prefill_worker_fails_the_decode_within_the_pull_deadline(
    cluster: LocalCluster, prompts: list[list[int]]
) -> None:
    producer = cluster.procs["prefill-a"].popen
    decode_endpoint = cluster.endpoints["decode-tcp"]

    async def attempt(rid: str, prompt: list[int], response: pb.PrefillResponse) -> tuple[object, float]:
        t0 = time.monotonic()
        try:
            await decode_with_kv(decode_endpoint, rid, prompt, response, timeout_s=PULL_TIMEOUT_S + 20)
        except grpc.aio.AioRpcError as e:
            return e, time.monotonic() - t0
        return None, time.monotonic() - t0

    async def body() -> list[tuple[object, float]]:
        stalled = await prefill(cluster.endpoints["prefill-a"], "stall-0", prompts[0])
        killed = await prefill(cluster.endpoints["prefill-a"], "kill-0", prompts[1])
        producer.send_signal(signal.SIGSTOP)  # alive, holding its sockets, answering nothing
        try:
            first = await attempt("stall-0", prompts[0], stalled)
        finally:
            producer.send_signal(signal.SIGKILL)
            producer.send_signal(signal.SIGCONT)
            producer.wait()
        second = await attempt("kill-0", prompts[1], killed)
        return [first, second]

    (stall_err, stall_s), (kill_err, kill_s) = run(body)
    for err in (stall_err, kill_err):
        assert isinstance(err, grpc.aio.AioRpcError) and err.code() is grpc.StatusCode.UNAVAILABLE
    assert "TransferTimeout" in (stall_err.details() or "")  # type: ignore[union-attr]
    assert "TransferPeerGone" in (kill_err.details() or "")  # type: ignore[union-attr]
    # no hang: each ends within the decode worker's pull deadline (plus process slack on 2 shared cores)
    assert stall_s < PULL_TIMEOUT_S + 5 and kill_s < PULL_TIMEOUT_S + 5


def test_bf16_workers_on_the_fused_cpu_kernels_decode_the_same_tokens_agg_and_disagg_over_nixl(
    tmp_path_factory: pytest.TempPathFactory, prompts: list[list[int]]
) -> None:
    """The default serving dtype: bf16 workers, whose model runs on the fused CPU kernels, hand KV over NIXL and
    the decode side continues exactly as if it had prefilled the prompt itself."""
    flags = ["--dtype", "bfloat16", "--kv-cache-bytes", str(24 << 20), "--threads", "1"]
    with pair_cluster(tmp_path_factory, "bf16", flags, "nixl") as c:
        decode_ep, prefill_ep = c.endpoints["decode-bf16"], c.endpoints["prefill-bf16"]

        async def body() -> tuple[list[list[int]], list[list[int]]]:
            agg, disagg = [], []
            async with grpc.aio.insecure_channel(decode_ep) as channel:
                stub = pb_grpc.DecodeWorkerStub(channel)
                for i, prompt in enumerate(prompts[:2]):
                    request = pb.DecodeRequest(
                        request_id=f"bf16-agg-{i}", prompt_token_ids=prompt, params=greedy(MAX_TOKENS)
                    )
                    agg.append(token_ids([c async for c in stub.Decode(request, timeout=RPC_TIMEOUT_S)]))
            for i, prompt in enumerate(prompts[:2]):
                response = await prefill(prefill_ep, f"bf16-disagg-{i}", prompt)
                chunks = await decode_with_kv(decode_ep, f"bf16-disagg-{i}", prompt, response)
                assert chunks[0].transfer_backend == "nixl"
                disagg.append([response.first_token.token_id, *token_ids(chunks)])
            return agg, disagg

        agg, disagg = run(body)
        logs = {p.worker_id: open(p.log_path).read() for p in c.procs.values()}
    assert all(len(tokens) > 4 for tokens in agg)  # real answers (they may end at EOS before MAX_TOKENS)
    assert disagg == agg
    assert all("fused CPU kernels loaded" in text for text in logs.values())


def test_fp8_wire_compression_ships_a_quarter_of_the_kv_and_concurrent_requests_continue_as_aggregated(
    tmp_path_factory: pytest.TempPathFactory, prompts: list[list[int]]
) -> None:
    """`--kv-compress fp8` on the prefill worker: its KV source encodes each request's KV for the wire on its
    publishing thread and the decode worker decodes it on arrival, off both event loops. Three requests at once:
    each ticket says fp8 and carries ~27 % of the float32 KV's bytes, and each decode runs to a whole answer from
    the dequantized KV (which tokens it picks may differ from the aggregated run's after the first: fp8 KV rounds;
    the codec's error is bounded in tests/kvtransfer)."""
    with pair_cluster(tmp_path_factory, "fp8", WORKER_FLAGS, "tcp", ["--kv-compress", "fp8"]) as c:
        decode_ep, prefill_ep = c.endpoints["decode-fp8"], c.endpoints["prefill-fp8"]

        async def agg_run(i: int, prompt: list[int]) -> list[int]:
            async with grpc.aio.insecure_channel(decode_ep) as channel:
                request = pb.DecodeRequest(
                    request_id=f"fp8-agg-{i}", prompt_token_ids=prompt, params=greedy(MAX_TOKENS)
                )
                stub = pb_grpc.DecodeWorkerStub(channel)
                return token_ids([c async for c in stub.Decode(request, timeout=RPC_TIMEOUT_S)])

        async def disagg_run(i: int, prompt: list[int]) -> tuple[TransferTicket, list[int], str]:
            response = await prefill(prefill_ep, f"fp8-disagg-{i}", prompt)
            chunks = await decode_with_kv(decode_ep, f"fp8-disagg-{i}", prompt, response)
            assert chunks[0].transfer_backend == "tcp"
            ticket = TransferTicket.from_json(response.kv.transfer_endpoint)
            return ticket, [response.first_token.token_id, *token_ids(chunks)], chunks[-1].finish_reason

        async def body() -> tuple[list[list[int]], list[tuple[TransferTicket, list[int], str]]]:
            agg = [await agg_run(i, p) for i, p in enumerate(prompts)]
            disagg = await asyncio.gather(*(disagg_run(i, p) for i, p in enumerate(prompts)))
            return agg, list(disagg)

        agg, disagg = run(body)
    for prompt, reference, (ticket, tokens, finish) in zip(prompts, agg, disagg, strict=True):
        assert ticket.encoding == "fp8"
        assert (
            ticket.raw_size >= (len(prompt) - 1) * 30 * 2 * 3 * 64 * 4
        )  # SmolLM2's float32 KV of the prompt
        assert ticket.size < 0.28 * ticket.raw_size
        assert tokens[0] == reference[0]  # the prefill's own token
        # a whole answer from the dequantized KV: as long as the aggregated one (fp8's rounding may change which
        # tokens, not that the decode runs to the end)
        assert finish in ("stop", "length") and len(tokens) > 4
        assert finish == "stop" or len(tokens) == MAX_TOKENS
