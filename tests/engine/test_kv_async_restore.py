"""Restores written beside the step: a request whose prefix comes back from tier 2 while another sequence decodes
waits while its blocks are written on the restore thread, and the other sequence keeps stepping. Both get the
tokens they get alone, the restored blocks become cached prefix blocks only once written, and an abort in the
middle of a restore leaks nothing. KV imported from a prefill worker is written the same way."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from services.engine.block_hash import block_hashes
from services.engine.engine import EngineConfig, KvWriteError, LLMEngine
from services.engine.sampling import SamplingParams
from services.engine.scheduler import RequestStatus
from services.runtime.async_engine import AsyncEngine
from tests.conftest import tiny_llama

BS = 4
POOL = 16
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
_g = torch.Generator().manual_seed(11)
A = torch.randint(0, 256, (29,), generator=_g).tolist()  # 7 full prefix blocks to restore
B = torch.randint(0, 256, (50,), generator=_g).tolist()  # with its output it needs the whole pool: evicts A
X = torch.randint(0, 256, (6,), generator=_g).tolist()  # the sequence that decodes while A is restored
LONG = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)


def engine(**kw) -> LLMEngine:
    cfg = dict(dtype="float32", block_size=BS, max_num_batched_tokens=64, num_kv_blocks=POOL)
    cfg.update(kw)
    return LLMEngine(tiny_llama(), EngineConfig(**cfg))


@pytest.fixture(scope="module")
def solo() -> tuple[list[int], list[int]]:
    e = engine(num_kv_blocks=256)
    return e.generate([A], GREEDY)[0], e.generate([X], LONG)[0]


def evict_a_into_tier2(e: LLMEngine) -> list[int]:
    e.generate([A], GREEDY)
    e.generate([B], GREEDY)
    hashes = block_hashes(A[: len(A) - 1], BS)
    assert e.blocks.lookup_prefix(hashes) == [] and e.tier2 is not None and all(h in e.tier2 for h in hashes)
    return hashes


def start_x_then_a(e: LLMEngine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {"x": [], "a": []}
    e.add_request("x", X, LONG)
    for o in e.step():  # x's prefill: it is running when A arrives
        out[o.request_id] += o.new_token_ids
    e.add_request("a", A, GREEDY)
    return out


def run(e: LLMEngine, out: dict[str, list[int]]) -> dict[str, list[int]]:
    while e.has_unfinished():
        for o in e.step():
            out[o.request_id] += o.new_token_ids
    return out


def step_while_a_is_written(e: LLMEngine, out: dict[str, list[int]]) -> None:
    """One step: x decodes while a's blocks are written beside it."""
    for o in e.step():
        out[o.request_id] += o.new_token_ids
    assert "a" in e.scheduler.restoring


def abort_a_mid_write(
    e: LLMEngine, out: dict[str, list[int]], solo: tuple[list[int], list[int]], pool: int
) -> None:
    """Abort a while its blocks are being written: x goes on with its solo tokens, and no block is leaked."""
    step_while_a_is_written(e, out)
    e.abort("a")
    assert "a" not in e.scheduler.restoring and "a" not in e.requests
    run(e, out)
    assert out["x"] == solo[1]
    assert e.stats().free_blocks == pool


