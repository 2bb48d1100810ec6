"""Client channels to rackserve services: one gRPC channel per endpoint, opened on first use and reused.

A process that calls many workers (the frontend's coordinator, a decode worker releasing producers' KV) keeps a
`ChannelPool` and asks it for the channel of an endpoint; every channel opens through `tls.open_channel`, so
mutual TLS applies to all of them. `close()` closes them all (at shutdown).

This room holds channels only: no request state, no retries, no knowledge of what is called over them.
"""

from __future__ import annotations

import asyncio

import grpc

from services.runtime.tls import GrpcTls, open_channel


class ChannelPool:
    """One gRPC channel per endpoint, reused by every call to it."""

    def __init__(self, tls: GrpcTls | None = None) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.tls = tls

    def get(self, endpoint: str) -> grpc.aio.Channel:
        channel = self._channels.get(endpoint)
        if channel is None:
            channel = self._channels[endpoint] = open_channel(endpoint, self.tls)
        return channel

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(c.close(grace=None) for c in channels), return_exceptions=True)
