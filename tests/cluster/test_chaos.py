"""Chaos: real faults under concurrent streaming load, through a real frontend process over HTTP/SSE.

One module-scoped cluster: a real etcd, a prefill worker, two decode workers, two routers (`--mode disagg`,
so every request is prefilled remotely and its KV transferred) and two frontends (A: the defaults, with a short
stall timeout and a loose KV budget, so a burst onto one tiny decode pool is that worker's queue to absorb rather
than the edge's to shed; B: `--migration-limit 0 --max-concurrent-requests 2`). The first test records the fault-free
output of a batch (greedy requests and seeded sampled ones); every fault then runs the same batch and checks
that each request's token stream is *identical* to it — no token duplicated, missing or changed — or, where the
fault leaves no way to finish, ends with the documented OpenAI-style error; that nothing runs past its
deadline; and, at the end, that the prefill worker holds no leaked KV blocks.

Faults are real: a SIGKILL of the real process, at an exact moment chosen by a test-only flag
(`--debug-die-after-tokens N` on a decode worker, `--debug-die-in prefill|transfer` on a prefill worker) or
by the test; SIGSTOP for a hung worker; etcd killed and restarted; a router killed. The core runs in
`make test`; `make chaos` (RACKSERVE_CHAOS_FULL=1) adds the slower faults. The summary table is printed at the
end (`pytest -s`) and written to $RACKSERVE_CHAOS_TABLE when set.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from services.rpc import pb_grpc
from tests.support.cluster import (
    WORKER_FLAGS,
    LocalCluster,
    Proc,
    local_cluster,
    run,
    start_process,
    wait_for_load,
)

FULL = os.environ.get("RACKSERVE_CHAOS_FULL", "") == "1"
MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 20
STALL_TIMEOUT_S = 10.0  # frontend A's --worker-stall-timeout-s: a SIGSTOPped worker is hung after this
REQUEST_TIMEOUT_S = 90.0  # the frontends' deadline; every request must end (either way) before it
KV_TTL_S = 20.0
QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three prime numbers.",
    "What colour is the sky?",
)
# (question index, temperature, seed): greedy ones, then seeded sampled ones
BATCH = [
    (0, 0.0, 7),
    (1, 0.0, 7),
    (2, 0.0, 7),
    (3, 0.0, 7),
    (0, 0.9, 1234),
    (1, 0.9, 99),
    (2, 0.8, 5),
    (3, 0.8, 6),
]
# the sampler's processors survive migration too: one penalised and one logit_bias request in the batch
# (logit_bias: no "." and a push towards " blue"; SmolLM2's ids 30 and 4461)
EXTRA: dict[tuple[int, float, int], dict[str, Any]] = {
    (2, 0.8, 5): {"frequency_penalty": 0.8, "presence_penalty": 0.5, "repetition_penalty": 1.2},
    (3, 0.8, 6): {"logit_bias": {"30": -100, "4461": 4}},
}


def _lines(proc: Proc) -> list[dict[str, Any]]:
    """The frontend's one JSON line per finished request."""
    out = []
    with open(proc.log_path, errors="replace") as f:
        for line in f:
            if (
                "request_finished" in line
            ):  # the rackserve.requests logger's line: prefix, then the JSON record
                out.append(json.loads(line[line.index("{") :]))
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    log_dir = str(tmp_path_factory.mktemp("chaos"))

    def start(etcd_url: str) -> list[Proc]:
        fe = ["--request-timeout-s", str(REQUEST_TIMEOUT_S), "--worker-stall-timeout-s", str(STALL_TIMEOUT_S),
              "--admission-kv-factor", "8"]  # fmt: skip
        return [
            start_process(
                "services.prefill.server",
                "prefill-a",
                etcd_url,
                log_dir,
                *WORKER_FLAGS,
                "--kv-ttl-s",
                str(KV_TTL_S),
            ),  # fmt: skip
            start_process("services.decode.server", "decode-a", etcd_url, log_dir, *WORKER_FLAGS),
            start_process("services.decode.server", "decode-b", etcd_url, log_dir, *WORKER_FLAGS),
            # round-robin placement: each fault's freshly added worker must get its share of the batch, where
            # the TTFT policy would rightly prefer the warm workers holding the prompts' prefixes
            *(
                start_process(
                    "services.router.server",
                    r,
                    etcd_url,
                    log_dir,
                    "--mode",
                    "disagg",
                    "--policy",
                    "round_robin",
                )
                for r in ("router-a", "router-b")
            ),
            start_process("services.frontend.server", "frontend-a", etcd_url, log_dir, *fe),
            start_process(
                "services.frontend.server",
                "frontend-b",
                etcd_url,
                log_dir,
                *fe,
                "--migration-limit",
                "0",
                "--max-concurrent-requests",
                "2",
            ),  # fmt: skip
        ]

    expect = {"decode": 2, "prefill": 1, "router": 2, "frontend": 2}
    # seven processes start at once: on a shared 2-core box loading three models can take minutes
    with local_cluster(log_dir, start, expect, startup_timeout_s=300) as c:
        c.log_dir = log_dir  # type: ignore[attr-defined]
        yield c


