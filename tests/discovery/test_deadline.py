"""`with_deadline`, the bound on every etcd call, must never swallow a cancel of the task that awaits it.

On Python 3.11 `asyncio.wait_for` does when the call completes in the same loop turn as the cancel: it returns
the result and the task runs on. The lease keep-alive caught that way never stopped, and the worker's SIGTERM
drain, which waits for it, hung until the test killed the process."""

from __future__ import annotations

import asyncio
import contextlib

from services.discovery.etcd import with_deadline


def test_a_cancel_that_lands_as_the_call_completes_stops_the_caller() -> None:
    ran_on: list[str] = []

    async def body() -> asyncio.Task[None]:
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[str] = loop.create_future()

        async def keep_alive() -> None:
            while True:  # like the lease's keep-alive: only a cancel ends it
                await with_deadline(reply, 5.0)
                ran_on.append("after the cancel")
                await asyncio.sleep(0.05)

        task = loop.create_task(keep_alive())
        await asyncio.sleep(0)  # the task now awaits the call
        reply.set_result("refreshed")  # the reply and the cancel in the same turn
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            async with asyncio.timeout(1.0):
                await task
        task.cancel()  # whatever happened, do not leave it running past the test
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return task

    asyncio.run(body())
    assert ran_on == []


def test_a_call_past_its_deadline_is_a_timeout_error() -> None:
    async def body() -> None:
        never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await with_deadline(never, 0.01)

    with contextlib.suppress(TimeoutError):
        asyncio.run(body())
        raise AssertionError("with_deadline returned without its call finishing")
