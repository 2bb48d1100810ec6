"""Client channels to rackserve services: one gRPC channel per endpoint, opened on first use and reused.

A process that calls many workers (the frontend's coordinator, a decode worker releasing producers' KV) keeps a
`ChannelPool` and asks it for the channel of an endpoint; every channel opens through `tls.open_channel`, so
mutual TLS applies to all of them. `close()` closes them all (at shutdown).

A caller that knows the epoch of the process behind the endpoint passes it: a newer epoch (the worker restarted
on the same address, as a container restarted in its pod does) gets a fresh channel. The old one had lost its
connection and gRPC backs off its reconnects up to two minutes, failing every call at once meanwhile: a decode
worker back on its address was reported failed and suppressed by every router, its requests answered 503, for
as long as that backoff (31 s after a 40 s outage, until 2026-12-07).

A channel nobody asked for in `idle_close_s` (5 minutes) and with no call in flight is closed, the next `get`
opening a new one. Until 2026-12-07 a worker that restarted on a new address (a Kubernetes pod gets a new IP)
left its channel in the pool for the life of the process: about 12 KiB each, and one that had failed a call
(its worker crashed) redialled the dead address, backing off up to two minutes, until gRPC idled it 30 minutes
later. The pool counts each channel's calls itself: the channel's connectivity state cannot tell, a worker
draining after GOAWAY shows IDLE while its streams run on.

This room holds channels only: no request state, no retries, no knowledge of what is called over them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc

from services.runtime.tls import GrpcTls, open_channel

LOCAL_SUBCHANNELS: list[tuple[str, object]] = [("grpc.use_local_subchannel_pool", 1)]

# a channel not asked for in this long, with no call in flight, is closed
IDLE_CLOSE_S = 300.0


class ChannelPool:
    """One gRPC channel per endpoint, reused by every call to it."""

    def __init__(self, tls: GrpcTls | None = None) -> None:
        self._channels: dict[str, _CountedChannel] = {}
        self._closing: set[asyncio.Task[None]] = set()  # superseded and idle channels being closed
        self._swept = time.monotonic()
        self.idle_close_s = IDLE_CLOSE_S
        self.tls = tls

    def get(self, endpoint: str, epoch: int = 0) -> grpc.aio.Channel:
        """The channel to `endpoint`; a fresh one when `epoch` (0: unknown) is newer than the one it served."""
        now = time.monotonic()
        if now - self._swept >= self.idle_close_s:
            self._close_idle(now)
        channel = self._channels.get(endpoint)
        if channel is not None and epoch > channel.epoch:
            # Only a newer epoch replaces it: a call naming an older one (a stale handle) goes to the same
            # address, and closing the channel would cancel the new process's calls on it. The replaced one
            # closes once its calls in flight are done: one may run on it (it reconnected to the new process
            # before a router had heard of it), and closing it under that call cancelled it (until 2026-12-07).
            channel.retire(self._close_later)
            channel = None
        if channel is None:
            # its own subchannels: gRPC shares one connection per address among a process's channels by
            # default, and a fresh channel would take over the old one's, still backing off its reconnects
            channel = _CountedChannel(open_channel(endpoint, self.tls, LOCAL_SUBCHANNELS))
            self._channels[endpoint] = channel
        channel.epoch = max(epoch, channel.epoch)
        channel.asked = now
        return channel

    def _close_idle(self, now: float) -> None:
        self._swept = now
        for endpoint, channel in list(self._channels.items()):
            if channel.calls == 0 and now - channel.asked >= self.idle_close_s:
                del self._channels[endpoint]
                self._close_later(channel)

    def _close_later(self, channel: grpc.aio.Channel) -> None:
        task = asyncio.get_running_loop().create_task(channel.close(grace=None))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(c.close(grace=None) for c in channels), *self._closing, return_exceptions=True)


class _CountedChannel(grpc.aio.Channel):
    """A channel that counts its calls in flight: every call made through a stub on it, until it is done."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._channel = channel
        self.calls = 0
        self.epoch = 0  # the newest epoch of the process it was asked for (0: unknown)
        self.asked = 0.0  # when the pool last handed it out (time.monotonic())
        self._retired: Callable[[grpc.aio.Channel], None] | None = None  # replaced: how to close it once idle

    def _counted(self, multicallable: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            made = multicallable(*args, **kwargs)
            self.calls += 1
            made.add_done_callback(self._done)
            return made

        return call

    def _done(self, _call: Any) -> None:
        self.calls -= 1
        if self.calls == 0 and self._retired is not None:
            self._retired(self)

    def retire(self, close: Callable[[grpc.aio.Channel], None]) -> None:
        """Close it with `close` now, or once its last call in flight is done."""
        if self.calls == 0:
            close(self)
        else:
            self._retired = close

    def unary_unary(self, *args: Any, **kwargs: Any) -> Any:
        return self._counted(self._channel.unary_unary(*args, **kwargs))

    def unary_stream(self, *args: Any, **kwargs: Any) -> Any:
        return self._counted(self._channel.unary_stream(*args, **kwargs))

    def stream_unary(self, *args: Any, **kwargs: Any) -> Any:
        return self._counted(self._channel.stream_unary(*args, **kwargs))

    def stream_stream(self, *args: Any, **kwargs: Any) -> Any:
        return self._counted(self._channel.stream_stream(*args, **kwargs))

    async def close(self, grace: float | None = None) -> None:
        await self._channel.close(grace)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self._channel.get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self._channel.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self._channel.channel_ready()

    async def __aenter__(self) -> _CountedChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close(None)