@pytest.mark.parametrize("codec", ["bf16", "fp8"])
def test_a_restore_beside_a_decoding_sequence_gives_both_their_solo_tokens(
    solo: tuple[list[int], list[int]], codec: str
) -> None:
    e = engine(kv_tier2_bytes=1 << 20, kv_tier2_codec=codec)
    hashes = evict_a_into_tier2(e)
    out = start_x_then_a(e)
    steps_x_alone = 0
    e.drain_kv_events()
    while "a" in e.requests and e.requests["a"].status is not RequestStatus.RUNNING:
        before = len(out["x"])
        for o in e.step():
            out[o.request_id] += o.new_token_ids
        if "a" in e.scheduler.restoring:  # written beside this step; not yet in the prefix cache
            assert not any(ev.kind == "restored" for ev in e.drain_kv_events())
            assert e.blocks.lookup_prefix(hashes[:1]) == []
        steps_x_alone += len(out["x"]) > before
    assert steps_x_alone >= 1  # x got a token while a's blocks were being written
    run(e, out)
    if codec == "bf16":  # lossless: the continuation is the solo run's
        assert out["a"] == solo[0]
    assert out["x"] == solo[1]  # the other sequence is never disturbed
    st = e.stats()
    assert st.tier2 is not None and st.tier2.overlapped == 1 and st.tier2.hits == len(hashes)
    assert st.free_blocks == POOL
    assert len(e.blocks.lookup_prefix(hashes)) == len(hashes)  # cached prefix blocks once written


def test_with_async_restore_off_the_restore_runs_before_the_step(solo: tuple[list[int], list[int]]) -> None:
    e = engine(kv_tier2_bytes=1 << 20, kv_async_restore=False)
    hashes = evict_a_into_tier2(e)
    out = run(e, start_x_then_a(e))
    assert out == {"a": solo[0], "x": solo[1]}
    st = e.stats()
    assert st.tier2 is not None and st.tier2.overlapped == 0 and st.tier2.hits == len(hashes)


def test_alone_the_restore_is_written_before_the_step_no_wait(solo: tuple[list[int], list[int]]) -> None:
    e = engine(kv_tier2_bytes=1 << 20)
    evict_a_into_tier2(e)
    e.add_request("a", A, GREEDY)
    first = e.step()  # nothing else to run: restored and prefilled in this very step
    assert [o.request_id for o in first] == ["a"]
    assert e.stats().tier2.overlapped == 0  # type: ignore[union-attr]


def test_aborting_a_restoring_request_leaks_no_block_and_keeps_the_restored_prefix(
    solo: tuple[list[int], list[int]],
) -> None:
    e = engine(kv_tier2_bytes=1 << 20)
    hashes = evict_a_into_tier2(e)
    abort_a_mid_write(e, start_x_then_a(e), solo, POOL)
    assert len(e.blocks.lookup_prefix(hashes)) == len(hashes)  # written, so kept as cached blocks


def test_a_second_request_for_the_restoring_prefix_waits_for_it_instead_of_recomputing(
    solo: tuple[list[int], list[int]],
) -> None:
    e = engine(kv_tier2_bytes=1 << 20)
    hashes = evict_a_into_tier2(e)
    e.drain_kv_events()
    out = start_x_then_a(e)
    e.add_request("a2", A, GREEDY)
    out["a2"] = []
    cached: dict[str, int] = {}
    while e.has_unfinished():
        for o in e.step():
            out[o.request_id] += o.new_token_ids
            cached[o.request_id] = o.num_cached_tokens
    assert out["a"] == out["a2"] == solo[0] and out["x"] == solo[1]
    assert cached["a2"] == len(hashes) * BS  # it hit the restored blocks, it did not recompute them
    kinds = [(ev.kind, ev.block_hash) for ev in e.drain_kv_events()]
    assert not any(k == "stored" and h in hashes for k, h in kinds)


