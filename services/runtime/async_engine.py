"""The engine behind an event loop: one LLMEngine, owned by one dedicated thread, fed from asyncio.

The engine is not thread-safe and `step()` blocks for tens of milliseconds, so it lives in a thread of its own.
The asyncio side never touches it: it puts commands (add, abort, release, a function to run) on a thread-safe
queue. The thread applies the commands, steps while there is work and sleeps on the queue when there is none
(no busy loop), and hands every step's outputs back to the loop in one `call_soon_threadsafe`, where they are
routed to per-request streams. KV block events and a stats snapshot are published the same way.

A request's failure (bad parameters, a prompt that cannot fit) surfaces as an exception from its own stream; it
never kills the thread. A consumer that goes away (a cancelled gRPC call) aborts its request in the engine.

This room must never know about gRPC, etcd or any service: it is the engine made safe to share.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from services.engine.engine import EngineStats, KvExport, LLMEngine, RequestOutput
from services.engine.kv_cache import KvEvent
from services.engine.sampling import SamplingParams
from services.engine.scheduler import RequestStatus
from services.runtime.errors import DuplicateRequestError, EngineClosedError
from services.telemetry import metrics

log = logging.getLogger("rackserve.runtime.engine")

# An engine thread that has not reported back for this long with work running is stuck for good, not busy (a
# starved CPU can make one step take tens of seconds): a worker stops vouching for it (`progress_age_s`) — the
# decode stream stops its keepalives, a prefill call fails — so its callers move on.
ENGINE_STUCK_S = 120.0

T = TypeVar("T")

# When every queued request waits for KV blocks and nothing runs, only a command (release, abort) can unblock
# the engine; the thread then sleeps on the command queue, waking at this period as a safety net.
_STALLED_WAIT_S = 0.1


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int]
    kv: KvExport | None
    hold_kv: bool


@dataclass
class _Abort:
    request_id: str
    notify: bool  # deliver a final finish_reason="abort" output to a stream still listening


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future[Any]


@dataclass
class _Stop:
    pass


_Command = _Add | _Abort | _Call | _Stop


@dataclass
class LoadStats(EngineStats):
    """The engine's stats plus what a router needs to estimate queueing on this worker."""

    queued_prefill_tokens: int = 0  # prompt tokens admitted or waiting that are not computed yet
    active_decode_blocks: int = 0  # KV blocks held by running sequences


def load_stats(engine: LLMEngine) -> LoadStats:
    """Read in the engine thread only."""
    sched = engine.scheduler
    queued = sum(max(0, len(r.prompt_ids) - r.num_computed_tokens) for r in (*sched.waiting, *sched.running))
    active = sum(len(r.block_ids) for r in sched.running)
    return LoadStats(**vars(engine.stats()), queued_prefill_tokens=queued, active_decode_blocks=active)


EngineUpdate = list[KvEvent] | LoadStats


@dataclass
class RequestTiming:
    """Monotonic timestamps of one request: queued, first scheduled into a step, first output."""

    submitted_s: float = field(default_factory=time.monotonic)
    scheduled_s: float | None = None
    first_output_s: float | None = None

    @property
    def queue_s(self) -> float:
        return (self.scheduled_s or self.first_output_s or self.submitted_s) - self.submitted_s

    @property
    def compute_s(self) -> float:
        if self.first_output_s is None:
            return 0.0
        return self.first_output_s - (self.scheduled_s or self.submitted_s)


class RequestStream:
    """The outputs of one request, in order, as an async iterator; ends after the finished output.

    Leaving early — cancellation of the consuming task, `aclose()`, or the `async with` block — aborts the
    request in the engine. `timing` fills in as the request is scheduled and produces its first output.
    """

    def __init__(self, engine: AsyncEngine, request_id: str) -> None:
        self.request_id = request_id
        self.timing = RequestTiming()
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._open = True

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._open:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # the consumer was cancelled: nobody will read the rest
            self._close(abort=True)
            raise
        if isinstance(item, BaseException):
            self._close(abort=False)  # the engine never took the request, or already dropped it
            raise item
        if item.finished:
            self._close(abort=False)
        return item

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._close(abort=True)

    def _close(self, abort: bool) -> None:
        if self._open:
            self._open = False
            self._engine._detach(self.request_id, abort=abort)

    def _deliver(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, RequestOutput) and self.timing.first_output_s is None:
            self.timing.first_output_s = time.monotonic()
        self._queue.put_nowait(item)


