"""Background tasks a process starts and does not await at once (a failure report, a KV release, a served
connection): `BackgroundTasks.spawn` starts one and keeps a reference until it is done.

asyncio keeps only a weak reference to a running task, so a task nobody holds may be collected mid-flight; every
fire-and-forget task therefore goes through a `BackgroundTasks` set, which drops it when it ends and logs an
exception it ended with (a task's own expected failures are its business: it catches and logs those itself).
`wait()` lets the pending ones finish (each has its own deadline); `cancel()` stops them.

This room knows nothing of what the tasks do.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger("rackserve.runtime.tasks")


class BackgroundTasks:
    """The tasks started through `spawn` that have not ended yet."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task[Any]:
        """Start `coro` on the running loop and hold it until it ends. Without a running loop (a generator
        finalized at shutdown) the coroutine is closed unstarted and RuntimeError raised."""
        try:
            task = asyncio.get_running_loop().create_task(coro, name=name)
        except RuntimeError:
            coro.close()
            raise
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            log.error("background task %s failed", task.get_name(), exc_info=error)

    def __len__(self) -> int:
        return len(self._tasks)

    async def wait(self) -> None:
        """Let every pending task finish."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def cancel(self) -> None:
        """Cancel every pending task and wait until they have ended."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