@pytest.mark.cluster  # runs helm
def test_the_switch_reaches_a_worker_from_its_flag_its_env_and_the_chart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On by default; `--no-kv-async-restore`, RACKSERVE_NO_KV_ASYNC_RESTORE=true (what the chart's
    `engine.no-kv-async-restore: true` sets in every worker's env) and `rackserve up --no-kv-async-restore` turn
    it off."""
    import argparse

    from services.launcher import add_arguments, engine_flags
    from services.runtime.args import add_engine_arguments, engine_config
    from tests.deploy.test_chart import container, env_of, find, render

    def worker(argv: list[str]) -> EngineConfig:
        parser = argparse.ArgumentParser()
        add_engine_arguments(parser)  # reads the env when the flags are declared, as a worker does at start
        return engine_config(parser.parse_args(argv))

    assert worker([]).kv_async_restore is True
    assert worker(["--no-kv-async-restore"]).kv_async_restore is False
    objs = render("--set", "engine.no-kv-async-restore=true")
    for role in ("prefill", "decode"):
        env = env_of(container(find(objs, "Deployment", f"rs-rackserve-{role}"), role))
        monkeypatch.setenv("RACKSERVE_NO_KV_ASYNC_RESTORE", env["RACKSERVE_NO_KV_ASYNC_RESTORE"])
        assert worker([]).kv_async_restore is False, role
    monkeypatch.delenv("RACKSERVE_NO_KV_ASYNC_RESTORE")
    up = argparse.ArgumentParser()
    add_arguments(up)
    for argv, on in (([], True), (["--no-kv-async-restore"], False)):
        assert worker(engine_flags(up.parse_args(argv), None)).kv_async_restore is on, argv


# --- KV imported from a prefill worker: written beside the step too ---
def prefilled_a() -> tuple[int, object]:
    """A's first token and its KV, from a prefill engine (what a decode worker pulls)."""
    p = engine(num_kv_blocks=256)
    p.add_request("a", A, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), hold_kv=True)
    [first] = p.step()
    return first.new_token_ids[0], p.export_kv("a")


def start_x_then_import_a(e: LLMEngine) -> dict[str, list[int]]:
    first, kv = prefilled_a()
    out: dict[str, list[int]] = {"x": [], "a": [first]}
    e.add_request("x", X, LONG)
    for o in e.step():  # x's prefill: it is decoding when A's KV arrives
        out[o.request_id] += o.new_token_ids
    e.add_request("a", A, GREEDY, output_ids=[first], kv=kv)  # type: ignore[arg-type]
    return out


def test_an_import_beside_a_decoding_sequence_gives_both_their_solo_tokens(
    solo: tuple[list[int], list[int]],
) -> None:
    """A decode worker given a long prompt's KV while it streams other sequences writes that KV on the restore
    thread beside the step: the other sequence gets its token in that step instead of waiting for the write, and
    the imported request continues exactly as the prompt's own run."""
    e = engine(num_kv_blocks=64)
    out = start_x_then_import_a(e)
    got = e.step()
    assert [o.request_id for o in got] == ["x"]  # x stepped; a's KV was being written beside it
    out["x"] += got[0].new_token_ids
    assert "a" in e.scheduler.restoring
    run(e, out)
    assert out == {"a": solo[0], "x": solo[1]}
    assert e.stats().free_blocks == 64


def test_with_async_restore_off_an_import_is_written_before_the_step(
    solo: tuple[list[int], list[int]],
) -> None:
    e = engine(num_kv_blocks=64, kv_async_restore=False)
    out = start_x_then_import_a(e)
    got = e.step()
    assert sorted(o.request_id for o in got) == ["a", "x"]  # written first, then both stepped
    for o in got:
        out[o.request_id] += o.new_token_ids
    assert run(e, out) == {"a": solo[0], "x": solo[1]}


def test_aborting_an_importing_request_leaks_no_block(solo: tuple[list[int], list[int]]) -> None:
    e = engine(num_kv_blocks=64)
    abort_a_mid_write(e, start_x_then_import_a(e), solo, 64)


