"""A prefill worker's hold on the KV it hands out: whatever ends the hold frees both the blocks and the publication.

A real PrefillWorker (in-process, a tiny random Llama, a real KvSource on TCP and shm in a temporary directory)
whose KV copy is slowed past the hold's TTL, as a starved CPU or a queue of publishes makes it: the hold expires
while the bytes are being copied out, before they are published.
"""

from __future__ import annotations

import asyncio
import os
import time
import types
from typing import Any

import pytest
from opentelemetry import trace

from services.engine.block_hash import block_hashes
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.kvtransfer import KvSource, TransferConfig
from services.prefill import server as prefill_server
from services.rpc import pb
from services.runtime import wire
from services.runtime.async_engine import AsyncEngine
from tests.conftest import tiny_llama
from tests.support.cluster import greedy, run

TTL_S = 0.2


async def _expired_during_copy(shm_dir: str, *, export: bool) -> tuple[list[str], list[str], int, int, bool]:
    """Prefill (or ExportPrefix) with the hold expiring while its KV is copied out; returns (the keys still
    published, the shm segments left, free blocks, total blocks, whether the answer carries a handle) once the
    call has ended."""
    config = EngineConfig(dtype="float32", block_size=4, num_kv_blocks=32, num_threads=1)
    engine = await AsyncEngine.start(lambda: LLMEngine(tiny_llama(), config))
    source = await KvSource.start(TransferConfig(backends=("tcp", "shm"), host="127.0.0.1", shm_dir=shm_dir))
    try:
        host = types.SimpleNamespace(
            worker_id="prefill-7", endpoint="127.0.0.1:1", epoch_ms=1, role="prefill", gate=None
        )
        worker = prefill_server.PrefillWorker(host, engine, source, kv_ttl_s=TTL_S)  # type: ignore[arg-type]
        copy_out = worker._copy_out

        def slowed(job: Any) -> Any:
            if job is not None:
                copy = job.copy_out

                def slow_copy(*args: Any) -> Any:
                    time.sleep(
                        3 * TTL_S
                    )  # the hold's TTL passes while the blocks are read (under the copy's pin)
                    return copy(*args)

                job.copy_out = slow_copy
            return job

        async def slow_copy_out(begin: Any) -> Any:
            return await copy_out(lambda e, pin: slowed(begin(e, pin)))

        worker._copy_out = slow_copy_out  # type: ignore[method-assign]
        prompt = list(range(1, 23))
        answer: pb.ExportPrefixResponse | pb.PrefillResponse
        if export:
            # the prompt's blocks in the prefix cache first (a prefill whose KV is released at once)
            async with engine.generate(
                "warm", prompt, wire.sampling_params(greedy(max_tokens=1)), hold_kv=True
            ) as stream:
                _ = [o async for o in stream]
            await engine.release("warm")
            hashes = block_hashes(prompt, 4)[:4]
            request = pb.ExportPrefixRequest(
                request_id="peer:prefix-pull-1", block_hashes=hashes, ttl_s=TTL_S
            )
            context = types.SimpleNamespace(invocation_metadata=lambda: ())
            answer = await worker.ExportPrefix(request, context)  # type: ignore[arg-type]
        else:
            request = pb.PrefillRequest(request_id="req-1", token_ids=prompt, params=greedy(max_tokens=8))
            answer = await worker._prefill("req-1", request, trace.INVALID_SPAN)
            assert answer.first_token.index == 0 and not answer.finished  # the first token all the same
        await asyncio.sleep(3 * TTL_S)  # past any timer of the call's own
        free, total = await engine.call(lambda e: (e.blocks.num_free, e.blocks.num_blocks))
        segments = [n for n in os.listdir(shm_dir) if not n.endswith(".lock")]
        return source.live_keys(), segments, free, total, answer.HasField("kv")
    finally:
        await source.close()
        await engine.close()


@pytest.mark.parametrize("export", [False, True], ids=["prefill", "export_prefix"])
def test_a_hold_that_expires_while_its_kv_is_copied_leaves_nothing_published(
    tmp_path: Any, export: bool
) -> None:
    """The hold's TTL passed before the publication existed, so its expiry had nothing to retract: the bytes
    were published anyway, under the source's backstop TTL (--kv-max-hold-s, 600 s), and no Release could reach
    them (the hold was gone) — a prompt's KV in /dev/shm for ten minutes per slow prefill. Now they are not.
    Nor is the expired handle handed out (it was until 2026-12-07: the decode worker or peer it went to was
    refused, and a request migrated for it): the answer has none, and its caller computes the KV itself."""
    keys, segments, free, total, handle = run(lambda: _expired_during_copy(str(tmp_path), export=export))
    assert keys == []
    assert segments == []
    assert free == total
    assert not handle


async def _fails_after_the_prompt(monkeypatch: pytest.MonkeyPatch) -> tuple[BaseException | None, int, int]:
    """A Prefill whose first token is computed and KV held, and which then fails before any handle exists (here
    recording the prompt's metrics): the call's error, and the free and total blocks once its TTL has passed."""
    config = EngineConfig(dtype="float32", block_size=4, num_kv_blocks=32, num_threads=1)
    engine = await AsyncEngine.start(lambda: LLMEngine(tiny_llama(), config))
    source = await KvSource.start(TransferConfig(backends=("tcp",), host="127.0.0.1"))
    try:
        host = types.SimpleNamespace(
            worker_id="prefill-7", endpoint="127.0.0.1:1", epoch_ms=1, role="prefill", gate=None
        )
        worker = prefill_server.PrefillWorker(host, engine, source, kv_ttl_s=TTL_S)  # type: ignore[arg-type]

        def broken(*_: Any) -> None:
            raise RuntimeError("injected: the prompt's metrics")

        monkeypatch.setattr(worker, "observe_prompt", broken)
        request = pb.PrefillRequest(
            request_id="req-1", token_ids=list(range(1, 23)), params=greedy(max_tokens=8)
        )
        error = None
        try:
            await worker._prefill("req-1", request, trace.INVALID_SPAN)
        except RuntimeError as exc:
            error = exc
        await asyncio.sleep(3 * TTL_S)  # past the TTL a hold would have had
        free, total = await engine.call(lambda e: (e.blocks.num_free, e.blocks.num_blocks))
        return error, free, total
    finally:
        await source.close()
        await engine.close()


def test_a_prefill_that_fails_after_its_prompt_ran_frees_the_blocks_it_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine holds a prefill's KV blocks as soon as the prompt has run; the TTL timer that frees them was set
    only later, once the response was built. An error in between (the prompt's metrics or span, the first token's
    conversion) left the blocks held with no timer, for the life of the process. Now the timer is set first."""
    error, free, total = run(lambda: _fails_after_the_prompt(monkeypatch))
    assert error is not None and "injected" in str(error)
    assert free == total
