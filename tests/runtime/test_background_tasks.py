"""services/runtime/tasks.py: a fire-and-forget task is held until it ends, a failure it ends with is logged
(never lost at garbage collection), `wait` lets pending ones finish and `cancel` stops them."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from services.runtime.tasks import BackgroundTasks


def test_a_spawned_task_is_held_while_it_runs_and_dropped_once_it_has_finished() -> None:
    done: list[str] = []

    async def work() -> None:
        await asyncio.sleep(0.01)
        gc.collect()
        await asyncio.sleep(0.01)
        done.append("finished")

    async def go() -> None:
        tasks = BackgroundTasks()
        tasks.spawn(work(), name="work")
        assert len(tasks) == 1
        await tasks.wait()
        assert len(tasks) == 0

    asyncio.run(go())
    assert done == ["finished"]


def test_a_failed_task_is_logged_with_its_name_and_dropped(caplog: pytest.LogCaptureFixture) -> None:
    async def boom() -> None:
        raise RuntimeError("release went wrong")

    async def go() -> None:
        tasks = BackgroundTasks()
        tasks.spawn(boom(), name="release r1")
        await tasks.wait()
        await asyncio.sleep(0)  # the done callback runs on the next turn of the loop
        assert len(tasks) == 0

    with caplog.at_level(logging.ERROR, logger="rackserve.runtime.tasks"):
        asyncio.run(go())
    [record] = [r for r in caplog.records if r.name == "rackserve.runtime.tasks"]
    assert "release r1" in record.getMessage()
    assert record.exc_info is not None and "release went wrong" in str(record.exc_info[1])


def test_cancel_stops_pending_tasks_and_a_cancelled_one_is_no_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def go() -> None:
        tasks = BackgroundTasks()
        forever = tasks.spawn(asyncio.sleep(3600), name="forever")
        await asyncio.sleep(0)
        await tasks.cancel()
        assert forever.cancelled()
        assert len(tasks) == 0

    with caplog.at_level(logging.ERROR, logger="rackserve.runtime.tasks"):
        asyncio.run(go())
    assert not [r for r in caplog.records if r.name == "rackserve.runtime.tasks"]


def test_without_a_running_loop_spawn_refuses_and_leaves_no_unawaited_coroutine() -> None:
    async def work() -> None:
        pass

    coro = work()
    with pytest.raises(RuntimeError):
        BackgroundTasks().spawn(coro)
    assert coro.cr_frame is None  # closed, so no "never awaited" warning