# --- a write beside the step that fails (out of device memory, say) ends its request, not the engine ---
def fail_writes_on_the_restore_thread(e: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make every KV write on the restore thread raise, as a device out of memory would; the engine thread's own
    writes go on. Returns the list the failed writes' thread names go to."""
    failed: list[str] = []
    write = e.kv.write_blocks

    def failing(ids: torch.Tensor, src: torch.Tensor) -> None:
        if threading.current_thread().name.startswith("kv-restore"):
            failed.append(threading.current_thread().name)
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        write(ids, src)

    monkeypatch.setattr(e.kv, "write_blocks", failing)
    return failed


@pytest.mark.parametrize("what", ["import", "tier restore"])
def test_a_failed_write_beside_the_step_ends_that_request_with_its_error_and_the_engine_goes_on(
    solo: tuple[list[int], list[int]], monkeypatch: pytest.MonkeyPatch, what: str
) -> None:
    """The failed request ends with a KvWriteError naming it (its stream gets the error; its blocks go back,
    nothing of it cached, the tier copies it took reported dropped); the sequence decoding beside it keeps its
    solo tokens, later steps run, and the same prompt runs whole afterwards."""
    if what == "import":
        e = engine(num_kv_blocks=64)
        pool, hashes = 64, block_hashes(A[: len(A) - 1], BS)
        failed = fail_writes_on_the_restore_thread(e, monkeypatch)
        out = start_x_then_import_a(e)
    else:
        e = engine(kv_tier2_bytes=1 << 20)
        pool = POOL
        hashes = evict_a_into_tier2(e)
        failed = fail_writes_on_the_restore_thread(e, monkeypatch)
        out = start_x_then_a(e)
    e.drain_kv_events()
    step_while_a_is_written(e, out)  # and the write fails
    failures: list[tuple[str, Exception]] = []
    while e.has_unfinished():
        for o in e.step():
            out[o.request_id] += o.new_token_ids
        failures += e.take_failures()
    assert failed and [rid for rid, _ in failures] == ["a"]
    assert isinstance(failures[0][1], KvWriteError) and "'a'" in str(failures[0][1])
    assert isinstance(failures[0][1].__cause__, torch.OutOfMemoryError)
    assert out["x"] == solo[1]  # the other sequence never noticed
    assert "a" not in e.requests and e.stats().free_blocks == pool
    assert e.blocks.lookup_prefix(hashes) == []  # nothing unwritten is cached
    if what == "tier restore":
        dropped = {ev.block_hash for ev in e.drain_kv_events() if ev.kind == "dropped"}
        assert set(hashes) <= dropped and not any(h in e.tier2 for h in hashes)  # type: ignore[operator]
    monkeypatch.undo()
    assert e.generate([A], GREEDY)[0] == solo[0]  # the engine is whole


def test_a_failed_import_write_fails_only_its_own_stream_on_the_async_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a worker (AsyncEngine) the failed request's stream raises the KvWriteError (the server turns it into
    a failed call, which the frontend migrates); the stream decoding beside it finishes with its solo tokens."""
    first, kv = prefilled_a()
    long_x = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)  # still decoding when A arrives
    x_solo = engine(num_kv_blocks=256).generate([X], long_x)[0]

    async def scenario() -> None:
        eng = await AsyncEngine.start(lambda: engine(num_kv_blocks=64))
        try:
            assert eng.engine is not None
            failed = fail_writes_on_the_restore_thread(eng.engine, monkeypatch)
            x_stream = eng.generate("x", X, long_x)
            x_first = await x_stream.__anext__()  # x decodes from here on

            async def rest_of_x() -> list[int]:
                return x_first.new_token_ids + [t async for o in x_stream for t in o.new_token_ids]

            x = asyncio.create_task(rest_of_x())
            a = eng.generate("a", A, GREEDY, output_ids=[first], kv=kv)  # type: ignore[arg-type]
            with pytest.raises(KvWriteError, match="'a'"):
                async for _ in a:
                    pass
            assert failed  # it failed beside x's steps, on the restore thread
            assert await x == x_solo
            assert await eng.call(lambda e: e.stats().free_blocks) == 64
        finally:
            await eng.close()

    async def bounded() -> None:  # a wedged engine fails the test instead of hanging it
        async with asyncio.timeout(60):
            await scenario()

    asyncio.run(bounded())