def url(cluster: LocalCluster, frontend: str) -> str:
    return f"http://{cluster.endpoints[frontend]}"


def add_worker(cluster: LocalCluster, module: str, worker_id: str, *flags: str) -> Proc:
    """Start one more real worker and wait until the routers can see it (it registered in etcd)."""
    role = module.split(".")[1]
    engine_flags = WORKER_FLAGS if role in ("prefill", "decode") else []
    log_dir = cluster.log_dir  # type: ignore[attr-defined]
    proc = start_process(module, worker_id, cluster.etcd.url, log_dir, *engine_flags, *flags)
    cluster.procs[worker_id] = proc

    async def registered() -> None:
        from services.discovery import WorkerDirectory

        d = WorkerDirectory(cluster.etcd.url, roles=(role,))
        await d.start()
        try:
            deadline = time.monotonic() + 300
            while not any(w.worker_id == worker_id for w in d.workers(role)):
                assert proc.popen.poll() is None, proc.log_tail()
                assert time.monotonic() < deadline, f"{worker_id} did not register"
                await asyncio.sleep(0.2)
        finally:
            await d.close()

    run(registered, 320)
    time.sleep(0.5)  # the routers' watches deliver the same event
    return proc


# ---- one request, one batch ----------------------------------------------------------------------------------


@dataclass
class Outcome:
    spec: tuple[int, float, int]
    request_id: str = ""
    status: int = 0
    tokens: list[str] = field(default_factory=list)  # each token's text, as the client's stream carried it
    text: str = ""
    finish_reason: str | None = None
    error: dict[str, Any] | None = None
    seconds: float = 0.0


async def stream_one(
    client: httpx.AsyncClient, base: str, spec: tuple[int, float, int], on_token: Callable[[int], None]
) -> Outcome:
    q, temperature, seed = spec
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": QUESTIONS[q]}],
        "max_tokens": MAX_TOKENS,
        "temperature": temperature,
        "seed": seed,
        "logprobs": True,
        "stream": True,
        **EXTRA.get(spec, {}),
    }
    out = Outcome(spec)
    t0 = time.monotonic()
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
        out.status, out.request_id = r.status_code, r.headers.get("x-request-id", "")
        if r.status_code != 200:
            out.error = json.loads(await r.aread())["error"]
        else:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    out.error = event["error"]
                    continue
                choice = event["choices"][0]
                out.text += choice["delta"].get("content") or ""
                for entry in (choice.get("logprobs") or {}).get("content") or []:
                    out.tokens.append(entry["token"])
                    on_token(len(out.tokens))
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
    out.seconds = time.monotonic() - t0
    return out


async def run_batch(
    base: str,
    during: Callable[[list[int]], Awaitable[None]] | None = None,
    specs: list[tuple[int, float, int]] = BATCH,
) -> list[Outcome]:
    """The batch, all at once; `during(progress)` runs alongside (progress[i]: tokens request i has seen)."""
    progress = [0] * len(specs)

    def tracker(i: int) -> Callable[[int], None]:
        def seen(n: int) -> None:
            progress[i] = n

        return seen

    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S + 30) as client:
        requests = [stream_one(client, base, s, tracker(i)) for i, s in enumerate(specs)]
        if during is None:
            return list(await asyncio.gather(*requests))
        results = await asyncio.gather(asyncio.gather(*requests), during(progress))
        return list(results[0])


