"""AsyncEngine in process, on a tiny random Llama: the thread contract the workers rely on.

A request's error comes out of its own stream and the thread keeps serving; a consumer that goes away aborts
its request; held KV stays until released; an idle or blocked engine thread sleeps instead of spinning.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import pytest

from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine, PromptTooLongError, RequestOutput
from services.engine.sampling import SamplingParams
from services.runtime.async_engine import AsyncEngine, LoadStats
from services.runtime.errors import DuplicateRequestError
from tests.conftest import tiny_llama

T = TypeVar("T")
NUM_BLOCKS = 8
BLOCK_SIZE = 16


def run(body: Callable[[AsyncEngine], Awaitable[T]], timeout_s: float = 30.0) -> T:
    async def main() -> T:
        config = EngineConfig(dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS, num_threads=1)
        engine = await AsyncEngine.start(lambda: LLMEngine(tiny_llama(), config))
        try:
            return await asyncio.wait_for(body(engine), timeout_s)
        finally:
            await engine.close()

    return asyncio.run(main())


def long_params(max_tokens: int = 200) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def load_matching(engine: AsyncEngine, predicate: Callable[[LoadStats], bool]) -> LoadStats:
    async with engine.events() as (_, updates):
        while not predicate(engine.stats()):
            await updates.get()
    return engine.stats()


def test_a_request_error_comes_out_of_its_stream_and_the_engine_keeps_serving() -> None:
    async def body(engine: AsyncEngine) -> tuple[list[BaseException], list[int]]:
        errors: list[BaseException] = []
        for rid, prompt in (("too-long", [1] * 600), ("bad-token", [1, 9999]), ("empty", [])):
            with pytest.raises(ValueError) as err:
                async for _ in engine.generate(rid, prompt, long_params(4)):
                    pass
            errors.append(err.value)
        outs = [o async for o in engine.generate("fine", [1, 2, 3], long_params(5))]
        return errors, [t for o in outs for t in o.new_token_ids]

    errors, tokens = run(body)
    assert isinstance(errors[0], PromptTooLongError)
    assert "outside the vocabulary" in str(errors[1]) and "empty" in str(errors[2])
    assert len(tokens) == 5


def test_a_request_larger_than_the_whole_cache_is_refused_not_left_waiting() -> None:
    async def body(engine: AsyncEngine) -> LoadStats:
        # the context is capped at what the cache holds: a longer prompt is refused as too long
        with pytest.raises(PromptTooLongError, match=f"context length of {NUM_BLOCKS * BLOCK_SIZE} tokens"):
            async for _ in engine.generate("huge", [1] * (NUM_BLOCKS * BLOCK_SIZE), long_params(4)):
                pass
        return await load_matching(engine, lambda s: s.waiting == 0 and s.running == 0)

    assert run(body).free_blocks == NUM_BLOCKS


def test_a_live_request_id_cannot_be_reused() -> None:
    async def body(engine: AsyncEngine) -> None:
        async with engine.generate("same", [1, 2, 3], long_params()) as stream:
            await stream.__anext__()
            with pytest.raises(DuplicateRequestError):
                engine.generate("same", [4, 5], long_params())

    run(body)


@pytest.mark.parametrize("hold_kv", [False, True])  # True: a prefill worker's request, its call cancelled
def test_cancelling_the_consumer_aborts_the_request(hold_kv: bool) -> None:
    async def body(engine: AsyncEngine) -> LoadStats:
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.generate("cancel-me", [1, 2, 3], long_params(400), hold_kv=hold_kv):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await load_matching(engine, lambda s: s.running == 0 and s.waiting == 0)

    load = run(body)
    assert load.free_blocks == NUM_BLOCKS


def test_abort_ends_a_listening_stream_with_finish_reason_abort() -> None:
    async def body(engine: AsyncEngine) -> str | None:
        async with engine.generate("abort-me", [1, 2, 3], long_params(400)) as stream:
            await stream.__anext__()
            await engine.abort("abort-me")
            outs = [o async for o in stream]
        return outs[-1].finish_reason

    assert run(body) == "abort"


def test_held_kv_stays_until_released() -> None:
    async def body(engine: AsyncEngine) -> tuple[int, int, bool, bool]:
        prompt = list(range(1, 2 * BLOCK_SIZE + 2))  # 3 blocks
        outs = [o async for o in engine.generate("held", prompt, long_params(1), hold_kv=True)]
        assert outs[-1].finished
        held = (await load_matching(engine, lambda s: s.running == 0)).free_blocks
        exported = await engine.export_kv("held")
        released = await engine.release("held")
        again = await engine.release("held")
        return held, exported.num_blocks, released, again

    held, exported_blocks, released, again = run(body)
    assert held == NUM_BLOCKS - 3 and exported_blocks == 3
    assert released and not again


def test_the_engine_thread_sleeps_when_idle_and_when_every_request_waits_for_blocks() -> None:
    """Counted in engine steps: a spinning thread would step thousands of times a second."""

    async def body(engine: AsyncEngine) -> tuple[int, int]:
        llm = engine.engine
        assert llm is not None
        steps = 0
        real_step = llm.step

        def counting_step() -> list[RequestOutput]:
            nonlocal steps
            steps += 1
            return real_step()

        llm.step = counting_step  # type: ignore[method-assign]
        await asyncio.sleep(1.0)
        idle_steps = steps
        # hold 7 of the 8 blocks, then ask for 2: the second request can only wait for a release
        hog = list(range(1, 6 * BLOCK_SIZE + 2))
        async for _ in engine.generate("hog", hog, long_params(1), hold_kv=True):
            pass
        waiter = engine.generate("waiter", list(range(200, 200 + BLOCK_SIZE + 1)), long_params(2))
        await load_matching(engine, lambda s: s.waiting == 1)
        before = steps
        await asyncio.sleep(1.0)
        blocked_steps = steps - before
        await engine.release("hog")
        outs = [o async for o in waiter]  # and it runs once the blocks are back
        assert outs[-1].finished
        return idle_steps, blocked_steps

    idle_steps, blocked_steps = run(body)
    assert idle_steps == 0
    assert blocked_steps <= 20  # woken by the 0.1 s safety net only


@pytest.mark.parametrize("hang_at_step", [1, 3])
def test_a_hung_step_ages_the_engine_and_an_idle_engine_never_looks_stuck(hang_at_step: int) -> None:
    """`progress_age_s` is what a worker vouches for its engine by (ENGINE_STUCK_S): 0 while idle, and growing
    while a step does not come back — also the very first step of a request on an idle engine, where the last
    snapshot still says nothing runs."""
    release = threading.Event()

    async def body(engine: AsyncEngine) -> tuple[float, float, float, float, list[int]]:
        assert engine.engine is not None
        await asyncio.sleep(
            1.5
        )  # idle a while: a step that then begins is young, not as old as the idle time
        idle = engine.progress_age_s()
        real_step, steps = engine.engine.step, [0]

        def step() -> list[RequestOutput]:
            steps[0] += 1
            if steps[0] == hang_at_step:
                release.wait(30)  # the step that does not come back (until the test lets it)
            return real_step()

        engine.engine.step = step  # type: ignore[method-assign]
        task = asyncio.ensure_future(_collect(engine.generate("r", [1, 2, 3], long_params(6))))
        while steps[0] < hang_at_step:
            await asyncio.sleep(0.05)
        young = engine.progress_age_s()
        await asyncio.sleep(1.0)
        hung = engine.progress_age_s()
        release.set()
        tokens = await task
        await asyncio.sleep(0.1)
        return idle, young, hung, engine.progress_age_s(), tokens

    try:
        idle, young, hung, after, tokens = run(body)
    finally:
        release.set()
    assert idle == 0.0 and after == 0.0  # idle before and after: nothing to be stuck in
    assert young < 1.0  # not the 1.5 s of idling before it
    assert hung >= 0.9  # the hung step shows, whichever step it is
    assert len(tokens) == 6  # and the request still finishes once the step returns


async def _collect(stream: AsyncIterator[RequestOutput]) -> list[int]:
    return [t async for o in stream for t in o.new_token_ids]


def test_a_request_that_arrives_during_a_step_is_in_the_load_published_before_the_next_step() -> None:
    """A router clears a request's reservation with the first load report that differs from the last: a request
    that reached the worker during a step must be in the report published before the step that runs it. Until
    2026-12-07 it was in none until that step ended (seconds for a long prompt on a CPU), and the router saw the
    worker idle meanwhile."""

    async def body(engine: AsyncEngine) -> LoadStats:
        inner = engine.engine
        assert inner is not None
        step = inner.step
        with_late = threading.Event()

        def slow_step() -> list[RequestOutput]:
            if "late" in inner.requests:
                with_late.set()
            threading.Event().wait(0.3)  # a long step
            return step()

        inner.step = slow_step  # type: ignore[method-assign]
        first = asyncio.ensure_future(consume(engine.generate("first", [1, 2, 3], long_params(3))))
        await load_matching(engine, lambda s: s.running == 1)
        await asyncio.sleep(0.1)  # inside first's step
        late = asyncio.ensure_future(consume(engine.generate("late", [4, 5, 6], long_params(2))))
        await asyncio.to_thread(with_late.wait, 5.0)
        await asyncio.sleep(0.1)  # inside the step that runs "late"
        stats = engine.stats()
        await asyncio.gather(first, late)
        return stats

    stats = run(body)
    assert stats.waiting + stats.running == 2


async def consume(stream: AsyncIterator[RequestOutput]) -> None:
    async for _ in stream:
        pass