class AsyncEngine:
    """Start with `await AsyncEngine.start(factory)`: the factory builds the LLMEngine inside the engine thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._subscribers: set[asyncio.Queue[EngineUpdate]] = set()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.engine: LLMEngine | None = None  # read-only facts (fingerprint, layout) for the asyncio side
        self._stats: LoadStats | None = None
        self._progress_s = time.monotonic()  # when the thread last handed back a step's or command's results
        self._step_since: float | None = None  # when the step now running began (None: not in a step)

    @classmethod
    async def start(cls, factory: Callable[[], LLMEngine]) -> AsyncEngine:
        """Build the engine in its own thread (model loading stays off the event loop) and start stepping."""
        loop = asyncio.get_running_loop()
        self = cls(loop)
        ready: asyncio.Future[LLMEngine] = loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(factory, ready), name="engine", daemon=True)
        self._thread.start()
        self.engine = await ready
        return self

    @property
    def device(self) -> str:
        """Where the engine's KV cache lives (a torch device: "cpu", "cuda:0"); what device-direct transfers
        deliver to."""
        assert self.engine is not None, "AsyncEngine.start() has not finished"
        return str(self.engine.device)

    # ------------------------------------------------------------------------------------ asyncio side
    def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        output_ids: Sequence[int] = (),
        kv: KvExport | None = None,
        hold_kv: bool = False,
    ) -> RequestStream:
        """Submit a request; iterate the returned stream for its outputs. Errors are raised by the stream."""
        if self._closed:
            raise EngineClosedError("the engine is shut down")
        if request_id in self._streams:
            raise DuplicateRequestError(f"request id {request_id!r} is already running on this worker")
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream
        self._commands.put(_Add(request_id, list(prompt_ids), params, list(output_ids), kv, hold_kv))
        return stream

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compile a request's grammar off the engine thread before `generate`, within COMPILE_TIMEOUT_S
        (services/engine/structured.py): `add_request` then finds it compiled. Compiled on the engine
        thread, one costly grammar froze every request on the worker. GrammarError (INVALID_ARGUMENT) if it
        does not compile in time."""
        assert self.engine is not None, "AsyncEngine.start() has not finished"
        if params.structured_kind and self.engine.tokenizer is not None:
            await self.engine.grammars.compile_within(params.structured_kind, params.structured_spec)

    async def abort(self, request_id: str) -> None:
        """Stop a request (or drop its held KV). A stream still listening ends with finish_reason "abort"."""
        self._commands.put(_Abort(request_id, notify=True))
        await self.call(lambda e: None)  # returns once the thread has applied the abort

    async def release(self, request_id: str) -> bool:
        """Free a finished request's held KV blocks; False when nothing was held under that id."""

        def release(engine: LLMEngine) -> bool:
            held = request_id in engine.requests
            engine.release_kv(request_id)
            return held

        return await self.call(release)

    async def export_kv(self, request_id: str, num_tokens: int | None = None) -> KvExport:
        return await self.call(lambda e: e.export_kv(request_id, num_tokens))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) in the engine thread, between steps, and return its result (or raise its error)."""
        if self._closed:
            raise EngineClosedError("the engine is shut down")
        future: asyncio.Future[T] = self._loop.create_future()
        self._commands.put(_Call(fn, future))
        return await future

    def progress_age_s(self) -> float:
        """Seconds since the engine thread last reported back: large only if a step is stuck, or nothing runs."""
        since = self._step_since
        if (
            since is not None
        ):  # in a step: also the first one of an idle engine, whose last snapshot ran nothing
            return time.monotonic() - since
        if self.engine is not None and self._stats is not None and self._stats.running == 0:
            return 0.0  # idle or waiting only: there is no step to be stuck in
        return time.monotonic() - self._progress_s

    def stats(self) -> LoadStats:
        """The latest snapshot, refreshed by the thread after every step and command."""
        assert self._stats is not None, "stats exist once the engine is started"
        return self._stats

    @contextlib.asynccontextmanager
    async def events(
        self, snapshot: bool = False
    ) -> AsyncIterator[tuple[tuple[list[int], list[int], list[int]], asyncio.Queue[EngineUpdate]]]:
        """Subscribe to the engine's updates: yields ((hashes cached now in the pool, hashes in tier 2, hashes on
        disk) if snapshot else ([], [], []), a queue that receives every batch of KV block events and every new
        LoadStats, in the order the thread produced them).

        The subscription starts before the snapshot is taken, so nothing falls between them; events already
        reflected in the snapshot may arrive again (stores and evictions are idempotent for an index).
        """
        q: asyncio.Queue[EngineUpdate] = asyncio.Queue()
        self._subscribers.add(q)
        try:
            cached = (
                await self.call(
                    lambda e: (e.blocks.cached_hashes(), e.blocks.tier2_hashes(), e.blocks.disk_hashes())
                )
                if snapshot
                else ([], [], [])
            )
            yield cached, q
        finally:
            self._subscribers.discard(q)

    def live_request_ids(self) -> list[str]:
        return list(self._streams)

    async def close(self) -> None:
        """Abort what is left, stop the thread and wait for it."""
        if self._closed:
            return
        self._closed = True
        self._commands.put(_Stop())
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        for stream in list(self._streams.values()):
            stream._deliver(EngineClosedError("the engine shut down before the request finished"))

    def _detach(self, request_id: str, abort: bool) -> None:
        self._streams.pop(request_id, None)
        if abort and not self._closed:
            self._commands.put(_Abort(request_id, notify=False))

    def _dispatch(
        self, items: list[tuple[str, RequestOutput | BaseException]], scheduled: dict[str, float]
    ) -> None:
        for rid, t in scheduled.items():
            stream = self._streams.get(rid)
            if stream is not None:
                stream.timing.scheduled_s = t
        for rid, item in items:
            stream = self._streams.get(rid)
            if stream is not None:  # gone: its consumer left and the abort is on its way
                stream._deliver(item)

    def _publish(self, update: EngineUpdate) -> None:
        for q in self._subscribers:
            q.put_nowait(update)

    # ------------------------------------------------------------------------------------ engine thread
    def _run(self, factory: Callable[[], LLMEngine], ready: asyncio.Future[LLMEngine]) -> None:
        try:
            engine = factory()
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting start()
            self._loop.call_soon_threadsafe(_set_exception, ready, e)
            return
        self._stats = load_stats(engine)
        self._loop.call_soon_threadsafe(_set_result, ready, engine)
        waiting: dict[str, None] = {}  # ids not yet scheduled into a step, to time their queueing
        stalled = False
        while True:
            busy = engine.has_unfinished() and not stalled
            try:
                if busy:
                    cmd = self._commands.get_nowait()
                else:
                    cmd = self._commands.get(timeout=_STALLED_WAIT_S if stalled else None)
            except queue.Empty:
                cmd = None
            items: list[tuple[str, RequestOutput | BaseException]] = []
            added = False
            while cmd is not None:
                if isinstance(cmd, _Stop):
                    self._shutdown(engine)
                    return
                self._apply(engine, cmd, items, waiting)
                added = added or isinstance(cmd, _Add)
                stalled = False
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            scheduled: dict[str, float] = {}
            if engine.has_unfinished():
                # requests that arrived during the last step are in no snapshot yet, and the worker repeats its last
                # one as a heartbeat for the whole next step (seconds, for a long prompt on a CPU): a router would
                # take them for gone, clear their reservations and see the worker less loaded than it is
                if added:
                    self._loop.call_soon_threadsafe(self._publish_stats, load_stats(engine))
                t0 = time.monotonic()
                self._step_since = t0
                try:
                    outs = engine.step()
                except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the thread
                    log.exception("engine step failed; aborting its requests")
                    outs = []
                    for rid in list(engine.requests):
                        if not engine.requests[rid].finished:
                            engine.abort(rid)
                            items.append((rid, RuntimeError(f"engine step failed: {e}")))
                finally:
                    self._step_since = None
                metrics.ENGINE_STEP_S.labels(metrics.process_role).observe(time.monotonic() - t0)
                items += [(o.request_id, o) for o in outs]
                items += engine.take_failures()  # requests whose KV write failed: their streams raise it
                for rid in list(waiting):
                    req = engine.requests.get(rid)
                    if req is None or req.status is not RequestStatus.WAITING:
                        scheduled[rid] = t0
                        del waiting[rid]
                stats = load_stats(engine)
                # nothing runs and nothing came out: every waiting request needs blocks only a command can free
                stalled = not outs and stats.running == 0 and stats.waiting > 0
            else:
                stats = load_stats(engine)
            events = engine.drain_kv_events()
            self._loop.call_soon_threadsafe(self._after_step, items, scheduled, events, stats)

    def _after_step(
        self,
        items: list[tuple[str, RequestOutput | BaseException]],
        scheduled: dict[str, float],
        events: list[KvEvent],
        stats: LoadStats,
    ) -> None:
        self._progress_s = time.monotonic()
        self._dispatch(items, scheduled)
        if events:
            self._publish(events)
        self._publish_stats(stats)

    def _publish_stats(self, stats: LoadStats) -> None:
        self._stats = stats
        self._publish(stats)

    def _apply(
        self,
        engine: LLMEngine,
        cmd: _Command,
        items: list[tuple[str, RequestOutput | BaseException]],
        waiting: dict[str, None],
    ) -> None:
        if isinstance(cmd, _Add):
            try:
                # e.g. a prefill whose KV is still held, or a prefix hold of that id
                if engine.id_in_use(cmd.request_id):
                    raise DuplicateRequestError(
                        f"request id {cmd.request_id!r} is already live on this worker"
                    )
                # refused there too: a request the whole cache cannot hold (the context is capped at the cache)
                engine.add_request(
                    cmd.request_id, cmd.prompt_ids, cmd.params, cmd.output_ids, cmd.kv, cmd.hold_kv
                )
                waiting[cmd.request_id] = None
            except Exception as e:  # noqa: BLE001 - the request's own error, raised by its stream
                items.append((cmd.request_id, e))
        elif isinstance(cmd, _Abort):
            req = engine.requests.get(cmd.request_id)
            was_running = req is not None and not req.finished
            engine.abort(cmd.request_id)
            waiting.pop(cmd.request_id, None)
            if cmd.notify and was_running:
                items.append((cmd.request_id, RequestOutput(cmd.request_id, [], True, "abort")))
        elif isinstance(cmd, _Call):
            # publish pending events and outputs first, so a snapshot taken here follows everything sent before
            events = engine.drain_kv_events()
            pending = list(items)
            items.clear()
            self._loop.call_soon_threadsafe(self._after_step, pending, {}, events, load_stats(engine))
            try:
                result = cmd.fn(engine)
            except Exception as e:  # noqa: BLE001 - raised to the caller
                self._loop.call_soon_threadsafe(_set_exception, cmd.future, e)
            else:
                self._loop.call_soon_threadsafe(_set_result, cmd.future, result)

    def _shutdown(self, engine: LLMEngine) -> None:
        for rid in list(engine.requests):
            engine.abort(rid)
        log.info("engine thread stopped")


def _set_result(future: asyncio.Future[T], value: T) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