async def until(predicate: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "the batch never got there"
        await asyncio.sleep(0.02)


# ---- the report ----------------------------------------------------------------------------------------------

ROWS: list[dict[str, Any]] = []
REFERENCE: dict[tuple[int, float, int], Outcome] = {}


def check_and_record(
    cluster: LocalCluster, fault: str, outcomes: list[Outcome], allowed_errors: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Every request completed identical to the fault-free run, or failed with an allowed, documented error;
    none ran past its deadline. Adds the fault's row to the table."""
    identical = failed = 0
    for o in outcomes:
        assert o.seconds < REQUEST_TIMEOUT_S + 5, f"{fault}: a request hung for {o.seconds:.0f}s"
        if o.error is not None:
            assert o.error.get("code") in allowed_errors, f"{fault}: unexpected error {o.error}"
            assert set(o.error) == {"message", "type", "param", "code"} and o.error["message"]
            failed += 1
            continue
        ref = REFERENCE[o.spec]
        assert o.tokens == ref.tokens, f"{fault}: {o.spec} stream differs\n{o.tokens}\n{ref.tokens}"
        assert o.text == ref.text and o.finish_reason == ref.finish_reason
        identical += 1
    ids = {o.request_id for o in outcomes}
    lines = [
        line
        for p in cluster.procs.values()
        if p.worker_id.startswith("frontend")
        for line in _lines(p)
        if line["request_id"] in ids
    ]
    moves = [m for line in lines for m in line["migration_log"]]
    recoveries = [m["recovery_s"] for m in moves if m["recovery_s"] is not None and m["outcome"] == "resumed"]
    row = {
        "fault": fault,
        "requests": len(outcomes),
        "identical": identical,
        "failed_clearly": failed,
        "re_transfer": sum(m["path"] == "re-transfer" for m in moves),
        "rebuild": sum(m["path"] == "rebuild" for m in moves),
        "p50_recovery_s": round(statistics.median(recoveries), 3) if recoveries else None,
        "causes": sorted({m["cause"] for m in moves}),
    }
    ROWS.append(row)
    return row


def table() -> str:
    head = "| fault | requests | completed identical | failed clearly | migrations (re-transfer / rebuild) " \
           "| p50 recovery s | causes |"  # fmt: skip
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in ROWS:
        p50 = "—" if r["p50_recovery_s"] is None else f"{r['p50_recovery_s']:.3f}"
        lines.append(
            f"| {r['fault']} | {r['requests']} | {r['identical']} | {r['failed_clearly']} | "
            f"{r['re_transfer']} / {r['rebuild']} | {p50} | {', '.join(r['causes']) or '—'} |"
        )
    return "\n".join(lines)


@pytest.fixture(scope="module", autouse=True)
def report() -> Iterator[None]:
    yield
    if ROWS:
        text = table()
        print("\n" + text)
        if path := os.environ.get("RACKSERVE_CHAOS_TABLE"):
            with open(path, "w") as f:
                f.write(text + "\n")


# ---- the faults (file order: each leaves the cluster able to serve the next) ----------------------------------


def test_fault_free_batch_is_the_reference(cluster: LocalCluster) -> None:
    outcomes = run(lambda: run_batch(url(cluster, "frontend-a")), 120)
    for o in outcomes:
        assert o.error is None and o.status == 200, o.error
        assert o.tokens and len(o.tokens) <= MAX_TOKENS and o.finish_reason in ("stop", "length")
        REFERENCE[o.spec] = o
    # seeded sampling is reproducible, and differs from greedy
    again = run(lambda: run_batch(url(cluster, "frontend-a"), specs=BATCH[-2:]), 120)
    assert [o.tokens for o in again] == [REFERENCE[s].tokens for s in BATCH[-2:]]
    check_and_record(cluster, "none", outcomes)


def test_decode_worker_killed_after_exactly_3_tokens_resumes_without_duplicates(
    cluster: LocalCluster,
) -> None:
    add_worker(cluster, "services.decode.server", "decode-die3", "--debug-die-after-tokens", "3")
    outcomes = run(lambda: run_batch(url(cluster, "frontend-a")), 150)
    assert cluster.procs["decode-die3"].popen.wait(30) == -signal.SIGKILL
    row = check_and_record(cluster, "decode SIGKILL after exactly 3 tokens", outcomes)
    assert row["identical"] == len(BATCH)
    assert row["re_transfer"] >= 1 and "decode_failed" in row["causes"]  # the prefill copy was still held
    killed_at = [m["at_token"] for p in ("frontend-a",) for line in _lines(cluster.procs[p])
                 for m in line["migration_log"] if m["from"] == "decode-die3"]  # fmt: skip
    assert 3 in killed_at  # the client had exactly tokens 0..2 when the worker died


def test_prefill_worker_killed_during_prefill_reruns_it_elsewhere(cluster: LocalCluster) -> None:
    add_worker(cluster, "services.prefill.server", "prefill-die", "--debug-die-in", "prefill")
    outcomes = run(lambda: run_batch(url(cluster, "frontend-a")), 150)
    assert cluster.procs["prefill-die"].popen.wait(30) == -signal.SIGKILL
    row = check_and_record(cluster, "prefill SIGKILL during prefill", outcomes)
    assert row["identical"] == len(BATCH) and "prefill_failed" in row["causes"]


def test_prefill_worker_killed_during_transfer_rebuilds_the_kv(cluster: LocalCluster) -> None:
    add_worker(cluster, "services.prefill.server", "prefill-die-t", "--debug-die-in", "transfer")
    outcomes = run(lambda: run_batch(url(cluster, "frontend-a")), 150)
    assert cluster.procs["prefill-die-t"].popen.wait(30) == -signal.SIGKILL
    row = check_and_record(cluster, "prefill SIGKILL during KV transfer", outcomes)
    assert row["identical"] == len(BATCH) and "transfer_failed" in row["causes"]
    assert row["rebuild"] >= 1


def test_past_the_migration_limit_the_stream_ends_with_migration_limit_exceeded(
    cluster: LocalCluster,
) -> None:
    """Frontend B allows no migration: a request on a worker that dies fails with the documented error."""
    add_worker(cluster, "services.decode.server", "decode-die2", "--debug-die-after-tokens", "2")
    base = url(cluster, "frontend-b")
    outcomes: list[Outcome] = []
    for _ in range(8):  # routers round-robin over three decode workers: the doomed one comes up soon
        outcomes += run(lambda: run_batch(base, specs=[BATCH[0]]), 120)
        if outcomes[-1].error is not None:
            break
    row = check_and_record(
        cluster, "decode SIGKILL, --migration-limit 0", outcomes, ("migration_limit_exceeded",)
    )
    assert row["failed_clearly"] == 1
    failed = outcomes[-1]
    assert failed.status == 200 and failed.tokens == REFERENCE[BATCH[0]].tokens[:2]  # what it had, once each
    assert "--migration-limit 0" in failed.error["message"]  # type: ignore[index]
    assert "decode_failed" in failed.error["message"]  # type: ignore[index]


def test_overload_is_429_with_retry_after_and_every_admitted_request_completes(cluster: LocalCluster) -> None:
    outcomes = run(lambda: run_batch(url(cluster, "frontend-b"), specs=BATCH[:5]), 150)
    rejected = [o for o in outcomes if o.status == 429]
    admitted = [o for o in outcomes if o.status != 429]
    assert rejected and len(admitted) >= 2
    for o in rejected:
        assert (
            o.error is not None and o.error["code"] == "overloaded" and o.error["type"] == "rate_limit_error"
        )
    for o in admitted:
        assert o.error is None and o.tokens == REFERENCE[o.spec].tokens


TINY_POOL_BLOCKS = 8  # 128 tokens: two of the batch's requests (~37 prompt + 20 output tokens) at a time
FP32_BLOCK_BYTES = (
    30 * 2 * 3 * 64 * 16 * 4
)  # SmolLM2's layers x (K, V) x kv heads x head dim x block x float32


def test_a_burst_that_overfills_a_tiny_decode_kv_pool_waits_for_blocks_and_completes_identically(
    cluster: LocalCluster,
) -> None:
    """Alone in the cluster, a decode worker whose pool holds two requests gets the whole batch at once: the rest
    wait in its queue for blocks (seen in its load reports and in the requests' decode_queue_s), none fails or
    migrates, and every stream is the unloaded one."""
    tiny = add_worker(cluster, "services.decode.server", "decode-tiny",
                      "--kv-cache-bytes", str(TINY_POOL_BLOCKS * FP32_BLOCK_BYTES))  # fmt: skip
    others = [cluster.procs[w].popen for w in ("decode-a", "decode-b")]
    base = url(cluster, "frontend-a")

    def decodes_seen() -> int:
        return int(httpx.get(f"{base}/health").json()["workers"]["decode"])

    async def watch_queue(progress: list[int]) -> None:
        # requests running and others queued behind them for blocks, in the worker's own load report
        await wait_for_load(
            tiny_endpoint, pb_grpc.DecodeWorkerStub, lambda s: s.running > 0 and s.waiting > 0, 60
        )

    for p in others:
        p.send_signal(signal.SIGSTOP)  # hung for a while: their leases expire and they leave discovery
    try:
        run(lambda: until(lambda: decodes_seen() == 1, 30), 40)
        time.sleep(1.0)  # the routers' watches see the same
        tiny_endpoint = next(w.endpoint for w in _decode_infos(cluster) if w.worker_id == "decode-tiny")
        outcomes = run(lambda: run_batch(base, watch_queue), 150)
    finally:
        for p in others:
            p.send_signal(signal.SIGCONT)
    run(lambda: until(lambda: decodes_seen() == 3, 30), 40)
    row = check_and_record(cluster, f"burst over one decode pool of {TINY_POOL_BLOCKS} blocks", outcomes)
    assert row["identical"] == len(BATCH) and row["causes"] == []  # busy, not failed: nothing migrated
    ids = {o.request_id for o in outcomes}
    waits = sorted(
        line["decode_queue_s"] for line in _lines(cluster.procs["frontend-a"]) if line["request_id"] in ids
    )
    assert len(waits) == len(BATCH) and waits[-1] > 0, waits
    tiny.popen.send_signal(signal.SIGTERM)  # the later faults expect the two regular decode workers
    assert tiny.popen.wait(30) == 0
    time.sleep(1.0)


def _decode_infos(cluster: LocalCluster) -> list[Any]:
    from services.discovery import WorkerDirectory

    async def listed() -> list[Any]:
        d = WorkerDirectory(cluster.etcd.url, roles=("decode",))
        await d.start()
        try:
            return d.workers("decode")
        finally:
            await d.close()

    return run(listed)


# ---- the slower faults: `make chaos` --------------------------------------------------------------------------

full_only = pytest.mark.skipif(not FULL, reason="make chaos (RACKSERVE_CHAOS_FULL=1) runs the slower faults")


@full_only
def test_decode_worker_killed_at_a_random_token_index_resumes_identically(cluster: LocalCluster) -> None:
    n = random.Random().randint(1, MAX_TOKENS - 2)
    add_worker(cluster, "services.decode.server", f"decode-die{n}r", "--debug-die-after-tokens", str(n))
    outcomes = run(lambda: run_batch(url(cluster, "frontend-a")), 150)
    row = check_and_record(cluster, f"decode SIGKILL at random token index ({n})", outcomes)
    assert row["identical"] == len(BATCH)


@full_only
def test_hung_decode_worker_is_detected_by_its_silence_and_its_requests_move(cluster: LocalCluster) -> None:
    hung = cluster.procs["decode-b"].popen

    async def freeze(progress: list[int]) -> None:
        await until(lambda: max(progress) >= 2)
        hung.send_signal(signal.SIGSTOP)

    try:
        outcomes = run(lambda: run_batch(url(cluster, "frontend-a"), freeze), 150)
    finally:
        hung.send_signal(signal.SIGKILL)
        hung.send_signal(signal.SIGCONT)
        hung.wait()
    row = check_and_record(cluster, "decode SIGSTOP (hung)", outcomes)
    assert row["identical"] == len(BATCH)
    add_worker(cluster, "services.decode.server", "decode-b2")


@full_only
def test_etcd_killed_and_restarted_mid_batch_loses_no_request(cluster: LocalCluster) -> None:
    async def outage(progress: list[int]) -> None:
        await until(lambda: max(progress) >= 1)
        cluster.etcd.kill()
        await asyncio.sleep(4.0)  # longer than the leases' TTL
        cluster.etcd.start()

    outcomes = run(lambda: run_batch(url(cluster, "frontend-a"), outage), 150)
    row = check_and_record(cluster, "etcd SIGKILL + restart", outcomes)
    assert row["identical"] == len(BATCH)
    # registrations come back by themselves: a batch after the outage is served as before
    after = run(lambda: run_batch(url(cluster, "frontend-a")), 150)
    assert check_and_record(cluster, "after the etcd restart", after)["identical"] == len(BATCH)


@full_only
def test_a_router_killed_mid_batch_fails_no_request(cluster: LocalCluster) -> None:
    async def kill_router(progress: list[int]) -> None:
        await until(lambda: max(progress) >= 1)
        cluster.procs["router-a"].popen.send_signal(signal.SIGKILL)

    outcomes = run(lambda: run_batch(url(cluster, "frontend-a"), kill_router), 150)
    assert check_and_record(cluster, "router SIGKILL", outcomes)["identical"] == len(BATCH)
    cluster.procs["router-b"].popen.send_signal(signal.SIGKILL)  # no router at all: the local fallback
    outcomes = run(lambda: run_batch(url(cluster, "frontend-a")), 150)
    assert check_and_record(cluster, "every router SIGKILLed", outcomes)["identical"] == len(BATCH)
    add_worker(cluster, "services.router.server", "router-c", "--mode", "disagg", "--policy", "round_robin")


@full_only
def test_sigterm_drains_a_decode_worker_and_the_streams_it_cannot_finish_move(cluster: LocalCluster) -> None:
    """With no drain grace, the worker aborts its streams as it stops; each resumes elsewhere, identical."""
    draining = add_worker(cluster, "services.decode.server", "decode-drain", "--drain-grace-s", "0").popen

    async def term(progress: list[int]) -> None:
        await until(lambda: max(progress) >= 2)
        draining.send_signal(signal.SIGTERM)

    outcomes = run(lambda: run_batch(url(cluster, "frontend-a"), term), 150)
    assert draining.wait(30) == 0  # a graceful exit
    row = check_and_record(cluster, "decode SIGTERM, no grace (drain)", outcomes)
    assert row["identical"] == len(BATCH)


@full_only
def test_extend_hold_keeps_prefill_kv_pullable_past_its_ttl_but_never_past_the_max_hold(
    cluster: LocalCluster,
) -> None:
    """What lets a long stream still re-transfer: ExtendHold keeps the KV past --kv-ttl-s, up to --kv-max-hold-s."""
    import grpc

    from services.rpc import pb
    from tests.support.cluster import greedy, token_ids

    worker = add_worker(
        cluster, "services.prefill.server", "prefill-hold", "--kv-ttl-s", "2", "--kv-max-hold-s", "6"
    )
    endpoint = cluster.endpoints["prefill-hold"] = next(
        line.split(" on ")[-1].strip() for line in open(worker.log_path) if " serving on " in line
    )
    from services.engine.model_files import smollm2_gguf_path
    from services.engine.tokenizer import Tokenizer

    prompt = list(
        Tokenizer.from_gguf(smollm2_gguf_path()).encode_chat([{"role": "user", "content": QUESTIONS[1]}])
    )

    async def body() -> tuple[list[int], pb.ExtendHoldResponse, pb.LoadSnapshot]:
        async with grpc.aio.insecure_channel(endpoint) as channel:
            stub = pb_grpc.PrefillWorkerStub(channel)
            r = await stub.Prefill(
                pb.PrefillRequest(request_id="hold-1", token_ids=prompt, params=greedy(8)), timeout=60
            )
            for _ in range(4):  # 4 s: twice the TTL
                await asyncio.sleep(1.0)
                ext = await stub.ExtendHold(pb.ExtendHoldRequest(request_id="hold-1", ttl_s=3.0), timeout=5)
                assert ext.held
            r.kv.expires_unix_ms = ext.expires_unix_ms
            first = [r.first_token.token_id]
            request = pb.DecodeRequest(
                request_id="hold-1",
                prompt_token_ids=prompt,
                emitted_token_ids=first,
                params=greedy(8),
                kv=r.kv,
            )
            async with grpc.aio.insecure_channel(cluster.endpoints["decode-a"]) as dch:
                chunks = [c async for c in pb_grpc.DecodeWorkerStub(dch).Decode(request, timeout=60)]
            assert chunks[0].transfer_bytes > 0  # pulled, past the TTL
            r2 = await stub.Prefill(
                pb.PrefillRequest(request_id="hold-2", token_ids=prompt, params=greedy(8)), timeout=60
            )
            for _ in range(12):  # past the 6 s max hold, extensions stop helping
                await asyncio.sleep(1.0)
                last = await stub.ExtendHold(pb.ExtendHoldRequest(request_id="hold-2", ttl_s=3.0), timeout=5)
                if not last.held:
                    break
            assert r2.kv.expires_unix_ms > 0
        freed = await wait_for_load(
            endpoint, pb_grpc.PrefillWorkerStub, lambda s: s.free_blocks == s.total_blocks, 10
        )
        return token_ids(chunks), last, freed

    tokens, last, freed = run(body, 120)
    assert tokens and not last.held and freed.free_blocks == freed.total_blocks


# ---- afterwards ----------------------------------------------------------------------------------------------


def test_no_prefill_worker_holds_leaked_kv_blocks_afterwards(cluster: LocalCluster) -> None:
    endpoint = cluster.endpoints["prefill-a"]
    load = run(
        lambda: wait_for_load(
            endpoint, pb_grpc.PrefillWorkerStub, lambda s: s.free_blocks == s.total_blocks, 8.0
        ),
        20,
    )
    assert load.free_blocks == load.total_blocks  # well before the KV TTL: every hold was released


def test_sigterm_drains_router_prefill_and_frontend_without_failing_a_request(cluster: LocalCluster) -> None:
    """Every service stops gracefully on SIGTERM: it leaves discovery, finishes what it has in flight (frontend
    B allows no migration, so a stream it loses would fail), and exits 0."""
    frontend = cluster.procs["frontend-b"].popen
    prefill = cluster.procs["prefill-a"].popen
    router = next(
        p for i, p in sorted(cluster.procs.items()) if i.startswith("router") and p.popen.poll() is None
    )

    async def term(progress: list[int]) -> None:
        await until(lambda: min(progress) >= 2)  # routed, prefilled, transferred: decoding
        for proc in (router.popen, prefill, frontend):
            proc.send_signal(signal.SIGTERM)

    outcomes = run(lambda: run_batch(url(cluster, "frontend-b"), term, specs=BATCH[:2]), 150)
    for o in outcomes:
        assert o.error is None and o.tokens == REFERENCE[o.spec].tokens
    assert [p.wait(30) for p in (router.popen, prefill, frontend)] == [0, 0, 0]

    async def gone() -> list[str]:
        from services.discovery import WorkerDirectory

        d = WorkerDirectory(cluster.etcd.url, roles=("router", "prefill", "frontend"))
        await d.start()
        try:
            return [w.worker_id for role in ("router", "prefill", "frontend") for w in d.workers(role)]
        finally:
            await d.close()

    left = run(gone)
    assert router.worker_id not in left and "prefill-a" not in left and "frontend-b" not in left
