"""Overload is backpressure, never failure.

- The engine: KV imported into a full pool waits in the queue for its blocks and then continues exactly as it
  would have unloaded (tiny random Llama, in process).
- The soak: a real cluster (etcd, router in disagg mode, a prefill and a decode worker with a small KV pool,
  the frontend with its default KV budget) driven at about 4x what its decode pool holds, for a bounded time.
  Every request either completes whole or is refused with 429/503 before its first token (a streamed answer
  sends its headers with the first token, so a non-200 status is by construction before it); no stream ends in
  an error; no worker leaves discovery; `/health` answers 200 throughout. Then, with the decode worker gone,
  `/health` answers 503 and a request is refused before any token.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from services.discovery import WorkerDirectory
from services.engine.engine import EngineConfig, LLMEngine
from services.engine.sampling import SamplingParams
from tests.conftest import tiny_llama
from tests.support.cluster import LocalCluster, Proc, local_cluster, run, start_process, wait_frontend_ready

# ---- the engine ------------------------------------------------------------------------------------------------


def _engine(num_kv_blocks: int) -> LLMEngine:
    config = EngineConfig(
        dtype="float32", num_kv_blocks=num_kv_blocks, block_size=4, max_num_batched_tokens=64
    )
    return LLMEngine(tiny_llama(), config)


def test_imported_kv_waits_for_blocks_in_a_full_pool_and_gives_the_unloaded_tokens() -> None:
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True)
    prompts = [[(7 * i + j) % 256 for j in range(9 + 3 * i)] for i in range(6)]
    unloaded = [_engine(256).generate([p], params)[0] for p in prompts]

    prefill = _engine(256)
    first_only = SamplingParams(**{**params.__dict__, "max_tokens": 1})
    exports, firsts = [], []
    for i, p in enumerate(prompts):
        prefill.add_request(f"r{i}", p, first_only, hold_kv=True)
        [first] = prefill.step()
        firsts.append(first.new_token_ids)
        exports.append(prefill.export_kv(f"r{i}"))

    decode = _engine(16)  # 64 tokens: two or three of these at a time, the rest wait for blocks
    assert sum(e.num_blocks for e in exports) > decode.blocks.num_blocks
    for i, p in enumerate(prompts):  # the whole burst at once: nothing is refused
        decode.add_request(f"r{i}", p, params, output_ids=firsts[i], kv=exports[i])
    out = {f"r{i}": list(firsts[i]) for i in range(len(prompts))}
    max_waiting = 0
    while decode.has_unfinished():
        for o in decode.step():
            out[o.request_id] += o.new_token_ids
        max_waiting = max(max_waiting, decode.stats().waiting)
    assert max_waiting > 0  # some of the burst queued for blocks
    assert [out[f"r{i}"] for i in range(len(prompts))] == unloaded
    assert decode.stats().free_blocks == decode.stats().total_blocks  # nothing leaked


def test_aborting_a_request_that_waits_for_blocks_drops_its_pending_kv() -> None:
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prefill = _engine(64)
    exports, firsts = [], []
    for i in range(2):
        prefill.add_request(f"r{i}", [i + 1] * 30, SamplingParams(max_tokens=1, temperature=0), hold_kv=True)
        [first] = prefill.step()
        firsts.append(first.new_token_ids)
        exports.append(prefill.export_kv(f"r{i}"))
    decode = _engine(12)
    for i in range(2):
        decode.add_request(f"r{i}", [i + 1] * 30, params, output_ids=firsts[i], kv=exports[i])
    decode.step()
    assert decode.stats().waiting == 1 and decode.stats().running == 1
    decode.abort("r1")
    assert decode.stats().waiting == 0 and not decode._pending_kv
    while decode.has_unfinished():
        decode.step()
    assert decode.stats().free_blocks == decode.stats().total_blocks


# ---- the soak ----------------------------------------------------------------------------------------------------

# float32 blocks of SmolLM2 are 720 KiB: 12 MiB is 17 blocks, 272 tokens, room for about 3 of these requests at
# once; 12 clients in a closed loop are about 4x that, and the frontend's budget (2x the pool) sheds the rest.
DECODE_KV_BYTES = 12 << 20
CLIENTS = 12
SOAK_S = float(os.environ.get("RACKSERVE_SOAK_S", "15"))
MAX_TOKENS = 8
REQUEST_TIMEOUT_S = 60.0
SOAK_FLAGS = ["--dtype", "float32", "--threads", "1"]


@pytest.fixture(scope="module")
def soak_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    log_dir = str(tmp_path_factory.mktemp("overload"))

    def start(etcd_url: str) -> list[Proc]:
        return [
            start_process(
                "services.prefill.server",
                "prefill-0",
                etcd_url,
                log_dir,
                *SOAK_FLAGS,
                "--kv-cache-bytes",
                str(24 << 20),
            ),  # fmt: skip
            start_process(
                "services.decode.server",
                "decode-0",
                etcd_url,
                log_dir,
                *SOAK_FLAGS,
                "--kv-cache-bytes",
                str(DECODE_KV_BYTES),
            ),  # fmt: skip
            start_process("services.router.server", "router-0", etcd_url, log_dir, "--mode", "disagg"),
            start_process(
                "services.frontend.server",
                "frontend-0",
                etcd_url,
                log_dir,
                "--request-timeout-s",
                str(REQUEST_TIMEOUT_S),
            ),  # fmt: skip
        ]

    expect = {"decode": 1, "prefill": 1, "router": 1, "frontend": 1}
    with local_cluster(log_dir, start, expect, startup_timeout_s=240) as c:
        wait_frontend_ready(f"http://{c.endpoints['frontend-0']}", ("router", "prefill", "decode"), 120)
        yield c


@dataclass
class Result:
    status: int
    tokens: int = 0
    finish_reason: str | None = None
    stream_error: dict[str, object] | None = None
    refusal: dict[str, object] | None = None
    retry_after: str | None = None


async def _one(client: httpx.AsyncClient, base: str, n: int) -> Result:
    # prompts of about 30..160 tokens (the disagg path: every one prefilled remotely and its KV imported)
    words = " ".join(f"w{(n * 7 + k) % 97}" for k in range(10 + (n * 37) % 50))
    body = {"model": "SmolLM2-135M-Instruct", "prompt": words, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, "logprobs": 0}  # fmt: skip
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        if r.status_code != 200:
            return Result(r.status_code, refusal=json.loads(await r.aread())["error"],
                          retry_after=r.headers.get("retry-after"))  # fmt: skip
        out = Result(200)
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                out.stream_error = event["error"]
                continue
            choice = event["choices"][0]
            out.tokens += len((choice.get("logprobs") or {}).get("tokens") or [])
            out.finish_reason = choice.get("finish_reason") or out.finish_reason
        return out


def test_soak_at_4x_capacity_every_request_completes_whole_or_is_refused_before_its_first_token(
    soak_cluster: LocalCluster,
) -> None:
    base = f"http://{soak_cluster.endpoints['frontend-0']}"
    health = httpx.get(f"{base}/health").json()
    capacity = health["kv_tokens"]["capacity"]
    assert 0 < capacity <= 400, health  # the small decode pool this soak overfills

    async def soak() -> tuple[list[Result], list[str], list[int]]:
        directory = WorkerDirectory(soak_cluster.etcd.url, roles=("prefill", "decode", "router", "frontend"))
        await directory.start()
        left: list[str] = []
        directory.subscribe(lambda kind, info: left.append(info.worker_id) if kind == "removed" else None)
        results: list[Result] = []
        health_codes: list[int] = []
        stop_at = time.monotonic() + SOAK_S
        counter = iter(range(1 << 30))

        async def client_loop(client: httpx.AsyncClient) -> None:
            while time.monotonic() < stop_at:
                r = await _one(client, base, next(counter))
                results.append(r)
                if r.status != 200:
                    await asyncio.sleep(0.2)  # a refused client backs off a little, as Retry-After asks

        async def watch_health(client: httpx.AsyncClient) -> None:
            while time.monotonic() < stop_at:
                health_codes.append((await client.get(f"{base}/health")).status_code)
                await asyncio.sleep(0.5)

        try:
            async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S + 10) as client:
                await asyncio.gather(watch_health(client), *(client_loop(client) for _ in range(CLIENTS)))
        finally:
            await directory.close()
        return results, left, health_codes

    results, left, health_codes = run(soak, SOAK_S + REQUEST_TIMEOUT_S + 30)
    completed = [r for r in results if r.status == 200]
    refused = [r for r in results if r.status != 200]
    summary = Counter((r.status, (r.refusal or {}).get("code")) for r in results)
    for r in completed:  # whole: every token, a finish reason, no error mid-stream
        assert r.stream_error is None, f"a stream failed after its first token: {r.stream_error} ({summary})"
        assert r.finish_reason in ("length", "stop") and 1 <= r.tokens <= MAX_TOKENS, r
    for r in refused:
        assert r.status in (429, 503), (r, summary)
        assert r.refusal is not None and r.refusal["code"] == "overloaded" and r.retry_after, r
    assert completed and refused, summary  # it was overloaded, and it still served
    assert left == [], f"workers left discovery under load: {left}"
    assert set(health_codes) == {200}, health_codes


def test_health_is_503_while_no_decode_worker_is_routable_and_requests_are_refused_before_any_token(
    soak_cluster: LocalCluster,
) -> None:
    base = f"http://{soak_cluster.endpoints['frontend-0']}"
    decode = soak_cluster.procs["decode-0"].popen
    decode.send_signal(signal.SIGTERM)
    assert decode.wait(30) == 0
    deadline = time.monotonic() + 10
    while (r := httpx.get(f"{base}/health")).status_code == 200:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.1)
    assert r.status_code == 503
    body = r.json()
    assert body["status"] == "unavailable" and body["workers"]["decode"] == 0 and body["reason"]
    reply = httpx.post(f"{base}/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": "Hi",
                                                       "max_tokens": 4, "stream": True}, timeout=30)  # fmt: skip
    assert reply.status_code == 503 and reply.headers.get("retry-after")
    assert set(reply.json()["error"]) == {"message", "type", "param", "code"}
