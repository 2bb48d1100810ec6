"""The shared worker library: what every rackserve gRPC service process is made of.

- `async_engine`: the engine in its own thread, driven from asyncio (`AsyncEngine`, `RequestStream`).
- `rpc`: admission, request metadata and the mapping of errors to gRPC status codes, for every RPC.
- `host`: one service process — gRPC server, health, etcd registration, drain on SIGTERM (`ServiceHost`).
- `worker`: what prefill and decode workers share — engine loading, WorkerInfo, the Subscribe stream.
- `wire`: proto ⇄ engine types. `args`: the common flags, each readable from a RACKSERVE_* variable.
- `channels`: one client channel per endpoint (`ChannelPool`); `tls`: mutual TLS for servers and channels.
- `tasks`: fire-and-forget tasks held until they end (`BackgroundTasks`).

Services import this library; it never imports a service.
"""
