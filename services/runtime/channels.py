"""Client channels to rackserve services: one gRPC channel per endpoint, opened on first use and reused.

A process that calls many workers (the frontend's coordinator, a decode worker releasing producers' KV) keeps a
`ChannelPool` and asks it for the channel of an endpoint; every channel opens through `tls.open_channel`, so
mutual TLS applies to all of them. `close()` closes them all (at shutdown).

A caller that knows the epoch of the process behind the endpoint passes it: a newer epoch (the worker restarted
on the same address, as a container restarted in its pod does) gets a fresh channel. The old one had lost its
connection and gRPC backs off its reconnects up to two minutes, failing every call at once meanwhile: a decode
worker back on its address was reported failed and suppressed by every router, its requests answered 503, for
as long as that backoff (31 s after a 40 s outage, until 2026-12-07).

This room holds channels only: no request state, no retries, no knowledge of what is called over them.
"""

from __future__ import annotations

import asyncio

import grpc

from services.runtime.tls import GrpcTls, open_channel

LOCAL_SUBCHANNELS: list[tuple[str, object]] = [("grpc.use_local_subchannel_pool", 1)]


class ChannelPool:
    """One gRPC channel per endpoint, reused by every call to it."""

    def __init__(self, tls: GrpcTls | None = None) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._epochs: dict[str, int] = {}  # endpoint -> the newest epoch of the process it was asked for
        self._closing: set[asyncio.Task[None]] = set()  # superseded channels being closed
        self.tls = tls

    def get(self, endpoint: str, epoch: int = 0) -> grpc.aio.Channel:
        """The channel to `endpoint`; a fresh one when `epoch` (0: unknown) is newer than the one it served."""
        channel = self._channels.get(endpoint)
        if channel is not None and epoch > self._epochs.get(endpoint, 0):
            # Only a newer epoch replaces it: a call naming an older one (a stale handle) goes to the same
            # address, and closing the channel would cancel the new process's calls on it.
            task = asyncio.get_running_loop().create_task(channel.close(grace=None))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
            channel = None
        if channel is None:
            # its own subchannels: gRPC shares one connection per address among a process's channels by
            # default, and a fresh channel would take over the old one's, still backing off its reconnects
            channel = self._channels[endpoint] = open_channel(endpoint, self.tls, LOCAL_SUBCHANNELS)
        self._epochs[endpoint] = max(epoch, self._epochs.get(endpoint, 0))
        return channel

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(c.close(grace=None) for c in channels), *self._closing, return_exceptions=True)
